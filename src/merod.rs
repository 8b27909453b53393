//! The merod admin API client, over the `calimero-client` crate (contracts/merod-admin.md).
//!
//! Calls: `GET /admin-api/peers` (readiness), `POST /admin-api/tee/fleet-join`
//! (`{"groupId": "<64 hex>"}`, TDX-attested admission, may take 30 s and more),
//! `POST /admin-api/namespaces/{id}/leave` (irreversible: core purges the node's keys), and
//! `GET /admin-api/namespaces/{id}` (does the node hold it?). merod listens on loopback in
//! its default `proxy` auth mode, so no token is sent.
//!
//! calimero-client's requests have no timeout and its errors drop the HTTP status: the
//! daemon bounds every call itself, and the membership check (where 404 means "gone" and
//! 500 means "ask again") reads the status with the connection's own HTTP client.

use std::time::Duration;

use async_trait::async_trait;
use calimero_client::auth::HeadlessAuthenticator;
use calimero_client::storage::JwtToken;
use calimero_client::{Client, ClientStorage, ConnectionInfo};
use calimero_server_primitives::admin::FleetJoinRequest;
use serde_json::Value;
use url::Url;

use crate::ids::GroupId;
use crate::strict_json::StrictValue;

/// Bound of a connection attempt to merod (it is on loopback: longer means it is not up).
pub const MEROD_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

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

/// A failed merod call. Each names the operation and the URL.
#[derive(Debug, thiserror::Error)]
pub enum MerodError {
    /// The call failed (transport, non-2xx, or an undecodable answer); calimero-client
    /// reports these as text, e.g. `Internal server error`.
    #[error("{op} {url}: {reason}")]
    Call {
        /// The operation, e.g. `fleet-join`.
        op: &'static str,
        /// The request URL.
        url: String,
        /// What failed.
        reason: String,
    },
    /// An answer with an unexpected HTTP status.
    #[error("{op} {url}: HTTP {status}")]
    Status {
        /// The operation.
        op: &'static str,
        /// The request URL.
        url: String,
        /// The HTTP status.
        status: u16,
    },
    /// A 2xx answer of an unexpected shape.
    #[error("{op} {url}: unexpected answer: {reason}")]
    Answer {
        /// The operation.
        op: &'static str,
        /// The request URL.
        url: String,
        /// What is wrong.
        reason: String,
    },
}

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
}

/// calimero-client wants somewhere to keep JWTs; a headless proxy-mode caller has none.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoTokenStorage;

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

/// merod's admin API over calimero-client.
#[derive(Clone, Debug)]
pub struct MerodClient {
    client: Client<HeadlessAuthenticator, NoTokenStorage>,
    connection: Connection,
}

impl MerodClient {
    /// A client for the admin API at `admin_url` (e.g. `http://127.0.0.1:2528/`).
    ///
    /// Errors: [`MerodError::Call`] when the HTTP client cannot be built.
    pub fn new(admin_url: &Url) -> Result<Self, MerodError> {
        let build_err = |reason: String| MerodError::Call {
            op: "connect",
            url: admin_url.to_string(),
            reason,
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
            .connect_timeout(MEROD_CONNECT_TIMEOUT)
            .no_proxy()
            .build()
            .map_err(|e| build_err(e.to_string()))?;
        let client = Client::new(connection.clone()).map_err(|e| build_err(format!("{e:#}")))?;
        Ok(Self { client, connection })
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

    fn url_text(&self, path: &str) -> String {
        self.url(path).to_string()
    }
}

#[async_trait]
impl Node for MerodClient {
    async fn probe(&self) -> Result<(), MerodError> {
        self.client
            .get_peers_count()
            .await
            .map(|_| ())
            .map_err(|e| MerodError::Call {
                op: "peers",
                url: self.url_text("admin-api/peers"),
                reason: format!("{e:#}"),
            })
    }

    async fn fleet_join(&self, group_id: GroupId) -> Result<Admission, MerodError> {
        let path = "admin-api/tee/fleet-join";
        let body = FleetJoinRequest {
            group_id: group_id.to_string(),
        };
        // Read strictly: an answer naming a key twice is an error, not "last one wins".
        let StrictValue(answer) =
            self.connection
                .post(path, body)
                .await
                .map_err(|e| MerodError::Call {
                    op: "fleet-join",
                    url: self.url_text(path),
                    reason: format!("{e:#}"),
                })?;
        parse_fleet_join(&answer).map_err(|reason| MerodError::Answer {
            op: "fleet-join",
            url: self.url_text(path),
            reason,
        })
    }

    async fn leave_namespace(&self, group_id: GroupId) -> Result<(), MerodError> {
        let id = group_id.to_string();
        self.client
            .leave_namespace(&id)
            .await
            .map(|_| ())
            .map_err(|e| MerodError::Call {
                op: "leave",
                url: self.url_text(&format!("admin-api/namespaces/{id}/leave")),
                reason: format!("{e:#}"),
            })
    }

    async fn holds_namespace(&self, group_id: GroupId) -> Result<bool, MerodError> {
        let url = self.url(&format!("admin-api/namespaces/{group_id}"));
        let op = "get namespace";
        let resp = self
            .connection
            .client
            .get(url.clone())
            .send()
            .await
            .map_err(|e| MerodError::Call {
                op,
                url: url.to_string(),
                reason: e.without_url().to_string(),
            })?;
        let status = resp.status().as_u16();
        // An unreadable, non-JSON or ambiguous (a key named twice) body reads as null: a 200
        // then does not count as held, so membership stays unknown.
        let body = match resp.bytes().await {
            Ok(bytes) => serde_json::from_slice::<StrictValue>(&bytes).map_or(Value::Null, |v| v.0),
            Err(_) => Value::Null,
        };
        parse_namespace_get(status, &body, group_id).map_err(|status| MerodError::Status {
            op,
            url: url.to_string(),
            status,
        })
    }
}

/// Reads a `fleet-join` answer: the flat object merod 0.11 sends, or the same wrapped in
/// `{"data": {...}}`. Only a boolean `admitted` counts.
///
/// Errors: a reason when neither shape has a boolean `admitted`.
pub fn parse_fleet_join(answer: &Value) -> Result<Admission, String> {
    let inner = match answer.get("data") {
        Some(data) if data.is_object() => data,
        _ => answer,
    };
    let admitted = inner
        .get("admitted")
        .and_then(Value::as_bool)
        .ok_or_else(|| "no boolean \"admitted\" (flat or under \"data\")".to_owned())?;
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
pub fn parse_namespace_get(status: u16, body: &Value, group_id: GroupId) -> Result<bool, u16> {
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
