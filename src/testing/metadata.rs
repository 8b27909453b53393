//! A loopback GCE instance metadata server: `GET /attrs/<name>` answers the attribute's text
//! (`text/plain`), 404 for one not set, and 403 for a request without
//! `Metadata-Flavor: Google`, as GCE does. Attributes can be set, cleared, made to fail with a
//! status or to answer late; every request is counted per attribute.
//!
//! ```no_run
//! # async fn demo() -> std::io::Result<()> {
//! use fleet_sidecar::testing::metadata::MetadataEmulator;
//! let md = MetadataEmulator::start().await?;
//! md.set("relay-url", "https://relay.example");
//! // `[registration] metadata_url = "<md.attributes_url()>"`
//! # Ok(()) }
//! ```

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http_body_util::Full;
use hyper::body::Bytes;
use hyper::header::{HeaderValue, CONTENT_TYPE};
use hyper::{Method, Response, StatusCode};
use url::Url;

use super::{lock, serve, Answer, Received, ServerHandle};

#[derive(Default)]
struct Inner {
    values: HashMap<String, String>,
    failing: HashMap<String, u16>,
    delay: Duration,
    reads: HashMap<String, u32>,
    without_header: u32,
}

/// The metadata server emulator. Clones share its state and server; the server stops when
/// [`MetadataEmulator::shutdown`] is called or the last clone is dropped.
#[derive(Clone)]
pub struct MetadataEmulator {
    inner: Arc<Mutex<Inner>>,
    server: Arc<ServerHandle>,
}

impl std::fmt::Debug for MetadataEmulator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MetadataEmulator")
            .field("addr", &self.server.addr())
            .finish_non_exhaustive()
    }
}

impl MetadataEmulator {
    /// Starts the emulator on `127.0.0.1:0` with no attribute set.
    pub async fn start() -> Result<Self, std::io::Error> {
        let inner = Arc::new(Mutex::new(Inner::default()));
        let state = Arc::clone(&inner);
        let server = serve(move |request| answer(Arc::clone(&state), request)).await?;
        Ok(Self {
            inner,
            server: Arc::new(server),
        })
    }

    /// The attributes URL: `http://127.0.0.1:PORT/attrs/` (what `metadata_url` takes).
    pub fn attributes_url(&self) -> Url {
        self.server
            .url()
            .join("attrs/")
            .expect("a fixed relative path joins")
    }

    /// Sets attribute `name` (answered 200 with `value` verbatim, CR/LF included).
    pub fn set(&self, name: &str, value: &str) {
        lock(&self.inner)
            .values
            .insert(name.to_owned(), value.to_owned());
    }

    /// Clears attribute `name` (answered 404).
    pub fn unset(&self, name: &str) {
        lock(&self.inner).values.remove(name);
    }

    /// Answers every read of `name` with `status` (and no text) while `Some`.
    pub fn set_failing(&self, name: &str, status: Option<u16>) {
        let mut inner = lock(&self.inner);
        match status {
            Some(s) => inner.failing.insert(name.to_owned(), s),
            None => inner.failing.remove(name),
        };
    }

    /// Sends every answer `delay` after its request (a hung server, for a long one).
    pub fn set_delay(&self, delay: Duration) {
        lock(&self.inner).delay = delay;
    }

    /// How many requests for `name` came with the header (whatever they were answered).
    pub fn reads(&self, name: &str) -> u32 {
        lock(&self.inner).reads.get(name).copied().unwrap_or(0)
    }

    /// How many requests came without `Metadata-Flavor: Google` (answered 403).
    pub fn without_header(&self) -> u32 {
        lock(&self.inner).without_header
    }

    /// Stops accepting connections.
    pub fn shutdown(&self) {
        self.server.shutdown();
    }
}

