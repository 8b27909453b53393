//! The fleet control plane (MDMA) client: `POST /api/fleet/should-join`,
//! `POST /api/fleet/confirm`, `POST /api/fleet/join-status`, and attested registration's `GET /api/fleet/nodes/challenge`
//! and `POST /api/fleet/nodes/register` (docs/mdma.md).
//!
//! The poll is strict: only HTTP 200 with a JSON object whose `assignments` is an array of
//! objects each with a 64-hex `group_id` string (and, if present, `retain` an array of
//! 64-hex strings) is a successful poll. Anything else fails the whole poll — dropping just
//! a bad entry would make that namespace look withdrawn. Unknown fields are ignored.
//! Every request is bounded (10 s), TLS is always verified (system roots plus an optional
//! extra CA file), redirects are not followed, and the token goes only into the
//! `X-Fleet-Token` header.
//!
//! Layout: the client and the poll are here; `answer` reads a should-join body in one pass, `inventory` and `recovery` hold the wire types of those two jobs' calls.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;
use tokio::time::Instant;
use url::Url;

use crate::ids::{GroupId, PeerId};
use crate::merod::{Refusal, TeeRole};
use crate::mrtd::Mrtd;
use crate::net::{is_loopback, read_capped, read_capped_chunks, BodyError, Chunks};

mod answer;
mod inventory;
mod recovery;

pub use inventory::{GroupInventory, InventoryReport, NamespaceInventory};
pub use recovery::{RecoveryEnvelope, RecoveryKey};

/// Bound of one MDMA request, connect to last byte (docs/mdma.md).
pub const MDMA_TIMEOUT: Duration = Duration::from_secs(10);
/// Largest poll answer read, in bytes (16 MiB); a longer one fails the poll.
///
/// Sized for a fleet: 10,000 assignments, each with 8 `admitter_addrs` of the longest
/// common form (`/ip6/<39 chars>/udp/65535/quic-v1/p2p/<52-char PeerId>`, 119 bytes),
/// are about 1,075 bytes an entry compact, 10.8 MB in all, and about 11.8 MB indented
/// one value a line. 16 MiB (16.8 MB) leaves over 40 % for longer (DNS) addresses and
/// other fields. It is also the bound of the memory one answer can take: the body is read
/// into one buffer of at most this size (bench/RESULTS.md: peak RSS parsing such an
/// answer).
pub const MAX_POLL_BODY: usize = 16 * 1024 * 1024;
/// Bound of `GET /api/fleet/nodes/challenge` (docs/mdma.md).
pub const CHALLENGE_TIMEOUT: Duration = Duration::from_secs(15);
/// Bound of `POST /api/fleet/nodes/register` (docs/mdma.md).
pub const REGISTER_TIMEOUT: Duration = Duration::from_secs(30);
/// Largest challenge or register answer read (a sane one is well under 1 KiB).
const MAX_REGISTRATION_BODY: usize = 64 * 1024;

/// The method of a request to MDMA: `POST` but for the recovery envelopes' `PUT` and
/// `DELETE`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RequestMethod {
    /// `POST`.
    Post,
    /// `PUT`.
    Put,
    /// `DELETE`.
    Delete,
}

impl RequestMethod {
    fn as_reqwest(self) -> reqwest::Method {
        match self {
            RequestMethod::Post => reqwest::Method::POST,
            RequestMethod::Put => reqwest::Method::PUT,
            RequestMethod::Delete => reqwest::Method::DELETE,
        }
    }
}

impl std::fmt::Display for RequestMethod {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            RequestMethod::Post => "POST",
            RequestMethod::Put => "PUT",
            RequestMethod::Delete => "DELETE",
        })
    }
}

/// A request to MDMA that got no usable answer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RequestError {
    /// No answer: connection refused, DNS, TLS, reset. The message spells out reqwest's
    /// chain of causes (it never holds a header, so never the token); `source()` keeps it.
    #[error("{method} {url}: {}", describe(.source))]
    Transport {
        /// The request method (`POST` but for the recovery envelopes' `PUT` and `DELETE`).
        method: RequestMethod,
        /// The request URL.
        url: Url,
        /// What failed.
        #[source]
        source: reqwest::Error,
    },
    /// No complete answer within the client's request timeout (default [`MDMA_TIMEOUT`]).
    #[error("{method} {url}: no answer within {timeout:?}")]
    Timeout {
        /// The request method.
        method: RequestMethod,
        /// The request URL.
        url: Url,
        /// The bound.
        timeout: Duration,
    },
    /// An answer with a status that does not count as success. The message ends with the
    /// start of the answer's body (`POST <url>: HTTP 403: {"error":"unknown node"}`), so a
    /// tool can print MDMA's reason.
    #[error("{method} {url}: HTTP {status}{}", reason_suffix(.body))]
    Status {
        /// The request method.
        method: RequestMethod,
        /// The request URL.
        url: Url,
        /// The HTTP status.
        status: u16,
        /// The wait the answer's `Retry-After` asked for, in whole seconds from when it
        /// came (delay-seconds, or an HTTP date less the wall clock then, rounded up);
        /// `None` when absent or unreadable. Read as a [`Duration`] with
        /// [`RequestError::retry_after`]. The daemon waits at least this, at most 60 s,
        /// before sending the same kind of request again. (Seconds in a `u32`, and the body
        /// boxed, keep the error small.)
        retry_after_secs: Option<u32>,
        /// The start of the answer's body, for people: read lossily as UTF-8 (at most 4 KiB
        /// read), surrounding whitespace trimmed, control characters escaped (`\n`,
        /// `\u{1b}`), cut to at most 512 chars (then ending in `…`), the client's own token
        /// replaced by `[redacted]` should MDMA echo it. Empty when the body was empty or
        /// could not be read. Never holds a request header. (Boxed: the error stays small.)
        body: Box<str>,
    },
}

/// Bytes of a refusal's body read for [`RequestError::Status`]'s `body`.
const REFUSAL_READ: usize = 4096;
/// Chars of a refusal's body kept in [`RequestError::Status`]'s `body`.
const REFUSAL_CHARS: usize = 512;

/// An answer's `Retry-After` (see `net::retry_after`) in whole seconds, rounded up.
fn retry_after_secs(headers: &reqwest::header::HeaderMap) -> Option<u32> {
    crate::net::retry_after(headers, SystemTime::now()).map(|d| {
        let secs = d.as_secs().saturating_add(u64::from(d.subsec_nanos() > 0));
        u32::try_from(secs).unwrap_or(u32::MAX)
    })
}

/// `: <body>` after the status, or nothing for an empty body.
fn reason_suffix(body: &str) -> String {
    if body.is_empty() {
        String::new()
    } else {
        format!(": {body}")
    }
}

/// The excerpt of a refusal's body kept in [`RequestError::Status`] (see its `body`).
fn refusal_excerpt(bytes: &[u8], token: Option<&FleetToken>) -> String {
    let mut text = String::from_utf8_lossy(bytes).trim().to_owned();
    if let Some(token) = token.map(FleetToken::expose).filter(|t| !t.is_empty()) {
        text = text.replace(token, "[redacted]");
    }
    let mut out = String::new();
    let mut kept = 0;
    for c in text.chars() {
        let piece: String = if c.is_control() {
            c.escape_default().collect()
        } else {
            c.into()
        };
        let n = piece.chars().count();
        if kept + n > REFUSAL_CHARS - 1 {
            out.push('…');
            return out;
        }
        out.push_str(&piece);
        kept += n;
    }
    out
}

/// Why a call got no answer, as every MDMA call tells it: its own bound ran out, or the
/// transport failed (the error kept without its URL, which the call's error names already).
enum NoAnswer {
    TimedOut,
    Transport(reqwest::Error),
}

/// The one place a reqwest failure is told as a timeout or a transport failure.
fn no_answer(e: reqwest::Error) -> NoAnswer {
    if e.is_timeout() {
        NoAnswer::TimedOut
    } else {
        NoAnswer::Transport(e.without_url())
    }
}

impl RequestError {
    fn from_reqwest(url: &Url, timeout: Duration, e: reqwest::Error) -> Self {
        Self::failed(RequestMethod::Post, url, timeout, e)
    }

    /// `e` of a `method` request to `url` that had `timeout`: a timeout, or a transport error.
    fn failed(method: RequestMethod, url: &Url, timeout: Duration, e: reqwest::Error) -> Self {
        let url = url.clone();
        match no_answer(e) {
            NoAnswer::TimedOut => RequestError::Timeout {
                method,
                url,
                timeout,
            },
            NoAnswer::Transport(source) => RequestError::Transport {
                method,
                url,
                source,
            },
        }
    }

    /// Whether the request ran out of time (rather than being refused or answered wrongly).
    pub fn is_timeout(&self) -> bool {
        matches!(self, RequestError::Timeout { .. })
    }

    /// The wait MDMA's answer asked for (its `Retry-After`), unbounded: see
    /// [`RequestError::Status`]'s `retry_after`. `None` for a failure without an answer.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            RequestError::Status {
                method: RequestMethod::Post,
                retry_after_secs,
                ..
            } => retry_after_secs.map(|s| Duration::from_secs(s.into())),
            _ => None,
        }
    }
}

#[cfg(feature = "daemon")]
impl crate::outcome::Timed for RequestError {
    fn is_timeout(&self) -> bool {
        RequestError::is_timeout(self)
    }
}

/// Why a poll failed. Every variant means: skip the whole cycle.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PollError {
    /// No answer, a timeout, or a status other than 200 (redirects and 204 included).
    #[error(transparent)]
    Request(#[from] RequestError),
    /// The client did not finish within the loop's own deadline.
    #[error("poll gave no answer within {timeout:?}")]
    Deadline {
        /// The deadline.
        timeout: Duration,
    },
    /// A 200 whose body is not a valid assignment document.
    #[error("POST {url}: HTTP 200 but {source}")]
    Malformed {
        /// The should-join URL.
        url: Url,
        /// What is wrong with the body.
        #[source]
        source: MalformedAnswer,
    },
}

