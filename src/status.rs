//! The running daemon's live status, as a tool reads it: `GET /status` on the daemon's
//! status listener (`status_listen` in its config; loopback, no authentication), JSON.
//!
//! This is the only way a tool learns what MDMA assigns without asking MDMA itself: a
//! `should-join` from a tool would count as the node's heartbeat. [`read_status`] reads the
//! sets of the daemon's latest successful poll and of its state; [`DaemonStatus::assigned`]
//! is `None` until the daemon has had one (an unknown, never an empty set).

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::ids::GroupId;
use crate::net::read_capped;

/// How long [`read_status`] waits for the whole answer (connect, send, read).
pub const STATUS_TIMEOUT: Duration = Duration::from_secs(2);

/// The largest status answer read (bytes): at 10,000 namespaces each set is about 0.7 MB.
pub const MAX_STATUS_BODY: usize = 64 * 1024 * 1024;

/// What a tool reads of the daemon's live status: the sets it reconciles, each as sorted
/// namespace ids (64 hex). Fields the daemon adds later are ignored; a missing set reads as
/// empty.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct DaemonStatus {
    /// The daemon's phase: `starting`, `waiting_for_merod`, `running` or `stopping`.
    #[serde(default)]
    pub phase: String,
    /// When the latest successful poll answered (Unix seconds, the daemon's wall clock);
    /// `None` before the first.
    #[serde(default)]
    pub last_ok_poll_at: Option<f64>,
    /// The latest successful poll's assignments (empty before the first: see
    /// [`DaemonStatus::assigned`]).
    #[serde(default)]
    pub desired: BTreeSet<GroupId>,
    /// The latest successful poll's `retain`: namespaces withdrawn from the assignments that
    /// MDMA asks the node to keep.
    #[serde(default)]
    pub retain: BTreeSet<GroupId>,
    /// Namespaces merod admitted, by the daemon's state.
    #[serde(default)]
    pub admitted: BTreeSet<GroupId>,
    /// Admitted namespaces MDMA acknowledged.
    #[serde(default)]
    pub confirmed: BTreeSet<GroupId>,
    /// Joins running.
    #[serde(default)]
    pub joining: BTreeSet<GroupId>,
    /// Leaves running.
    #[serde(default)]
    pub leaving: BTreeSet<GroupId>,
}

impl DaemonStatus {
    /// What MDMA assigns, by the daemon's latest successful poll; `None` while the daemon
    /// has had none (the empty `desired` then says nothing).
    pub fn assigned(&self) -> Option<&BTreeSet<GroupId>> {
        self.last_ok_poll_at.map(|_| &self.desired)
    }

    /// The latest successful poll's `retain`, `None` while the daemon has had none.
    pub fn retained(&self) -> Option<&BTreeSet<GroupId>> {
        self.last_ok_poll_at.map(|_| &self.retain)
    }
}

/// Why the daemon's live status could not be read. `kind()` names it (`client`,
/// `unreachable`, `status`, `answer`); `Serialize` as `{"kind", "message"}`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StatusError {
    /// No HTTP client could be built (the TLS backend failed to load).
    #[error("cannot build an HTTP client: {0}")]
    Client(#[source] reqwest::Error),
    /// The listener did not answer in time, or the connection failed.
    #[error("GET {url}: {source} (is the daemon running?)")]
    Unreachable {
        /// `http://HOST:PORT/status`.
        url: String,
        /// The connection's error.
        #[source]
        source: reqwest::Error,
    },
    /// The listener answered with a status other than 2xx.
    #[error("GET {url}: HTTP {status}")]
    Status {
        /// `http://HOST:PORT/status`.
        url: String,
        /// The HTTP status code.
        status: u16,
    },
    /// The answer was not the status JSON, or larger than [`MAX_STATUS_BODY`].
    #[error("GET {url}: unexpected answer: {reason}")]
    Answer {
        /// `http://HOST:PORT/status`.
        url: String,
        /// What was wrong with it.
        reason: String,
    },
}

