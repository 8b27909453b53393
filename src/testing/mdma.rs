//! Emulator of the MDMA fleet API (see `docs/mdma.md`):
//! `POST /api/fleet/should-join`, `POST /api/fleet/confirm`,
//! `POST /api/fleet/join-status` (answered 200 `{"status":"recorded"}`, or 404 like an MDMA
//! without the route after [`MdmaEmulator::set_join_status_route`]`(false)`), and attested
//! registration's `GET /api/fleet/nodes/challenge` and `POST /api/fleet/nodes/register`.
//!
//! Test double for the demo and the integration tests, not production code.
//!
//! - With a token configured, a request whose `X-Fleet-Token` is missing or different answers
//!   401; without one the header is ignored (but recorded).
//! - Bodies must be JSON objects sent with `Content-Type: application/json`: a poll
//!   `{"peer_id": str, "mrtd"?: str, "held_namespaces"?: [str]}` (a `null` mrtd is refused:
//!   the contract leaves it out), a confirm `{"peer_id": str, "group_id": str,
//!   "authorship_ready"?: bool, "tee_role"?: str|null}`; unknown fields are ignored. Anything
//!   else answers 400. Every request is recorded, whatever it was answered.
//! - Assignments carry the `admitter_addrs` set with [`MdmaEmulator::set_admitter_addrs`]
//!   (default `[]`).
//! - A poll is answered with the next queued [`PollReply`], else with the standing one
//!   (default: no assignments). A confirm answers 200 `{}`, or 503 while failures are scripted
//!   for its group with [`MdmaEmulator::fail_next_confirms`].
//! - A challenge answers 200 `{"challenge": "<fresh>", "expires_at_ms": …}` (no token needed).
//!   A register (no token needed) must carry the string fields `peer_id`,
//!   `executor_account`, `relay_url`, `challenge` (one this emulator issued), `quote`,
//!   `enrolment_token`; `csr` only as a string and `quote_binding` only as
//!   `"registration"`; anything else answers 400 (an unknown challenge 403). A well-formed one is answered with the next queued
//!   [`RegisterReply`], else the standing one (default: a token). An issued token becomes
//!   the one every later request must carry.
//! - `POST /api/fleet/inventory` (the context inventory) is checked for the token and the
//!   body's `peer_id`, `namespaces` and `full`, recorded ([`MdmaEmulator::inventories`]) and
//!   answered 200, or what [`MdmaEmulator::set_inventory_status`] set (unless an answer is
//!   scripted for the path with [`MdmaEmulator::set_answer`], which then takes it).
//! - `PUT /api/fleet/recovery-envelope` (a recovery envelope) is checked for the token and
//!   the body's `peer_id`, `account_id`, `namespace_id`, `ciphertext` (strings) and
//!   `version` (a positive integer); kept when its version is above the one held for the
//!   same key (200), else 409; `DELETE` of the same path takes the three ids and drops the
//!   envelope (200 whether it was held or not). Both are recorded
//!   ([`MdmaEmulator::recovery_calls`]); [`MdmaEmulator::set_recovery_status`] answers them
//!   with another status; [`MdmaEmulator::recovery_envelopes`] is what is held.
//! - Any other path (a tool's own call, e.g. `POST /api/fleet/recovery`) is checked for the
//!   token, recorded ([`MdmaEmulator::requests`]) and answered with what
//!   [`MdmaEmulator::set_answer`] scripted for it, else 404 `{"error":"Not found"}`.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hyper::body::Bytes;
use hyper::header::{HeaderValue, RETRY_AFTER};
use hyper::{HeaderMap, Method, StatusCode};
use serde_json::{json, Map, Value};
use tokio::sync::watch;
use url::Url;

use super::{
    is_json_content_type, json_response, lock, raw_json_response, serve, Answer, BadRequest,
    Received, ServerHandle,
};

/// The header carrying the fleet token.
pub const TOKEN_HEADER: &str = "x-fleet-token";

/// How the emulator answers a (well-formed, authorised) poll.
#[derive(Clone, Debug, PartialEq)]
pub enum PollReply {
    /// 200 `{"assignments":[{"group_id": id, "admitter_addrs": []}, ...]}` plus
    /// `"retain": [...]` when `Some`.
    Assign {
        /// The `group_id`s of the `assignments` entries, in order.
        assignments: Vec<String>,
        /// The `retain` list; left out of the body when `None`.
        retain: Option<Vec<String>>,
    },
    /// This HTTP status with body `{"error":"emulated"}`.
    Status(u16),
    /// 200, `Content-Type: application/json`, exactly this body (for non-JSON / wrong-shape
    /// tests).
    RawBody(String),
    /// Never answers: the request stays pending until the client gives up.
    Hang,
}

impl PollReply {
    /// `Assign` of these ids, without `retain`.
    pub fn assign<I, S>(ids: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        PollReply::Assign {
            assignments: ids.into_iter().map(Into::into).collect(),
            retain: None,
        }
    }

    /// `Assign` of `ids` with a `retain` list.
    pub fn assign_retain<I, S, R, T>(ids: I, retain: R) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
        R: IntoIterator<Item = T>,
        T: Into<String>,
    {
        PollReply::Assign {
            assignments: ids.into_iter().map(Into::into).collect(),
            retain: Some(retain.into_iter().map(Into::into).collect()),
        }
    }
}

/// A fleet-sized `should-join` body: `entries` assignments (ids `{i:064x}`), each with
/// `addrs` admitter addresses of the longest common form
/// (`/ip6/<full address>/udp/65535/quic-v1/p2p/<PeerId>`, 119 bytes each), compact.
pub fn fleet_answer(entries: usize, addrs: usize) -> String {
    let ids: Vec<String> = (0..entries).map(|i| format!("{i:064x}")).collect();
    fleet_answer_for(&ids, addrs)
}

