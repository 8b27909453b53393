//! The merod admin API client, over the `calimero-client` crate (docs/merod-admin.md).
//!
//! Calls: `GET /admin-api/peers` (readiness), `POST /admin-api/tee/fleet-join`
//! (`{"groupId": "<64 hex>", "admitterAddrs": [..]}`, TDX-attested admission, may take 30 s
//! and more), `POST /admin-api/namespaces/{id}/leave` (irreversible: core purges the node's
//! keys), `GET /admin-api/namespaces/{id}` (does the node hold it?), `GET
//! /admin-api/namespaces` (everything it holds, every page), `GET /admin-api/identity` (the
//! node's account, also read by attested registration), `GET /admin-api/groups/{id}/members`
//! (the node's role in a namespace), and for attested registration
//! `POST /admin-api/tee/registration-attest` and `POST /admin-api/tee/attest` (a TD quote over
//! a nonce). merod listens on loopback in its default `proxy` auth mode, so no token is
//! sent.
//!
//! calimero-client's requests have no timeout and its errors drop the HTTP status: the
//! daemon bounds every call itself, and the membership check (where 404 means "gone" and
//! 500 means "ask again") reads the status with the connection's own HTTP client.
//!
//! Layout: this file holds the client, the errors and the loop's calls; `listen`
//! (`ListenCandidates`: merod at the first of its listen addresses that answers), `paging`
//! (the one walk of offset-paged lists), and the jobs' reads: `groups` (a namespace's
//! groups, contexts, members and usage), `seal` (member devices, sealing), `node_key` (the
//! node's public key).

use std::collections::BTreeSet;
use std::fmt;
use std::sync::Arc;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use async_trait::async_trait;
use calimero_client::auth::HeadlessAuthenticator;
use calimero_client::storage::JwtToken;
use calimero_client::{Client, ClientStorage, ConnectionInfo};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use url::Url;

use crate::ids::GroupId;
use crate::net::read_capped;
use crate::strict_json::StrictValue;

mod groups;
#[cfg(feature = "daemon")]
mod listen;
mod node_key;
mod paging;
mod seal;

pub use groups::{GroupMember, NamespaceUsage, StorageBytes, GROUP_PAGE, GROUP_PAGES};
#[cfg(feature = "daemon")]
pub(crate) use listen::{ListenCandidates, OnMerod};
pub use node_key::{NodeKey, NodeKeyError};
pub use seal::{MemberDevice, MemberDevices, SealedEnvelope, SEAL_ROUTE_RETRY, SEAL_TIMEOUT};

/// Default bound of a connection attempt to merod (it is on loopback: longer means it is
/// not up).
pub const MEROD_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Default bound of a readiness probe (`GET /admin-api/peers`).
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(5);
/// Default bound of a `fleet-join`: 180 s, as merod's own client gives it. A join is about
/// 35 s of direct admission, up to 30 s of admission wait, then the namespace's contexts join,
/// which takes longer the more contexts there are.
pub const JOIN_TIMEOUT: Duration = Duration::from_secs(180);
/// How long a refusal of `admitterAddrs` (an older core) holds by default before the field
/// is offered again: merod may have been upgraded and restarted between two readiness probes,
/// unseen. Offering it to an older core costs one extra 400 per fleet-join this often.
pub const ADMITTER_ADDRS_RETRY: Duration = Duration::from_secs(600);
/// Default bound of a namespace leave.
pub const LEAVE_TIMEOUT: Duration = Duration::from_secs(60);
/// Default bound of a membership check or a namespace listing.
pub const CHECK_TIMEOUT: Duration = Duration::from_secs(10);
/// Bound of one quote (`registration-attest` or `attest`): generating a TD quote.
pub const ATTEST_TIMEOUT: Duration = Duration::from_secs(30);
/// Largest identity or attest answer read (a quote is a few KiB).
const MAX_ATTEST_BODY: usize = 1024 * 1024;
/// Largest answer of any other merod call read (bytes). The largest merod sends is a page of
/// the namespace listing or the usage of every namespace (a few MB at 10,000 namespaces);
/// one announced or found larger is refused as [`MerodError::Answer`] before it can fill
/// the daemon's memory within the call's deadline.
pub const MAX_MEROD_BODY: usize = 64 * 1024 * 1024;

/// The route of the node's identity (its account and node key).
const IDENTITY_PATH: &str = "admin-api/identity";

/// What `GET /admin-api/identity` says of the node's account.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NodeAccount {
    /// `data.accountId`, trimmed and lowercased.
    Account(String),
    /// merod's own 404: the node holds neither a device nor an account root yet (both are
    /// minted the first time it takes part in a namespace).
    NotMinted,
}
/// Default bound of reading the node's role in a namespace (every page of its members).
pub const MEMBERS_TIMEOUT: Duration = Duration::from_secs(20);
/// Most refusals kept from one `fleet-join` answer.
pub const MAX_REFUSALS: usize = 8;
/// Longest `peer` of a refusal kept, in characters (longer ones are cut).
pub const MAX_REFUSAL_PEER: usize = 128;
/// Longest `reason` of a refusal kept, in characters (longer ones are cut).
pub const MAX_REFUSAL_REASON: usize = 512;
/// merod's own words for "this node does not hold that namespace" on a 404 of
/// `GET /admin-api/namespaces/{id}` (core 0.11): never joined or left and purged, and an
/// identity without membership. A 404 with other words is not merod's answer about the
/// namespace (a proxy, a renamed route): membership unknown.
pub const NOT_HELD_MESSAGES: [&str; 2] = ["No namespace identity found", "Namespace not found"];

/// One admitting node's refusal, from a `fleet-join` answer's `refusals`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Refusal {
    /// The refusing node's PeerId as merod wrote it (at most [`MAX_REFUSAL_PEER`] chars).
    pub peer: String,
    /// Why it refused (at most [`MAX_REFUSAL_REASON`] chars).
    pub reason: String,
}

/// The role merod gives this node in a namespace, as far as the fleet cares: a TEE role.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum TeeRole {
    /// `RelayTee`: the node may author (relay) for the namespace.
    RelayTee,
    /// `ReadOnlyTee`: a read-only TEE replica.
    ReadOnlyTee,
}

impl TeeRole {
    /// merod's spelling (`RelayTee`, `ReadOnlyTee`).
    pub fn as_str(self) -> &'static str {
        match self {
            TeeRole::RelayTee => "RelayTee",
            TeeRole::ReadOnlyTee => "ReadOnlyTee",
        }
    }

    /// The role merod names `role`; `None` for any other role (`Admin`, `Member`, …).
    pub fn from_merod(role: &str) -> Option<Self> {
        match role {
            "RelayTee" => Some(TeeRole::RelayTee),
            "ReadOnlyTee" => Some(TeeRole::ReadOnlyTee),
            _ => None,
        }
    }
}

/// merod's answer to a `fleet-join` that completed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Admission {
    /// `admitted`: only `true` is admission; `false` is retried next cycle.
    pub admitted: bool,
    /// `status`: `"joined"` or `"announced"` (empty when absent).
    pub status: String,
    /// Why merod did not admit, when it says: the strings under `reason`, `reasons`,
    /// `message`, `error`, `errors` or `detail` (flat or under `data`), in that order.
    pub reasons: Vec<String>,
    /// The admitting nodes' refusals (`refusals`, flat or under `data`): the first
    /// [`MAX_REFUSALS`] entries that are objects, `peer` and `reason` cut to
    /// [`MAX_REFUSAL_PEER`] and [`MAX_REFUSAL_REASON`] chars (a missing one reads as "").
    pub refusals: Vec<Refusal>,
    /// `admitted_by` (flat or under `data`) when it is set: the admitting node's PeerId as
    /// merod wrote it (at most [`MAX_REFUSAL_PEER`] chars), or the JSON text of any other
    /// truthy value (`true`, a non-zero number, a non-empty array or object). `None` when
    /// absent, `null`, `false`, `0`, `""`, `[]` or `{}`. It is shown to MDMA (join-status
    /// `admitted`); it never stands in for `admitted: true`, the only admission the
    /// sidecar confirms.
    pub admitted_by: Option<String>,
}