/// Why a 200 `should-join` body is not a valid assignment document.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MalformedAnswer {
    /// Announced or found larger than [`MAX_POLL_BODY`]; refused without reading it whole.
    #[error("the body is larger than {limit} bytes")]
    TooLarge {
        /// The cap, in bytes.
        limit: usize,
    },
    /// Not JSON, or an object naming the same key twice (at any depth): ambiguous.
    #[error("the body is ambiguous or not JSON ({0})")]
    Ambiguous(#[source] serde_json::Error),
    /// JSON of the wrong shape (no `assignments` array, an entry without a 64-hex
    /// `group_id`, a `retain` that is not an array of 64-hex ids); names line and column.
    #[error("the body is not a valid assignment document ({0})")]
    Shape(#[source] serde_json::Error),
}

impl PollError {
    /// The wait MDMA's answer asked for (`Retry-After` on a refused poll), unbounded.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            PollError::Request(e) => e.retry_after(),
            PollError::Deadline { .. } | PollError::Malformed { .. } => None,
        }
    }

    /// The failure's one classification: the `outcome` label of
    /// `fleet_sidecar_polls_total` and the `error_kind` of its log line — `transport`,
    /// `timeout` (the client's or the loop's deadline), `status`, `malformed`.
    pub fn metric_label(&self) -> &'static str {
        match self {
            PollError::Request(RequestError::Transport { .. }) => "transport",
            PollError::Request(RequestError::Timeout { .. }) | PollError::Deadline { .. } => {
                "timeout"
            }
            PollError::Request(RequestError::Status { .. }) => "status",
            PollError::Malformed { .. } => "malformed",
        }
    }
}

/// Why a confirm failed (no answer, a timeout, or a non-2xx status): the namespace stays
/// unconfirmed and is confirmed again later.
pub type ConfirmError = RequestError;

/// Why an [`MdmaClient::post_json`] call failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CallError {
    /// `path` does not name a place under the client's MDMA URL (an absolute URL, a `..`
    /// climbing out of it, a query or fragment).
    #[error("{path:?} is not an API path under the MDMA URL {base}")]
    Path {
        /// The client's base URL.
        base: Url,
        /// The path as given.
        path: String,
    },
    /// No answer, a timeout, or a status other than 2xx (redirects included: never followed).
    #[error(transparent)]
    Request(#[from] RequestError),
    /// A 2xx answer whose body could not be read whole within [`MAX_POLL_BODY`], or (from
    /// [`MdmaAnswer::json`]) is not the JSON asked for.
    #[error("POST {url}: HTTP {status} but {source}")]
    Malformed {
        /// The request URL.
        url: Url,
        /// The 2xx status.
        status: u16,
        /// What is wrong with the body.
        #[source]
        source: MalformedAnswer,
    },
}

/// A 2xx answer to [`MdmaClient::post_json`]: its status and body, read whole (at most
/// [`MAX_POLL_BODY`] bytes).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MdmaAnswer {
    /// The request URL.
    pub url: Url,
    /// The HTTP status (200..=299).
    pub status: u16,
    /// The body as sent (may be empty, e.g. for a 204).
    pub body: Vec<u8>,
}

impl MdmaAnswer {
    /// The body read strictly as `T`: JSON with no object naming a key twice (at any
    /// depth), then the shape of `T`.
    ///
    /// Errors: [`CallError::Malformed`] with [`MalformedAnswer::Ambiguous`] (not JSON, or a
    /// key named twice) or [`MalformedAnswer::Shape`] (not the shape of `T`).
    pub fn json<T: serde::de::DeserializeOwned>(&self) -> Result<T, CallError> {
        let malformed = |source| CallError::Malformed {
            url: self.url.clone(),
            status: self.status,
            source,
        };
        crate::strict_json::reject_duplicate_keys(&self.body)
            .map_err(|e| malformed(MalformedAnswer::Ambiguous(e)))?;
        serde_json::from_slice(&self.body).map_err(|e| malformed(MalformedAnswer::Shape(e)))
    }
}

/// Why the MDMA client could not be built.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MdmaClientError {
    /// The extra CA file could not be read.
    #[error("cannot read mdma_ca_file {path}: {source}")]
    CaRead {
        /// The CA file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The extra CA file holds no usable PEM certificate.
    #[error("mdma_ca_file {path} holds no usable PEM certificate: {reason}")]
    CaParse {
        /// The CA file.
        path: PathBuf,
        /// What is wrong, naming the certificate's place in the file.
        reason: String,
    },
    /// The base URL cannot take the API paths (e.g. `cannot-be-a-base` URLs).
    #[error("MDMA URL {base} cannot take the API path {path}: {source}")]
    Url {
        /// The base URL.
        base: Url,
        /// The path joined to it.
        path: &'static str,
        /// The URL parser's error.
        #[source]
        source: url::ParseError,
    },
    /// The HTTP client could not be built (TLS backend).
    #[error("cannot build the MDMA HTTP client: {}", describe(.0))]
    Build(#[source] reqwest::Error),
}

/// A secret string type: `new` wraps the value, `expose` gives it to the one place that
/// sends it, `Debug` prints `[redacted]`, and there is no `Display`, so it cannot slip
/// into a log line or an error message by formatting.
macro_rules! secret_string {
    ($(#[$doc:meta])* $name:ident, $(#[$expose:meta])*) => {
        $(#[$doc])*
        #[derive(Clone, PartialEq, Eq)]
        pub struct $name(String);

        impl $name {
            /// Wraps the token value.
            pub fn new(value: impl Into<String>) -> Self {
                Self(value.into())
            }

            $(#[$expose])*
            pub fn expose(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("[redacted]")
            }
        }
    };
}

secret_string!(
    /// The fleet token, sent only as the `X-Fleet-Token` header. Its `Debug` prints
    /// `[redacted]` and it has no `Display`, so it cannot slip into a log line or an error
    /// message by formatting.
    FleetToken,
    /// The token itself, for the one place that must send it (the `X-Fleet-Token` header).
);

secret_string!(
    /// The enrolment token a node presents to `register` (from the GCE metadata attribute
    /// `enrolment-token` or a file; may be empty). Like [`FleetToken`], its `Debug` prints
    /// `[redacted]` and it has no `Display`.
    EnrolmentToken,
    /// The token itself, for the one place that sends it (the `register` body).
);

secret_string!(
    /// The log shippers' token MDMA delivers in a `should-join` answer (`logs_token`).
    /// Only its SHA-256 is ever reported (`logs_token_fp`); like [`FleetToken`], its
    /// `Debug` prints `[redacted]` and it has no `Display`.
    LogsToken,
    /// The token itself, for the one place that writes it (the token file).
);

/// No enrolment token (an empty one), as a node without the metadata attribute has.
impl Default for EnrolmentToken {
    fn default() -> Self {
        Self::new("")
    }
}

/// A registration challenge from `GET /api/fleet/nodes/challenge`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Challenge {
    /// `challenge`: a non-empty string, bound into the quote's nonce.
    pub challenge: String,
    /// `expires_at_ms`, when MDMA says (Unix milliseconds): a JSON integer or an
    /// integer-valued float; `None` when absent or not a whole number (registration does
    /// not use it, so an odd value never fails the attempt).
    pub expires_at_ms: Option<u64>,
}

/// The body of `POST /api/fleet/nodes/register` (docs/mdma.md). Its `Debug` redacts the
/// enrolment token.
#[derive(Clone, Debug)]
pub struct RegisterRequest {
    /// `peer_id`: the node's PeerId.
    pub peer_id: PeerId,
    /// `executor_account`: merod's account id (`GET /admin-api/identity`).
    pub executor_account: String,
    /// `relay_url`: the node's relay URL, possibly empty.
    pub relay_url: String,
    /// `challenge`: as MDMA issued it.
    pub challenge: String,
    /// `quote`: the TD quote, base64, as merod gave it.
    pub quote: String,
    /// `enrolment_token`: possibly empty.
    pub enrolment_token: EnrolmentToken,
    /// Whether the quote came from `registration-attest` (then `quote_binding:
    /// "registration"` is sent); `false` for the fallback `tee/attest`, which has no binding.
    pub registration_bound: bool,
    /// `csr`: the node's certificate signing request for the relay host, DER as one line of
    /// base64, which MDMA signs and later delivers as `tls_certificate`; left out when
    /// `None`. The nonce the quote is over must end in `|` and the hex SHA-256 of this text.
    pub csr: Option<String>,
}

/// A 2xx answer to `register`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Registered {
    /// `fleet_token`, when MDMA issued one; `None` when it issues no tokens (it has no
    /// signing key): the node then polls without a token.
    pub token: Option<FleetToken>,
}

/// A registration call (`challenge` or `register`) that failed. Never holds a token.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RegisterError {
    /// No answer (refused, reset, TLS); `source()` keeps reqwest's error.
    #[error("{method} {url}: {}", describe(.source))]
    Transport {
        /// `GET` or `POST`.
        method: &'static str,
        /// The request URL.
        url: Url,
        /// What failed.
        #[source]
        source: reqwest::Error,
    },
    /// No complete answer within the call's bound.
    #[error("{method} {url}: no answer within {timeout:?}")]
    Timeout {
        /// `GET` or `POST`.
        method: &'static str,
        /// The request URL.
        url: Url,
        /// The bound ([`CHALLENGE_TIMEOUT`] or [`REGISTER_TIMEOUT`]).
        timeout: Duration,
    },
    /// `register` answered 403: MDMA's verdict refused the quote or the enrolment.
    #[error("POST {url}: HTTP 403 (MDMA refused the registration)")]
    Refused {
        /// The request URL.
        url: Url,
    },
    /// `register` answered 503: MDMA could not evaluate the quote now.
    #[error("POST {url}: HTTP 503 (MDMA cannot evaluate the quote now)")]
    Unavailable {
        /// The request URL.
        url: Url,
        /// The wait the answer's `Retry-After` asked for, in whole seconds (see
        /// [`RequestError::Status`]'s `retry_after_secs`).
        retry_after_secs: Option<u32>,
    },
    /// Another status than 2xx.
    #[error("{method} {url}: HTTP {status}")]
    Status {
        /// `GET` or `POST`.
        method: &'static str,
        /// The request URL.
        url: Url,
        /// The HTTP status.
        status: u16,
        /// The wait the answer's `Retry-After` asked for, in whole seconds (see
        /// [`RequestError::Status`]'s `retry_after_secs`).
        retry_after_secs: Option<u32>,
    },
    /// A 2xx answer of the wrong shape (not JSON, no `challenge`, an unsendable token).
    #[error("{method} {url}: unexpected answer: {reason}")]
    Answer {
        /// `GET` or `POST`.
        method: &'static str,
        /// The request URL.
        url: Url,
        /// What is wrong (never the token).
        reason: String,
    },
}

impl RegisterError {
    /// Whether the call ran out of time.
    pub fn is_timeout(&self) -> bool {
        matches!(self, RegisterError::Timeout { .. })
    }

    /// The wait MDMA's answer asked for (its `Retry-After`), unbounded; `None` without one.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            RegisterError::Unavailable {
                retry_after_secs, ..
            }
            | RegisterError::Status {
                retry_after_secs, ..
            } => retry_after_secs.map(|s| Duration::from_secs(s.into())),
            _ => None,
        }
    }
}