/// [`fleet_answer`] for these assignment ids, in this order.
pub fn fleet_answer_for<S: AsRef<str>>(ids: &[S], addrs: usize) -> String {
    let mut body = String::from(r#"{"assignments":["#);
    for (i, id) in ids.iter().enumerate() {
        if i > 0 {
            body.push(',');
        }
        body.push_str(&format!(
            r#"{{"group_id":"{}","admitter_addrs":["#,
            id.as_ref()
        ));
        for a in 0..addrs {
            if a > 0 {
                body.push(',');
            }
            body.push_str(&format!(
                r#""/ip6/2001:0db8:85a3:0000:0000:8a2e:{:04x}:{a:04x}/udp/65535/quic-v1/p2p/{}""#,
                i % 0x1_0000,
                ADMITTER_PEER_ID
            ));
        }
        body.push_str("]}");
    }
    body.push_str(r#"],"retain":[]}"#);
    body
}

impl Default for PollReply {
    fn default() -> Self {
        PollReply::Assign {
            assignments: Vec::new(),
            retain: None,
        }
    }
}

/// How the emulator answers a well-formed `register`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RegisterReply {
    /// 200 `{"status":"registered","fleet_token": token}`; from then on every request must
    /// carry this token.
    Issue(String),
    /// 200 `{"status":"registered"}`: registered, but no token issued (no signing key).
    Tokenless,
    /// This status with `{"error":"emulated"}` (403: a verdict; 503: quote not evaluable).
    Status(u16),
}

/// The token the emulator issues by default ([`RegisterReply::Issue`] of it).
pub const ISSUED_TOKEN: &str = "NEVER-LOGGED-TOKEN-issued-by-the-emulator";

/// One `register` request as received.
#[derive(Clone, Debug)]
pub struct RegisterRecord {
    /// The body, when it was a JSON object.
    pub body: Option<Map<String, Value>>,
    /// What was answered.
    pub status: u16,
    /// When the request arrived.
    pub at: Instant,
}

/// One `PUT` or `DELETE /api/fleet/recovery-envelope` as received.
#[derive(Clone, Debug)]
pub struct RecoveryCall {
    /// `PUT` or `DELETE`.
    pub method: String,
    /// The body, when it was a JSON object.
    pub body: Option<Map<String, Value>>,
    /// What was answered.
    pub status: u16,
}

/// A recovery envelope held: `(peer_id, namespace_id, account_id)` → `(version, ciphertext)`.
pub type HeldEnvelopes = std::collections::BTreeMap<(String, String, String), (u64, String)>;

/// One `POST /api/fleet/inventory` as received.
#[derive(Clone, Debug)]
pub struct InventoryPost {
    /// The body, when it was a JSON object.
    pub body: Option<Map<String, Value>>,
    /// `full` of the body, when a boolean.
    pub full: Option<bool>,
    /// What was answered.
    pub status: u16,
    /// When it arrived.
    pub at: Instant,
}

/// One `should-join` request as received.
#[derive(Clone, Debug)]
pub struct PollRecord {
    /// `peer_id` of the body, when it was a string.
    pub peer_id: Option<String>,
    /// `mrtd` of the body, when present and a string.
    pub mrtd: Option<String>,
    /// The `X-Fleet-Token` header as sent.
    pub token: Option<String>,
    /// `held_namespaces` of the body, when present and an array (its strings).
    pub held_namespaces: Option<Vec<String>>,
    /// `tls_cert_not_after` of the body, when present and a string.
    pub tls_cert_not_after: Option<String>,
    /// `logs_token_fp` of the body, when present and a string.
    pub logs_token_fp: Option<String>,
    /// `executor_account` of the body, when present and a string.
    pub executor_account: Option<String>,
    /// `swarm_addrs` of the body, when present and an array (its strings).
    pub swarm_addrs: Option<Vec<String>>,
    /// `relay_url` of the body, when present and a string.
    pub relay_url: Option<String>,
    /// What was answered; 0 for [`PollReply::Hang`].
    pub status: u16,
    /// When the request arrived.
    pub at: Instant,
}

/// One `confirm` request as received.
#[derive(Clone, Debug)]
pub struct ConfirmRecord {
    /// `peer_id` of the body, when it was a string.
    pub peer_id: Option<String>,
    /// `group_id` of the body (as sent), when it was a string.
    pub group_id: Option<String>,
    /// `tee_role` of the body: `Some(None)` for `null`, `None` when absent.
    pub tee_role: Option<Option<String>>,
    /// `authorship_ready` of the body, when a boolean.
    pub authorship_ready: Option<bool>,
    /// The `X-Fleet-Token` header as sent.
    pub token: Option<String>,
    /// What was answered.
    pub status: u16,
    /// When the request arrived.
    pub at: Instant,
}

/// How the emulator answers a request to a path other than should-join and confirm.
#[derive(Clone, Debug, PartialEq)]
pub enum CallReply {
    /// This status with this JSON body.
    Json(u16, Value),
    /// Never answers.
    Hang,
}

/// One request to a path other than should-join and confirm, as received.
#[derive(Clone, Debug)]
pub struct RequestRecord {
    /// The HTTP method.
    pub method: String,
    /// The path without the query string.
    pub path: String,
    /// The `X-Fleet-Token` header as sent.
    pub token: Option<String>,
    /// The body as text (lossy UTF-8).
    pub body: String,
    /// What was answered; 0 for [`CallReply::Hang`].
    pub status: u16,
    /// When the request arrived.
    pub at: Instant,
}

/// One `join-status` request as received.
#[derive(Clone, Debug)]
pub struct JoinStatusRecord {
    /// The body as sent (`Null` when it was not JSON).
    pub body: Value,
    /// What was answered.
    pub status: u16,
    /// When the request arrived.
    pub at: Instant,
}

struct Inner {
    token: Option<String>,
    answers: HashMap<String, CallReply>,
    requests: Vec<RequestRecord>,
    /// Every inventory post.
    inventories: Vec<InventoryPost>,
    /// The status inventory posts are answered with, when not 200.
    inventory_status: Option<u16>,
    /// Every recovery-envelope request.
    recovery_calls: Vec<RecoveryCall>,
    /// The recovery envelopes held.
    recovery_envelopes: HeldEnvelopes,
    /// The status recovery-envelope requests are answered with, when set.
    recovery_status: Option<u16>,
    /// Requests received, to every path.
    received: usize,
    standing: PollReply,
    queue: VecDeque<PollReply>,
    /// Remaining scripted confirm failures, keyed by lowercase group id.
    confirm_failures: HashMap<String, u32>,
    polls: Vec<PollRecord>,
    confirms: Vec<ConfirmRecord>,
    register_standing: RegisterReply,
    register_queue: VecDeque<RegisterReply>,
    challenges: Vec<String>,
    registrations: Vec<RegisterRecord>,
    join_statuses: Vec<JoinStatusRecord>,
    /// Whether `/api/fleet/join-status` exists (an older MDMA answers 404).
    join_status_route: bool,
    /// `admitter_addrs` per assignment (lowercase group id).
    admitter_addrs: HashMap<String, Vec<String>>,
    /// Top-level fields added to every assignment answer (`tls_certificate`,
    /// `logs_token`): what MDMA delivers.
    deliveries: serde_json::Map<String, Value>,
    /// The `expires_at_ms` sent with each challenge (`None`: now + 5 min, an integer).
    challenge_expiry: Option<Value>,
    /// The `Retry-After` header of every answer that is not a 2xx.
    retry_after: Option<String>,
}

struct Shared {
    inner: Mutex<Inner>,
    poll_count: watch::Sender<usize>,
}

/// The MDMA emulator. Clones share the same state and server; the server stops when
/// [`MdmaEmulator::shutdown`] is called or the last clone is dropped.
#[derive(Clone)]
pub struct MdmaEmulator {
    shared: Arc<Shared>,
    server: Arc<ServerHandle>,
}

impl std::fmt::Debug for MdmaEmulator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MdmaEmulator")
            .field("addr", &self.server.addr())
            .finish_non_exhaustive()
    }
}

