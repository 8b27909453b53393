//! The merod admin API client, over the `calimero-client` crate (docs/merod-admin.md).
//!
//! Calls: `GET /admin-api/peers` (readiness), `POST /admin-api/tee/fleet-join`
//! (`{"groupId": "<64 hex>"}`, TDX-attested admission, may take 30 s and more),
//! `POST /admin-api/namespaces/{id}/leave` (irreversible: core purges the node's keys), and
//! `GET /admin-api/namespaces/{id}` (does the node hold it?), and for attested registration
//! `GET /admin-api/identity` (the account), `POST /admin-api/tee/registration-attest` and
//! `POST /admin-api/tee/attest` (a TD quote over a nonce). merod listens on loopback in its
//! default `proxy` auth mode, so no token is sent.
//!
//! calimero-client's requests have no timeout and its errors drop the HTTP status: the
//! daemon bounds every call itself, and the membership check (where 404 means "gone" and
//! 500 means "ask again") reads the status with the connection's own HTTP client.

use std::collections::BTreeSet;
use std::fmt;
use std::time::Duration;

use async_trait::async_trait;
use calimero_client::auth::HeadlessAuthenticator;
use calimero_client::storage::JwtToken;
use calimero_client::{Client, ClientStorage, ConnectionInfo};
use calimero_server_primitives::admin::FleetJoinRequest;
use serde::Deserialize;
use serde_json::Value;
use url::Url;

use crate::ids::GroupId;
use crate::strict_json::StrictValue;

#[cfg(feature = "daemon")]
mod listen;
#[cfg(feature = "daemon")]
pub(crate) use listen::ListenCandidates;

/// Default bound of a connection attempt to merod (it is on loopback: longer means it is
/// not up).
pub const MEROD_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Default bound of a readiness probe (`GET /admin-api/peers`).
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(5);
/// Default bound of a `fleet-join`: TDX-attested admission takes ~30 s, and more under load.
pub const JOIN_TIMEOUT: Duration = Duration::from_secs(90);
/// Default bound of a namespace leave.
pub const LEAVE_TIMEOUT: Duration = Duration::from_secs(60);
/// Default bound of a membership check or a namespace listing.
pub const CHECK_TIMEOUT: Duration = Duration::from_secs(10);
/// Bound of one quote (`registration-attest` or `attest`): generating a TD quote.
pub const ATTEST_TIMEOUT: Duration = Duration::from_secs(30);
/// Largest identity or attest answer read (a quote is a few KiB).
const MAX_ATTEST_BODY: usize = 1024 * 1024;

/// What `GET /admin-api/identity` says of the node's account.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NodeAccount {
    /// `data.accountId`, trimmed and lowercased.
    Account(String),
    /// merod's own 404: the node holds neither a device nor an account root yet (both are
    /// minted the first time it takes part in a namespace).
    NotMinted,
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
}

/// The admin-API call an error is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
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
        })
    }
}

/// The cause of a failed call, as the HTTP layer or calimero-client reported it.
pub(crate) type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// A failed merod call. Each names the operation and the URL and keeps its cause.
#[derive(Debug, thiserror::Error)]
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
            | MerodError::Answer { op, .. } => *op,
        }
    }

    /// Whether the call ran out of time (rather than being refused or answered wrongly).
    pub fn is_timeout(&self) -> bool {
        matches!(self, MerodError::Timeout { .. })
    }

    /// The failure's one classification, stable for a program to match (the `kind` of its
    /// `Serialize` form, `{"kind": …, "message": …}`): `call` (refused, reset, or a non-2xx
    /// answer as calimero-client reports it), `timeout`, `status`, `answer` (a 2xx of an
    /// unexpected shape).
    pub fn kind(&self) -> &'static str {
        match self {
            MerodError::Call { .. } => "call",
            MerodError::Timeout { .. } => "timeout",
            MerodError::Status { .. } => "status",
            MerodError::Answer { .. } => "answer",
        }
    }
}

serialize_kind_and_message!(MerodError);