/// The admin-API call an error is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum MerodOp {
    /// Building the HTTP client.
    Connect,
    /// `GET /admin-api/peers` (readiness).
    Peers,
    /// `POST /admin-api/tee/fleet-join`.
    FleetJoin,
    /// `POST /admin-api/namespaces/{id}/leave`.
    Leave,
    /// `GET /admin-api/namespaces/{id}`.
    GetNamespace,
    /// `GET /admin-api/namespaces`.
    ListNamespaces,
    /// `GET /admin-api/identity`.
    Identity,
    /// `POST /admin-api/tee/registration-attest`.
    RegistrationAttest,
    /// `POST /admin-api/tee/attest`.
    Attest,
    /// `GET /admin-api/groups/{id}/members`.
    Members,
    /// `GET /admin-api/network/status`.
    NetworkStatus,
    /// `GET /admin-api/groups/{id}/subgroups`.
    Subgroups,
    /// `GET /admin-api/groups/{id}/contexts`.
    Contexts,
    /// `GET /admin-api/groups/{id}/members/{account}/capabilities`.
    Capabilities,
    /// `GET /admin-api/usage`.
    Usage,
    /// `GET /admin-api/groups/{id}/member-devices`.
    MemberDevices,
    /// `POST /admin-api/groups/{id}/accounts/{account}/seal`.
    Seal,
}

impl fmt::Display for MerodOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            MerodOp::Connect => "connect",
            MerodOp::Peers => "peers",
            MerodOp::FleetJoin => "fleet-join",
            MerodOp::Leave => "leave",
            MerodOp::GetNamespace => "get namespace",
            MerodOp::ListNamespaces => "list namespaces",
            MerodOp::Identity => "identity",
            MerodOp::RegistrationAttest => "registration-attest",
            MerodOp::Attest => "attest",
            MerodOp::Members => "members",
            MerodOp::NetworkStatus => "network status",
            MerodOp::Subgroups => "subgroups",
            MerodOp::Contexts => "contexts",
            MerodOp::Capabilities => "capabilities",
            MerodOp::Usage => "usage",
            MerodOp::MemberDevices => "member-devices",
            MerodOp::Seal => "seal",
        })
    }
}

/// The cause of a failed call, as the HTTP layer or calimero-client reported it.
pub(crate) type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// A failed merod call. Each names the operation and the URL and keeps its cause.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MerodError {
    /// The call failed: transport (connection refused, reset) or a non-2xx answer, as
    /// calimero-client reports it (its errors carry the reason as text, not the status).
    /// The message spells out the whole chain of causes, for the log; `source()` keeps it.
    #[error("{op} {url}: {}", chain(.source.as_ref()))]
    Call {
        /// The operation.
        op: MerodOp,
        /// The request URL.
        url: String,
        /// What failed.
        #[source]
        source: BoxError,
    },
    /// No complete answer within the call's deadline (see [`MerodClientBuilder`]).
    #[error("{op} {url}: no answer within {after:?}")]
    Timeout {
        /// The operation.
        op: MerodOp,
        /// The request URL.
        url: String,
        /// The deadline that passed.
        after: Duration,
    },
    /// An answer with an HTTP status that does not say what was asked.
    #[error("{op} {url}: HTTP {status}")]
    Status {
        /// The operation.
        op: MerodOp,
        /// The request URL.
        url: String,
        /// The HTTP status.
        status: u16,
    },
    /// A non-2xx answer carrying merod's `{"error": "<message>"}`, or a newer core's typed
    /// refusal `{"error": "<message>", "type": "<kind>", "data": …}` (400 a bad proof, 403
    /// not a member, 404 unknown, 409 a stale counter, 503 undecidable).
    #[error("{op} {url}: HTTP {status}: {message}{}", typed(.kind))]
    Refused {
        /// The operation.
        op: MerodOp,
        /// The request URL.
        url: String,
        /// The HTTP status.
        status: u16,
        /// merod's message (at most [`MAX_REFUSAL_MESSAGE`] chars kept).
        message: String,
        /// The refusal's `type`, when merod names one (at most [`MAX_REFUSAL_TYPE`] chars
        /// kept). Its `data` is not kept.
        kind: Option<String>,
    },
    /// A 2xx answer of an unexpected shape.
    #[error("{op} {url}: unexpected answer: {reason}")]
    Answer {
        /// The operation.
        op: MerodOp,
        /// The request URL.
        url: String,
        /// What is wrong with it.
        reason: String,
    },
}