impl MdmaEmulator {
    /// Starts the emulator on `127.0.0.1:0`. With `Some(token)` every request must carry
    /// `X-Fleet-Token: <token>`.
    pub async fn start(token: Option<String>) -> Result<Self, std::io::Error> {
        let (poll_count, _) = watch::channel(0usize);
        let shared = Arc::new(Shared {
            inner: Mutex::new(Inner {
                token,
                answers: HashMap::new(),
                requests: Vec::new(),
                inventories: Vec::new(),
                inventory_status: None,
                recovery_calls: Vec::new(),
                recovery_envelopes: HeldEnvelopes::new(),
                recovery_status: None,
                received: 0,
                standing: PollReply::default(),
                queue: VecDeque::new(),
                confirm_failures: HashMap::new(),
                polls: Vec::new(),
                confirms: Vec::new(),
                register_standing: RegisterReply::Issue(ISSUED_TOKEN.to_owned()),
                register_queue: VecDeque::new(),
                challenges: Vec::new(),
                registrations: Vec::new(),
                join_statuses: Vec::new(),
                join_status_route: true,
                admitter_addrs: HashMap::new(),
                deliveries: serde_json::Map::new(),
                challenge_expiry: None,
                retry_after: None,
            }),
            poll_count,
        });
        let handler_state = shared.clone();
        let server = Arc::new(serve(move |request| route(handler_state.clone(), request)).await?);
        Ok(MdmaEmulator { shared, server })
    }

    /// `http://127.0.0.1:PORT/`, the `MDMA_URL` to give the client.
    pub fn url(&self) -> Url {
        self.server.url()
    }

    /// The bound address.
    pub fn addr(&self) -> std::net::SocketAddr {
        self.server.addr()
    }

    /// Sets the standing answer (served once the queue is empty).
    pub fn set_reply(&self, reply: PollReply) {
        lock(&self.shared.inner).standing = reply;
    }

    /// Queues one-shot answers, served first and in order, before the standing one.
    pub fn queue_replies(&self, replies: impl IntoIterator<Item = PollReply>) {
        lock(&self.shared.inner).queue.extend(replies);
    }

    /// The token every request must carry from now on (`None`: any or none), e.g. to play
    /// a rotated signing key that refuses the tokens issued before.
    pub fn set_token(&self, token: Option<String>) {
        lock(&self.shared.inner).token = token;
    }

    /// Sets the standing answer to `register` (served once its queue is empty).
    pub fn set_register_reply(&self, reply: RegisterReply) {
        lock(&self.shared.inner).register_standing = reply;
    }

    /// Queues one-shot answers to `register`, served first and in order.
    pub fn queue_register_replies(&self, replies: impl IntoIterator<Item = RegisterReply>) {
        lock(&self.shared.inner).register_queue.extend(replies);
    }

    /// Sends `expires_at_ms` as exactly this JSON value in every challenge from now on (as
    /// a backend that writes integers as floats would, `1733150000000.0`), instead of an
    /// integer five minutes ahead.
    pub fn set_challenge_expiry(&self, value: Value) {
        lock(&self.shared.inner).challenge_expiry = Some(value);
    }

    /// Sends this `Retry-After` header (`"30"`, an HTTP date, or garbage) with every answer
    /// that is not a 2xx from now on, on every route; `None`: none (the default).
    pub fn set_retry_after(&self, value: Option<&str>) {
        lock(&self.shared.inner).retry_after = value.map(str::to_owned);
    }

    /// Every `register` so far, in arrival order.
    pub fn registrations(&self) -> Vec<RegisterRecord> {
        lock(&self.shared.inner).registrations.clone()
    }

    /// The challenges issued so far, in order.
    pub fn challenges(&self) -> Vec<String> {
        lock(&self.shared.inner).challenges.clone()
    }

    /// The next `n` confirms of `group_id` (compared case-insensitively) answer 503.
    /// Replaces any count still pending for that group.
    pub fn fail_next_confirms(&self, group_id: &str, n: u32) {
        lock(&self.shared.inner)
            .confirm_failures
            .insert(group_id.to_ascii_lowercase(), n);
    }

    /// Answers requests to `path` (e.g. `/api/fleet/inventory`; any method) with `reply`
    /// from now on, once their token is right.
    pub fn set_answer(&self, path: &str, reply: CallReply) {
        let path = format!("/{}", path.trim_start_matches('/'));
        lock(&self.shared.inner).answers.insert(path, reply);
    }

    /// Every `POST /api/fleet/inventory`, in arrival order.
    pub fn inventories(&self) -> Vec<InventoryPost> {
        lock(&self.shared.inner).inventories.clone()
    }

    /// Every `PUT` and `DELETE /api/fleet/recovery-envelope`, in arrival order.
    pub fn recovery_calls(&self) -> Vec<RecoveryCall> {
        lock(&self.shared.inner).recovery_calls.clone()
    }

