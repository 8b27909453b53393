//! The optional status listener (`status_listen = "127.0.0.1:PORT"`, off by default) and the
//! report `fleet-sidecar status` prints.
//!
//! Routes: `/healthz` (200 while the process serves), `/readyz` (200 only when the identity
//! is known and a poll succeeded within `ready_max_poll_age` — it goes unready during an
//! MDMA outage), `/metrics` (Prometheus/OpenMetrics text), `/status` (the live status as
//! JSON, see [`LiveStatus`]).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State as AxumState;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::state::{State, StateStore};
use crate::telemetry::{unix_now, LiveStatus, Telemetry};

#[derive(Clone)]
struct Shared {
    telemetry: Arc<Telemetry>,
    ready_max_poll_age: Duration,
}

/// The listener's routes.
pub fn router(telemetry: Arc<Telemetry>, ready_max_poll_age: Duration) -> Router {
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

/// What `fleet-sidecar status --json` prints.
#[derive(Debug, Serialize)]
pub struct Report {
    /// The state file read.
    pub state_file: String,
    /// Its content (`null` when it does not exist yet).
    pub state: Option<State>,
    /// Why the state file could not be read, if so.
    pub state_error: Option<String>,
    /// Leave candidates per the state file alone, with why they wait.
    pub pending_leaves: std::collections::BTreeMap<String, String>,
    /// The running daemon's `/status`, when the listener is on and answered.
    pub live: Option<LiveStatus>,
    /// Why the live status is missing (listener off, or no answer).
    pub live_error: Option<String>,
}

/// Builds the report: the state file (read only, never written) and, when `status_listen`
/// is set, the live status from the running daemon (2 s bound).
pub async fn report(cfg: &Config) -> Report {
    let (state, state_error) = match StateStore::new(&cfg.state_file).load() {
        Ok(s) => (s, None),
        Err(e) => (None, Some(e.to_string())),
    };
    let pending_leaves = state
        .as_ref()
        .map(|s| {
            s.absent_polls
                .iter()
                .map(|(id, polls)| {
                    let why = if let Some(wait) = cfg.leave_policy.stability_wait(*polls) {
                        wait.to_string()
                    } else {
                        format!(
                            "absent from {polls} successful polls: due to leave (the live status tells whether the mass-withdrawal guard or the rate limit holds it)"
                        )
                    };
                    (id.to_string(), why)
                })
                .collect()
        })
        .unwrap_or_default();
    let (live, live_error) = match cfg.status_listen {
        None => (
            None,
            Some("status_listen is not set: no live status".to_owned()),
        ),
        Some(addr) => match fetch_live(addr).await {
            Ok(l) => (Some(l), None),
            Err(e) => (None, Some(e.to_string())),
        },
    };
    Report {
        state_file: cfg.state_file.display().to_string(),
        state,
        state_error,
        pending_leaves,
        live,
        live_error,
    }
}

/// Why the running daemon's live status could not be had.
#[derive(Debug, thiserror::Error)]
enum LiveError {
    #[error("cannot build an HTTP client: {0}")]
    Client(#[source] reqwest::Error),
    #[error("GET {url}: {source} (is the daemon running?)")]
    Unreachable {
        url: String,
        #[source]
        source: reqwest::Error,
    },
    #[error("GET {url}: HTTP {status}")]
    Status { url: String, status: u16 },
    #[error("GET {url}: unexpected answer: {source}")]
    Answer {
        url: String,
        #[source]
        source: reqwest::Error,
    },
}

async fn fetch_live(addr: SocketAddr) -> Result<LiveStatus, LiveError> {
    let url = format!("http://{addr}/status");
    // The daemon's own listener on this host: never through an environment proxy.
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(2))
        .no_proxy()
        .build()
        .map_err(LiveError::Client)?;
    let resp = client
        .get(&url)
        .send()
        .await
        .map_err(|e| LiveError::Unreachable {
            url: url.clone(),
            source: e.without_url(),
        })?;
    if !resp.status().is_success() {
        return Err(LiveError::Status {
            url,
            status: resp.status().as_u16(),
        });
    }
    resp.json().await.map_err(|e| LiveError::Answer {
        url,
        source: e.without_url(),
    })
}

/// The report as text for a terminal.
pub fn render_text(r: &Report, now: f64) -> String {
    let mut out = format!("state file: {}\n", r.state_file);
    match (&r.state, &r.state_error) {
        (_, Some(e)) => out.push_str(&format!("  ERROR: {e}\n")),
        (None, None) => out.push_str("  (does not exist yet: nothing admitted)\n"),
        (Some(s), None) => {
            out.push_str(&format!(
                "  admitted: {}, confirmed: {}\n",
                s.admitted.len(),
                s.confirmed.len()
            ));
            for id in &s.admitted {
                let what = if s.confirmed.contains(id) {
                    "confirmed"
                } else {
                    "admitted, not confirmed"
                };
                out.push_str(&format!("  {id}  {what}\n"));
            }
            for id in &s.joining {
                out.push_str(&format!(
                    "  {id}  joining: fleet-join sent, admission not recorded (merod may hold it)\n"
                ));
            }
        }
    }
    let live_pending = r.live.as_ref().map(|l| &l.pending_leaves);
    match live_pending {
        Some(p) if !p.is_empty() => {
            out.push_str("pending leave (live):\n");
            for (id, why) in p {
                out.push_str(&format!("  {id}  {why}\n"));
            }
        }
        Some(_) => out.push_str("pending leave (live): none\n"),
        None if !r.pending_leaves.is_empty() => {
            out.push_str("pending leave (from the state file):\n");
            for (id, why) in &r.pending_leaves {
                out.push_str(&format!("  {id}  {why}\n"));
            }
        }
        None => out.push_str("pending leave: none\n"),
    }
    match (&r.live, &r.live_error) {
        (Some(l), _) => {
            out.push_str(&format!("live: {}: {}\n", l.phase, l.summary(now)));
            if let Some(p) = &l.peer_id {
                out.push_str(&format!("  peer id: {p}\n"));
            }
            match (&l.mrtd, &l.mrtd_source) {
                (Some(m), Some(src)) => out.push_str(&format!("  mrtd: {m} ({src})\n")),
                _ => out.push_str("  mrtd: unreadable (polling with the PeerId only)\n"),
            }
            out.push_str(&format!(
                "  desired: {}, joining: {}, leaving: {}, mass-withdrawal guard: {}\n",
                l.desired.len(),
                l.joining.len(),
                l.leaving.len(),
                l.mass_drop
            ));
        }
        (None, Some(e)) => out.push_str(&format!("live: {e}\n")),
        (None, None) => {}
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::GroupId;
    use std::path::Path;

    #[tokio::test]
    async fn pending_leaves_from_the_state_file_say_how_far_along_they_are() {
        let dir = tempfile::tempdir().unwrap();
        let state_file = dir.path().join("s.json");
        let (a, b) = (GroupId::from_bytes([1; 32]), GroupId::from_bytes([2; 32]));
        let c = GroupId::from_bytes([3; 32]);
        let state = State {
            admitted: [a, b].into(),
            confirmed: [a, b].into(),
            joining: [c].into(),
            absent_polls: [(a, 1), (b, 3)].into(),
        };
        StateStore::new(&state_file).save(&state).unwrap();
        let text = format!(
            "mdma_url = \"https://m\"\nstate_file = \"{}\"",
            state_file.display()
        );
        let cfg = Config::from_toml(&text, Path::new("c.toml")).unwrap();
        let r = report(&cfg).await;
        assert_eq!(
            r.pending_leaves[&a.to_string()],
            "absent from 1 of the 3 successful polls needed"
        );
        assert!(r.pending_leaves[&b.to_string()].contains("due to leave"));
        assert!(r.live.is_none() && r.live_error.is_some());
        assert!(render_text(&r, 0.0).contains(&format!(
            "  {c}  joining: fleet-join sent, admission not recorded"
        )));
    }
}