/// Why a 2xx answer's body is not what its route returns, said as [`MerodError::Answer`]'s
/// `reason` (what the parse of one route's body returns; its caller adds the op and URL).
#[derive(Debug, thiserror::Error)]
pub(crate) enum AnswerFault {
    /// A field or an array the route always has is missing or of another type: what, in
    /// merod's field names.
    #[error("{0}")]
    Shape(&'static str),
    /// A field that is not a short string (a device's `deviceId` or `signingKey`).
    #[error("a device's {0} is not a short string")]
    DeviceField(&'static str),
    /// A field that is not a non-empty string within its bound (a sealed envelope's).
    #[error("no non-empty string {0}")]
    NoString(&'static str),
    /// A group id that does not parse.
    #[error("{what} {value:?}: {source}")]
    BadGroupId {
        /// Which field.
        what: &'static str,
        /// As merod gave it.
        value: String,
        /// Why.
        #[source]
        source: crate::ids::GroupIdError,
    },
    /// A context id that is not ASCII letters and digits within its bound.
    #[error("contextId {0:?} is not an id")]
    BadContextId(String),
    /// Not JSON, or JSON with a repeated key.
    #[error(transparent)]
    Json(#[from] serde_json::Error),
}

/// Longest message of a [`MerodError::Refused`] kept, in chars.
pub const MAX_REFUSAL_MESSAGE: usize = 512;
/// Longest `type` of a [`MerodError::Refused`] kept, in chars.
pub const MAX_REFUSAL_TYPE: usize = 64;

/// ` (type T)` for a typed refusal, else nothing.
fn typed(kind: &Option<String>) -> String {
    kind.as_deref()
        .map_or_else(String::new, |k| format!(" (type {k})"))
}

/// An error and its causes, outermost first, joined with `: `.
fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut next = e.source();
    while let Some(cause) = next {
        let more = cause.to_string();
        if !text.contains(&more) {
            text.push_str(": ");
            text.push_str(&more);
        }
        next = cause.source();
    }
    text
}

impl MerodError {
    /// The operation that failed.
    pub fn op(&self) -> MerodOp {
        match self {
            MerodError::Call { op, .. }
            | MerodError::Timeout { op, .. }
            | MerodError::Status { op, .. }
            | MerodError::Refused { op, .. }
            | MerodError::Answer { op, .. } => *op,
        }
    }

    /// The HTTP status of a non-2xx answer ([`MerodError::Status`] or
    /// [`MerodError::Refused`]); `None` for any other failure.
    pub fn status(&self) -> Option<u16> {
        match self {
            MerodError::Status { status, .. } | MerodError::Refused { status, .. } => Some(*status),
            _ => None,
        }
    }

    /// Whether the call ran out of time (rather than being refused or answered wrongly).
    pub fn is_timeout(&self) -> bool {
        matches!(self, MerodError::Timeout { .. })
    }

    /// Whether the call never reached merod's admin API, or lost its connection before an
    /// answer: the connection was refused, reset or aborted. (A timeout, an HTTP status or a
    /// wrong answer all came from something listening there.)
    pub fn is_unreachable(&self) -> bool {
        let MerodError::Call { source, .. } = self else {
            return false;
        };
        let mut next: Option<&(dyn std::error::Error + 'static)> = Some(source.as_ref());
        while let Some(e) = next {
            if e.downcast_ref::<reqwest::Error>()
                .is_some_and(reqwest::Error::is_connect)
            {
                return true;
            }
            if e.downcast_ref::<std::io::Error>().is_some_and(|io| {
                matches!(
                    io.kind(),
                    std::io::ErrorKind::ConnectionRefused
                        | std::io::ErrorKind::ConnectionReset
                        | std::io::ErrorKind::ConnectionAborted
                        | std::io::ErrorKind::NotConnected
                )
            }) {
                return true;
            }
            next = e.source();
        }
        false
    }

    /// The failure's one classification, stable for a program to match (the `kind` of its
    /// `Serialize` form, `{"kind": …, "message": …}`): `call` (refused, reset, or a non-2xx
    /// answer as calimero-client reports it), `timeout`, `status` (a non-2xx, with or
    /// without merod's words), `answer` (a 2xx of an unexpected shape).
    pub fn kind(&self) -> &'static str {
        match self {
            MerodError::Call { .. } => "call",
            MerodError::Timeout { .. } => "timeout",
            MerodError::Status { .. } | MerodError::Refused { .. } => "status",
            MerodError::Answer { .. } => "answer",
        }
    }
}

serialize_kind_and_message!(MerodError);

#[cfg(feature = "daemon")]
impl crate::outcome::Timed for MerodError {
    fn is_timeout(&self) -> bool {
        MerodError::is_timeout(self)
    }
}

/// The node as the daemon sees it; [`MerodClient`] is the real one, tests supply their own.
#[async_trait]
pub trait Node: Send + Sync + 'static {
    /// Whether the admin API answers (`GET /admin-api/peers`; what `meroctl peers` runs).
    ///
    /// Errors: [`MerodError`] while merod is not up.
    async fn probe(&self) -> Result<(), MerodError>;

    /// `POST /admin-api/tee/fleet-join` for `group_id`, handing merod `admitter_addrs`
    /// (the admitting nodes' multiaddrs MDMA sent, direct admission) when not empty.
    ///
    /// Errors: [`MerodError`]; `admitted: false` is not an error but an [`Admission`].
    async fn fleet_join(
        &self,
        group_id: GroupId,
        admitter_addrs: &[String],
    ) -> Result<Admission, MerodError>;

    /// `POST /admin-api/namespaces/{id}/leave`. A 500 may mean "nothing left to leave":
    /// ask [`Node::holds_namespace`] to tell.
    ///
    /// Errors: [`MerodError`].
    async fn leave_namespace(&self, group_id: GroupId) -> Result<(), MerodError>;

    /// `GET /admin-api/namespaces/{id}`: `true` on 200, `false` on a 404 in merod's own
    /// words ([`NOT_HELD_MESSAGES`]).
    ///
    /// Errors: [`MerodError`] for any other answer (a 404 of another shape included):
    /// membership unknown.
    async fn holds_namespace(&self, group_id: GroupId) -> Result<bool, MerodError>;

    /// Every namespace merod holds (`GET /admin-api/namespaces`, every page): what the
    /// `held_namespaces` refresh reports and orphans are found in.
    ///
    /// Errors: [`MerodError`]; a failed or partial read is an error, never a shorter set.
    async fn list_namespaces(&self) -> Result<BTreeSet<GroupId>, MerodError>;

    /// The node's account ([`MerodClient::identity`]: `GET /admin-api/identity`,
    /// `data.accountId`, lowercase); [`NodeAccount::NotMinted`] while merod has none yet (its
    /// 404 until the node first takes part in a namespace).
    ///
    /// Errors: [`MerodError`].
    async fn identity(&self) -> Result<NodeAccount, MerodError>;

    /// The TEE role of `account` in `group_id` (`GET /admin-api/groups/{id}/members`, every
    /// page); `None` when its row is missing or has another role.
    ///
    /// Errors: [`MerodError`] when the member list could not be read whole.
    async fn tee_role(
        &self,
        group_id: GroupId,
        account: &str,
    ) -> Result<Option<TeeRole>, MerodError>;

    /// The node's network status ([`MerodClient::network_status`]: `GET
    /// /admin-api/network/status`): its own PeerId and the addresses others reach it at.
    ///
    /// Errors: [`MerodError`].
    async fn network_status(&self) -> Result<NetworkStatus, MerodError>;
}

/// What `GET /admin-api/network/status` says of how others reach the node (core 0.11
/// answers flat `{"localPeerId", "listenAddrs", "externalAddrs", "relays", …}`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NetworkStatus {
    /// `localPeerId`, trimmed (`""` when absent or not a string).
    pub local_peer_id: String,
    /// `externalAddrs`: each item as a string (a non-string as its JSON text), trimmed,
    /// those starting with `/` only, in merod's order.
    pub external_addrs: Vec<String>,
}

/// Most addresses reported as `swarm_addrs`.
pub const MAX_SWARM_ADDRS: usize = 16;

impl NetworkStatus {
    /// The addresses reported to MDMA as `swarm_addrs` (and handed by MDMA to other joiners
    /// as `admitter_addrs`): each external address ending `/p2p/<localPeerId>` (appended
    /// unless it already ends so; a relay circuit `…/p2p/<relay>/p2p-circuit` gets it
    /// appended), duplicates dropped in order, at most [`MAX_SWARM_ADDRS`]. Empty when the
    /// PeerId is unknown.
    pub fn swarm_addrs(&self) -> Vec<String> {
        let peer = self.local_peer_id.trim();
        if peer.is_empty() {
            return Vec::new();
        }
        let suffix = format!("/p2p/{peer}");
        let mut out: Vec<String> = Vec::new();
        for addr in &self.external_addrs {
            let full = if addr.ends_with(&suffix) {
                addr.clone()
            } else {
                format!("{addr}{suffix}")
            };
            if !out.contains(&full) {
                out.push(full);
            }
            if out.len() == MAX_SWARM_ADDRS {
                break;
            }
        }
        out
    }
}

/// Reads a `network/status` answer, flat or under `data`.
///
/// Errors: [`AnswerFault::Shape`], why it is not one (no `externalAddrs` array).
fn parse_network_status(body: &Value) -> Result<NetworkStatus, AnswerFault> {
    let inner = match body.get("data") {
        Some(d) if d.is_object() => d,
        _ => body,
    };
    let addrs = inner
        .get("externalAddrs")
        .and_then(Value::as_array)
        .ok_or(AnswerFault::Shape("no externalAddrs array"))?;
    Ok(NetworkStatus {
        local_peer_id: inner
            .get("localPeerId")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .trim()
            .to_owned(),
        external_addrs: addrs
            .iter()
            .map(|v| v.as_str().map_or_else(|| v.to_string(), str::to_owned))
            .map(|s| s.trim().to_owned())
            .filter(|s| s.starts_with('/'))
            .collect(),
    })
}

/// calimero-client wants somewhere to keep JWTs; a headless proxy-mode caller has none.
#[derive(Clone, Copy, Debug, Default)]
struct NoTokenStorage;

#[async_trait]
impl ClientStorage for NoTokenStorage {
    async fn load_tokens(&self, _node_name: &str) -> calimero_client::Result<Option<JwtToken>> {
        Ok(None)
    }

    async fn save_tokens(
        &self,
        _node_name: &str,
        _tokens: &JwtToken,
    ) -> calimero_client::Result<()> {
        Ok(())
    }
}

type Connection = ConnectionInfo<HeadlessAuthenticator, NoTokenStorage>;

/// The deadlines a [`MerodClient`] applies to its calls; the defaults are the daemon's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Deadlines {
    connect: Duration,
    probe: Duration,
    join: Duration,
    leave: Duration,
    check: Duration,
    members: Duration,
}

/// Builds a [`MerodClient`] with per-call deadlines other than the defaults.
///
/// ```
/// use std::time::Duration;
/// use fleet_sidecar::MerodClient;
///
/// let url = "http://127.0.0.1:2528/".parse().unwrap();
/// let merod = MerodClient::builder(url)
///     .join_timeout(Duration::from_secs(45))
///     .check_timeout(Duration::from_secs(3))
///     .build()
///     .expect("a loopback URL builds a client");
/// assert_eq!(merod.admin_url().as_str(), "http://127.0.0.1:2528/");
/// ```
#[derive(Clone, Debug)]
pub struct MerodClientBuilder {
    admin_url: Url,
    deadlines: Deadlines,
    addrs_retry: Duration,
}

impl MerodClientBuilder {
    /// Bound of establishing a connection (default [`MEROD_CONNECT_TIMEOUT`], 5 s).
    pub fn connect_timeout(mut self, d: Duration) -> Self {
        self.deadlines.connect = d;
        self
    }

    /// Bound of [`MerodClient::probe`] (default [`PROBE_TIMEOUT`], 5 s).
    pub fn probe_timeout(mut self, d: Duration) -> Self {
        self.deadlines.probe = d;
        self
    }

    /// Bound of [`MerodClient::fleet_join`] (default [`JOIN_TIMEOUT`], 180 s).
    pub fn join_timeout(mut self, d: Duration) -> Self {
        self.deadlines.join = d;
        self
    }