    /// The recovery envelopes held now.
    pub fn recovery_envelopes(&self) -> HeldEnvelopes {
        lock(&self.shared.inner).recovery_envelopes.clone()
    }

    /// Answers recovery-envelope requests with `status` (`None`: as MDMA would).
    pub fn set_recovery_status(&self, status: Option<u16>) {
        lock(&self.shared.inner).recovery_status = status;
    }

    /// Answers inventory posts with `status` (`None`: 200 `{"status":"ok"}`).
    pub fn set_inventory_status(&self, status: Option<u16>) {
        lock(&self.shared.inner).inventory_status = status;
    }

    /// Every request to a path other than should-join and confirm, in arrival order.
    pub fn requests(&self) -> Vec<RequestRecord> {
        lock(&self.shared.inner).requests.clone()
    }

    /// How many requests came so far, to every path.
    pub fn received(&self) -> usize {
        lock(&self.shared.inner).received
    }

    /// The `admitter_addrs` sent with the assignment of `group_id` from now on.
    pub fn set_admitter_addrs(&self, group_id: &str, addrs: Vec<String>) {
        lock(&self.shared.inner)
            .admitter_addrs
            .insert(group_id.to_ascii_lowercase(), addrs);
    }

    /// Adds top-level `key` with `value` to every assignment answer from now on (`None`
    /// removes it): what MDMA delivers, such as `tls_certificate` or `logs_token`.
    pub fn set_delivery(&self, key: &str, value: Option<Value>) {
        let mut inner = lock(&self.shared.inner);
        match value {
            Some(v) => inner.deliveries.insert(key.to_owned(), v),
            None => inner.deliveries.remove(key),
        };
    }

    /// Whether `POST /api/fleet/join-status` exists (default true; false: 404 like an MDMA
    /// that predates it).
    pub fn set_join_status_route(&self, present: bool) {
        lock(&self.shared.inner).join_status_route = present;
    }

    /// Every join-status report so far, in arrival order.
    pub fn join_statuses(&self) -> Vec<JoinStatusRecord> {
        lock(&self.shared.inner).join_statuses.clone()
    }

    /// Every poll so far, in arrival order.
    pub fn polls(&self) -> Vec<PollRecord> {
        lock(&self.shared.inner).polls.clone()
    }

    /// Every confirm so far, in arrival order.
    pub fn confirms(&self) -> Vec<ConfirmRecord> {
        lock(&self.shared.inner).confirms.clone()
    }

    /// Group ids (as sent) with at least one 2xx confirm.
    pub fn confirmed(&self) -> BTreeSet<String> {
        lock(&self.shared.inner)
            .confirms
            .iter()
            .filter(|record| (200..300).contains(&record.status))
            .filter_map(|record| record.group_id.clone())
            .collect()
    }

    /// Waits until at least `n` polls were recorded (whatever they were answered); false if
    /// `timeout` passed first. Uses the tokio clock.
    pub async fn wait_for_polls(&self, n: usize, timeout: Duration) -> bool {
        let mut count = self.shared.poll_count.subscribe();
        let reached = tokio::time::timeout(timeout, count.wait_for(|seen| *seen >= n)).await;
        matches!(reached, Ok(Ok(_)))
    }

    /// Stops accepting connections (also happens when the last clone is dropped).
    pub fn shutdown(&self) {
        self.server.shutdown();
    }
}

fn header(headers: &HeaderMap, name: &str) -> Option<String> {
    headers
        .get(name)
        .map(|value| String::from_utf8_lossy(value.as_bytes()).into_owned())
}

/// The request body as a JSON object, or why it is refused.
fn json_object(headers: &HeaderMap, body: &[u8]) -> Result<Map<String, Value>, BadRequest> {
    if !is_json_content_type(headers) {
        return Err(BadRequest(
            "expected Content-Type: application/json".to_owned(),
        ));
    }
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err(BadRequest("the body must be a JSON object".to_owned())),
        Err(err) => Err(BadRequest(format!("the body is not JSON: {err}"))),
    }
}

fn string_field(body: &Result<Map<String, Value>, BadRequest>, name: &str) -> Option<String> {
    body.as_ref()
        .ok()
        .and_then(|map| map.get(name))
        .and_then(Value::as_str)
        .map(str::to_owned)
}

/// Checks `required` are strings and `optional` are strings when present.
fn check_fields(
    body: Result<Map<String, Value>, BadRequest>,
    required: &[&str],
    optional: &[&str],
) -> Result<(), BadRequest> {
    let map = body?;
    for name in required {
        match map.get(*name) {
            Some(Value::String(_)) => {}
            Some(_) => return Err(BadRequest(format!("field `{name}` must be a string"))),
            None => return Err(BadRequest(format!("missing field `{name}`"))),
        }
    }
    for name in optional {
        match map.get(*name) {
            None | Some(Value::String(_)) => {}
            Some(_) => {
                return Err(BadRequest(format!(
                    "field `{name}` must be a string when present"
                )))
            }
        }
    }
    Ok(())
}

fn authorised(expected: &Option<String>, sent: &Option<String>) -> bool {
    match expected {
        None => true,
        Some(token) => sent.as_deref() == Some(token.as_str()),
    }
}

fn error_body(message: &str) -> Value {
    json!({ "error": message })
}

fn assign_body(
    assignments: &[String],
    retain: &Option<Vec<String>>,
    addrs: &HashMap<String, Vec<String>>,
) -> Value {
    let entries: Vec<Value> = assignments
        .iter()
        .map(|id| {
            let listed = addrs
                .get(&id.to_ascii_lowercase())
                .cloned()
                .unwrap_or_default();
            json!({ "group_id": id, "admitter_addrs": listed })
        })
        .collect();
    let mut body = json!({ "assignments": entries });
    if let Some(retain) = retain {
        body["retain"] = json!(retain);
    }
    body
}

/// What a poll will be answered, decided under the lock.
enum Planned {
    Json(u16, Value),
    Raw(String),
    Hang,
}

impl Planned {
    fn status(&self) -> u16 {
        match self {
            Planned::Json(status, _) => *status,
            Planned::Raw(_) => 200,
            Planned::Hang => 0,
        }
    }
}