/// The node as the daemon sees it; [`MerodClient`] is the real one, tests supply their own.
#[async_trait]
pub trait Node: Send + Sync + 'static {
    /// Whether the admin API answers (`GET /admin-api/peers`; what `meroctl peers` runs).
    ///
    /// Errors: [`MerodError`] while merod is not up.
    async fn probe(&self) -> Result<(), MerodError>;

    /// `POST /admin-api/tee/fleet-join` for `group_id`.
    ///
    /// Errors: [`MerodError`]; `admitted: false` is not an error but an [`Admission`].
    async fn fleet_join(&self, group_id: GroupId) -> Result<Admission, MerodError>;

    /// `POST /admin-api/namespaces/{id}/leave`. A 500 may mean "nothing left to leave":
    /// ask [`Node::holds_namespace`] to tell.
    ///
    /// Errors: [`MerodError`].
    async fn leave_namespace(&self, group_id: GroupId) -> Result<(), MerodError>;

    /// `GET /admin-api/namespaces/{id}`: `true` on 200, `false` on 404 (`No namespace
    /// identity found` or `Namespace not found`).
    ///
    /// Errors: [`MerodError`] for any other answer: membership unknown.
    async fn holds_namespace(&self, group_id: GroupId) -> Result<bool, MerodError>;

    /// Every namespace merod holds (`GET /admin-api/namespaces`, all pages): what orphans
    /// are found in.
    ///
    /// Errors: [`MerodError`]: the list is unknown.
    async fn list_namespaces(&self) -> Result<BTreeSet<GroupId>, MerodError>;
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

    /// Bound of [`MerodClient::fleet_join`] (default [`JOIN_TIMEOUT`], 90 s).
    pub fn join_timeout(mut self, d: Duration) -> Self {
        self.deadlines.join = d;
        self
    }

    /// Bound of [`MerodClient::leave_namespace`] (default [`LEAVE_TIMEOUT`], 60 s).
    pub fn leave_timeout(mut self, d: Duration) -> Self {
        self.deadlines.leave = d;
        self
    }

    /// Bound of [`MerodClient::holds_namespace`] and [`MerodClient::list_namespaces`]
    /// (default [`CHECK_TIMEOUT`], 10 s).
    pub fn check_timeout(mut self, d: Duration) -> Self {
        self.deadlines.check = d;
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
            },
        }
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
    /// and `limit` until a page comes back short): each entry's `namespaceId`, a 64-hex group
    /// id. Other fields of the entries are not read.
    ///
    /// Errors: [`MerodError::Call`] (transport), [`MerodError::Status`] (non-2xx),
    /// [`MerodError::Timeout`] (the whole listing, default 10 s), [`MerodError::Answer`] when
    /// the answer is not the documented shape or an entry has no valid `namespaceId`.
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
            let mut held = BTreeSet::new();
            for page in 0usize.. {
                let mut url = self.url(path);
                url.query_pairs_mut()
                    .append_pair("offset", &(page * LIST_PAGE).to_string())
                    .append_pair("limit", &LIST_PAGE.to_string());
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
                if !resp.status().is_success() {
                    return Err(MerodError::Status {
                        op,
                        url: url_text.clone(),
                        status,
                    });
                }
                let body = resp.bytes().await.map_err(|e| MerodError::Call {
                    op,
                    url: url_text.clone(),
                    source: e.without_url().into(),
                })?;
                let list: NamespaceList =
                    serde_json::from_slice(&body).map_err(|e| answer_err(e.to_string()))?;
                let count = list.data.len();
                for entry in list.data {
                    let id = entry.namespace_id.parse().map_err(|e| {
                        answer_err(format!("namespaceId {:?}: {e}", entry.namespace_id))
                    })?;
                    held.insert(id);
                }
                if count < LIST_PAGE {
                    break;
                }
            }
            Ok(held)
        })
        .await
    }
}

impl MerodClient {
    /// The node's account (`GET /admin-api/identity` → `data.accountId`, trimmed and
    /// lowercased), bounded by the check deadline (default 10 s).
    ///
    /// Errors: [`MerodError::Status`] for a non-2xx other than merod's own "not minted yet"
    /// 404 (which is [`NodeAccount::NotMinted`]); [`MerodError::Answer`] for an account id
    /// that is empty or not printable ASCII without `|` (it is a field of the registration
    /// nonce); transport and timeout as usual.
    pub async fn identity(&self) -> Result<NodeAccount, MerodError> {
        let op = MerodOp::Identity;
        let path = "admin-api/identity";
        let (status, body) = self.raw(op, path, None, self.deadlines.check).await?;
        let answer_err = |reason: &str| MerodError::Answer {
            op,
            url: self.url(path).to_string(),
            reason: reason.to_owned(),
        };
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
                return Ok(NodeAccount::NotMinted);
            }
        }
        if !(200..300).contains(&status) {
            return Err(MerodError::Status {
                op,
                url: self.url(path).to_string(),
                status,
            });
        }
        let value = value.map_err(|e| answer_err(&e.to_string()))?;
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

    /// A TD quote bound to a registration: `POST /admin-api/tee/registration-attest`
    /// `{"nonce": "<64 hex>"}` (bounded by [`ATTEST_TIMEOUT`]). `Ok(None)` on a 404: this
    /// merod predates the route (0.11.0-rc.25 does), so the caller falls back to
    /// [`MerodClient::attest`]. The quote is `data.quoteB64` (else a top-level `quoteB64`),
    /// non-empty, returned verbatim.
    ///
    /// Errors: [`MerodError::Status`] for a non-2xx other than 404 (400: a bad nonce),
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
            Err(MerodError::Status { status: 404, .. }) => Ok(None),
            other => other.map(Some),
        }
    }

    /// A TD quote over `nonce` (64 hex chars): `POST /admin-api/tee/attest`
    /// `{"nonce": "<64 hex>"}`, bounded by [`ATTEST_TIMEOUT`]; the report data is the nonce
    /// and 32 zero bytes, with no registration binding. The quote is `data.quoteB64` (else a
    /// top-level `quoteB64`), non-empty, returned verbatim.
    ///
    /// Errors: [`MerodError::Status`] for a non-2xx, [`MerodError::Answer`] for a 2xx
    /// without a quote; transport and timeout.
    pub async fn attest(&self, nonce: &str) -> Result<String, MerodError> {
        self.quote(MerodOp::Attest, "admin-api/tee/attest", nonce)
            .await
    }

    async fn quote(&self, op: MerodOp, path: &str, nonce: &str) -> Result<String, MerodError> {
        let body = serde_json::json!({ "nonce": nonce });
        let (status, answer) = self.raw(op, path, Some(body), ATTEST_TIMEOUT).await?;
        if !(200..300).contains(&status) {
            return Err(MerodError::Status {
                op,
                url: self.url(path).to_string(),
                status,
            });
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
            let mut resp = req.send().await.map_err(call_err)?;
            let status = resp.status().as_u16();
            let mut bytes = Vec::new();
            while let Some(chunk) = resp.chunk().await.map_err(call_err)? {
                if bytes.len() + chunk.len() > MAX_ATTEST_BODY {
                    return Err(MerodError::Answer {
                        op,
                        url: url.to_string(),
                        reason: format!("larger than {MAX_ATTEST_BODY} bytes"),
                    });
                }
                bytes.extend_from_slice(&chunk);
            }
            Ok((status, bytes))
        })
        .await
    }
}