    /// Bound of [`MerodClient::leave_namespace`] (default [`LEAVE_TIMEOUT`], 60 s).
    pub fn leave_timeout(mut self, d: Duration) -> Self {
        self.deadlines.leave = d;
        self
    }

    /// Bound of [`MerodClient::holds_namespace`], [`MerodClient::list_namespaces`] (every
    /// page) and [`MerodClient::identity`] (default [`CHECK_TIMEOUT`], 10 s).
    pub fn check_timeout(mut self, d: Duration) -> Self {
        self.deadlines.check = d;
        self
    }

    /// Bound of [`MerodClient::tee_role`], every page (default [`MEMBERS_TIMEOUT`], 20 s).
    pub fn members_timeout(mut self, d: Duration) -> Self {
        self.deadlines.members = d;
        self
    }

    /// How long a refusal of `admitterAddrs` holds before the field is offered again
    /// (default [`ADMITTER_ADDRS_RETRY`], 10 min; see [`MerodClient::admitter_addrs_refused`]).
    pub fn admitter_addrs_retry(mut self, d: Duration) -> Self {
        self.addrs_retry = d;
        self
    }

    /// Builds the client. Nothing is sent yet.
    ///
    /// Errors: [`MerodError::Call`] with [`MerodOp::Connect`] when the HTTP client cannot
    /// be built.
    pub fn build(self) -> Result<MerodClient, MerodError> {
        let admin_url = self.admin_url;
        let build_err = |source: BoxError| MerodError::Call {
            op: MerodOp::Connect,
            url: admin_url.to_string(),
            source,
        };
        let mut connection = ConnectionInfo::new(
            admin_url.clone(),
            None,
            HeadlessAuthenticator::new(),
            NoTokenStorage,
        );
        // merod is on loopback: no proxy from the environment (HTTP_PROXY, ALL_PROXY…)
        // may capture its calls.
        connection.client = reqwest::Client::builder()
            .connect_timeout(self.deadlines.connect)
            .no_proxy()
            .build()
            .map_err(|e| build_err(e.into()))?;
        let client = Client::new(connection.clone()).map_err(|e| build_err(e.into()))?;
        Ok(MerodClient {
            client,
            connection,
            deadlines: self.deadlines,
            addrs_refused: CoreLack::new(self.addrs_retry),
            seal_missing: CoreLack::new(SEAL_ROUTE_RETRY),
        })
    }
}

/// merod's admin API over calimero-client, every call bounded by its own deadline.
///
/// ```no_run
/// # async fn demo() -> Result<(), fleet_sidecar::MerodError> {
/// // `Node` holds the calls the daemon makes (probe, fleet-join, leave, membership).
/// use fleet_sidecar::{MerodClient, Node};
///
/// let merod = MerodClient::new(&"http://127.0.0.1:2528/".parse().unwrap())?;
/// merod.probe().await?;
/// for id in merod.list_namespaces().await? {
///     println!("merod holds {id}");
/// }
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct MerodClient {
    client: Client<HeadlessAuthenticator, NoTokenStorage>,
    connection: Connection,
    deadlines: Deadlines,
    /// merod refused `admitterAddrs` (an older core): not offered again until it is seen
    /// down (a refused connection: it restarts), the refusal is older than its bound, or
    /// this process restarts. Shared by clones.
    addrs_refused: Arc<CoreLack>,
    /// merod has no seal route (a core before 0.11.0-rc.34): not asked again until it is
    /// seen down, [`SEAL_ROUTE_RETRY`] passed, or this process restarts. Shared by clones.
    seal_missing: Arc<CoreLack>,
}

/// When merod last showed it lacks something a newer core has (a field it refuses, a
/// route it does not know), and how long that holds: an older core is not asked again and
/// again, and one upgraded in place is asked again once it is seen down or the bound passes.
#[derive(Debug)]
struct CoreLack {
    holds_for: Duration,
    /// On the monotonic clock: a wall-clock step neither ends nor prolongs it.
    since: Mutex<Option<std::time::Instant>>,
}

impl CoreLack {
    fn new(holds_for: Duration) -> Arc<Self> {
        Arc::new(Self {
            holds_for,
            since: Mutex::new(None),
        })
    }

    fn set(&self, refused: bool) {
        let mut since = self.since.lock().unwrap_or_else(PoisonError::into_inner);
        *since = refused.then(std::time::Instant::now);
    }

    fn holds(&self) -> bool {
        let since = self.since.lock().unwrap_or_else(PoisonError::into_inner);
        since.is_some_and(|t| t.elapsed() < self.holds_for)
    }
}

impl MerodClient {
    /// A client for the admin API at `admin_url` (e.g. `http://127.0.0.1:2528/`) with the
    /// daemon's deadlines.
    ///
    /// Errors: [`MerodError::Call`] when the HTTP client cannot be built.
    pub fn new(admin_url: &Url) -> Result<Self, MerodError> {
        Self::builder(admin_url.clone()).build()
    }

    /// A builder for a client with other deadlines than the daemon's.
    pub fn builder(admin_url: Url) -> MerodClientBuilder {
        MerodClientBuilder {
            admin_url,
            deadlines: Deadlines {
                connect: MEROD_CONNECT_TIMEOUT,
                probe: PROBE_TIMEOUT,
                join: JOIN_TIMEOUT,
                leave: LEAVE_TIMEOUT,
                check: CHECK_TIMEOUT,
                members: MEMBERS_TIMEOUT,
            },
            addrs_retry: ADMITTER_ADDRS_RETRY,
        }
    }

    /// merod was seen down (a refused connection, a failed probe): what an older core was
    /// found to lack is asked again, as the one that comes back may be newer.
    fn seen_down(&self) {
        self.addrs_refused.set(false);
        self.seal_missing.set(false);
    }

    /// The admin API base URL.
    pub fn admin_url(&self) -> &Url {
        &self.connection.api_url
    }

    fn url(&self, path: &str) -> Url {
        let mut url = self.connection.api_url.clone();
        url.set_path(path);
        url
    }

    /// Runs `call` within `after`; a deadline passed, in calimero-client's or reqwest's
    /// own timeout or in ours, is [`MerodError::Timeout`].
    async fn bounded<T>(
        &self,
        op: MerodOp,
        path: &str,
        after: Duration,
        call: impl std::future::Future<Output = Result<T, MerodError>>,
    ) -> Result<T, MerodError> {
        match tokio::time::timeout(after, call).await {
            Ok(result) => result,
            Err(_) => Err(MerodError::Timeout {
                op,
                url: self.url(path).to_string(),
                after,
            }),
        }
    }

    /// A calimero-client error as a [`MerodError`] that keeps it as its source.
    fn client_error(&self, op: MerodOp, path: &str, e: impl Into<BoxError>) -> MerodError {
        MerodError::Call {
            op,
            url: self.url(path).to_string(),
            source: e.into(),
        }
    }