/// should-join and confirm (POST), then any scripted path.
async fn route(shared: Arc<Shared>, request: Received) -> Answer {
    lock(&shared.inner).received += 1;
    let mut answer = answer(&shared, request).await;
    if !answer.status().is_success() {
        let retry_after = lock(&shared.inner).retry_after.clone();
        if let Some(value) = retry_after.and_then(|v| HeaderValue::from_str(&v).ok()) {
            answer.headers_mut().insert(RETRY_AFTER, value);
        }
    }
    answer
}

/// The answer of the route `request` is for.
async fn answer(shared: &Shared, request: Received) -> Answer {
    let body = request.body.unwrap_or_default();
    match (request.uri.path(), &request.method) {
        ("/api/fleet/should-join", &Method::POST) => {
            should_join(shared, &request.headers, &body).await
        }
        ("/api/fleet/confirm", &Method::POST) => confirm(shared, &request.headers, &body),
        ("/api/fleet/nodes/challenge", &Method::GET) => challenge(shared),
        ("/api/fleet/nodes/register", &Method::POST) => register(shared, &request.headers, &body),
        ("/api/fleet/join-status", &Method::POST) => join_status(shared, &request.headers, &body),
        // A scripted answer takes precedence (a tool's own use of the path).
        ("/api/fleet/inventory", &Method::POST)
            if !lock(&shared.inner)
                .answers
                .contains_key("/api/fleet/inventory") =>
        {
            inventory(shared, &request.headers, &body)
        }
        ("/api/fleet/recovery-envelope", method)
            if (method == Method::PUT || method == Method::DELETE)
                && !lock(&shared.inner)
                    .answers
                    .contains_key("/api/fleet/recovery-envelope") =>
        {
            recovery_envelope(shared, method, &request.headers, &body)
        }
        (path, method) => other(shared, method, path, &request.headers, &body).await,
    }
}

/// `PUT` / `DELETE /api/fleet/recovery-envelope` (see the module docs).
fn recovery_envelope(
    shared: &Shared,
    method: &Method,
    headers: &HeaderMap,
    body: &Bytes,
) -> Answer {
    let token = header(headers, TOKEN_HEADER);
    let kept = json_object(headers, body).ok();
    let text = |name: &str| {
        kept.as_ref()
            .and_then(|m| m.get(name))
            .and_then(Value::as_str)
            .map(str::to_owned)
    };
    let key = match (text("peer_id"), text("namespace_id"), text("account_id")) {
        (Some(p), Some(n), Some(a)) => Some((p, n, a)),
        _ => None,
    };
    let put = *method == Method::PUT;
    let version = kept
        .as_ref()
        .and_then(|m| m.get("version"))
        .and_then(Value::as_u64)
        .filter(|v| *v > 0);
    let mut inner = lock(&shared.inner);
    let (status, answer) = if !authorised(&inner.token, &token) {
        (401, error_body("missing or wrong X-Fleet-Token"))
    } else if let Some(status) = inner.recovery_status {
        (status, error_body("emulated"))
    } else {
        match (key, put) {
            (None, _) => (
                400,
                error_body("peer_id, account_id and namespace_id are required"),
            ),
            (Some(key), true) => match (version, text("ciphertext")) {
                (Some(version), Some(ciphertext)) => {
                    let held = inner.recovery_envelopes.get(&key).map(|(v, _)| *v);
                    if held.is_some_and(|h| version <= h) {
                        (409, error_body("a newer or equal version is held"))
                    } else {
                        inner.recovery_envelopes.insert(key, (version, ciphertext));
                        (200, json!({ "status": "ok" }))
                    }
                }
                _ => (
                    400,
                    error_body("ciphertext and a positive version are required"),
                ),
            },
            (Some(key), false) => {
                inner.recovery_envelopes.remove(&key);
                (200, json!({ "status": "ok" }))
            }
        }
    };
    inner.recovery_calls.push(RecoveryCall {
        method: method.to_string(),
        body: kept,
        status,
    });
    drop(inner);
    json_response(status, answer)
}

/// `POST /api/fleet/inventory`: the token checked, then `{"peer_id": s, "namespaces": [..],
/// "full": bool}` required; 200 `{"status":"ok"}` or the status set.
fn inventory(shared: &Shared, headers: &HeaderMap, body: &Bytes) -> Answer {
    let at = Instant::now();
    let token = header(headers, TOKEN_HEADER);
    let parsed = json_object(headers, body);
    let kept = parsed.as_ref().ok().cloned();
    let full = kept
        .as_ref()
        .and_then(|m| m.get("full"))
        .and_then(Value::as_bool);
    let shape_ok = kept.as_ref().is_some_and(|m| {
        m.get("peer_id").is_some_and(Value::is_string)
            && m.get("namespaces").is_some_and(Value::is_array)
            && full.is_some()
    });
    let mut inner = lock(&shared.inner);
    let (status, answer) = if !authorised(&inner.token, &token) {
        (401, error_body("missing or wrong X-Fleet-Token"))
    } else if !shape_ok {
        (400, error_body("peer_id, namespaces and full are required"))
    } else if let Some(status) = inner.inventory_status {
        (status, error_body("emulated"))
    } else {
        (200, json!({ "status": "ok" }))
    };
    inner.inventories.push(InventoryPost {
        body: kept,
        full,
        status,
        at,
    });
    drop(inner);
    json_response(status, answer)
}

/// A request to any other path: recorded, then its scripted answer (404 without one).
async fn other(
    shared: &Shared,
    method: &Method,
    path: &str,
    headers: &HeaderMap,
    body: &Bytes,
) -> Answer {
    let token = header(headers, TOKEN_HEADER);
    let reply = {
        let mut inner = lock(&shared.inner);
        let reply = if !authorised(&inner.token, &token) {
            CallReply::Json(401, error_body("missing or wrong X-Fleet-Token"))
        } else {
            let found = inner.answers.get(path).cloned();
            found.unwrap_or_else(|| CallReply::Json(404, error_body("Not found")))
        };
        inner.requests.push(RequestRecord {
            method: method.to_string(),
            path: path.to_owned(),
            token,
            body: String::from_utf8_lossy(body).into_owned(),
            status: match &reply {
                CallReply::Json(status, _) => StatusCode::from_u16(*status)
                    .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
                    .as_u16(),
                CallReply::Hang => 0,
            },
            at: Instant::now(),
        });
        reply
    };
    match reply {
        CallReply::Json(status, body) => json_response(status, body),
        CallReply::Hang => std::future::pending().await,
    }
}