/// How the latest `should-join` went, as far as the token is concerned: shared by the
/// clones of one [`MdmaClient`], read by the daemon's token job.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct PollVerdict {
    /// Since when polls have been refused with 401 or 403, with no accepted poll between
    /// (`None`: none refused since the latest accepted one). Polls MDMA did not answer on
    /// the token (5xx, no answer) do not break the streak.
    pub(crate) refused_since: Option<Instant>,
    /// Polls refused since the latest accepted one.
    pub(crate) refusals: u64,
    /// Polls MDMA accepted (200), since the client was built.
    pub(crate) accepted: u64,
}

/// The token every clone of one [`MdmaClient`] sends, replaceable while it runs, and the
/// verdict of its polls.
#[derive(Clone)]
struct TokenSlot {
    token: Arc<RwLock<Option<FleetToken>>>,
    verdict: Arc<watch::Sender<PollVerdict>>,
}

impl TokenSlot {
    fn new(token: Option<FleetToken>) -> Self {
        Self {
            token: Arc::new(RwLock::new(token)),
            verdict: Arc::new(watch::Sender::new(PollVerdict::default())),
        }
    }

    fn get(&self) -> Option<FleetToken> {
        self.token
            .read()
            .map_or_else(|e| e.into_inner().clone(), |t| t.clone())
    }

    fn set(&self, token: Option<FleetToken>) {
        match self.token.write() {
            Ok(mut t) => *t = token,
            Err(e) => *e.into_inner() = token,
        }
    }

    /// Records a poll's HTTP status (`None`: no answer). Only MDMA's word on the token
    /// moves the verdict: a refusal starts or extends the streak, an accepted poll ends it.
    /// Anything else (a 503 of a rolling deploy, a timeout, a refused connection) says
    /// nothing of the token, so it neither extends nor resets the streak, and wakes no one.
    fn record(&self, status: Option<u16>) {
        let now = Instant::now();
        self.verdict.send_if_modified(|v| match status {
            Some(401 | 403) => {
                v.refused_since.get_or_insert(now);
                v.refusals += 1;
                true
            }
            Some(200) => {
                v.refused_since = None;
                v.refusals = 0;
                v.accepted += 1;
                true
            }
            _ => false,
        });
    }
}

impl fmt::Debug for TokenSlot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TokenSlot")
            .field("token", &self.get())
            .finish_non_exhaustive()
    }
}

/// A successful `should-join` answer: what MDMA assigns to this node now.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ShouldJoin {
    /// `assignments[].group_id`: the namespaces this node should hold.
    pub assignments: BTreeSet<GroupId>,
    /// `retain`: namespaces to keep if held, but not to join.
    pub retain: BTreeSet<GroupId>,
    /// `assignments[].admitter_addrs`: the admitting nodes' multiaddrs MDMA sends for an
    /// assignment (direct admission), in MDMA's order, only the strings starting with `/`
    /// and holding no line break; only assignments with at least one such address.
    /// Each list is shared (`Arc`): an answer kept for reuse and the copies handed out hold
    /// one copy of the strings.
    pub admitter_addrs: BTreeMap<GroupId, Arc<[String]>>,
    /// `tls_certificate`: a PEM certificate MDMA signed for the node (over the CSR its
    /// registration sent), when the answer carries a non-empty string; anything else is no
    /// delivery.
    pub tls_certificate: Option<String>,
    /// `logs_token`: the log shippers' token, when the answer carries a non-empty string.
    pub logs_token: Option<LogsToken>,
}

/// Which should-join answer an answer is: the BLAKE3 digest of the bytes it was read from
/// (32 bytes). Only [`ControlPlane::should_join_if_changed`] makes one, for an answer that
/// passed the whole validation; it is handed back to that method to say which answer the
/// caller holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AnswerDigest([u8; 32]);

#[cfg(test)]
impl AnswerDigest {
    /// A digest of these bytes' value, for the daemon's own tests.
    pub(crate) const fn of_test(bytes: [u8; 32]) -> Self {
        Self(bytes)
    }
}

/// What the caller of [`ControlPlane::should_join_if_changed`] holds already, so the poll
/// hands out only what it lacks. `Holding::default()` holds nothing: every answer is
/// whole.
#[derive(Clone, Copy, Debug, Default)]
pub struct Holding<'a> {
    /// The digest of the answer the caller holds (an earlier call's): an answer
    /// byte-for-byte that one is [`Polled::Unchanged`].
    pub answer: Option<&'a AnswerDigest>,
    /// The namespaces the caller has joined: a [`Polled::Changed`] answer keeps no
    /// `admitter_addrs` for them (they are validated all the same; only a join uses
    /// them). The caller's answer then lacks them for as long as it holds it: to join one
    /// of these again, it polls holding no `answer`, so the answer is read again whole.
    pub joined: Option<&'a BTreeSet<GroupId>>,
}

/// What [`ControlPlane::should_join_if_changed`] polled.
#[derive(Debug)]
pub enum Polled {
    /// An answer other than the one the caller holds (or the caller named none).
    Changed {
        /// The answer, validated as [`ControlPlane::should_join`]'s.
        answer: ShouldJoin,
        /// Its digest, to hand back next time; `None` when the control plane keeps none
        /// (every answer is then `Changed`).
        digest: Option<AnswerDigest>,
    },
    /// Byte-for-byte the answer the caller holds: nothing to take in.
    Unchanged,
}

/// What the node tells MDMA about itself in a `should-join`, besides its identity.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NodeReport<'a> {
    /// `held_namespaces`: what merod holds, lowercase 64 hex, sorted, unique, at most
    /// [`MAX_HELD_REPORTED`]; `None` leaves the field out ("no report"), `Some(&[])` says
    /// merod holds nothing.
    pub held_namespaces: Option<&'a [GroupId]>,
    /// `tls_cert_not_after`: the node's TLS certificate's `notAfter` as
    /// `YYYY-MM-DDTHH:MM:SSZ`; `""` when there is none, it is unreadable or self-signed (MDMA
    /// then sends a certificate); `None` leaves the field out (not reported).
    pub tls_cert_not_after: Option<&'a str>,
    /// `logs_token_fp`: lowercase hex SHA-256 of the log-shipping token MDMA delivered,
    /// never the token; `""` when there is none; `None` leaves the field out.
    pub logs_token_fp: Option<&'a str>,
    /// `executor_account`: merod's account id (lowercase 64 hex), `""` while merod holds
    /// none yet; `None` leaves the field out.
    pub executor_account: Option<&'a str>,
    /// `swarm_addrs`: the multiaddrs other nodes reach this one at, each ending
    /// `/p2p/<PeerId>`, at most 16 (MDMA hands them to other joiners as `admitter_addrs`);
    /// `[]` means "not reported" (MDMA keeps what it had); `None` leaves the field out.
    pub swarm_addrs: Option<&'a [String]>,
    /// `relay_url`: the relay the node registers with (`[registration] relay_url`, else
    /// the instance metadata's `relay-url`), `""` when unknown or none; `None` leaves the
    /// field out.
    pub relay_url: Option<&'a str>,
}

/// Most ids sent as `held_namespaces`: MDMA cannot tell a cut list from a whole one, so a
/// longer list is not reported at all.
pub const MAX_HELD_REPORTED: usize = 512;

/// `state` of a join-status report: how the latest fleet-join of a namespace ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JoinState {
    /// merod answered `admitted: true`.
    Admitted,
    /// Not admitted, and admitting nodes said why (`refusals`).
    Refused,
    /// Not admitted, no refusal: nobody answered yet (or an older core that does not say).
    Waiting,
    /// The call failed or timed out.
    Error,
}

impl JoinState {
    /// The wire spelling (`admitted`, `refused`, `waiting`, `error`).
    pub fn as_str(self) -> &'static str {
        match self {
            JoinState::Admitted => "admitted",
            JoinState::Refused => "refused",
            JoinState::Waiting => "waiting",
            JoinState::Error => "error",
        }
    }
}

/// `POST /api/fleet/join-status`: why a join of `group_id` has (not) gone through.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct JoinStatus {
    /// How the latest fleet-join ended.
    pub state: JoinState,
    /// The admitting nodes' refusals (at most 8; see [`crate::Admission::refusals`]).
    pub refusals: Vec<Refusal>,
    /// The failure (≤ 512 chars) when `state` is `error`, else `None` (sent as `null`).
    pub error: Option<String>,
    /// This node's PeerId.
    pub peer_id: String,
    /// The namespace (64 hex, lowercase).
    pub group_id: GroupId,
    /// fleet-join attempts of this namespace so far (kept across restarts).
    pub attempts: u64,
}