    /// Lists the namespaces merod holds (`GET /admin-api/namespaces`, paged with `offset`
    /// and `limit` until a page comes back short, pages overlapping by one row so a list
    /// that shifted between two pages, or a merod that ignores `offset`, is told from a
    /// whole one; at most [`LIST_PAGES`] pages): each entry's `namespaceId`, a 64-hex group
    /// id. Other fields of the entries are not read.
    ///
    /// Errors: [`MerodError::Call`] (transport), [`MerodError::Status`] or
    /// [`MerodError::Refused`] (non-2xx), [`MerodError::Timeout`] (the whole listing,
    /// default 10 s), [`MerodError::Answer`] when the answer is not the documented shape, an
    /// entry has no valid `namespaceId`, or the list cannot be read whole (it shifted, a
    /// page did not advance, more than [`LIST_PAGES`] pages).
    pub async fn list_namespaces(&self) -> Result<BTreeSet<GroupId>, MerodError> {
        let op = MerodOp::ListNamespaces;
        let path = "admin-api/namespaces";
        let url_text = self.url(path).to_string();
        let answer_err = |reason: String| MerodError::Answer {
            op,
            url: url_text.clone(),
            reason,
        };
        self.bounded(op, path, self.deadlines.check, async {
            // Gathered in a list, the set built once at the end from it sorted: inserted one
            // by one in merod's (ascending) order, a B-tree's nodes stay half full (about
            // 620 KB at 10,000 namespaces instead of 330 KB).
            let mut held = Vec::new();
            let mut walk = paging::PageWalk::new(LIST_PAGE, LIST_PAGES);
            loop {
                let offset = walk
                    .next_page()
                    .map_err(|fault| answer_err(fault.to_string()))?;
                let mut url = self.url(path);
                url.query_pairs_mut()
                    .append_pair("offset", &offset.to_string())
                    .append_pair("limit", &walk.size().to_string());
                let resp =
                    self.connection
                        .client
                        .get(url)
                        .send()
                        .await
                        .map_err(|e| MerodError::Call {
                            op,
                            url: url_text.clone(),
                            source: e.without_url().into(),
                        })?;
                let status = resp.status().as_u16();
                let body = read_capped(resp, MAX_MEROD_BODY).await.map_err(|e| {
                    e.into_error(answer_err, |e| MerodError::Call {
                        op,
                        url: url_text.clone(),
                        source: e.without_url().into(),
                    })
                })?;
                if !(200..300).contains(&status) {
                    return Err(refusal_of(op, &url_text, status, &body));
                }
                let list: NamespaceList =
                    serde_json::from_slice(&body).map_err(|e| answer_err(e.to_string()))?;
                for entry in &list.data {
                    let id = entry.namespace_id.parse().map_err(|e| {
                        answer_err(format!("namespaceId {:?}: {e}", entry.namespace_id))
                    })?;
                    held.push(id);
                }
                let step = walk
                    .page(list.data.iter().map(|e| e.namespace_id.as_str()))
                    .map_err(|fault| answer_err(fault.to_string()))?;
                if step == paging::Step::Done {
                    break;
                }
            }
            held.sort_unstable();
            held.dedup();
            Ok(held.into_iter().collect())
        })
        .await
    }
}

impl MerodClient {
    /// The node's account (`GET /admin-api/identity` → `data.accountId`, trimmed and
    /// lowercased), bounded by the check deadline (default 10 s).
    ///
    /// Errors: [`MerodError::Refused`] (merod said why) or [`MerodError::Status`] for a
    /// non-2xx other than merod's own "not minted yet"
    /// 404 (which is [`NodeAccount::NotMinted`]); [`MerodError::Answer`] for an account id
    /// that is empty or not printable ASCII without `|` (it is a field of the registration
    /// nonce); transport and timeout as usual.
    pub async fn identity(&self) -> Result<NodeAccount, MerodError> {
        let Some(value) = self.identity_answer().await? else {
            return Ok(NodeAccount::NotMinted);
        };
        let answer_err = |reason: &str| MerodError::Answer {
            op: MerodOp::Identity,
            url: self.url(IDENTITY_PATH).to_string(),
            reason: reason.to_owned(),
        };
        let account = value
            .pointer("/data/accountId")
            .and_then(Value::as_str)
            .ok_or_else(|| answer_err("no string data.accountId"))?
            .trim()
            .to_ascii_lowercase();
        if account.is_empty() || !account.bytes().all(|b| b.is_ascii_graphic() && b != b'|') {
            return Err(answer_err(
                "data.accountId is empty or not printable ASCII without '|'",
            ));
        }
        Ok(NodeAccount::Account(account))
    }

    /// `GET /admin-api/identity`'s JSON answer, `None` for merod's own "not minted yet" 404
    /// (bounded by the check deadline).
    ///
    /// Errors: as [`MerodClient::identity`], but for the account checks.
    pub(crate) async fn identity_answer(&self) -> Result<Option<Value>, MerodError> {
        let op = MerodOp::Identity;
        let (status, body) = self
            .raw(op, IDENTITY_PATH, None, self.deadlines.check)
            .await?;
        let value = crate::strict_json::from_slice::<StrictValue>(&body).map(|v| v.0);
        if status == 404 {
            let words = value
                .as_ref()
                .ok()
                .and_then(|v| v.get("error"))
                .and_then(Value::as_str)
                .unwrap_or_default();
            // Only merod's own words mean "not minted": a 404 from a proxy or an old merod
            // without the route is not an answer about the account.
            if words.contains("neither a device nor an account") {
                return Ok(None);
            }
        }
        if !(200..300).contains(&status) {
            return Err(refusal_of(
                op,
                self.url(IDENTITY_PATH).as_str(),
                status,
                &body,
            ));
        }
        value.map(Some).map_err(|e| MerodError::Answer {
            op,
            url: self.url(IDENTITY_PATH).to_string(),
            reason: e.to_string(),
        })
    }

    /// A TD quote bound to a registration: `POST /admin-api/tee/registration-attest`
    /// `{"nonce": "<64 hex>"}` (bounded by [`ATTEST_TIMEOUT`]). `Ok(None)` on a 404: this
    /// merod predates the route (0.11.0-rc.25 does), so the caller falls back to
    /// [`MerodClient::attest`]. The quote is `data.quoteB64` (else a top-level `quoteB64`),
    /// non-empty, returned verbatim.
    ///
    /// Errors: [`MerodError::Refused`] or [`MerodError::Status`] for a non-2xx other than 404
    /// (400: a bad nonce),
    /// [`MerodError::Answer`] for a 2xx without a quote; transport and timeout.
    pub async fn registration_attest(&self, nonce: &str) -> Result<Option<String>, MerodError> {
        match self
            .quote(
                MerodOp::RegistrationAttest,
                "admin-api/tee/registration-attest",
                nonce,
            )
            .await
        {
            Err(e) if e.status() == Some(404) => Ok(None),
            other => other.map(Some),
        }
    }

    /// A TD quote over `nonce` (64 hex chars): `POST /admin-api/tee/attest`
    /// `{"nonce": "<64 hex>"}`, bounded by [`ATTEST_TIMEOUT`]; the report data is the nonce
    /// and 32 zero bytes, with no registration binding. The quote is `data.quoteB64` (else a
    /// top-level `quoteB64`), non-empty, returned verbatim.
    ///
    /// Errors: [`MerodError::Refused`] or [`MerodError::Status`] for a non-2xx,
    /// [`MerodError::Answer`] for a 2xx
    /// without a quote; transport and timeout.
    pub async fn attest(&self, nonce: &str) -> Result<String, MerodError> {
        self.quote(MerodOp::Attest, "admin-api/tee/attest", nonce)
            .await
    }

    async fn quote(&self, op: MerodOp, path: &str, nonce: &str) -> Result<String, MerodError> {
        let body = serde_json::json!({ "nonce": nonce });
        let (status, answer) = self.raw(op, path, Some(body), ATTEST_TIMEOUT).await?;
        if !(200..300).contains(&status) {
            return Err(refusal_of(op, self.url(path).as_str(), status, &answer));
        }
        let answer_err = |reason: String| MerodError::Answer {
            op,
            url: self.url(path).to_string(),
            reason,
        };
        let StrictValue(value) =
            crate::strict_json::from_slice(&answer).map_err(|e| answer_err(e.to_string()))?;
        let quote = value
            .pointer("/data/quoteB64")
            .or_else(|| value.get("quoteB64"))
            .and_then(Value::as_str)
            .unwrap_or_default();
        if quote.is_empty() {
            return Err(answer_err(
                "no non-empty data.quoteB64 (or quoteB64)".to_owned(),
            ));
        }
        Ok(quote.to_owned())
    }

    /// One request with the connection's own HTTP client (so the status is kept): its
    /// status and body (capped), all within `after`.
    async fn raw(
        &self,
        op: MerodOp,
        path: &str,
        json: Option<Value>,
        after: Duration,
    ) -> Result<(u16, Vec<u8>), MerodError> {
        let url = self.url(path);
        let call_err = |e: reqwest::Error| MerodError::Call {
            op,
            url: url.to_string(),
            source: e.without_url().into(),
        };
        self.bounded(op, path, after, async {
            let req = match json {
                Some(body) => self.connection.client.post(url.clone()).json(&body),
                None => self.connection.client.get(url.clone()),
            };
            let resp = req.send().await.map_err(call_err)?;
            let status = resp.status().as_u16();
            let too_large = |reason| MerodError::Answer {
                op,
                url: url.to_string(),
                reason,
            };
            let bytes = read_capped(resp, MAX_ATTEST_BODY)
                .await
                .map_err(|e| e.into_error(too_large, call_err))?;
            Ok((status, bytes))
        })
        .await
    }
}

