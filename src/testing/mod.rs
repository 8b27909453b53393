//! Loopback test doubles for the two services the sidecar talks to (the `testing` feature).
//!
//! For tool authors' tests, the demo and this crate's integration tests. They are **not**
//! production code: they listen on `127.0.0.1` only, keep everything in memory, and answer
//! with the shapes documented in `docs/mdma.md` (MDMA) and recorded from a real node (merod,
//! see `fixtures/merod/`). They run on hyper and tokio alone: none of the daemon's
//! dependencies (no axum, no metrics, no log subscriber) come with the `testing` feature.
//!
//! - [`mdma::MdmaEmulator`] plays the fleet control plane (`/api/fleet/should-join`,
//!   `/api/fleet/confirm`, and any other path a tool posts to), with scriptable answers
//!   (assignments, error statuses, raw bodies, requests that never answer) and a record of
//!   every call.
//! - [`merod::MerodEmulator`] plays the admin API of merod 0.11.0-rc.25 (`/admin-api/...`):
//!   fleet-join, namespace leave / get / list (paged), health, ready and peers, with
//!   scriptable join, leave and listing behaviour (delays, refusals, hangs, errors) and a
//!   record of every call.
//! - [`metadata::MetadataEmulator`] plays the GCE instance metadata server (`relay-url`,
//!   `enrolment-token`, …), with attributes set, cleared, failing or late.
//!
//! Layout: `mdma`, `merod` and `metadata` hold those emulators; `sandbox` (the `emulator`
//! feature) lays out a throwaway node around them, in which the demo and the integration
//! tests run the real daemon.
//!
//! All are started with `start(..).await` inside a tokio runtime and stop when
//! `shutdown()` is called or when the last clone of the emulator is dropped. Requests that were
//! told to hang keep their connection open until the client gives up; no new connection is
//! accepted after shutdown.

pub mod mdma;
pub mod merod;
pub mod metadata;
#[cfg(feature = "daemon")]
pub mod sandbox;

use std::convert::Infallible;
use std::future::Future;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use http_body_util::{BodyExt, Full, Limited};
use hyper::body::{Bytes, Incoming};
use hyper::header::CONTENT_TYPE;
use hyper::{HeaderMap, Method, Request, Response, StatusCode, Uri};
use hyper_util::rt::TokioIo;
use hyper_util::server::graceful::GracefulShutdown;
use serde_json::Value;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use url::Url;

/// Largest request body the emulators read; a longer one is answered 400. A full context
/// inventory of 10,000 namespaces is about 4 MB, and it is one request by its nature (`full`
/// says "these are all").
const BODY_LIMIT: usize = 16 * 1024 * 1024;

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

/// One request as an emulator's handler sees it: the head and the whole body (or why the
/// body could not be read: too long, or the client stopped sending).
pub(crate) struct Received {
    pub(crate) method: Method,
    pub(crate) uri: Uri,
    pub(crate) headers: HeaderMap,
    pub(crate) body: Result<Bytes, Box<dyn std::error::Error + Send + Sync>>,
}

/// An emulator's answer.
pub(crate) type Answer = Response<Full<Bytes>>;

/// Serves `handler` over HTTP/1.1 on `127.0.0.1:0` in a background task (must be called
/// inside a tokio runtime) and returns the handle that keeps it running.
pub(crate) async fn serve<H, F>(handler: H) -> std::io::Result<ServerHandle>
where
    H: Fn(Received) -> F + Send + Sync + 'static,
    F: Future<Output = Answer> + Send + 'static,
{
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await?;
    let addr = listener.local_addr()?;
    let (stop_tx, mut stop_rx) = oneshot::channel::<()>();
    let handler = Arc::new(handler);
    tokio::spawn(async move {
        let graceful = GracefulShutdown::new();
        loop {
            // Ends on an explicit stop and also when the sender is dropped with the handle.
            let accepted = tokio::select! {
                _ = &mut stop_rx => break,
                accepted = listener.accept() => accepted,
            };
            let Ok((stream, _)) = accepted else {
                // Out of file descriptors or the like: wait instead of spinning.
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            };
            let handler = handler.clone();
            let service = hyper::service::service_fn(move |request: Request<Incoming>| {
                let handler = handler.clone();
                async move {
                    let (parts, body) = request.into_parts();
                    let body = Limited::new(body, BODY_LIMIT)
                        .collect()
                        .await
                        .map(|collected| collected.to_bytes());
                    let received = Received {
                        method: parts.method,
                        uri: parts.uri,
                        headers: parts.headers,
                        body,
                    };
                    Ok::<_, Infallible>(handler(received).await)
                }
            });
            let connection = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service);
            let connection = graceful.watch(connection);
            tokio::spawn(async move {
                let _ = connection.await;
            });
        }
        drop(listener);
        // Idle connections close now; one still answering (or hanging) closes after.
        graceful.shutdown().await;
    });
    Ok(ServerHandle {
        addr,
        stop: Mutex::new(Some(stop_tx)),
    })
}

/// Why an emulator refuses a request: the message its 400 answer carries, worded as the real
/// service words it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub(crate) struct BadRequest(pub(crate) String);

/// Locks a mutex, ignoring poisoning (the emulators' state stays usable after a panicking test).
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// A JSON answer with this status; a status outside 100..=999 becomes 500.
pub(crate) fn json_response(status: u16, body: Value) -> Answer {
    raw_json_response(status, body.to_string())
}

/// This exact body as `application/json` with this status (500 for an impossible one).
pub(crate) fn raw_json_response(status: u16, body: String) -> Answer {
    let code = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut answer = Response::new(Full::new(Bytes::from(body)));
    *answer.status_mut() = code;
    answer.headers_mut().insert(
        CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/json"),
    );
    answer
}

/// The `Content-Type` header as text, if present and readable.
pub(crate) fn content_type(headers: &HeaderMap) -> Option<String> {
    headers
        .get(CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .map(str::to_owned)
}

/// True for `application/json` (parameters such as `charset` allowed) and `application/*+json`,
/// the media types merod's JSON extractor accepts.
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

/// In the emulators' tests: a client that gives up after 10 s (a hung emulator fails the
/// test instead of stalling it).
#[cfg(test)]
fn test_client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    async fn hi(_: Received) -> Answer {
        Response::new(Full::new(Bytes::from_static(b"hi")))
    }

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
        let server = serve(hi).await.unwrap();
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
        let server = serve(hi).await.unwrap();
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