/// The control plane as the daemon sees it; [`MdmaClient`] is the real one, tests supply
/// their own.
#[async_trait]
pub trait ControlPlane: Send + Sync + 'static {
    /// Polls `should-join` for this node. `mrtd` is left out of the request when `None`;
    /// `report` adds what the node tells about itself (`held_namespaces`).
    ///
    /// Errors: [`PollError`]: any of them means the poll failed.
    async fn should_join(
        &self,
        peer_id: &PeerId,
        mrtd: Option<&Mrtd>,
        report: NodeReport<'_>,
    ) -> Result<ShouldJoin, PollError>;

    /// [`ControlPlane::should_join`], told what the caller holds ([`Holding`]): the digest
    /// of an answer an earlier call gave, and the namespaces it has joined. An answer
    /// byte-for-byte the one held is [`Polled::Unchanged`], neither parsed nor copied
    /// (MDMA repeats an unchanged answer every poll, and at 10,000 assignments handing it
    /// out again costs more than reading it). A changed one leaves out the
    /// `admitter_addrs` of the joined namespaces (at 10,000 × 8 addresses they are about
    /// 12 MB the caller would keep for nothing). The poll is the heartbeat all the same.
    ///
    /// The default never says `Unchanged`, gives no digest and leaves every address in:
    /// every answer is [`Polled::Changed`] and whole. [`MdmaClient`] gives the BLAKE3
    /// digest of the bytes.
    ///
    /// Errors: as [`ControlPlane::should_join`].
    async fn should_join_if_changed(
        &self,
        peer_id: &PeerId,
        mrtd: Option<&Mrtd>,
        report: NodeReport<'_>,
        held: Holding<'_>,
    ) -> Result<Polled, PollError> {
        let _ = held;
        let answer = self.should_join(peer_id, mrtd, report).await?;
        Ok(Polled::Changed {
            answer,
            digest: None,
        })
    }

    /// Confirms the admission of `group_id`, with the node's TEE role in it (`tee_role`,
    /// `null` when unknown) and `authorship_ready` (true only for `RelayTee`).
    ///
    /// Errors: [`ConfirmError`]; the namespace then stays unconfirmed.
    async fn confirm(
        &self,
        peer_id: &PeerId,
        group_id: GroupId,
        role: Option<TeeRole>,
    ) -> Result<(), ConfirmError>;

    /// Reports how the latest fleet-join of a namespace ended (`POST /api/fleet/join-status`,
    /// best effort: an MDMA without the route answers 404).
    ///
    /// Errors: [`RequestError`]; nothing depends on it.
    async fn join_status(&self, report: &JoinStatus) -> Result<(), RequestError>;
}

/// MDMA over HTTPS with reqwest/rustls.
///
/// ```no_run
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// use std::time::Duration;
/// use fleet_sidecar::{ControlPlane, FleetToken, MdmaClient, mdma::NodeReport};
///
/// let mdma = MdmaClient::builder("https://mdma.example/".parse()?)
///     .token(FleetToken::new("…"))
///     .timeout(Duration::from_secs(5))
///     .build()?;
/// let peer_id = "12D3KooWJ6X2tBZEd8qKWvJyhtH2v2XyP4eQ9dcU2xZ8Y6YrjcVk".parse()?;
/// // Only the node's own sidecar polls: MDMA counts a should-join as its heartbeat.
/// let answer = mdma.should_join(&peer_id, None, NodeReport::default()).await?;
/// println!("{} assigned", answer.assignments.len());
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct MdmaClient {
    http: reqwest::Client,
    base: Url,
    /// The same client without a connection pool, built at the first need: the one resend
    /// of a should-join whose kept-alive connection the server closed as it was reused goes
    /// out on a fresh connection.
    fresh: std::sync::Arc<std::sync::OnceLock<reqwest::Client>>,
    /// What `fresh` is built from.
    settings: ClientSettings,
    on_resend: OnResend,
    should_join_url: Url,
    confirm_url: Url,
    challenge_url: Url,
    register_url: Url,
    join_status_url: Url,
    token: TokenSlot,
    timeout: Duration,
    /// The last should-join answer that passed the whole validation, by its bytes' digest.
    last_answer: LastAnswer,
}

/// The last accepted should-join answer, kept with the BLAKE3 digest of the bytes it was read
/// from: an answer byte-for-byte the same is that answer again, so it is not parsed again
/// (MDMA repeats an unchanged answer every poll). Only bytes that passed the whole
/// validation are kept; any other body goes through it again. Shared by the client's clones.
#[derive(Clone, Debug, Default)]
struct LastAnswer {
    kept: Arc<std::sync::Mutex<Kept>>,
    reused: Arc<std::sync::atomic::AtomicU64>,
}

/// An accepted answer and the BLAKE3 digest of its bytes.
type Kept = Option<(AnswerDigest, ShouldJoin)>;

impl LastAnswer {
    fn slot(&self) -> std::sync::MutexGuard<'_, Kept> {
        self.kept
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The kept answer if `digest` is its bytes' digest.
    fn reuse(&self, digest: &AnswerDigest) -> Option<ShouldJoin> {
        let slot = self.slot();
        let (kept, answer) = slot.as_ref()?;
        if kept != digest {
            return None;
        }
        self.count_reuse();
        Some(answer.clone())
    }

    /// Counts an answer not parsed again ([`MdmaClient::answers_reused`]).
    fn count_reuse(&self) {
        self.reused
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// Keeps `answer`, read and validated from bytes whose digest is `digest`.
    fn keep(&self, digest: AnswerDigest, answer: &ShouldJoin) {
        *self.slot() = Some((digest, answer.clone()));
    }
}

/// Builds an [`MdmaClient`]: token, extra CA file, request timeout.
#[derive(Clone, Debug)]
pub struct MdmaClientBuilder {
    base: Url,
    token: Option<FleetToken>,
    ca_file: Option<PathBuf>,
    timeout: Duration,
    on_resend: OnResend,
}

/// What the client calls each time it sends a should-join once more on a fresh connection
/// (the daemon counts it in `fleet_sidecar_poll_resends_total`).
#[derive(Clone, Default)]
struct OnResend(Option<std::sync::Arc<dyn Fn() + Send + Sync>>);

impl fmt::Debug for OnResend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.0.is_some() { "Some(..)" } else { "None" })
    }
}

impl MdmaClientBuilder {
    /// Send `token` as `X-Fleet-Token` on every request.
    pub fn token(mut self, token: FleetToken) -> Self {
        self.token = Some(token);
        self
    }

    /// Trust the PEM certificates in `path` besides the system roots.
    pub fn ca_file(mut self, path: impl Into<PathBuf>) -> Self {
        self.ca_file = Some(path.into());
        self
    }

    /// Bound of one request, connect to last byte (default [`MDMA_TIMEOUT`], 10 s).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Calls `f` each time a should-join is sent once more on a fresh connection because
    /// the server closed the kept-alive one as it was reused (an idle timeout equal to the
    /// poll interval, common behind load balancers). should-join is safe to repeat; it is
    /// resent once, and only when the request failed on an open connection with no answer
    /// (not a refused connection, not a timeout).
    pub fn on_resend(mut self, f: impl Fn() + Send + Sync + 'static) -> Self {
        self.on_resend = OnResend(Some(std::sync::Arc::new(f)));
        self
    }

    /// Builds the client (reads the CA file; sends nothing).
    ///
    /// Errors: [`MdmaClientError`] for an unreadable CA file or one with a bad block, a
    /// base URL that cannot take the API paths, or a TLS backend that cannot start.
    pub fn build(self) -> Result<MdmaClient, MdmaClientError> {
        MdmaClient::build(self)
    }
}

#[derive(Serialize)]
struct PollRequest<'a> {
    peer_id: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    mrtd: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    held_namespaces: Option<&'a [GroupId]>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tls_cert_not_after: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    logs_token_fp: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    executor_account: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    swarm_addrs: Option<&'a [String]>,
    #[serde(skip_serializing_if = "Option::is_none")]
    relay_url: Option<&'a str>,
}

#[derive(Serialize)]
struct ConfirmRequest<'a> {
    peer_id: &'a str,
    group_id: String,
    authorship_ready: bool,
    tee_role: Option<&'static str>,
}

impl MdmaClient {
    /// A client for MDMA at `base` (a URL ending in `/`), sending `token` as
    /// `X-Fleet-Token` when set, trusting the system roots plus the PEM certificates in
    /// `ca_file`.
    ///
    /// Errors: [`MdmaClientError`] for an unreadable or empty CA file.
    pub fn new(
        base: &Url,
        token: Option<FleetToken>,
        ca_file: Option<&std::path::Path>,
    ) -> Result<Self, MdmaClientError> {
        MdmaClientBuilder {
            base: base.clone(),
            token,
            ca_file: ca_file.map(Path::to_owned),
            timeout: MDMA_TIMEOUT,
            on_resend: OnResend::default(),
        }
        .build()
    }

    /// A builder for a client at `base` (a URL ending in `/`), with no token, the system
    /// roots only and the default timeout.
    pub fn builder(base: Url) -> MdmaClientBuilder {
        MdmaClientBuilder {
            base,
            token: None,
            ca_file: None,
            timeout: MDMA_TIMEOUT,
            on_resend: OnResend::default(),
        }
    }