/// Entries asked for per page of `GET /admin-api/namespaces` (merod's default).
const LIST_PAGE: usize = 100;

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
                .map_err(|e| self.client_error(op, path, e))
        })
        .await
    }

    async fn fleet_join(&self, group_id: GroupId) -> Result<Admission, MerodError> {
        let op = MerodOp::FleetJoin;
        let path = "admin-api/tee/fleet-join";
        let body = FleetJoinRequest {
            group_id: group_id.to_string(),
        };
        self.bounded(op, path, self.deadlines.join, async {
            // Read strictly: an answer naming a key twice is an error, not "last one wins".
            let StrictValue(answer) = self
                .connection
                .post(path, body)
                .await
                .map_err(|e| self.client_error(op, path, e))?;
            parse_fleet_join(&answer).map_err(|reason| MerodError::Answer {
                op,
                url: self.url(path).to_string(),
                reason: reason.to_string(),
            })
        })
        .await
    }

    async fn leave_namespace(&self, group_id: GroupId) -> Result<(), MerodError> {
        let op = MerodOp::Leave;
        let id = group_id.to_string();
        let path = format!("admin-api/namespaces/{id}/leave");
        self.bounded(op, &path, self.deadlines.leave, async {
            self.client
                .leave_namespace(&id)
                .await
                .map(|_| ())
                .map_err(|e| self.client_error(op, &path, e))
        })
        .await
    }

    async fn list_namespaces(&self) -> Result<BTreeSet<GroupId>, MerodError> {
        MerodClient::list_namespaces(self).await
    }

    async fn holds_namespace(&self, group_id: GroupId) -> Result<bool, MerodError> {
        let op = MerodOp::GetNamespace;
        let path = format!("admin-api/namespaces/{group_id}");
        let url = self.url(&path);
        self.bounded(op, &path, self.deadlines.check, async {
            let resp = self
                .connection
                .client
                .get(url.clone())
                .send()
                .await
                .map_err(|e| MerodError::Call {
                    op,
                    url: url.to_string(),
                    source: e.without_url().into(),
                })?;
            let status = resp.status().as_u16();
            // An unreadable, non-JSON or ambiguous (a key named twice) body reads as null: a
            // 200 then does not count as held, so membership stays unknown.
            let body = match resp.bytes().await {
                Ok(bytes) => {
                    serde_json::from_slice::<StrictValue>(&bytes).map_or(Value::Null, |v| v.0)
                }
                Err(_) => Value::Null,
            };
            parse_namespace_get(status, &body, group_id).map_err(|status| MerodError::Status {
                op,
                url: url.to_string(),
                status,
            })
        })
        .await
    }
}

/// A `fleet-join` answer with no boolean `admitted`, flat or under `data`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("no boolean \"admitted\" (flat or under \"data\")")]
pub struct NoAdmitted;

/// Reads a `fleet-join` answer: the flat object merod 0.11 sends, or the same wrapped in
/// `{"data": {...}}`. Only a boolean `admitted` counts.
///
/// Errors: [`NoAdmitted`] when neither shape has a boolean `admitted`.
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
    Ok(Admission {
        admitted,
        status,
        reasons,
    })
}

/// Reads a `GET /admin-api/namespaces/{id}` answer: 200 listing `group_id` → held; 404 →
/// not held.
///
/// Errors: the status of any other answer (or 200 for another id): membership unknown.
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
        404 => Ok(false),
        other => Err(other),
    }
}