/// Entries asked for per page of `GET /admin-api/namespaces` (merod's default).
const LIST_PAGE: usize = 100;
/// Most pages of `GET /admin-api/namespaces` read for one listing: 99,001 namespaces, ten
/// times a fleet-sized node.
pub const LIST_PAGES: usize = 1000;

/// `GET /admin-api/namespaces` as merod 0.11 answers it. calimero-client's own type for it
/// requires fields a recorded merod 0.11.0-rc.25 answer does not have (`upgradePolicy`), so
/// only what is used is declared here.
#[derive(Deserialize)]
struct NamespaceList {
    data: Vec<NamespaceEntry>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct NamespaceEntry {
    namespace_id: String,
}

/// A `fleet-join` request as newer cores take it: `admitterAddrs` only when there are some
/// (an older core's request type refuses unknown fields).
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct FleetJoinBody<'a> {
    group_id: String,
    #[serde(skip_serializing_if = "<[String]>::is_empty")]
    admitter_addrs: &'a [String],
}

/// One answer read whole: its status and its JSON body (`Null` when it is not JSON, or is
/// ambiguous: a key named twice; `unreadable` then says why).
struct Answered {
    status: u16,
    body: Value,
    unreadable: Option<String>,
}

impl Answered {
    /// An answer of `status` with `bytes`: its body as JSON (a key repeated in an object
    /// refuses it), or `null` and why it is not.
    fn read(status: u16, bytes: &[u8]) -> Self {
        let (body, unreadable) = match serde_json::from_slice::<StrictValue>(bytes) {
            Ok(v) => (v.0, None),
            Err(e) => (Value::Null, Some(e.to_string())),
        };
        Self {
            status,
            body,
            unreadable,
        }
    }
}

impl MerodClient {
    /// Sends `req` and reads the answer whole; a refused connection also forgets a
    /// refusal of `admitterAddrs` (merod is down: the one that comes back may be newer).
    async fn send(
        &self,
        op: MerodOp,
        url: &Url,
        req: reqwest::RequestBuilder,
    ) -> Result<Answered, MerodError> {
        let (status, bytes) = self.fetch(op, url, req).await?;
        Ok(Answered::read(status, &bytes))
    }

    /// [`MerodClient::send`], a 2xx body handed over as it came (for an answer too large
    /// to be worth a `serde_json::Value`: read it with a typed reader); any other answer is
    /// read as [`MerodClient::send`] reads it.
    async fn send_raw(
        &self,
        op: MerodOp,
        url: &Url,
        req: reqwest::RequestBuilder,
    ) -> Result<Result<bytes::Bytes, Answered>, MerodError> {
        let (status, bytes) = self.fetch(op, url, req).await?;
        Ok(if (200..300).contains(&status) {
            Ok(bytes)
        } else {
            Err(Answered::read(status, &bytes))
        })
    }

    /// Sends `req`: the status and the whole body, at most [`MAX_MEROD_BODY`] bytes.
    async fn fetch(
        &self,
        op: MerodOp,
        url: &Url,
        req: reqwest::RequestBuilder,
    ) -> Result<(u16, bytes::Bytes), MerodError> {
        let transport = |e: reqwest::Error| {
            if e.is_connect() {
                self.seen_down();
            }
            MerodError::Call {
                op,
                url: url.to_string(),
                source: e.without_url().into(),
            }
        };
        let resp = req.send().await.map_err(transport)?;
        let status = resp.status().as_u16();
        let bytes = read_capped(resp, MAX_MEROD_BODY).await.map_err(|e| {
            e.into_error(
                |reason| MerodError::Answer {
                    op,
                    url: url.to_string(),
                    reason,
                },
                transport,
            )
        })?;
        Ok((status, bytes::Bytes::from(bytes)))
    }

    /// A non-2xx answer as an error (see [`refusal`]).
    fn refused(op: MerodOp, url: &Url, answer: &Answered) -> MerodError {
        refusal(op, url.as_str(), answer.status, &answer.body)
    }

    /// `GET /admin-api/network/status`: the node's PeerId and external addresses, bounded by
    /// the check deadline (default 10 s).
    ///
    /// Errors: [`MerodError::Refused`] or [`MerodError::Status`] for a non-2xx,
    /// [`MerodError::Answer`] for a 2xx without an `externalAddrs` array; transport and
    /// timeout.
    pub async fn network_status(&self) -> Result<NetworkStatus, MerodError> {
        self.get_parsed(MerodOp::NetworkStatus, "admin-api/network/status", |body| {
            parse_network_status(body)
        })
        .await
    }

    /// Whether a refusal of `admitterAddrs` was seen and not yet forgotten: it is forgotten
    /// when merod is seen down (a refused connection, a failed readiness probe) and once it
    /// is older than [`MerodClientBuilder::admitter_addrs_retry`] (default
    /// [`ADMITTER_ADDRS_RETRY`], 10 min), so a merod upgraded between two probes gets the
    /// field again (see [`Node::fleet_join`] on [`MerodClient`]).
    pub fn admitter_addrs_refused(&self) -> bool {
        self.addrs_refused.holds()
    }

    /// The TEE role of `account` (lowercase 64 hex, from [`MerodClient::identity`]) in
    /// `group_id`: its row of `GET /admin-api/groups/{id}/members?offset=O&limit=1000`. A
    /// full page is followed by the next one starting at its last row (the anchor: the
    /// list must not have shifted in between), at most [`MEMBER_PAGES`] pages. `Ok(None)`:
    /// no row for the account, or a role that is not a TEE role.
    ///
    /// Errors: [`MerodError`] when the list could not be read whole (a failed page, a shift,
    /// too many pages, an unexpected shape), bounded by 20 s in all by default.
    pub async fn tee_role(
        &self,
        group_id: GroupId,
        account: &str,
    ) -> Result<Option<TeeRole>, MerodError> {
        let op = MerodOp::Members;
        let path = format!("admin-api/groups/{group_id}/members");
        let account = account.to_ascii_lowercase();
        let mine = |m: &groups::GroupMember| m.identity == account;
        let rows = self
            .paged_until(
                op,
                &path,
                (MEMBER_PAGE, MEMBER_PAGES),
                groups::parse_member_rows,
                |m: &groups::GroupMember| m.identity.as_str(),
                |rows: &[groups::GroupMember]| rows.iter().any(mine),
            )
            .await
            .map_err(|e| match e {
                MerodError::Answer { op, url, reason } => MerodError::Answer {
                    op,
                    url,
                    reason: format!("member list: {reason}"),
                },
                other => other,
            })?;
        Ok(rows
            .iter()
            .find(|m| mine(m))
            .and_then(|m| TeeRole::from_merod(&m.role)))
    }
}

/// Rows asked for per page of `GET /admin-api/groups/{id}/members`.
const MEMBER_PAGE: usize = 1000;
/// Most pages of members read for one role.
pub const MEMBER_PAGES: usize = 10;

/// The rows of a members page, `{"members": [{"identity", "role"}]}` (flat as core 0.11
/// answers, or under `data`): `(identity lowercased, role)`.
fn parse_members(body: &Value) -> Result<Vec<(String, String)>, AnswerFault> {
    let inner = match body.get("data") {
        Some(d) if d.is_object() => d,
        _ => body,
    };
    let rows = inner
        .get("members")
        .and_then(Value::as_array)
        .ok_or(AnswerFault::Shape("no members array"))?;
    rows.iter()
        .map(|row| {
            let identity = row.get("identity").and_then(Value::as_str);
            let role = row.get("role").and_then(Value::as_str);
            match (identity, role) {
                (Some(i), Some(r)) => Ok((i.to_ascii_lowercase(), r.to_owned())),
                _ => Err(AnswerFault::Shape(
                    "a member row without string identity and role",
                )),
            }
        })
        .collect()
}

/// `{"error": "<message>"}`'s message.
fn error_message(body: &Value) -> Option<&str> {
    body.get("error").and_then(Value::as_str)
}

/// A non-2xx answer with `body` (`Null` when it was not JSON) as an error:
/// [`MerodError::Refused`] when it says why (`error`, and a typed refusal's `type`), else
/// [`MerodError::Status`]. Every non-2xx merod answer is read through here.
fn refusal(op: MerodOp, url: &str, status: u16, body: &Value) -> MerodError {
    match error_message(body) {
        Some(message) => {
            let kind = body
                .get("type")
                .and_then(Value::as_str)
                .filter(|k| !k.is_empty())
                .map(|k| cut(k, MAX_REFUSAL_TYPE));
            MerodError::Refused {
                op,
                url: url.to_owned(),
                status,
                message: cut(message, MAX_REFUSAL_MESSAGE),
                kind,
            }
        }
        None => MerodError::Status {
            op,
            url: url.to_owned(),
            status,
        },
    }
}