async fn should_join(shared: &Shared, headers: &HeaderMap, body: &Bytes) -> Answer {
    let at = Instant::now();
    let token = header(headers, TOKEN_HEADER);
    let parsed = json_object(headers, body);
    let peer_id = string_field(&parsed, "peer_id");
    let mrtd = string_field(&parsed, "mrtd");
    let held_namespaces = parsed
        .as_ref()
        .ok()
        .and_then(|map| map.get("held_namespaces"))
        .and_then(Value::as_array)
        .map(|ids| {
            ids.iter()
                .filter_map(Value::as_str)
                .map(str::to_owned)
                .collect()
        });
    let tls_cert_not_after = string_field(&parsed, "tls_cert_not_after");
    let logs_token_fp = string_field(&parsed, "logs_token_fp");
    let executor_account = string_field(&parsed, "executor_account");
    let relay_url = string_field(&parsed, "relay_url");
    let swarm_addrs = parsed
        .as_ref()
        .ok()
        .and_then(|map| map.get("swarm_addrs"))
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(Value::as_str)
                .map(str::to_owned)
                .collect()
        });
    let valid = check_fields(
        parsed,
        &["peer_id"],
        &[
            "mrtd",
            "tls_cert_not_after",
            "logs_token_fp",
            "executor_account",
            "relay_url",
        ],
    );

    let (answer, count) = {
        let mut inner = lock(&shared.inner);
        let answer = if !authorised(&inner.token, &token) {
            Planned::Json(401, error_body("missing or wrong X-Fleet-Token"))
        } else if let Err(message) = valid {
            Planned::Json(400, error_body(&message.0))
        } else {
            let reply = match inner.queue.pop_front() {
                Some(reply) => reply,
                None => inner.standing.clone(),
            };
            match reply {
                PollReply::Assign {
                    assignments,
                    retain,
                } => {
                    let mut body = assign_body(&assignments, &retain, &inner.admitter_addrs);
                    for (key, value) in &inner.deliveries {
                        body[key] = value.clone();
                    }
                    Planned::Json(200, body)
                }
                PollReply::Status(status) => {
                    // Record the status actually sent (an impossible one becomes 500).
                    let sent = StatusCode::from_u16(status)
                        .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
                        .as_u16();
                    Planned::Json(sent, error_body("emulated"))
                }
                PollReply::RawBody(body) => Planned::Raw(body),
                PollReply::Hang => Planned::Hang,
            }
        };
        inner.polls.push(PollRecord {
            peer_id,
            mrtd,
            token,
            held_namespaces,
            tls_cert_not_after,
            logs_token_fp,
            executor_account,
            swarm_addrs,
            relay_url,
            status: answer.status(),
            at,
        });
        (answer, inner.polls.len())
    };
    shared.poll_count.send_replace(count);

    match answer {
        Planned::Json(status, body) => json_response(status, body),
        Planned::Raw(body) => raw_json_response(200, body),
        Planned::Hang => std::future::pending().await,
    }
}

fn confirm(shared: &Shared, headers: &HeaderMap, body: &Bytes) -> Answer {
    let at = Instant::now();
    let token = header(headers, TOKEN_HEADER);
    let parsed = json_object(headers, body);
    let peer_id = string_field(&parsed, "peer_id");
    let group_id = string_field(&parsed, "group_id");
    let field = |name: &str| parsed.as_ref().ok().and_then(|map| map.get(name)).cloned();
    let tee_role = field("tee_role").map(|v| v.as_str().map(str::to_owned));
    let authorship_ready = field("authorship_ready").and_then(|v| v.as_bool());
    let valid = check_fields(parsed, &["peer_id", "group_id"], &[]);

    let mut inner = lock(&shared.inner);
    let (status, body) = if !authorised(&inner.token, &token) {
        (401, error_body("missing or wrong X-Fleet-Token"))
    } else if let Err(message) = valid {
        (400, error_body(&message.0))
    } else {
        let key = group_id.as_deref().unwrap_or_default().to_ascii_lowercase();
        match inner.confirm_failures.get_mut(&key) {
            Some(left) if *left > 0 => {
                *left -= 1;
                (503, error_body("emulated"))
            }
            _ => (200, json!({})),
        }
    };
    inner.confirms.push(ConfirmRecord {
        peer_id,
        group_id,
        tee_role,
        authorship_ready,
        token,
        status,
        at,
    });
    drop(inner);
    json_response(status, body)
}

/// The admitting node's PeerId in [`fleet_answer`]'s addresses (any well-formed one).
const ADMITTER_PEER_ID: &str = "12D3KooWJ6X2tBZEd8qKWvJyhtH2v2XyP4eQ9dcU2xZ8Y6YrjcVk";

fn challenge(shared: &Shared) -> Answer {
    let mut inner = lock(&shared.inner);
    // Unique per emulator run and call; no randomness needed (and the `testing` fakes take
    // none of the daemon's dependencies, fastrand among them).
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let challenge = format!(
        "emulated-challenge-{}-{nanos:08x}",
        inner.challenges.len() + 1,
    );
    inner.challenges.push(challenge.clone());
    let scripted = inner.challenge_expiry.clone();
    drop(inner);
    let expires_at_ms = scripted.unwrap_or_else(|| {
        json!(std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64 + 300_000))
    });
    json_response(
        200,
        json!({ "challenge": challenge, "expires_at_ms": expires_at_ms }),
    )
}

