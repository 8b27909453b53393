//! Loopback test doubles for the two services the sidecar talks to.
//!
//! These emulators exist for the demo and for the integration tests. They are **not** production
//! code: they listen on `127.0.0.1` only, keep everything in memory, and answer with the shapes
//! documented in `docs/mdma.md` (MDMA) and recorded from a real node (merod, see
//! `fixtures/merod/`).
//!
//! - [`mdma::MdmaEmulator`] plays the fleet control plane (`/api/fleet/should-join`,
//!   `/api/fleet/confirm`), with scriptable answers (assignments, error statuses, raw bodies,
//!   requests that never answer) and a record of every call.
//! - [`merod::MerodEmulator`] plays the admin API of merod 0.11.0-rc.25 (`/admin-api/...`):
//!   fleet-join, namespace leave / get / list, health, ready and peers, with scriptable join and
//!   leave behaviour (delays, refusals, hangs, errors) and a record of every call.
//!
//! Both are started with `start(..).await` inside a tokio runtime and stop when
//! `shutdown()` is called or when the last clone of the emulator is dropped. Requests that were
//! told to hang keep their connection open until the client gives up; no new connection is
//! accepted after shutdown.

pub mod mdma;
pub mod merod;
pub mod sandbox;

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::{Mutex, MutexGuard};

use axum::http::header::CONTENT_TYPE;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Json, Router};
use serde_json::Value;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use url::Url;

/// A running loopback HTTP server. The server stops accepting connections when
/// [`ServerHandle::shutdown`] is called or when the handle is dropped.
#[derive(Debug)]
pub struct ServerHandle {
    addr: SocketAddr,
    stop: Mutex<Option<oneshot::Sender<()>>>,
}

impl ServerHandle {
    /// The bound address (`127.0.0.1:<port>`).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://127.0.0.1:<port>/`.
    pub fn url(&self) -> Url {
        Url::parse(&format!("http://{}/", self.addr)).expect("a socket address always forms a URL")
    }

    /// Stops accepting new connections and closes idle ones. Requests already in progress are
    /// allowed to finish (a hanging one stays pending until its client gives up).
    /// Calling it more than once is harmless.
    pub fn shutdown(&self) {
        if let Some(stop) = lock(&self.stop).take() {
            let _ = stop.send(());
        }
    }
}

impl Drop for ServerHandle {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Serves `router` on `127.0.0.1:0` in a background task (must be called inside a tokio
/// runtime) and returns the handle that keeps it running.
pub async fn serve(router: Router) -> std::io::Result<ServerHandle> {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await?;
    let addr = listener.local_addr()?;
    let (stop_tx, stop_rx) = oneshot::channel::<()>();
    tokio::spawn(async move {
        // Resolves on an explicit stop and also when the sender is dropped with the handle.
        let signal = async move {
            let _ = stop_rx.await;
        };
        let _ = axum::serve(listener, router)
            .with_graceful_shutdown(signal)
            .await;
    });
    Ok(ServerHandle {
        addr,
        stop: Mutex::new(Some(stop_tx)),
    })
}

/// Locks a mutex, ignoring poisoning (the emulators' state stays usable after a panicking test).
/// Why an emulator refuses a request: the message its 400 answer carries, worded as the real
/// service words it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub(crate) struct BadRequest(pub(crate) String);

pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// A JSON response with this status; a status outside 100..=999 becomes 500.
pub(crate) fn json_response(status: u16, body: Value) -> Response {
    let code = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    (code, Json(body)).into_response()
}

/// The `Content-Type` header as text, if present and readable.
pub(crate) fn content_type(headers: &HeaderMap) -> Option<String> {
    headers
        .get(CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .map(str::to_owned)
}

/// True for `application/json` (parameters such as `charset` allowed) and `application/*+json`,
/// the same media types axum's `Json` extractor accepts.
pub(crate) fn is_json_content_type(headers: &HeaderMap) -> bool {
    let Some(value) = content_type(headers) else {
        return false;
    };
    let essence = value
        .split(';')
        .next()
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase();
    match essence.split_once('/') {
        Some((kind, sub)) => kind == "application" && (sub == "json" || sub.ends_with("+json")),
        None => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::routing::get;
    use std::time::Duration;

    async fn connect_fails_within(addr: SocketAddr, limit: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + limit;
        while tokio::time::Instant::now() < deadline {
            if tokio::net::TcpStream::connect(addr).await.is_err() {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        false
    }

    #[tokio::test]
    async fn serves_until_shutdown() {
        let server = serve(Router::new().route("/", get(|| async { "hi" })))
            .await
            .unwrap();
        assert_eq!(server.url().as_str(), format!("http://{}/", server.addr()));
        let text = reqwest::get(server.url())
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        assert_eq!(text, "hi");
        let addr = server.addr();
        server.shutdown();
        server.shutdown();
        assert!(connect_fails_within(addr, Duration::from_secs(5)).await);
    }

    #[tokio::test]
    async fn dropping_the_handle_stops_the_server() {
        let server = serve(Router::new().route("/", get(|| async { "hi" })))
            .await
            .unwrap();
        let addr = server.addr();
        drop(server);
        assert!(connect_fails_within(addr, Duration::from_secs(5)).await);
    }

    #[test]
    fn json_content_types() {
        let check = |value: &str| {
            let mut headers = HeaderMap::new();
            headers.insert(CONTENT_TYPE, value.parse().unwrap());
            is_json_content_type(&headers)
        };
        assert!(check("application/json"));
        assert!(check("Application/JSON; charset=utf-8"));
        assert!(check("application/merge-patch+json"));
        assert!(!check("text/plain"));
        assert!(!check("application/jsonx"));
        assert!(!is_json_content_type(&HeaderMap::new()));
    }
}
