//! The optional status listener (`status_listen = "127.0.0.1:PORT"`, off by default): the
//! telemetry served over HTTP.
//!
//! Routes: `/healthz` (200 while the process serves), `/readyz` (200 only when the identity
//! is known and a poll succeeded within `ready_max_poll_age` — it goes unready during an
//! MDMA outage), `/metrics` (Prometheus/OpenMetrics text), `/status` (the live status as
//! JSON, see [`super::LiveStatus`]).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State as AxumState;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use tokio_util::sync::CancellationToken;

use super::{unix_now, Telemetry};

#[derive(Clone)]
struct Shared {
    telemetry: Arc<Telemetry>,
    ready_max_poll_age: Duration,
}

/// The listener's routes.
pub(crate) fn router(telemetry: Arc<Telemetry>, ready_max_poll_age: Duration) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/status", get(status))
        .with_state(Shared {
            telemetry,
            ready_max_poll_age,
        })
}

async fn readyz(AxumState(s): AxumState<Shared>) -> Response {
    match s
        .telemetry
        .snapshot()
        .readiness(unix_now(), s.ready_max_poll_age)
    {
        Ok(()) => (StatusCode::OK, "ready\n").into_response(),
        Err(why) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {why}\n"),
        )
            .into_response(),
    }
}

async fn metrics(AxumState(s): AxumState<Shared>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        s.telemetry.encode_metrics(),
    )
        .into_response()
}

async fn status(AxumState(s): AxumState<Shared>) -> Response {
    axum::Json(s.telemetry.snapshot()).into_response()
}

/// Binds `addr` and serves `/healthz`, `/readyz`, `/metrics` and `/status` until `shutdown`.
/// Returns the bound address.
///
/// Errors: the bind error (address in use, permission).
pub async fn serve(
    addr: SocketAddr,
    telemetry: Arc<Telemetry>,
    ready_max_poll_age: Duration,
    shutdown: CancellationToken,
) -> std::io::Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    let app = router(telemetry, ready_max_poll_age);
    tokio::spawn(async move {
        let stopped = async move { shutdown.cancelled().await };
        if let Err(e) = axum::serve(listener, app)
            .with_graceful_shutdown(stopped)
            .await
        {
            tracing::error!("status listener stopped: {e}");
        }
    });
    Ok(bound)
}