fn register(shared: &Shared, headers: &HeaderMap, body: &Bytes) -> Answer {
    let at = Instant::now();
    let parsed = json_object(headers, body);
    let kept = parsed.as_ref().ok().cloned();
    let challenge = string_field(&parsed, "challenge");
    let binding = parsed
        .as_ref()
        .ok()
        .and_then(|m| m.get("quote_binding").cloned());
    let valid = check_fields(
        parsed,
        &[
            "peer_id",
            "executor_account",
            "relay_url",
            "challenge",
            "quote",
            "enrolment_token",
        ],
        &["csr"],
    );
    let mut inner = lock(&shared.inner);
    let (status, body) = if let Err(message) = valid {
        (400, error_body(&message.0))
    } else if binding.is_some_and(|b| b != json!("registration")) {
        (
            400,
            error_body("quote_binding must be \"registration\" when sent"),
        )
    } else if !challenge.is_some_and(|c| inner.challenges.contains(&c)) {
        (403, error_body("unknown challenge"))
    } else {
        let reply = match inner.register_queue.pop_front() {
            Some(r) => r,
            None => inner.register_standing.clone(),
        };
        match reply {
            RegisterReply::Issue(token) => {
                inner.token = Some(token.clone());
                (200, json!({ "status": "registered", "fleet_token": token }))
            }
            RegisterReply::Tokenless => (200, json!({ "status": "registered" })),
            RegisterReply::Status(status) => (
                StatusCode::from_u16(status)
                    .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
                    .as_u16(),
                error_body("emulated"),
            ),
        }
    };
    inner.registrations.push(RegisterRecord {
        body: kept,
        status,
        at,
    });
    drop(inner);
    json_response(status, body)
}

fn join_status(shared: &Shared, headers: &HeaderMap, body: &Bytes) -> Answer {
    let at = Instant::now();
    let token = header(headers, TOKEN_HEADER);
    let parsed = json_object(headers, body);
    let mut inner = lock(&shared.inner);
    let (status, answer) = if !inner.join_status_route {
        (404, error_body("Not found"))
    } else if !authorised(&inner.token, &token) {
        (401, error_body("missing or wrong X-Fleet-Token"))
    } else if let Err(message) = &parsed {
        (400, error_body(&message.0))
    } else {
        (200, json!({ "status": "recorded" }))
    };
    inner.join_statuses.push(JoinStatusRecord {
        body: parsed.map_or(Value::Null, Value::Object),
        status,
        at,
    });
    drop(inner);
    json_response(status, answer)
}

#[cfg(test)]
mod tests {
    use super::*;
    use hyper::header::CONTENT_TYPE;

    const A: &str = "38069a4cc4285c4245c84587ac60084ba53502a8b91c9b108bca40f10ec4d3df";
    const B: &str = "abababababababababababababababababababababababababababababababab";
    const PEER: &str = "12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN";

    use crate::testing::test_client as client;

    fn endpoint(emu: &MdmaEmulator, path: &str) -> Url {
        emu.url().join(path).unwrap()
    }

    async fn poll(emu: &MdmaEmulator, token: Option<&str>) -> reqwest::Response {
        let mut request = client()
            .post(endpoint(emu, "api/fleet/should-join"))
            .json(&json!({ "peer_id": PEER, "mrtd": "0".repeat(96) }));
        if let Some(token) = token {
            request = request.header("X-Fleet-Token", token);
        }
        request.send().await.unwrap()
    }

    async fn poll_json(emu: &MdmaEmulator) -> (u16, Value) {
        let response = poll(emu, None).await;
        let status = response.status().as_u16();
        (status, response.json().await.unwrap())
    }

    async fn confirm_status(emu: &MdmaEmulator, group_id: &str) -> u16 {
        client()
            .post(endpoint(emu, "api/fleet/confirm"))
            .json(&json!({ "peer_id": PEER, "group_id": group_id }))
            .send()
            .await
            .unwrap()
            .status()
            .as_u16()
    }

    #[tokio::test]
    async fn token_is_required_when_configured() {
        let emu = MdmaEmulator::start(Some("s3cret".into())).await.unwrap();
        assert_eq!(poll(&emu, None).await.status(), 401);
        assert_eq!(poll(&emu, Some("wrong")).await.status(), 401);
        assert_eq!(poll(&emu, Some("s3cret")).await.status(), 200);
        let confirm = client()
            .post(endpoint(&emu, "api/fleet/confirm"))
            .json(&json!({ "peer_id": PEER, "group_id": A }))
            .send()
            .await
            .unwrap();
        assert_eq!(confirm.status(), 401);
        assert!(emu.confirmed().is_empty());

        let polls = emu.polls();
        let seen: Vec<(Option<&str>, u16)> = polls
            .iter()
            .map(|p| (p.token.as_deref(), p.status))
            .collect();
        assert_eq!(
            seen,
            vec![(None, 401), (Some("wrong"), 401), (Some("s3cret"), 200)]
        );
        assert_eq!(polls[2].peer_id.as_deref(), Some(PEER));
        assert_eq!(polls[2].mrtd.as_deref(), Some("0".repeat(96).as_str()));
    }

    #[tokio::test]
    async fn token_header_is_ignored_without_a_token() {
        let emu = MdmaEmulator::start(None).await.unwrap();
        assert_eq!(poll(&emu, Some("anything")).await.status(), 200);
        assert_eq!(poll(&emu, None).await.status(), 200);
        let polls = emu.polls();
        assert_eq!(polls[0].token.as_deref(), Some("anything"));
        assert_eq!(polls[1].token, None);
    }

    #[tokio::test]
    async fn default_reply_is_no_assignments() {
        let emu = MdmaEmulator::start(None).await.unwrap();
        let (status, body) = poll_json(&emu).await;
        assert_eq!(status, 200);
        assert_eq!(body, json!({ "assignments": [] }));
    }

    #[tokio::test]
    async fn queued_replies_come_first_then_the_standing_one() {
        let emu = MdmaEmulator::start(None).await.unwrap();
        emu.set_reply(PollReply::assign_retain([A], [B]));
        emu.queue_replies([PollReply::Status(500), PollReply::assign([B])]);

        let (status, body) = poll_json(&emu).await;
        assert_eq!((status, body), (500, json!({ "error": "emulated" })));
        let (status, body) = poll_json(&emu).await;
        assert_eq!(status, 200);
        assert_eq!(
            body,
            json!({ "assignments": [{ "group_id": B, "admitter_addrs": [] }] })
        );
        for _ in 0..2 {
            let (status, body) = poll_json(&emu).await;
            assert_eq!(status, 200);
            assert_eq!(
                body,
                json!({
                    "assignments": [{ "group_id": A, "admitter_addrs": [] }],
                    "retain": [B],
                })
            );
        }
        let statuses: Vec<u16> = emu.polls().iter().map(|p| p.status).collect();
        assert_eq!(statuses, vec![500, 200, 200, 200]);
    }