/// [`refusal`] of a body read as bytes (strictly: a key named twice reads as no message).
fn refusal_of(op: MerodOp, url: &str, status: u16, body: &[u8]) -> MerodError {
    let value = crate::strict_json::from_slice::<StrictValue>(body).map_or(Value::Null, |v| v.0);
    refusal(op, url, status, &value)
}

/// `text` cut to at most `max` chars.
fn cut(text: &str, max: usize) -> String {
    text.chars().take(max).collect()
}

/// Whether a 400 answer to a fleet-join refuses the `admitterAddrs` field (an older core:
/// its request type refuses unknown fields and names the field in its message).
pub fn refuses_admitter_addrs(status: u16, body: &Value) -> bool {
    status == 400 && error_message(body).is_some_and(|m| m.contains("admitterAddrs"))
}

#[async_trait]
impl Node for MerodClient {
    async fn probe(&self) -> Result<(), MerodError> {
        let op = MerodOp::Peers;
        let path = "admin-api/peers";
        self.bounded(op, path, self.deadlines.probe, async {
            self.client
                .get_peers_count()
                .await
                .map(|_| ())
                .map_err(|e| {
                    // merod down: the one that comes back may be newer.
                    self.seen_down();
                    self.client_error(op, path, e)
                })
        })
        .await
    }

    /// Sends `admitterAddrs` when `admitter_addrs` is not empty and merod has not refused
    /// the field. A 400 naming it ([`refuses_admitter_addrs`]: an older core) is asked again
    /// at once without it, and the field is not offered again until merod is seen down or
    /// the refusal is [`ADMITTER_ADDRS_RETRY`] old ([`MerodClient::admitter_addrs_refused`]).
    async fn fleet_join(
        &self,
        group_id: GroupId,
        admitter_addrs: &[String],
    ) -> Result<Admission, MerodError> {
        let op = MerodOp::FleetJoin;
        let path = "admin-api/tee/fleet-join";
        let url = self.url(path);
        self.bounded(op, path, self.deadlines.join, async {
            let mut addrs = if self.admitter_addrs_refused() {
                &[][..]
            } else {
                admitter_addrs
            };
            loop {
                let body = FleetJoinBody {
                    group_id: group_id.to_string(),
                    admitter_addrs: addrs,
                };
                let answer = self
                    .send(op, &url, self.connection.client.post(url.clone()).json(&body))
                    .await?;
                if !addrs.is_empty() && refuses_admitter_addrs(answer.status, &answer.body) {
                    self.addrs_refused.set(true);
                    tracing::warn!("merod refused admitterAddrs (an older core): joining without the admitting nodes' addresses until merod is seen restarting or the refusal is {:?} old", self.addrs_refused.holds_for);
                    addrs = &[];
                    continue;
                }
                if !(200..300).contains(&answer.status) {
                    return Err(Self::refused(op, &url, &answer));
                }
                // Read strictly: an answer naming a key twice is an error, not "last one wins".
                let reason = match &answer.unreadable {
                    Some(why) => why.clone(),
                    None => match parse_fleet_join(&answer.body) {
                        Ok(admission) => return Ok(admission),
                        Err(no) => no.to_string(),
                    },
                };
                return Err(MerodError::Answer {
                    op,
                    url: url.to_string(),
                    reason,
                });
            }
        })
        .await
    }

    /// Sent with the connection's own HTTP client, as fleet-join is, so a refusal keeps its
    /// status and a typed refusal its `type` (calimero-client keeps only the message). A 2xx
    /// is a leave only with the `data.namespaceId` calimero-client's own type requires.
    async fn leave_namespace(&self, group_id: GroupId) -> Result<(), MerodError> {
        let op = MerodOp::Leave;
        let path = format!("admin-api/namespaces/{group_id}/leave");
        let url = self.url(&path);
        self.bounded(op, &path, self.deadlines.leave, async {
            let answer = self
                .send(op, &url, self.connection.client.post(url.clone()))
                .await?;
            if !(200..300).contains(&answer.status) {
                return Err(Self::refused(op, &url, &answer));
            }
            match answer.body.pointer("/data/namespaceId") {
                Some(Value::String(_)) => Ok(()),
                _ => Err(MerodError::Answer {
                    op,
                    url: url.to_string(),
                    reason: answer
                        .unreadable
                        .unwrap_or_else(|| "no string data.namespaceId".to_owned()),
                }),
            }
        })
        .await
    }

    async fn holds_namespace(&self, group_id: GroupId) -> Result<bool, MerodError> {
        let op = MerodOp::GetNamespace;
        let path = format!("admin-api/namespaces/{group_id}");
        let url = self.url(&path);
        self.bounded(op, &path, self.deadlines.check, async {
            // An unreadable, non-JSON or ambiguous (a key named twice) body reads as null: a
            // 200 then does not count as held, and a 404 not as "not held": unknown.
            let answer = self
                .send(op, &url, self.connection.client.get(url.clone()))
                .await?;
            parse_namespace_get(answer.status, &answer.body, group_id)
                .map_err(|_| Self::refused(op, &url, &answer))
        })
        .await
    }

    async fn list_namespaces(&self) -> Result<BTreeSet<GroupId>, MerodError> {
        MerodClient::list_namespaces(self).await
    }

    async fn network_status(&self) -> Result<NetworkStatus, MerodError> {
        MerodClient::network_status(self).await
    }

    async fn identity(&self) -> Result<NodeAccount, MerodError> {
        MerodClient::identity(self).await
    }

    async fn tee_role(
        &self,
        group_id: GroupId,
        account: &str,
    ) -> Result<Option<TeeRole>, MerodError> {
        MerodClient::tee_role(self, group_id, account).await
    }
}

/// A `fleet-join` answer with no boolean `admitted`, flat or under `data`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("no boolean \"admitted\" (flat or under \"data\")")]
// A pure entry point for the contract and schema tests, the fuzzers and the benches;
// not part of the library's promise.
#[doc(hidden)]
pub struct NoAdmitted;

/// Reads a `fleet-join` answer: the flat object merod 0.11 sends, or the same wrapped in
/// `{"data": {...}}`. Only a boolean `admitted` counts.
///
/// Errors: [`NoAdmitted`] when neither shape has a boolean `admitted`.
// A pure entry point for the contract and schema tests, the fuzzers and the benches;
// not part of the library's promise.
#[doc(hidden)]
pub fn parse_fleet_join(answer: &Value) -> Result<Admission, NoAdmitted> {
    let inner = match answer.get("data") {
        Some(data) if data.is_object() => data,
        _ => answer,
    };
    let admitted = inner
        .get("admitted")
        .and_then(Value::as_bool)
        .ok_or(NoAdmitted)?;
    let status = inner
        .get("status")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_owned();
    let mut reasons = Vec::new();
    for key in ["reason", "reasons", "message", "error", "errors", "detail"] {
        match inner.get(key) {
            Some(Value::String(s)) => reasons.push(s.clone()),
            Some(Value::Array(items)) => reasons.extend(
                items
                    .iter()
                    .map(|v| v.as_str().map_or_else(|| v.to_string(), str::to_owned)),
            ),
            Some(v @ Value::Object(_)) => reasons.push(v.to_string()),
            _ => {}
        }
    }
    let refusals = inner
        .get("refusals")
        .and_then(Value::as_array)
        .map(|items| {
            items
                .iter()
                .filter(|v| v.is_object())
                .take(MAX_REFUSALS)
                .map(|v| {
                    let text = |key: &str, max: usize| {
                        v.get(key)
                            .and_then(Value::as_str)
                            .map_or_else(String::new, |s| cut(s, max))
                    };
                    Refusal {
                        peer: text("peer", MAX_REFUSAL_PEER),
                        reason: text("reason", MAX_REFUSAL_REASON),
                    }
                })
                .collect()
        })
        .unwrap_or_default();
    let admitted_by = match inner.get("admitted_by") {
        None | Some(Value::Null | Value::Bool(false)) => None,
        Some(Value::String(s)) => (!s.is_empty()).then(|| cut(s, MAX_REFUSAL_PEER)),
        Some(Value::Number(n)) => (n.as_f64() != Some(0.0)).then(|| n.to_string()),
        Some(Value::Array(a)) if a.is_empty() => None,
        Some(Value::Object(o)) if o.is_empty() => None,
        Some(v) => Some(cut(&v.to_string(), MAX_REFUSAL_PEER)),
    };
    Ok(Admission {
        admitted,
        status,
        reasons,
        refusals,
        admitted_by,
    })
}