    fn build(b: MdmaClientBuilder) -> Result<Self, MdmaClientError> {
        let (base, ca_file) = (&b.base, b.ca_file.as_deref());
        let mut roots = Vec::new();
        if let Some(path) = ca_file {
            let pem = std::fs::read(path).map_err(|source| MdmaClientError::CaRead {
                path: path.to_owned(),
                source,
            })?;
            let certs = reqwest::Certificate::from_pem_bundle(&pem).map_err(|e| {
                MdmaClientError::CaParse {
                    path: path.to_owned(),
                    reason: e.to_string(),
                }
            })?;
            if certs.is_empty() {
                return Err(MdmaClientError::CaParse {
                    path: path.to_owned(),
                    reason: "no CERTIFICATE block".to_owned(),
                });
            }
            for (i, cert) in certs.into_iter().enumerate() {
                check_root(&cert).map_err(|e| MdmaClientError::CaParse {
                    path: path.to_owned(),
                    reason: format!("certificate {} of the file: {}", i + 1, describe(&e)),
                })?;
                roots.push(cert);
            }
        }
        let settings = ClientSettings {
            roots,
            timeout: b.timeout,
            https_only: base.scheme() == "https",
            loopback: is_loopback(base),
        };
        let http = settings.client(true).map_err(MdmaClientError::Build)?;
        let join = |path: &'static str| {
            base.join(path).map_err(|source| MdmaClientError::Url {
                base: base.clone(),
                path,
                source,
            })
        };
        Ok(Self {
            http,
            base: base.clone(),
            fresh: std::sync::Arc::default(),
            settings,
            on_resend: b.on_resend,
            should_join_url: join("api/fleet/should-join")?,
            confirm_url: join("api/fleet/confirm")?,
            challenge_url: join("api/fleet/nodes/challenge")?,
            register_url: join("api/fleet/nodes/register")?,
            join_status_url: join("api/fleet/join-status")?,
            token: TokenSlot::new(b.token),
            timeout: b.timeout,
            last_answer: LastAnswer::default(),
        })
    }

    /// How many should-join answers were byte-for-byte the last accepted one, and so were
    /// that answer again without being parsed (since the client was built, its clones
    /// included).
    pub fn answers_reused(&self) -> u64 {
        self.last_answer
            .reused
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The MDMA base URL the client was built for.
    pub fn base_url(&self) -> &Url {
        &self.base
    }

    /// POSTs `body` as JSON to `path` under the MDMA URL (e.g. `api/fleet/inventory`; a
    /// leading `/` is allowed and the base's own path prefix is kept), with exactly the
    /// daemon's rules: the request timeout, TLS verified against the system roots plus the
    /// CA file, no redirect followed, no environment proxy for a loopback MDMA, the token
    /// only in `X-Fleet-Token`. The answer is read whole, capped at [`MAX_POLL_BODY`].
    /// `confirm` is sent this way.
    ///
    /// ```no_run
    /// # async fn demo(mdma: fleet_sidecar::MdmaClient) -> Result<(), fleet_sidecar::CallError> {
    /// let answer = mdma
    ///     .post_json("api/fleet/inventory", &serde_json::json!({"namespaces": []}))
    ///     .await?;
    /// let ack: serde_json::Value = answer.json()?;
    /// println!("HTTP {}: {ack}", answer.status);
    /// # Ok(()) }
    /// ```
    ///
    /// Errors: [`CallError::Path`] for a path that leaves the base URL,
    /// [`CallError::Request`] for no answer, a timeout or a status outside 2xx,
    /// [`CallError::Malformed`] for a 2xx body larger than the cap.
    pub async fn post_json<B: Serialize + ?Sized>(
        &self,
        path: &str,
        body: &B,
    ) -> Result<MdmaAnswer, CallError> {
        let url = self.api_url(path)?;
        let resp = self.send(&url, body).await?;
        let status = resp.status().as_u16();
        let body = read_capped(resp, MAX_POLL_BODY)
            .await
            .map_err(|e| match e {
                BodyError::TooLarge { .. } => CallError::Malformed {
                    url: url.clone(),
                    status,
                    source: MalformedAnswer::TooLarge {
                        limit: MAX_POLL_BODY,
                    },
                },
                BodyError::Transport(e) => RequestError::from_reqwest(&url, self.timeout, e).into(),
            })?;
        Ok(MdmaAnswer { url, status, body })
    }

    /// `path` joined to the base URL, refused unless the result stays under it.
    fn api_url(&self, path: &str) -> Result<Url, CallError> {
        let refused = || CallError::Path {
            base: self.base.clone(),
            path: path.to_owned(),
        };
        let relative = path.strip_prefix('/').unwrap_or(path);
        if relative.is_empty() || relative.contains(['?', '#']) || relative.contains("..") {
            return Err(refused());
        }
        let url = self.base.join(relative).map_err(|_| refused())?;
        if !url.as_str().starts_with(self.base.as_str()) {
            return Err(refused());
        }
        Ok(url)
    }

    /// `method` (`PUT`, `DELETE`, …) of `body` as JSON to `path` under the MDMA URL, like
    /// [`MdmaClient::post_json`] (the fleet token, the request timeout, no redirect); the
    /// answer's body is not read. The recovery envelopes are written and removed this way.
    ///
    /// Errors: [`CallError::Path`] for a path that leaves the base URL,
    /// [`CallError::Request`] for no answer, a timeout or a status outside 2xx.
    pub async fn send_json<B: Serialize + ?Sized>(
        &self,
        method: RequestMethod,
        path: &str,
        body: &B,
    ) -> Result<u16, CallError> {
        let url = self.api_url(path)?;
        let resp = self.send_as(method, &url, body).await?;
        Ok(resp.status().as_u16())
    }

    /// Sends one POST of `body` to `url`; a 2xx answer is returned unread.
    ///
    /// Errors: [`RequestError`] for no answer, a timeout or a status outside 2xx.
    async fn send<B: Serialize + ?Sized>(
        &self,
        url: &Url,
        body: &B,
    ) -> Result<reqwest::Response, RequestError> {
        self.send_as(RequestMethod::Post, url, body).await
    }

    /// Sends one `method` request of `body` to `url`; a 2xx answer is returned unread.
    ///
    /// Errors: [`RequestError`] for no answer, a timeout or a status outside 2xx.
    async fn send_as<B: Serialize + ?Sized>(
        &self,
        method: RequestMethod,
        url: &Url,
        body: &B,
    ) -> Result<reqwest::Response, RequestError> {
        let resp = self
            .request_with(&self.http, method, url, body)
            .send()
            .await
            .map_err(|e| RequestError::failed(method, url, self.timeout, e))?;
        if resp.status().is_success() {
            Ok(resp)
        } else {
            Err(self.refused(method, url, resp).await)
        }
    }

    /// [`RequestError::Status`] for a refusal, with the start of its body (never a header).
    async fn refused(
        &self,
        method: RequestMethod,
        url: &Url,
        mut resp: reqwest::Response,
    ) -> RequestError {
        let status = resp.status().as_u16();
        let retry_after_secs =
            crate::net::retry_after(resp.headers(), SystemTime::now()).map(|d| {
                u32::try_from(d.as_secs() + u64::from(d.subsec_nanos() > 0)).unwrap_or(u32::MAX)
            });
        let mut bytes = Vec::new();
        // Within the request's own timeout; a body that fails to arrive is left out.
        while bytes.len() < REFUSAL_READ {
            match resp.chunk().await {
                Ok(Some(chunk)) => bytes.extend_from_slice(&chunk),
                Ok(None) | Err(_) => break,
            }
        }
        bytes.truncate(REFUSAL_READ);
        RequestError::Status {
            method,
            url: url.clone(),
            status,
            retry_after_secs,
            body: refusal_excerpt(&bytes, self.token.get().as_ref()).into_boxed_str(),
        }
    }

    fn post<B: Serialize + ?Sized>(&self, url: &Url, body: &B) -> reqwest::RequestBuilder {
        self.post_with(&self.http, url, body)
    }

    fn post_with<B: Serialize + ?Sized>(
        &self,
        http: &reqwest::Client,
        url: &Url,
        body: &B,
    ) -> reqwest::RequestBuilder {
        self.request_with(http, RequestMethod::Post, url, body)
    }

    fn request_with<B: Serialize + ?Sized>(
        &self,
        http: &reqwest::Client,
        method: RequestMethod,
        url: &Url,
        body: &B,
    ) -> reqwest::RequestBuilder {
        let req = http.request(method.as_reqwest(), url.clone()).json(body);
        match self.token.get() {
            Some(t) => req.header("X-Fleet-Token", t.expose()),
            None => req,
        }
    }

    /// Replaces the token this client and all its clones send from now on (`None`: send
    /// no `X-Fleet-Token`). The daemon uses it for a token issued by registration or a
    /// replaced `fleet_token_file`, with no restart.
    pub fn set_token(&self, token: Option<FleetToken>) {
        self.token.set(token);
    }

    /// Whether a token is sent.
    pub fn has_token(&self) -> bool {
        self.token.get().is_some()
    }

    /// The token sent now (for comparing with a file read again).
    #[cfg(feature = "daemon")]
    pub(crate) fn token(&self) -> Option<FleetToken> {
        self.token.get()
    }

    /// The verdicts of this client's polls, as they change.
    #[cfg(feature = "daemon")]
    pub(crate) fn verdicts(&self) -> watch::Receiver<PollVerdict> {
        self.token.verdict.subscribe()
    }

    /// `GET /api/fleet/nodes/challenge` (bounded by [`CHALLENGE_TIMEOUT`]): a fresh
    /// challenge for a registration. No token is needed or sent.
    ///
    /// Errors: [`RegisterError`]: transport, timeout, a non-2xx status, or an answer
    /// without a non-empty string `challenge`.
    pub async fn challenge(&self) -> Result<Challenge, RegisterError> {
        let (method, url) = ("GET", &self.challenge_url);
        let req = self.http.get(url.clone()).timeout(CHALLENGE_TIMEOUT);
        let body = self
            .registration_call(method, url, CHALLENGE_TIMEOUT, req)
            .await?;
        // Registration uses only `challenge`: `expires_at_ms` is kept when it reads as a
        // whole number (an integer-valued float too) and dropped otherwise, never failing
        // the attempt over a field it does not need.
        #[derive(Deserialize)]
        struct Answer {
            challenge: String,
            #[serde(default)]
            expires_at_ms: Option<serde_json::Value>,
        }
        let answer: Answer =
            crate::strict_json::from_slice(&body).map_err(|e| RegisterError::Answer {
                method,
                url: url.clone(),
                reason: e.to_string(),
            })?;
        if answer.challenge.is_empty() {
            return Err(RegisterError::Answer {
                method,
                url: url.clone(),
                reason: "`challenge` is empty".to_owned(),
            });
        }
        Ok(Challenge {
            challenge: answer.challenge,
            expires_at_ms: answer
                .expires_at_ms
                .and_then(|v| crate::strict_json::WholeNumber::deserialize(v).ok())
                .map(|w| w.0),
        })
    }

    /// `POST /api/fleet/nodes/register` (bounded by [`REGISTER_TIMEOUT`]) with `request`.
    /// No token is sent. A 2xx answer is [`Registered`], with the issued `fleet_token` when
    /// there is a non-empty one.
    ///
    /// Errors: [`RegisterError::Refused`] (403), [`RegisterError::Unavailable`] (503),
    /// [`RegisterError::Status`] (another non-2xx), transport, timeout, and
    /// [`RegisterError::Answer`] for a 2xx that is not a JSON object or whose `fleet_token`
    /// is not a string that can be sent as a header.
    pub async fn register(&self, request: &RegisterRequest) -> Result<Registered, RegisterError> {
        #[derive(Serialize)]
        struct Body<'a> {
            peer_id: &'a str,
            executor_account: &'a str,
            relay_url: &'a str,
            challenge: &'a str,
            quote: &'a str,
            enrolment_token: &'a str,
            #[serde(skip_serializing_if = "Option::is_none")]
            quote_binding: Option<&'static str>,
            #[serde(skip_serializing_if = "Option::is_none")]
            csr: Option<&'a str>,
        }
        let (method, url) = ("POST", &self.register_url);
        let body = Body {
            peer_id: request.peer_id.as_str(),
            executor_account: &request.executor_account,
            relay_url: &request.relay_url,
            challenge: &request.challenge,
            quote: &request.quote,
            enrolment_token: request.enrolment_token.expose(),
            quote_binding: request.registration_bound.then_some("registration"),
            csr: request.csr.as_deref(),
        };
        let req = self
            .http
            .post(url.clone())
            .json(&body)
            .timeout(REGISTER_TIMEOUT);
        let answer = self
            .registration_call(method, url, REGISTER_TIMEOUT, req)
            .await?;
        let bad = |reason: &str| RegisterError::Answer {
            method,
            url: url.clone(),
            reason: reason.to_owned(),
        };
        let answer: serde_json::Map<String, serde_json::Value> =
            crate::strict_json::from_slice(&answer)
                .map_err(|_| bad("not a JSON object (or a key named twice)"))?;
        let token = match answer.get("fleet_token") {
            None | Some(serde_json::Value::Null) => None,
            Some(serde_json::Value::String(t)) if t.is_empty() => None,
            Some(serde_json::Value::String(t)) => {
                if reqwest::header::HeaderValue::from_str(t).is_err() {
                    return Err(bad(
                        "`fleet_token` holds characters not allowed in a header",
                    ));
                }
                Some(FleetToken::new(t.clone()))
            }
            Some(_) => return Err(bad("`fleet_token` is not a string")),
        };
        Ok(Registered { token })
    }

    /// Sends one registration call and reads its 2xx body (capped).
    async fn registration_call(
        &self,
        method: &'static str,
        url: &Url,
        timeout: Duration,
        req: reqwest::RequestBuilder,
    ) -> Result<Vec<u8>, RegisterError> {
        let fail = |e: reqwest::Error| match no_answer(e) {
            NoAnswer::TimedOut => RegisterError::Timeout {
                method,
                url: url.clone(),
                timeout,
            },
            NoAnswer::Transport(source) => RegisterError::Transport {
                method,
                url: url.clone(),
                source,
            },
        };
        let call = async {
            let resp = req.send().await.map_err(fail)?;
            let status = resp.status().as_u16();
            let retry_after_secs = || retry_after_secs(resp.headers());
            match status {
                200..=299 => {}
                403 if method == "POST" => return Err(RegisterError::Refused { url: url.clone() }),
                503 if method == "POST" => {
                    return Err(RegisterError::Unavailable {
                        url: url.clone(),
                        retry_after_secs: retry_after_secs(),
                    })
                }
                _ => {
                    return Err(RegisterError::Status {
                        method,
                        url: url.clone(),
                        status,
                        retry_after_secs: retry_after_secs(),
                    })
                }
            }
            let too_large = |reason| RegisterError::Answer {
                method,
                url: url.clone(),
                reason,
            };
            read_capped(resp, MAX_REGISTRATION_BODY)
                .await
                .map_err(|e| e.into_error(too_large, fail))
        };
        // reqwest's own timeout covers the whole request; this one also bounds a body that
        // trickles in.
        match tokio::time::timeout(timeout, call).await {
            Ok(r) => r,
            Err(_) => Err(RegisterError::Timeout {
                method,
                url: url.clone(),
                timeout,
            }),
        }
    }
}