    #[tokio::test]
    async fn raw_body_is_served_verbatim() {
        let emu = MdmaEmulator::start(None).await.unwrap();
        emu.set_reply(PollReply::RawBody("<html>not json".into()));
        let response = poll(&emu, None).await;
        assert_eq!(response.status(), 200);
        assert_eq!(
            response.headers()[CONTENT_TYPE].to_str().unwrap(),
            "application/json"
        );
        assert_eq!(response.text().await.unwrap(), "<html>not json");
    }

    #[tokio::test]
    async fn status_reply_is_served() {
        let emu = MdmaEmulator::start(None).await.unwrap();
        emu.queue_replies([PollReply::Status(204), PollReply::Status(302)]);
        assert_eq!(poll(&emu, None).await.status(), 204);
        let no_redirects = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .unwrap();
        let response = no_redirects
            .post(endpoint(&emu, "api/fleet/should-join"))
            .json(&json!({ "peer_id": PEER }))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 302);
    }

    #[tokio::test]
    async fn hang_does_not_block_other_requests() {
        let emu = MdmaEmulator::start(None).await.unwrap();
        emu.queue_replies([PollReply::Hang]);
        emu.set_reply(PollReply::assign([A]));

        let hanging = {
            let url = endpoint(&emu, "api/fleet/should-join");
            tokio::spawn(async move {
                reqwest::Client::builder()
                    .timeout(Duration::from_millis(500))
                    .build()
                    .unwrap()
                    .post(url)
                    .json(&json!({ "peer_id": PEER }))
                    .send()
                    .await
            })
        };
        assert!(emu.wait_for_polls(1, Duration::from_secs(5)).await);

        let (status, body) = poll_json(&emu).await;
        assert_eq!(status, 200);
        assert_eq!(body["assignments"][0]["group_id"], A);

        let err = hanging.await.unwrap().unwrap_err();
        assert!(err.is_timeout(), "{err}");
        let statuses: Vec<u16> = emu.polls().iter().map(|p| p.status).collect();
        assert_eq!(statuses, vec![0, 200]);
    }

    #[tokio::test]
    async fn wait_for_polls_times_out() {
        let emu = MdmaEmulator::start(None).await.unwrap();
        assert!(!emu.wait_for_polls(1, Duration::from_millis(50)).await);
        assert!(emu.wait_for_polls(0, Duration::from_millis(50)).await);
        poll(&emu, None).await;
        assert!(emu.wait_for_polls(1, Duration::from_millis(50)).await);
    }

    #[tokio::test]
    async fn confirm_failures_are_counted_down() {
        let emu = MdmaEmulator::start(None).await.unwrap();
        emu.fail_next_confirms(&A.to_uppercase(), 2);
        assert_eq!(confirm_status(&emu, A).await, 503);
        assert!(emu.confirmed().is_empty());
        assert_eq!(confirm_status(&emu, A).await, 503);
        assert_eq!(confirm_status(&emu, B).await, 200);
        assert_eq!(confirm_status(&emu, A).await, 200);
        assert_eq!(confirm_status(&emu, A).await, 200);

        let body: Value = client()
            .post(endpoint(&emu, "api/fleet/confirm"))
            .json(&json!({ "peer_id": PEER, "group_id": A }))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(body, json!({}));

        assert_eq!(
            emu.confirmed(),
            BTreeSet::from([A.to_owned(), B.to_owned()])
        );
        let confirms = emu.confirms();
        let statuses: Vec<u16> = confirms.iter().map(|c| c.status).collect();
        assert_eq!(statuses, vec![503, 503, 200, 200, 200, 200]);
        assert_eq!(confirms[0].peer_id.as_deref(), Some(PEER));
        assert_eq!(confirms[0].group_id.as_deref(), Some(A));
    }

    #[tokio::test]
    async fn malformed_requests_answer_400_and_are_recorded() {
        let emu = MdmaEmulator::start(None).await.unwrap();
        emu.queue_replies([PollReply::Status(500)]);
        let url = endpoint(&emu, "api/fleet/should-join");
        let bodies: Vec<(Option<&str>, String)> = vec![
            (None, json!({ "peer_id": PEER }).to_string()),
            (Some("text/plain"), json!({ "peer_id": PEER }).to_string()),
            (Some("application/json"), "not json".into()),
            (Some("application/json"), "[1,2]".into()),
            (Some("application/json"), "{}".into()),
            (
                Some("application/json"),
                json!({ "peer_id": 7 }).to_string(),
            ),
            (
                Some("application/json"),
                json!({ "peer_id": PEER, "mrtd": null }).to_string(),
            ),
        ];
        for (content_type, body) in &bodies {
            let mut request = client().post(url.clone()).body(body.clone());
            if let Some(content_type) = content_type {
                request = request.header(CONTENT_TYPE, *content_type);
            }
            let response = request.send().await.unwrap();
            assert_eq!(response.status(), 400, "{content_type:?} {body}");
            let body: Value = response.json().await.unwrap();
            assert!(body["error"].is_string());
        }
        let polls = emu.polls();
        assert_eq!(polls.len(), bodies.len());
        assert!(polls.iter().all(|p| p.status == 400));
        assert_eq!(polls[0].peer_id, None);
        assert_eq!(polls[6].peer_id.as_deref(), Some(PEER));
        // The queued reply was not used up by the refused requests.
        assert_eq!(poll(&emu, None).await.status(), 500);

        let response = client()
            .post(endpoint(&emu, "api/fleet/confirm"))
            .json(&json!({ "peer_id": PEER }))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 400);
        assert_eq!(emu.confirms()[0].status, 400);
        assert!(emu.confirmed().is_empty());
    }

    #[tokio::test]
    async fn unknown_route_is_404_and_shutdown_stops_the_server() {
        let emu = MdmaEmulator::start(None).await.unwrap();
        let response = client()
            .get(endpoint(&emu, "api/fleet/nope"))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 404);
        let addr = emu.addr();
        let clone = emu.clone();
        emu.shutdown();
        drop(emu);
        let mut refused = false;
        for _ in 0..100 {
            if tokio::net::TcpStream::connect(addr).await.is_err() {
                refused = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(refused);
        // The state stays readable after shutdown.
        assert!(clone.polls().is_empty());
    }
}