impl StatusError {
    /// The failure's stable name: `client`, `unreachable`, `status` or `answer`.
    pub fn kind(&self) -> &'static str {
        match self {
            StatusError::Client(_) => "client",
            StatusError::Unreachable { .. } => "unreachable",
            StatusError::Status { .. } => "status",
            StatusError::Answer { .. } => "answer",
        }
    }
}

serialize_kind_and_message!(StatusError);

/// Reads the running daemon's live status from its listener at `addr` (the daemon's
/// `status_listen`), within [`STATUS_TIMEOUT`], never through a proxy.
///
/// Errors: [`StatusError`]; a daemon that is not running is
/// [`StatusError::Unreachable`].
pub async fn read_status(addr: SocketAddr) -> Result<DaemonStatus, StatusError> {
    fetch(addr).await
}

/// The one read of `/status`, into the daemon's own full form or a tool's [`DaemonStatus`].
pub(crate) async fn fetch<T: DeserializeOwned>(addr: SocketAddr) -> Result<T, StatusError> {
    let url = format!("http://{addr}/status");
    // The daemon's own listener on this host: never through an environment proxy.
    let client = reqwest::Client::builder()
        .timeout(STATUS_TIMEOUT)
        .no_proxy()
        .build()
        .map_err(StatusError::Client)?;
    let unreachable = |e: reqwest::Error| StatusError::Unreachable {
        url: url.clone(),
        source: e.without_url(),
    };
    let resp = client.get(&url).send().await.map_err(unreachable)?;
    if !resp.status().is_success() {
        return Err(StatusError::Status {
            url,
            status: resp.status().as_u16(),
        });
    }
    let body = read_capped(resp, MAX_STATUS_BODY).await.map_err(|e| {
        e.into_error(
            |reason| StatusError::Answer {
                url: url.clone(),
                reason,
            },
            unreachable,
        )
    })?;
    serde_json::from_slice(&body).map_err(|e| StatusError::Answer {
        url: url.clone(),
        reason: e.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(n: u8) -> GroupId {
        format!("{n:064x}").parse().unwrap()
    }

    #[test]
    fn what_mdma_assigns_is_unknown_until_the_daemon_had_a_good_poll() {
        let before: DaemonStatus =
            serde_json::from_str(r#"{"phase": "starting", "desired": [], "retain": []}"#).unwrap();
        assert_eq!(before.assigned(), None);
        assert_eq!(before.retained(), None);

        let text = format!(
            r#"{{"phase": "running", "last_ok_poll_at": 1.5, "desired": ["{}"], "retain": [],
                "admitted": ["{}"], "some_later_field": {{"x": 1}}}}"#,
            id(1),
            id(2)
        );
        let after: DaemonStatus = serde_json::from_str(&text).unwrap();
        assert_eq!(after.assigned(), Some(&BTreeSet::from([id(1)])));
        assert_eq!(after.retained(), Some(&BTreeSet::new()));
        assert_eq!(after.admitted, BTreeSet::from([id(2)]));
        assert!(after.confirmed.is_empty());
    }

    #[test]
    fn a_bad_id_in_a_set_is_an_error_not_a_skipped_entry() {
        let bad = r#"{"last_ok_poll_at": 1.0, "desired": ["not-hex"]}"#;
        assert!(serde_json::from_str::<DaemonStatus>(bad).is_err());
    }

    #[tokio::test]
    async fn a_listener_that_never_answers_is_unreachable_within_the_bound() {
        // Bound but never accepting: the connection is queued and no answer comes.
        let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = silent.local_addr().unwrap();
        let started = std::time::Instant::now();
        let err = read_status(addr).await.unwrap_err();
        assert!(
            started.elapsed() < STATUS_TIMEOUT * 3,
            "{:?}",
            started.elapsed()
        );
        assert_eq!(err.kind(), "unreachable", "{err}");
        assert_eq!(
            serde_json::to_value(&err).unwrap()["kind"],
            serde_json::json!("unreachable")
        );
    }
}