/// How the HTTP clients of an [`MdmaClient`] are built.
#[derive(Clone, Debug)]
struct ClientSettings {
    /// The extra trust roots (`mdma_ca_file`), besides the system's.
    roots: Vec<reqwest::Certificate>,
    timeout: Duration,
    https_only: bool,
    /// MDMA is on loopback: no environment proxy.
    loopback: bool,
}

impl ClientSettings {
    /// A client; `pooled: false` keeps no idle connection (every request on a fresh one).
    fn client(&self, pooled: bool) -> Result<reqwest::Client, reqwest::Error> {
        let mut builder = reqwest::Client::builder()
            .timeout(self.timeout)
            .connect_timeout(self.timeout)
            .redirect(reqwest::redirect::Policy::none())
            .tls_built_in_webpki_certs(false)
            .tls_built_in_native_certs(true)
            .https_only(self.https_only)
            .user_agent(concat!("fleet-sidecar/", env!("CARGO_PKG_VERSION")));
        for cert in &self.roots {
            builder = builder.add_root_certificate(cert.clone());
        }
        if !pooled {
            builder = builder.pool_max_idle_per_host(0);
        }
        // Environment proxies (HTTP_PROXY, HTTPS_PROXY, ALL_PROXY) never reach a loopback
        // MDMA; a remote one goes through them as usual (NO_PROXY honoured).
        if self.loopback {
            builder = builder.no_proxy();
        }
        builder.build()
    }
}

/// Whether `cert` is usable as a trust root, on its own: builds a client trusting only it
/// (no system roots loaded), so a bad block in the CA file is named instead of failing the
/// whole client with reqwest's bare `builder error`.
///
/// Errors: reqwest's error, whose causes say what is wrong (rustls's message).
fn check_root(cert: &reqwest::Certificate) -> Result<(), reqwest::Error> {
    reqwest::Client::builder()
        .tls_built_in_root_certs(false)
        .add_root_certificate(cert.clone())
        .build()
        .map(drop)
}

/// Whether a request failed on a connection that was open (a kept-alive one the server
/// closed or reset as it was reused) before any answer: not a refused or failed connect,
/// not a timeout, not an answer. Repeating a should-join then is safe.
fn closed_without_answer(e: &reqwest::Error) -> bool {
    e.is_request() && !e.is_connect() && !e.is_timeout()
}