async fn answer(inner: Arc<Mutex<Inner>>, request: Received) -> Answer {
    let delay = lock(&inner).delay;
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    let text = |status: StatusCode, body: String| {
        let mut answer = Response::new(Full::new(Bytes::from(body)));
        *answer.status_mut() = status;
        answer
            .headers_mut()
            .insert(CONTENT_TYPE, HeaderValue::from_static("text/plain"));
        answer
    };
    let Some(name) = request.uri.path().strip_prefix("/attrs/") else {
        return text(StatusCode::NOT_FOUND, String::new());
    };
    if request.method != Method::GET {
        return text(StatusCode::METHOD_NOT_ALLOWED, String::new());
    }
    let mut inner = lock(&inner);
    if request
        .headers
        .get("metadata-flavor")
        .map(HeaderValue::as_bytes)
        != Some(b"Google")
    {
        inner.without_header += 1;
        return text(StatusCode::FORBIDDEN, String::new());
    }
    *inner.reads.entry(name.to_owned()).or_default() += 1;
    if let Some(&status) = inner.failing.get(name) {
        let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        return text(status, String::new());
    }
    match inner.values.get(name) {
        Some(value) => text(StatusCode::OK, value.clone()),
        None => text(StatusCode::NOT_FOUND, String::new()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metadata::{MetadataAttribute, MetadataClient, MetadataError};

    #[tokio::test]
    async fn the_client_reads_sets_remembers_and_is_bounded() {
        let md = MetadataEmulator::start().await.unwrap();
        let client = MetadataClient::new(md.attributes_url()).unwrap();
        let relay = MetadataAttribute::RelayUrl;
        // Not set: 404 is `None`, and the value "" ("not set").
        assert_eq!(client.read(relay).await.unwrap(), None);
        assert_eq!(client.value(relay).await.unwrap(), "");
        // CR/LF always go; surrounding spaces go except for server-port.
        md.set("relay-url", " https://relay.example\r\n");
        assert_eq!(client.value(relay).await.unwrap(), "https://relay.example");
        md.set("server-port", "8080 \n");
        assert_eq!(
            client.read(MetadataAttribute::ServerPort).await.unwrap(),
            Some("8080 ".to_owned())
        );
        assert_eq!(
            client.server_port().await,
            crate::metadata::DEFAULT_SERVER_PORT
        );
        md.set("server-port", "08080\n");
        assert_eq!(client.server_port().await, 8080);
        // A failing server keeps what was read; the error itself names the status.
        md.set_failing("relay-url", Some(503));
        assert!(matches!(
            client.read(relay).await,
            Err(MetadataError::Status { status: 503, .. })
        ));
        assert_eq!(client.value(relay).await.unwrap(), "https://relay.example");
        md.set_failing("relay-url", None);
        md.unset("relay-url");
        assert_eq!(client.value(relay).await.unwrap(), "https://relay.example");
        // Every read carried the header.
        assert_eq!(md.without_header(), 0);
        assert_eq!(md.reads("relay-url"), 6);
        let plain = reqwest::Client::new()
            .get(md.attributes_url().join("relay-url").unwrap())
            .send()
            .await
            .unwrap();
        assert_eq!(plain.status().as_u16(), 403);
        assert_eq!(md.without_header(), 1);
    }

    /// Waits out one real [`METADATA_TIMEOUT`](crate::metadata::METADATA_TIMEOUT): paused
    /// time would skip the loopback answers too.
    #[tokio::test]
    async fn a_hung_server_is_a_timeout_and_the_last_value_stays() {
        let md = MetadataEmulator::start().await.unwrap();
        let client = MetadataClient::new(md.attributes_url()).unwrap();
        let relay = MetadataAttribute::RelayUrl;
        assert!(client.value(relay).await.is_ok());
        md.set_delay(Duration::from_secs(3600));
        let started = tokio::time::Instant::now();
        assert_eq!(client.value(relay).await.unwrap(), "");
        let waited = started.elapsed();
        assert!(
            waited >= crate::metadata::METADATA_TIMEOUT && waited < Duration::from_secs(60),
            "{waited:?}"
        );
    }
}