/// Reads a `GET /admin-api/namespaces/{id}` answer: 200 listing `group_id` → held; 404 in
/// merod's own words ([`NOT_HELD_MESSAGES`]) → not held.
///
/// Errors: the status of any other answer (a 200 for another id, a 404 of another shape: a
/// proxy, a renamed route): membership unknown.
pub(crate) fn parse_namespace_get(
    status: u16,
    body: &Value,
    group_id: GroupId,
) -> Result<bool, u16> {
    match status {
        200 => {
            let listed = body
                .get("data")
                .and_then(|d| d.get("namespaceId"))
                .and_then(Value::as_str)
                .and_then(|s| s.parse::<GroupId>().ok());
            if listed == Some(group_id) {
                Ok(true)
            } else {
                Err(status)
            }
        }
        404 if error_message(body).is_some_and(|m| NOT_HELD_MESSAGES.contains(&m)) => Ok(false),
        other => Err(other),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const A: &str = "38069a4cc4285c4245c84587ac60084ba53502a8b91c9b108bca40f10ec4d3df";

    #[test]
    fn refusals_are_read_flat_or_under_data_capped_and_cut() {
        let many: Vec<Value> = (0..12)
            .map(|i| json!({"peer": "p".repeat(200), "reason": format!("r{i}{}", "x".repeat(600))}))
            .collect();
        let flat = json!({"admitted": false, "refusals": many});
        let a = parse_fleet_join(&flat).unwrap();
        assert_eq!(a.refusals.len(), MAX_REFUSALS);
        assert_eq!(a.refusals[0].peer.chars().count(), MAX_REFUSAL_PEER);
        assert_eq!(a.refusals[0].reason.chars().count(), MAX_REFUSAL_REASON);
        assert!(a.refusals[7].reason.starts_with("r7"));
        let wrapped = json!({"data": {"admitted": false,
            "refusals": ["not an object", {"peer": "12D3KooWA", "reason": "MRTD"}, {"reason": 7}]}});
        let a = parse_fleet_join(&wrapped).unwrap();
        assert_eq!(
            a.refusals,
            [
                Refusal {
                    peer: "12D3KooWA".into(),
                    reason: "MRTD".into()
                },
                Refusal {
                    peer: String::new(),
                    reason: String::new()
                },
            ]
        );
        let none = parse_fleet_join(&json!({"admitted": true, "refusals": "x"})).unwrap();
        assert!(none.refusals.is_empty());
    }

    #[test]
    fn swarm_addrs_end_with_the_node_s_own_peer_id_deduplicated_at_most_16() {
        let answer = json!({
            "localPeerId": " SELF ",
            "listenAddrs": ["/ip4/0.0.0.0/tcp/2528"],
            "externalAddrs": [
                "/ip4/1.2.3.4/udp/2528/quic-v1",
                "/ip4/1.2.3.4/tcp/2528/p2p/SELF",
                "/ip4/9.9.9.9/udp/4001/quic-v1/p2p/RELAY/p2p-circuit",
                " /ip4/1.2.3.4/udp/2528/quic-v1 ",
                "not/an/addr",
                7
            ],
            "relays": []
        });
        let status = parse_network_status(&answer).unwrap();
        assert_eq!(
            status.swarm_addrs(),
            [
                "/ip4/1.2.3.4/udp/2528/quic-v1/p2p/SELF",
                "/ip4/1.2.3.4/tcp/2528/p2p/SELF",
                "/ip4/9.9.9.9/udp/4001/quic-v1/p2p/RELAY/p2p-circuit/p2p/SELF",
            ]
        );
        let many: Vec<String> = (0..40).map(|i| format!("/ip4/10.0.0.{i}/tcp/1")).collect();
        let status =
            parse_network_status(&json!({"data": {"localPeerId": "P", "externalAddrs": many}}))
                .unwrap();
        assert_eq!(status.swarm_addrs().len(), MAX_SWARM_ADDRS);
        // No PeerId: nothing can be reported.
        let status =
            parse_network_status(&json!({"externalAddrs": ["/ip4/1.2.3.4/tcp/1"]})).unwrap();
        assert!(status.swarm_addrs().is_empty());
        assert!(parse_network_status(&json!({"localPeerId": "P"})).is_err());
    }

    #[test]
    fn admitted_by_is_read_when_truthy_flat_or_under_data() {
        let by = |answer: Value| parse_fleet_join(&answer).unwrap().admitted_by;
        assert_eq!(
            by(json!({"admitted": false, "admitted_by": "12D3KooWA", "refusals": []})),
            Some("12D3KooWA".into())
        );
        assert_eq!(
            by(json!({"data": {"admitted": false, "admitted_by": "p".repeat(300)}}))
                .map(|p| p.chars().count()),
            Some(MAX_REFUSAL_PEER)
        );
        assert_eq!(
            by(json!({"admitted": false, "admitted_by": true})),
            Some("true".into())
        );
        assert_eq!(
            by(json!({"admitted": false, "admitted_by": 3})),
            Some("3".into())
        );
        for falsy in [
            json!(null),
            json!(false),
            json!(0),
            json!(0.0),
            json!(""),
            json!([]),
            json!({}),
        ] {
            assert_eq!(
                by(json!({"admitted": false, "admitted_by": falsy})),
                None,
                "{falsy}"
            );
        }
        assert_eq!(by(json!({"admitted": true})), None);
        // It is shown, never taken for admission.
        let a = parse_fleet_join(&json!({"admitted": false, "admitted_by": "12D3KooWA"})).unwrap();
        assert!(!a.admitted);
    }

    #[test]
    fn only_merod_s_own_404_is_not_held() {
        let id: GroupId = A.parse().unwrap();
        for message in NOT_HELD_MESSAGES {
            assert_eq!(
                parse_namespace_get(404, &json!({ "error": message }), id),
                Ok(false)
            );
        }
        for body in [
            json!({"error": "Not found"}),
            json!({"error": "no namespace identity found"}),
            json!({}),
            Value::Null,
            json!("<html>404</html>"),
        ] {
            assert_eq!(parse_namespace_get(404, &body, id), Err(404), "{body}");
        }
        let held = json!({"data": {"namespaceId": A}});
        assert_eq!(parse_namespace_get(200, &held, id), Ok(true));
        assert_eq!(parse_namespace_get(500, &held, id), Err(500));
    }

    #[test]
    fn an_older_core_s_400_naming_the_field_is_a_refusal_of_it() {
        let named = json!({"error": "Invalid JSON data: unknown field `admitterAddrs`, expected `groupId`"});
        assert!(refuses_admitter_addrs(400, &named));
        assert!(!refuses_admitter_addrs(500, &named));
        assert!(!refuses_admitter_addrs(
            400,
            &json!({"error": "Field 'group_id' must be exactly 64 characters"})
        ));
        assert!(!refuses_admitter_addrs(400, &Value::Null));
    }

    #[test]
    fn member_rows_are_read_flat_or_under_data() {
        let rows = json!({"members": [{"identity": "AB", "role": "RelayTee"}]});
        assert_eq!(
            parse_members(&rows).unwrap(),
            [("ab".to_owned(), "RelayTee".to_owned())]
        );
        let wrapped = json!({"data": rows});
        assert_eq!(parse_members(&wrapped).unwrap().len(), 1);
        assert!(parse_members(&json!({"members": [{"identity": "ab"}]})).is_err());
        assert!(parse_members(&json!({"data": []})).is_err());
        assert_eq!(TeeRole::from_merod("RelayTee"), Some(TeeRole::RelayTee));
        assert_eq!(
            TeeRole::from_merod("ReadOnlyTee"),
            Some(TeeRole::ReadOnlyTee)
        );
        assert_eq!(TeeRole::from_merod("Admin"), None);
    }
}