/// reqwest's error text with its causes (it never holds a header, so never the token).
fn describe(e: &reqwest::Error) -> String {
    let mut text = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

impl MdmaClient {
    /// Sends a should-join and reads its `200` body (capped at [`MAX_POLL_BODY`]) with its
    /// digest, computed as it streams in.
    async fn fetch_should_join(
        &self,
        peer_id: &PeerId,
        mrtd: Option<&Mrtd>,
        report: NodeReport<'_>,
    ) -> Result<(Chunks, AnswerDigest), PollError> {
        let url = &self.should_join_url;
        let body = PollRequest {
            peer_id: peer_id.as_str(),
            mrtd: mrtd.map(Mrtd::to_hex),
            held_namespaces: report.held_namespaces,
            tls_cert_not_after: report.tls_cert_not_after,
            logs_token_fp: report.logs_token_fp,
            executor_account: report.executor_account,
            swarm_addrs: report.swarm_addrs,
            relay_url: report.relay_url,
        };
        let fail =
            |e: reqwest::Error| PollError::from(RequestError::from_reqwest(url, self.timeout, e));
        let sent = match self.post(url, &body).send().await {
            Err(e) if closed_without_answer(&e) => {
                let fresh = match self.fresh.get() {
                    Some(c) => Some(c),
                    None => self
                        .settings
                        .client(false)
                        .ok()
                        .map(|c| self.fresh.get_or_init(|| c)),
                };
                match fresh {
                    Some(fresh) => {
                        if let Some(f) = &self.on_resend.0 {
                            f();
                        }
                        tracing::debug!(
                            "should-join failed on an open connection with no answer ({}): sent once more on a fresh connection",
                            describe(&e)
                        );
                        self.post_with(fresh, url, &body).send().await
                    }
                    None => Err(e),
                }
            }
            other => other,
        };
        self.token
            .record(sent.as_ref().ok().map(|r| r.status().as_u16()));
        let resp = sent.map_err(fail)?;
        if resp.status().as_u16() != 200 {
            return Err(self.refused(RequestMethod::Post, url, resp).await.into());
        }
        let mut hasher = blake3::Hasher::new();
        let chunks = read_capped_chunks(resp, MAX_POLL_BODY, |chunk| {
            hasher.update(chunk);
        })
        .await
        .map_err(|e| match e {
            BodyError::TooLarge { .. } => PollError::Malformed {
                url: url.clone(),
                source: MalformedAnswer::TooLarge {
                    limit: MAX_POLL_BODY,
                },
            },
            BodyError::Transport(e) => fail(e),
        })?;
        Ok((chunks, AnswerDigest(hasher.finalize().into())))
    }

    /// The answer read as `chunks`, whose digest is `digest`: the last accepted one again
    /// when it is its bytes, else parsed and validated (and kept when it passes).
    fn answer_from(&self, chunks: Chunks, digest: AnswerDigest) -> Result<ShouldJoin, PollError> {
        if let Some(answer) = self.last_answer.reuse(&digest) {
            return Ok(answer);
        }
        let answer = self.parse(chunks, None)?;
        self.last_answer.keep(digest, &answer);
        Ok(answer)
    }

    /// The answer in `chunks`, without the addresses of the namespaces in `joined`.
    fn parse(
        &self,
        chunks: Chunks,
        joined: Option<&BTreeSet<GroupId>>,
    ) -> Result<ShouldJoin, PollError> {
        // The chunks are copied into one buffer only now, for an answer that changed, and
        // freed chunk by chunk as they are copied.
        let bytes = chunks.into_contiguous();
        parse_answer(&bytes, joined).map_err(|source| PollError::Malformed {
            url: self.should_join_url.clone(),
            source,
        })
    }
}

#[async_trait]
impl ControlPlane for MdmaClient {
    async fn should_join(
        &self,
        peer_id: &PeerId,
        mrtd: Option<&Mrtd>,
        report: NodeReport<'_>,
    ) -> Result<ShouldJoin, PollError> {
        let (chunks, digest) = self.fetch_should_join(peer_id, mrtd, report).await?;
        self.answer_from(chunks, digest)
    }

    async fn should_join_if_changed(
        &self,
        peer_id: &PeerId,
        mrtd: Option<&Mrtd>,
        report: NodeReport<'_>,
        held: Holding<'_>,
    ) -> Result<Polled, PollError> {
        let (chunks, digest) = self.fetch_should_join(peer_id, mrtd, report).await?;
        // A digest is only ever made for bytes that passed the whole validation.
        if held.answer == Some(&digest) {
            self.last_answer.count_reuse();
            return Ok(Polled::Unchanged);
        }
        // The caller keeps this answer itself (and it may lack addresses): it is not kept
        // here for `should_join` as well.
        let answer = self.parse(chunks, held.joined)?;
        Ok(Polled::Changed {
            answer,
            digest: Some(digest),
        })
    }

    async fn confirm(
        &self,
        peer_id: &PeerId,
        group_id: GroupId,
        role: Option<TeeRole>,
    ) -> Result<(), ConfirmError> {
        let body = ConfirmRequest {
            peer_id: peer_id.as_str(),
            group_id: group_id.to_string(),
            authorship_ready: role == Some(TeeRole::RelayTee),
            tee_role: role.map(TeeRole::as_str),
        };
        // The answer's body is not read: any 2xx is the acknowledgement.
        self.send(&self.confirm_url, &body).await.map(drop)
    }

    async fn join_status(&self, report: &JoinStatus) -> Result<(), RequestError> {
        // Best effort, the answer's body is not read: any 2xx is the acknowledgement.
        self.send(&self.join_status_url, report).await.map(drop)
    }
}

/// A `should-join` answer as [`parse_should_join`] reads it; other fields are ignored.
#[derive(Deserialize)]
struct PollAnswer {
    assignments: Vec<PollEntry>,
    #[serde(default)]
    retain: Vec<GroupId>,
    #[serde(default)]
    tls_certificate: Option<serde_json::Value>,
    #[serde(default)]
    logs_token: Option<serde_json::Value>,
}

#[derive(Deserialize)]
struct PollEntry {
    group_id: GroupId,
    #[serde(default)]
    admitter_addrs: Option<Vec<String>>,
}

/// The addresses of `admitter_addrs` kept: those starting with `/` and holding no line
/// break, in order.
pub(crate) fn keep_admitter_addrs<A: AsRef<str> + Into<String>>(
    addrs: impl IntoIterator<Item = A>,
) -> Arc<[String]> {
    addrs
        .into_iter()
        .filter(|a| {
            let a = a.as_ref();
            a.starts_with('/') && !a.contains(['\n', '\r'])
        })
        .map(Into::into)
        .collect()
}

/// Validates a 200 `should-join` body (docs/mdma.md), parsed straight into typed structs
/// (no intermediate `serde_json::Value`). Unknown fields are ignored.
///
/// Errors: [`MalformedAnswer::Ambiguous`] for a body that is not JSON or any object (top
/// level, an entry, or an ignored field) naming the same key twice; an ambiguous document
/// fails the poll. [`MalformedAnswer::Shape`] for the wrong shape (not an object, no
/// `assignments` array, an entry without a 64-hex `group_id`, an `admitter_addrs` that is
/// neither `null` nor an array of strings, a `retain` that is not an array of 64-hex ids).
/// Both name the line and column of the first fault.
///
/// One pass over the body in the common case, allocating only the two sets (see
/// `mdma/answer.rs`); a body it refuses is read again the strict two-step way only to name
/// the fault as before.
// A pure entry point for the contract and schema tests, the fuzzers and the benches;
// not part of the library's promise.
#[doc(hidden)]
pub fn parse_should_join(body: &[u8]) -> Result<ShouldJoin, MalformedAnswer> {
    parse_answer(body, None)
}

/// [`parse_should_join`], keeping no `admitter_addrs` for the assignments in `joined`
/// (they are validated all the same).
fn parse_answer(
    body: &[u8],
    joined: Option<&BTreeSet<GroupId>>,
) -> Result<ShouldJoin, MalformedAnswer> {
    match answer::read(body, joined) {
        Ok(read) => Ok(ShouldJoin {
            assignments: read.assignments,
            retain: read.retain,
            admitter_addrs: read.admitter_addrs,
            tls_certificate: read.tls_certificate,
            logs_token: read.logs_token.map(LogsToken::new),
        }),
        Err(fast) => Err(match parse_two_step(body) {
            Err(e) => e,
            // The one-pass reader also refuses arrays standing for objects.
            Ok(_) => MalformedAnswer::Shape(fast),
        }),
    }
}

/// The strict reading in two steps: no repeated key anywhere, then the typed shape. Names
/// the fault of a refused body ([`parse_should_join`] uses it only for that).
fn parse_two_step(body: &[u8]) -> Result<ShouldJoin, MalformedAnswer> {
    crate::strict_json::reject_duplicate_keys(body).map_err(MalformedAnswer::Ambiguous)?;
    let answer: PollAnswer = serde_json::from_slice(body).map_err(MalformedAnswer::Shape)?;
    let mut admitter_addrs = BTreeMap::new();
    let mut assignments = BTreeSet::new();
    for entry in answer.assignments {
        assignments.insert(entry.group_id);
        let addrs = keep_admitter_addrs(entry.admitter_addrs.unwrap_or_default());
        if addrs.is_empty() {
            admitter_addrs.remove(&entry.group_id);
        } else {
            admitter_addrs.insert(entry.group_id, addrs);
        }
    }
    let text = |v: Option<serde_json::Value>| match v {
        Some(serde_json::Value::String(s)) if !s.is_empty() => Some(s),
        _ => None,
    };
    Ok(ShouldJoin {
        assignments,
        retain: answer.retain.into_iter().collect(),
        admitter_addrs,
        tls_certificate: text(answer.tls_certificate),
        logs_token: text(answer.logs_token).map(LogsToken::new),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A rolling MDMA deploy: the old instances refuse the token, the restarting ones answer
    /// 503, interleaved (26 refusals and 13 unavailable answers in 60 s). The refusals
    /// alone are a streak: the node registers again once it is 30 s long.
    #[tokio::test(start_paused = true)]
    async fn a_rolling_deploy_s_503s_neither_reset_nor_extend_the_refused_token_streak() {
        use crate::registration::{Due, Held, Machine, Why, REJECTED_FOR};
        let slot = TokenSlot::new(Some(FleetToken::new("NEVER-LOGGED-TOKEN")));
        let mut seen = slot.verdict.subscribe();
        let id = crate::registration::Identity {
            executor_account: "acc".to_owned(),
            peer_id: "12D3KooWJ6X2tBZEd8qKWvJyhtH2v2XyP4eQ9dcU2xZ8Y6YrjcVk".to_owned(),
            relay_url: String::new(),
        };
        let machine = Machine::new(Duration::from_secs(30), Held::Token, Some(id));
        let t0 = Instant::now();
        let mut registered_at = None;
        for i in 0..39u32 {
            let status = if i % 3 == 2 { Some(503) } else { Some(401) };
            slot.record(status);
            // A 503 is no news of the token: nobody watching the verdict is woken.
            assert_eq!(seen.has_changed().unwrap(), status != Some(503), "poll {i}");
            seen.borrow_and_update();
            let v = *slot.verdict.borrow();
            assert_eq!(v.refused_since, Some(t0), "poll {i}");
            if registered_at.is_none()
                && machine.due(Instant::now(), v.refused_since) == Due::Now(Why::Rejected)
            {
                registered_at = Some(Instant::now() - t0);
            }
            tokio::time::advance(Duration::from_millis(1540)).await;
        }
        let v = *slot.verdict.borrow();
        assert_eq!(v.refusals, 26);
        let at = registered_at.expect("registered again during the deploy");
        assert!(
            at >= REJECTED_FOR && at < REJECTED_FOR + Duration::from_secs(2),
            "{at:?}"
        );
        // No answer at all (a timeout, a refused connection) is no news either; an
        // accepted poll ends the streak.
        slot.record(None);
        assert_eq!(slot.verdict.borrow().refused_since, Some(t0));
        slot.record(Some(200));
        assert_eq!(slot.verdict.borrow().refused_since, None);
        assert_eq!(slot.verdict.borrow().refusals, 0);
    }

    #[test]
    fn a_refusal_keeps_a_capped_escaped_excerpt_of_its_body_without_the_token() {
        let token = FleetToken::new("NEVER-LOGGED-TOKEN");
        let body = "  {\"error\":\"unknown node\"}\n\u{1b}[31m echo NEVER-LOGGED-TOKEN \n";
        assert_eq!(
            refusal_excerpt(body.as_bytes(), Some(&token)),
            r#"{"error":"unknown node"}\n\u{1b}[31m echo [redacted]"#
        );
        assert_eq!(refusal_excerpt(b"\xff\xfeok", None), "\u{fffd}\u{fffd}ok");
        assert_eq!(refusal_excerpt(b"", None), "");
        let long = refusal_excerpt("é".repeat(2000).as_bytes(), None);
        assert_eq!(long.chars().count(), REFUSAL_CHARS);
        assert!(long.ends_with("é…"), "{long}");
        let escapes = refusal_excerpt(&[0x07; 600], None);
        assert!(escapes.chars().count() <= REFUSAL_CHARS, "{escapes}");
        let url: Url = "https://mdma.example/api/fleet/confirm".parse().unwrap();
        let refused = RequestError::Status {
            method: RequestMethod::Post,
            url: url.clone(),
            status: 403,
            retry_after_secs: None,
            body: "no such node".into(),
        };
        assert_eq!(
            refused.to_string(),
            "POST https://mdma.example/api/fleet/confirm: HTTP 403: no such node"
        );
        let bare = RequestError::Status {
            method: RequestMethod::Post,
            url,
            status: 503,
            retry_after_secs: None,
            body: Box::default(),
        };
        assert!(bare.to_string().ends_with("HTTP 503"), "{bare}");
    }

    const A: &str = "38069a4cc4285c4245c84587ac60084ba53502a8b91c9b108bca40f10ec4d3df";
    const B: &str = "abababababababababababababababababababababababababababababababab";

    fn id(s: &str) -> GroupId {
        s.parse().unwrap()
    }

    #[test]
    fn a_good_answer_gives_the_sets_and_ignores_extras() {
        let body = format!(
            r#"{{"assignments":[{{"group_id":"{A}","admitter_addrs":["/ip4/1.2.3.4/tcp/1"]}},
                {{"group_id":"{}","new_hint":1}}],"retain":["{B}"],"future":{{"x":1}}}}"#,
            B.to_uppercase()
        );
        let d = parse_should_join(body.as_bytes()).unwrap();
        assert_eq!(d.assignments, [id(A), id(B)].into());
        assert_eq!(d.retain, [id(B)].into());
        let empty = parse_should_join(br#"{"assignments":[]}"#).unwrap();
        assert_eq!(empty, ShouldJoin::default());
    }

    #[test]
    fn admitter_addrs_are_kept_in_order_when_they_are_multiaddrs() {
        let body = format!(
            r#"{{"assignments":[{{"group_id":"{A}","admitter_addrs":["/ip4/10.0.0.1/tcp/2428/p2p/12D3KooWA","dns:1","/ip4/10.0.0.2/tcp/1\nX","/dns4/b/tcp/2/p2p/12D3KooWB"]}},
                {{"group_id":"{B}","admitter_addrs":["x"]}}]}}"#
        );
        let d = parse_should_join(body.as_bytes()).unwrap();
        assert_eq!(
            d.admitter_addrs,
            [(
                id(A),
                vec![
                    "/ip4/10.0.0.1/tcp/2428/p2p/12D3KooWA".to_owned(),
                    "/dns4/b/tcp/2/p2p/12D3KooWB".to_owned()
                ]
                .into()
            )]
            .into()
        );
        agrees_with_two_step(body.as_bytes());
        // null is no addresses; anything but an array of strings fails the poll.
        let null = format!(r#"{{"assignments":[{{"group_id":"{A}","admitter_addrs":null}}]}}"#);
        assert!(parse_should_join(null.as_bytes())
            .unwrap()
            .admitter_addrs
            .is_empty());
        agrees_with_two_step(null.as_bytes());
        for bad in [r#""/ip4/1""#, "[1]", "{}", r#"[["/ip4/1"]]"#] {
            let body =
                format!(r#"{{"assignments":[{{"group_id":"{A}","admitter_addrs":{bad}}}]}}"#);
            assert!(parse_should_join(body.as_bytes()).is_err(), "{body}");
            agrees_with_two_step(body.as_bytes());
        }
        // A repeated entry's addresses are its last ones.
        let again = format!(
            r#"{{"assignments":[{{"group_id":"{A}","admitter_addrs":["/a"]}},{{"group_id":"{A}"}}]}}"#
        );
        assert!(parse_should_join(again.as_bytes())
            .unwrap()
            .admitter_addrs
            .is_empty());
        agrees_with_two_step(again.as_bytes());
    }

    #[test]
    fn ten_thousand_entries_parse() {
        let entries: Vec<String> = (0..10_000u32)
            .map(|i| format!(r#"{{"group_id":"{i:064x}","admitter_addrs":[]}}"#))
            .collect();
        let body = format!(r#"{{"assignments":[{}],"retain":[]}}"#, entries.join(","));
        assert_eq!(
            parse_should_join(body.as_bytes())
                .unwrap()
                .assignments
                .len(),
            10_000
        );
    }

    #[test]
    fn delivered_items_are_taken_only_as_non_empty_strings_and_never_fail_a_poll() {
        let id = "ab".repeat(32);
        let body = |extra: &str| format!(r#"{{"assignments":[{{"group_id":"{id}"}}]{extra}}}"#);
        let delivered = body(
            r#","tls_certificate":"-----BEGIN CERTIFICATE-----\nX","logs_token":"NEVER-LOGGED-TOKEN-logs""#,
        );
        let got = parse_should_join(delivered.as_bytes()).unwrap();
        agrees_with_two_step(delivered.as_bytes());
        assert_eq!(
            got.tls_certificate.as_deref(),
            Some("-----BEGIN CERTIFICATE-----\nX")
        );
        assert_eq!(
            got.logs_token.as_ref().map(LogsToken::expose),
            Some("NEVER-LOGGED-TOKEN-logs")
        );
        assert!(!format!("{got:?}").contains("NEVER-LOGGED"), "{got:?}");
        for extra in [
            "",
            r#","tls_certificate":"","logs_token":"""#,
            r#","tls_certificate":null,"logs_token":5"#,
            r#","tls_certificate":{"pem":"x"},"logs_token":["x"]"#,
            r#","tls_certificate":true,"logs_token":1.5"#,
        ] {
            let text = body(extra);
            let got = parse_should_join(text.as_bytes()).unwrap();
            agrees_with_two_step(text.as_bytes());
            assert_eq!(got.assignments.len(), 1, "{text}");
            assert_eq!(got.tls_certificate, None, "{text}");
            assert!(got.logs_token.is_none(), "{text}");
        }
        // Ambiguity stays a failed poll, in a delivery as anywhere.
        for extra in [
            r#","tls_certificate":{"a":1,"a":2}"#,
            r#","logs_token":"a","logs_token":"b""#,
        ] {
            let text = body(extra);
            assert!(
                matches!(
                    parse_should_join(text.as_bytes()),
                    Err(MalformedAnswer::Ambiguous(_))
                ),
                "{text}"
            );
            agrees_with_two_step(text.as_bytes());
        }
    }

    /// The one-pass reader against the strict two-step reading it replaces, on `body`:
    /// both accept with the same sets, or both refuse (the one-pass reader may only also
    /// refuse an array standing for an object), and a refusal names the same fault.
    fn agrees_with_two_step(body: &[u8]) {
        let one = parse_should_join(body);
        let two = parse_two_step(body);
        let text = String::from_utf8_lossy(body);
        match (&one, &two) {
            (Ok(a), Ok(b)) => assert_eq!(a, b, "{text}"),
            (Err(a), Err(b)) => assert_eq!(a.to_string(), b.to_string(), "{text}"),
            (Err(MalformedAnswer::Shape(_)), Ok(_)) => {
                assert!(text.contains('['), "refused only for an array: {text}")
            }
            _ => panic!("one pass {one:?}, two steps {two:?}: {text}"),
        }
    }

    #[test]
    fn the_one_pass_reader_agrees_with_the_two_step_reading_on_the_fuzz_corpus() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/should_join");
        let mut n = 0;
        for entry in std::fs::read_dir(dir).unwrap() {
            agrees_with_two_step(&std::fs::read(entry.unwrap().path()).unwrap());
            n += 1;
        }
        assert!(n > 100, "the corpus holds {n} inputs");
    }

    #[test]
    fn the_one_pass_reader_refuses_arrays_standing_for_objects() {
        let good = format!(r#"{{"group_id":"{A}"}}"#);
        for body in [
            format!(r#"[[{good}]]"#),
            format!(r#"[[{good}],["{B}"]]"#),
            format!(r#"{{"assignments":[["{A}"]]}}"#),
            "[[]]".to_owned(),
        ] {
            assert!(parse_should_join(body.as_bytes()).is_err(), "{body}");
            agrees_with_two_step(body.as_bytes());
        }
    }

    #[test]
    fn repeated_keys_are_found_in_objects_of_any_size_and_after_escapes() {
        // Past the short list of keys, the hash set takes over: a repeat is still found,
        // first or last.
        let many = |repeat: &str| {
            let keys: String = (0..40).map(|i| format!(r#","k{i}":{i}"#)).collect();
            format!(r#"{{"assignments":[{{"group_id":"{A}"{keys}{repeat}}}]{keys}{repeat}}}"#)
        };
        parse_should_join(many("").as_bytes()).unwrap();
        for repeat in [r#","k0":0"#, r#","k39":0"#, r#","k\u0030":0"#] {
            let body = many(repeat);
            assert!(matches!(
                parse_should_join(body.as_bytes()),
                Err(MalformedAnswer::Ambiguous(_))
            ));
        }
        // Escaped spellings of the fields the reader uses are the same keys.
        for body in [
            format!(r#"{{"assignments":[{{"group_id":"{A}","group\u005fid":"{B}"}}]}}"#),
            r#"{"assignments":[],"\u0061ssignments":[]}"#.to_owned(),
            r#"{"assignments":[],"retain":[],"r\u0065tain":[]}"#.to_owned(),
        ] {
            assert!(
                matches!(
                    parse_should_join(body.as_bytes()),
                    Err(MalformedAnswer::Ambiguous(_))
                ),
                "{body}"
            );
        }
        // An escaped spelling alone is the field itself, and an escaped id is the id.
        let body = format!(
            r#"{{"\u0061ssignments":[{{"group\u005fid":"\u0033{}"}}]}}"#,
            &A[1..]
        );
        assert_eq!(
            parse_should_join(body.as_bytes()).unwrap().assignments,
            [id(A)].into()
        );
        agrees_with_two_step(body.as_bytes());
    }

    #[test]
    fn every_wrong_shape_fails_the_whole_poll() {
        let good = format!(r#"{{"group_id":"{A}"}}"#);
        for body in [
            String::new(),
            "not json".to_owned(),
            "[]".to_owned(),
            "null".to_owned(),
            r#""assignments""#.to_owned(),
            "{}".to_owned(),
            r#"{"assignments":null}"#.to_owned(),
            r#"{"assignments":{}}"#.to_owned(),
            format!(r#"{{"assignments":[{good},"{A}"]}}"#),
            format!(r#"{{"assignments":[{good},{{}}]}}"#),
            format!(r#"{{"assignments":[{good},{{"group_id":7}}]}}"#),
            format!(r#"{{"assignments":[{good},{{"group_id":"abcd"}}]}}"#),
            format!(
                r#"{{"assignments":[{good},{{"group_id":"{}"}}]}}"#,
                "z".repeat(64)
            ),
            format!(r#"{{"assignments":[{good}],"retain":"{A}"}}"#),
            format!(r#"{{"assignments":[{good}],"retain":[1]}}"#),
            format!(r#"{{"assignments":[{good}],"retain":["abc"]}}"#),
            format!(r#"{{"assignments":[{good}]"#),
            format!(r#"{{"assignments":[{good}],"retain":null}}"#),
            // Ambiguous: a key named twice, at the top, in an entry, or in an ignored field.
            format!(
                r#"{{"assignments":[{good},{{"group_id":"{B}"}}],"retain":[],"assignments":[{good}]}}"#
            ),
            format!(r#"{{"assignments":[{{"group_id":"{A}","group_id":"{B}"}}]}}"#),
            format!(r#"{{"assignments":[{{"group_id":"{A}","hint":1,"hint":2}}]}}"#),
            format!(r#"{{"assignments":[{good}],"retain":[],"retain":["{A}"]}}"#),
            format!(r#"{{"assignments":[{good}],"future":{{"x":1,"x":2}}}}"#),
        ] {
            assert!(parse_should_join(body.as_bytes()).is_err(), "{body}");
            agrees_with_two_step(body.as_bytes());
        }
    }
}
