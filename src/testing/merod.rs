//! Emulator of the admin API of merod 0.11.0-rc.25, built from the answers recorded from a real
//! node in `fixtures/merod/` (see `docs/merod-admin.md`).
//!
//! Test double for the demo and the integration tests, not production code.
//!
//! Routes (all under `/admin-api`):
//! - `GET /health`, `GET /ready` (503 `starting` while not ready), `GET /peers` (503 while not
//!   ready);
//! - `POST /tee/fleet-join` `{"groupId": "<64 hex>", "admitterAddrs": [..]}` — validated like
//!   merod (content type, camelCase field, id length, hex; `admitterAddrs` refused with a 400
//!   naming it while [`MerodEmulator::set_older_core`] is on, as an older core would), then
//!   the namespace's [`JoinBehaviour`];
//! - `POST /namespaces/{id}/leave` — then the namespace's [`LeaveBehaviour`];
//! - `GET /namespaces/{id}` (200 member / 404 `No namespace identity found`),
//!   `GET /namespaces` (`?offset=&limit=`, default 0/100) listing the held namespaces page
//!   by page, then the [`ListBehaviour`];
//! - `GET /identity`: 404 "holds neither a device nor an account root yet" until the node
//!   first takes part in a namespace (an admission, [`MerodEmulator::hold`] or
//!   [`MerodEmulator::set_minted`]), then the recorded account (rc.25's: its `publicKey` in
//!   base58), its `publicKey` replaced by what [`MerodEmulator::set_public_key`] gave (a
//!   newer core's 64 hex, or anything);
//! - `GET /network/status`: flat `{"localPeerId", "listenAddrs", "externalAddrs", …}`, the
//!   sandbox's PeerId and [`MerodEmulator::set_external_addrs`] (none by default);
//! - `POST /tee/attest` `{"nonce": "<64 hex>"}`: 200 `{"data":{"quoteB64": …, "quote": {…}}}`,
//!   a mock quote (`quote` is the recorded parsed quote, its report data the nonce and 32 zero
//!   bytes); a bad nonce 400 worded as merod words it;
//!   `POST /tee/registration-attest` the same, but only with
//!   [`MerodEmulator::set_registration_attest`] (rc.25 predates it: 404, like any unknown route);
//! - `GET /groups/{id}/members` (`?offset=&limit=`): the recorded member list (an `Admin` and
//!   this node, with the account fleet-join answers, as `ReadOnlyTee` or the role
//!   [`MerodEmulator::set_role`] gives it; after [`MerodEmulator::set_extra_members`] more
//!   rows) while held, else 500;
//! - the context inventory's routes, answered in the recorded shapes:
//!   `GET /groups/{id}/subgroups` (what [`MerodEmulator::set_subgroups`] gave, else none),
//!   `GET /groups/{id}/contexts` (`?offset=&limit=`, at most 1,000 rows a page; what
//!   [`MerodEmulator::set_contexts`] gave, else none) for a group of a held namespace's tree,
//!   else 500 as for a namespace not joined; `GET /groups/{id}/members/{account}/capabilities`
//!   (the recorded 4, or what [`MerodEmulator::set_capabilities`] gave; `None`: 500) for such
//!   a group; `GET /usage` (a row per held namespace: zero bytes, or
//!   [`MerodEmulator::set_usage_total`]'s, and the counts of its tree as the routes above
//!   answer it: contexts and subgroups of the whole tree, the namespace's own members; 500
//!   with [`MerodEmulator::set_usage_failing`]);
//!   [`MerodEmulator::set_ignores_offset`] makes the paged lists answer the first page for
//!   any offset, as a server ignoring `offset` would; [`MerodEmulator::set_page_cap`] makes
//!   them serve fewer rows a page than asked;
//! - the recovery envelopes' routes: `GET /groups/{id}/member-devices` (`?offset=&limit=`;
//!   what [`MerodEmulator::set_member_devices`] gave, else the recorded row of the node's own
//!   account) for a group of a held namespace's tree, else 500; `POST
//!   /groups/{id}/accounts/{account}/seal` `{"plaintext": "<hex>"}`: 404 with no body, as
//!   rc.25 answers (the route shipped in rc.34), until [`MerodEmulator::set_seal_route`]; then
//!   200 `{"data": {"accountRootEpoch", "ephemeralPublicKey", "nonce", "ciphertext"}}` with a
//!   fresh key and nonce each call (as real sealing), merod's 404 for an account
//!   [`MerodEmulator::set_seal_refused`] names; [`MerodEmulator::sealed`] keeps each sealed
//!   plaintext. [`MerodEmulator::set_group_members`] gives any group of the tree its own
//!   member list;
//! - `POST /tee/fleet-join` naming `admitterAddrs` on an older core
//!   ([`MerodEmulator::set_older_core`]): 400 naming the field;
//! - [`MerodEmulator::set_foreign_404`] makes `GET /namespaces/{id}` answer a 404 that is not
//!   merod's word on a namespace (as a proxy or a renamed route would);
//! - [`MerodEmulator::set_membership_lag`] makes it answer merod's own 404 `No namespace
//!   identity found` for a namespace it holds and lists (a membership answer lagging an
//!   admission);
//! - a known route with another method: 405, an unknown route: 404, both with an empty body
//!   and no content type, as merod answers them.
//!
//! Ids are compared case-insensitively, stored and answered lowercase. The effect of a join or a
//! leave (the namespace becoming held / no longer held) happens after its delay even if the
//! client gave up waiting, as on a real node. Delays use `tokio::time::sleep`.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hyper::body::Bytes;
use hyper::{HeaderMap, Method, StatusCode, Uri};
use serde::Deserialize;
use serde_json::{json, Value};
use url::Url;

use super::{
    content_type, is_json_content_type, json_response, lock, serve, Answer, BadRequest, Received,
    ServerHandle,
};

/// How `POST /admin-api/tee/fleet-join` behaves for a well-formed request.
#[derive(Clone, Debug, PartialEq)]
pub enum JoinBehaviour {
    /// After `delay`, answer the fleet-join-admitted fixture (ids substituted); the namespace
    /// becomes held.
    Admit {
        /// How long the call takes.
        delay: Duration,
    },
    /// The first `refusals` calls answer like fleet-join-unknown-namespace (status "announced",
    /// admitted:false) after `delay`; later calls behave as Admit.
    RefuseThenAdmit {
        /// How many calls (per namespace) are refused first.
        refusals: u32,
        /// How long each call takes.
        delay: Duration,
    },
    /// Never answers.
    Hang,
    /// Answer this status with `{"error": message}`; e.g. 500 "Failed to generate attestation".
    Error {
        /// The HTTP status.
        status: u16,
        /// The `error` text.
        message: String,
    },
    /// Answers admitted:true (like Admit) but the namespace is NOT held afterwards (seen on a
    /// live node after leave + re-join).
    AdmitWithoutHolding {
        /// How long the call takes.
        delay: Duration,
    },
    /// Answers admitted:false with these `(peer, reason)` refusals, flat (`refusals` beside
    /// `admitted`) or, with `under_data`, the whole answer wrapped in `{"data": …}`.
    Refuse {
        /// The refusals, in order.
        refusals: Vec<(String, String)>,
        /// Wrap the answer in `data`.
        under_data: bool,
    },
}

impl Default for JoinBehaviour {
    fn default() -> Self {
        JoinBehaviour::Admit {
            delay: Duration::ZERO,
        }
    }
}

/// How `POST /admin-api/namespaces/{id}/leave` behaves for a well-formed id.
#[derive(Clone, Debug, PartialEq)]
pub enum LeaveBehaviour {
    /// The recorded behaviour: held → after `delay` 200 with the namespace-leave-member body and
    /// no longer held; not held → at once 500 `{"error":"Internal server error"}`.
    Normal {
        /// How long a leave of a held namespace takes.
        delay: Duration,
    },
    /// Never answers (the namespace stays held).
    Hang,
    /// Answer this status with `{"error": ...}` ("Internal server error" for 500, else the
    /// status's reason phrase); the namespace stays held.
    Error {
        /// The HTTP status.
        status: u16,
    },
}

impl Default for LeaveBehaviour {
    fn default() -> Self {
        LeaveBehaviour::Normal {
            delay: Duration::ZERO,
        }
    }
}

/// How `GET /admin-api/namespaces` (the listing) behaves.
#[derive(Clone, Debug, Default, PartialEq)]
pub enum ListBehaviour {
    /// The recorded shape, `{"data": [<entry>, ...]}`, one page of the held namespaces per
    /// `offset`/`limit`.
    #[default]
    Normal,
    /// Never answers.
    Hang,
    /// Answer this status with `{"error": "Internal server error"}` (or the status's reason
    /// phrase).
    Error {
        /// The HTTP status.
        status: u16,
    },
    /// 200 with exactly this body (for wrong-shape tests).
    RawBody(String),
    /// The first `pages` listing requests after [`MerodEmulator::set_list`] answer as
    /// [`ListBehaviour::Normal`]; every later one answers `status` as
    /// [`ListBehaviour::Error`] does. `ErrorAfterPages { pages: 1, status: 500 }` fails the
    /// second page of a listing longer than one page (a failure in the middle of a walk).
    ErrorAfterPages {
        /// Listing requests answered normally first.
        pages: usize,
        /// The HTTP status of every later one.
        status: u16,
    },
    /// As [`ListBehaviour::Normal`], but every page starts at offset 0 (a server that
    /// ignores `offset`).
    IgnoresOffset,
    /// As [`ListBehaviour::Normal`], and once the first listing request is answered, this
    /// namespace is no longer held (left between two pages of one listing).
    LeftAfterFirstPage(String),
}

/// One request as received by the emulator.
#[derive(Clone, Debug)]
pub struct CallRecord {
    /// The HTTP method.
    pub method: String,
    /// The path without the query string.
    pub path: String,
    /// The `Content-Type` header, if any.
    pub content_type: Option<String>,
    /// The body as text (lossy UTF-8).
    pub body: String,
    /// What was answered; 0 while pending, for a hung request, or when the client gave up
    /// before the answer.
    pub status: u16,
    /// When the request arrived.
    pub at: Instant,
}

/// One recorded answer: its status and JSON body.
#[derive(Clone, Debug)]
struct Recorded {
    status: u16,
    body: Value,
}

impl Recorded {
    fn load(name: &str, raw: &str) -> Self {
        let file: Value = serde_json::from_str(raw)
            .unwrap_or_else(|err| panic!("fixture {name} is not valid JSON: {err}"));
        let response = &file["response"];
        let status = response["status"]
            .as_u64()
            .and_then(|status| u16::try_from(status).ok())
            .unwrap_or_else(|| panic!("fixture {name} has no numeric response.status"));
        let body = response
            .get("body")
            .cloned()
            .unwrap_or_else(|| panic!("fixture {name} has no response.body"));
        Recorded { status, body }
    }

    fn respond(&self) -> Answer {
        json_response(self.status, self.body.clone())
    }

    /// This answer with `body[pointer...]` string fields set to `id`.
    fn with_id(&self, pointers: &[&str], id: &str) -> Answer {
        let mut body = self.body.clone();
        for pointer in pointers {
            let field = body
                .pointer_mut(pointer)
                .unwrap_or_else(|| panic!("recorded body has no {pointer}"));
            *field = Value::String(id.to_owned());
        }
        json_response(self.status, body)
    }
}

macro_rules! fixture {
    ($name:literal) => {
        Recorded::load(
            $name,
            include_str!(concat!("../../fixtures/merod/", $name, ".json")),
        )
    };
}

/// The recorded answers the emulator is built from, parsed once at start.
struct Fixtures {
    health: Recorded,
    ready: Recorded,
    peers: Recorded,
    join_admitted: Recorded,
    join_unknown: Recorded,
    join_no_content_type: Recorded,
    join_snake_case: Recorded,
    join_short_id: Recorded,
    join_non_hex: Recorded,
    get_member: Recorded,
    get_never_joined: Recorded,
    leave_member: Recorded,
    leave_again: Recorded,
    leave_bad_id: Recorded,
    /// `POST /tee/attest`: `data.quoteB64` and the parsed `data.quote`.
    attest: Recorded,
    /// `POST /tee/attest` with a short nonce (400).
    attest_short_nonce: Recorded,
    /// `GET /groups/{id}/members` of a namespace held, this node's row carrying `account`.
    members: Recorded,
    /// `GET /groups/{id}/members` of a namespace not held.
    members_not_held: Recorded,
    /// `GET /groups/{id}/subgroups` of a namespace held (none).
    subgroups: Recorded,
    /// `GET /groups/{id}/contexts` of a namespace held (none).
    contexts: Recorded,
    /// `GET /groups/{id}/contexts` of a namespace not held (500).
    contexts_not_held: Recorded,
    /// `GET /groups/{id}/members/{account}/capabilities` of the node in a namespace held.
    capabilities: Recorded,
    /// `GET /usage` holding one namespace: its row.
    usage: Recorded,
    /// `GET /groups/{id}/member-devices` of a namespace held: the node's own account.
    member_devices: Recorded,
    identity_before: Recorded,
    identity_after: Recorded,
    /// One entry of `GET /admin-api/namespaces`.
    list_entry: Value,
}

impl Fixtures {
    fn load() -> Self {
        let list = fixture!("namespaces-list-member");
        let list_entry = list.body["data"][0].clone();
        assert!(
            list_entry.is_object(),
            "fixture namespaces-list-member has no data[0] object"
        );
        let join_admitted = fixture!("fleet-join-admitted");
        let fixtures = Fixtures {
            health: fixture!("health"),
            ready: fixture!("ready"),
            peers: fixture!("peers"),
            join_admitted: join_admitted.clone(),
            join_unknown: fixture!("fleet-join-unknown-namespace"),
            join_no_content_type: fixture!("fleet-join-no-content-type"),
            join_snake_case: fixture!("fleet-join-snake-case-body"),
            join_short_id: fixture!("fleet-join-short-id"),
            join_non_hex: fixture!("fleet-join-non-hex-id"),
            get_member: fixture!("namespace-get-member"),
            get_never_joined: fixture!("namespace-get-never-joined"),
            leave_member: fixture!("namespace-leave-member"),
            leave_again: fixture!("namespace-leave-again"),
            leave_bad_id: fixture!("namespace-leave-bad-id"),
            attest: fixture!("attest"),
            attest_short_nonce: fixture!("attest-short-nonce"),
            members: own_member_row(fixture!("group-members-member"), &join_admitted),
            members_not_held: fixture!("group-members-never-joined"),
            subgroups: fixture!("group-subgroups-member"),
            contexts: fixture!("group-contexts-member"),
            contexts_not_held: fixture!("group-contexts-never-joined"),
            capabilities: fixture!("group-capabilities-member"),
            usage: fixture!("usage-member"),
            member_devices: fixture!("group-member-devices-member"),
            identity_before: fixture!("identity-before-join"),
            identity_after: fixture!("identity-after-join"),
            list_entry,
        };
        // Fail at start, not in a request, if a body lacks a field the emulator substitutes.
        for (recorded, pointers) in [
            (&fixtures.join_admitted, JOIN_ID_FIELDS),
            (&fixtures.join_unknown, JOIN_ID_FIELDS),
            (&fixtures.get_member, DATA_NAMESPACE_ID),
            (&fixtures.leave_member, DATA_NAMESPACE_ID),
            (&fixtures.attest, ATTEST_FIELDS),
        ] {
            for pointer in pointers {
                assert!(
                    recorded.body.pointer(pointer).is_some(),
                    "recorded body lacks {pointer}"
                );
            }
        }
        assert!(fixtures.list_entry.get("namespaceId").is_some());
        assert!(
            fixtures.account().is_some(),
            "identity-after-join has no accountId"
        );
        assert!(
            fixtures.members.body["members"][0]["identity"].is_string(),
            "group-members-member has no members[0].identity"
        );
        fixtures
    }

    /// The node's account in the recorded identity.
    fn account(&self) -> Option<&str> {
        self.identity_after
            .body
            .pointer("/data/accountId")?
            .as_str()
    }
}

/// The recorded member list with this node's row (`ReadOnlyTee`) naming the `account` of
/// the recorded admission, so the emulator's answers agree with each other.
fn own_member_row(mut members: Recorded, join_admitted: &Recorded) -> Recorded {
    let account = join_admitted.body["account"].clone();
    assert!(
        account.is_string(),
        "fixture fleet-join-admitted has no account"
    );
    let rows = members.body["members"]
        .as_array_mut()
        .expect("fixture group-members-member has a members array");
    let own = rows
        .iter_mut()
        .find(|row| row["role"] == "ReadOnlyTee")
        .expect("fixture group-members-member lists this node as ReadOnlyTee");
    own["identity"] = account;
    members
}

const JOIN_ID_FIELDS: &[&str] = &["/group_id", "/namespace_id"];
const DATA_NAMESPACE_ID: &[&str] = &["/data/namespaceId"];
const ATTEST_FIELDS: &[&str] = &["/data/quoteB64", "/data/quote/body/reportdata"];

struct Inner {
    default_join: JoinBehaviour,
    join: HashMap<String, JoinBehaviour>,
    default_leave: LeaveBehaviour,
    leave: HashMap<String, LeaveBehaviour>,
    list: ListBehaviour,
    /// Listing requests answered since the last [`MerodEmulator::set_list`].
    listed: usize,
    /// Refusals already served under `RefuseThenAdmit`, per namespace.
    refused: HashMap<String, u32>,
    ready: bool,
    held: BTreeSet<String>,
    calls: Vec<CallRecord>,
    join_counts: HashMap<String, usize>,
    leave_counts: HashMap<String, usize>,
    /// Whether the device and account exist (minted on first taking part in a namespace).
    minted: bool,
    /// `externalAddrs` of `GET /network/status`.
    external_addrs: Vec<String>,
    /// Whether `registration-attest` exists (newer than rc.25).
    registration_attest: bool,
    /// An error status `attest` and `registration-attest` answer, when set.
    attest_error: Option<u16>,
    /// An older core: `admitterAddrs` is refused with a 400 naming it.
    older_core: bool,
    /// The node's role per namespace (default `ReadOnlyTee`).
    roles: HashMap<String, String>,
    /// Member rows listed before the owner and the node.
    extra_members: usize,
    /// Namespaces for which `GET /namespaces/{id}` answers a 404 that is not merod's own.
    foreign_404: BTreeSet<String>,
    /// Namespaces for which `GET /namespaces/{id}` answers merod's own "not held" 404
    /// whether held or not.
    membership_lag: BTreeSet<String>,
    /// Each group's direct subgroups.
    subgroups: HashMap<String, Vec<String>>,
    /// Each group's contexts.
    contexts: HashMap<String, Vec<String>>,
    /// The node's capability bits per group (`None`: refused); default the recorded 4.
    capabilities: HashMap<String, Option<u32>>,
    /// `bytes.total` per namespace in `GET /usage` (default 0).
    usage_total: HashMap<String, u64>,
    /// `GET /usage` answers 500.
    usage_failing: bool,
    /// The paged group lists answer their first page whatever the offset.
    ignores_offset: bool,
    /// Most rows a page of a group list holds, whatever `limit` asked.
    page_cap: Option<usize>,
    /// How long the inventory's routes (usage, subgroups, contexts, capabilities) wait
    /// before answering.
    inventory_delay: Duration,
    /// Requests per route kind (`subgroups`, `contexts`, `members`, `capabilities`, `usage`,
    /// `member-devices`, `seal`).
    inventory_calls: HashMap<&'static str, usize>,
    /// Member lists (account, role) of groups, in place of the recorded one.
    group_members: HashMap<String, Vec<(String, String)>>,
    /// `member-devices` rows of groups: each account and its (device id, signing key)s.
    member_devices: HashMap<String, Vec<AccountDevices>>,
    /// The seal route exists (a core from rc.34 on).
    seal_route: bool,
    /// Accounts sealing to which answers merod's 404 (no root key on record).
    seal_refused: BTreeSet<String>,
    /// Each plaintext sealed: (group, account, plaintext as UTF-8).
    sealed: Vec<(String, String, String)>,
    /// `publicKey` of the identity answer, in place of the recorded one.
    public_key: Option<String>,
}

/// An account and its `(deviceId, signingKey)`s, as `member-devices` lists them.
type AccountDevices = (String, Vec<(String, String)>);

/// The account id of the recorded `identity-after-join` answer.
pub const ACCOUNT_ID: &str = "b2541b60308ddf07a2d1aa7506fdb93d44f8fadb430870620438846ae5c6c845";

/// The mock quote the emulator answers for `nonce`: `MOCKQUOTE` then the nonce, as base64
/// text (what merod's mock-attestation mode makes is a quote over the same report data).
pub fn mock_quote(nonce: &str) -> String {
    format!("TU9DS1FVT1RF{nonce}")
}

struct Shared {
    inner: Mutex<Inner>,
    fixtures: Fixtures,
}

/// The merod admin API emulator. Clones share the same state and server; the server stops when
/// [`MerodEmulator::shutdown`] is called or the last clone is dropped.
#[derive(Clone)]
pub struct MerodEmulator {
    shared: Arc<Shared>,
    server: Arc<ServerHandle>,
    /// The further addresses of [`MerodEmulator::listen_also`].
    extra: Arc<Mutex<Vec<ServerHandle>>>,
}

impl std::fmt::Debug for MerodEmulator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MerodEmulator")
            .field("addr", &self.server.addr())
            .finish_non_exhaustive()
    }
}

impl MerodEmulator {
    /// Starts the emulator on `127.0.0.1:0`: ready, holding nothing, joins admitted and leaves
    /// done at once.
    pub async fn start() -> Result<Self, std::io::Error> {
        let shared = Arc::new(Shared {
            inner: Mutex::new(Inner {
                default_join: JoinBehaviour::default(),
                join: HashMap::new(),
                default_leave: LeaveBehaviour::default(),
                leave: HashMap::new(),
                list: ListBehaviour::default(),
                listed: 0,
                refused: HashMap::new(),
                ready: true,
                held: BTreeSet::new(),
                calls: Vec::new(),
                join_counts: HashMap::new(),
                leave_counts: HashMap::new(),
                minted: false,
                external_addrs: Vec::new(),
                registration_attest: false,
                attest_error: None,
                older_core: false,
                roles: HashMap::new(),
                extra_members: 0,
                foreign_404: BTreeSet::new(),
                membership_lag: BTreeSet::new(),
                subgroups: HashMap::new(),
                contexts: HashMap::new(),
                capabilities: HashMap::new(),
                usage_total: HashMap::new(),
                usage_failing: false,
                ignores_offset: false,
                page_cap: None,
                inventory_delay: Duration::ZERO,
                inventory_calls: HashMap::new(),
                group_members: HashMap::new(),
                member_devices: HashMap::new(),
                seal_route: false,
                public_key: None,
                seal_refused: BTreeSet::new(),
                sealed: Vec::new(),
            }),
            fixtures: Fixtures::load(),
        });
        let handler_state = shared.clone();
        let server = Arc::new(serve(move |request| handle(handler_state.clone(), request)).await?);
        Ok(MerodEmulator {
            shared,
            server,
            extra: Arc::default(),
        })
    }

    /// `http://127.0.0.1:PORT/` (the admin routes are under `/admin-api`).
    pub fn url(&self) -> Url {
        self.server.url()
    }

    /// The bound address.
    pub fn addr(&self) -> std::net::SocketAddr {
        self.server.addr()
    }

    /// The join behaviour of namespaces without their own (default `Admit { delay: 0 }`).
    pub fn set_default_join(&self, behaviour: JoinBehaviour) {
        let mut inner = lock(&self.shared.inner);
        let Inner { join, refused, .. } = &mut *inner;
        refused.retain(|id, _| join.contains_key(id));
        inner.default_join = behaviour;
    }

    /// The join behaviour of one namespace (overrides the default; restarts its refusal count).
    pub fn set_join(&self, group_id: &str, behaviour: JoinBehaviour) {
        let id = group_id.to_ascii_lowercase();
        let mut inner = lock(&self.shared.inner);
        inner.refused.remove(&id);
        inner.join.insert(id, behaviour);
    }

    /// The leave behaviour of namespaces without their own (default `Normal { delay: 0 }`).
    pub fn set_default_leave(&self, behaviour: LeaveBehaviour) {
        lock(&self.shared.inner).default_leave = behaviour;
    }

    /// The leave behaviour of one namespace (overrides the default).
    pub fn set_leave(&self, group_id: &str, behaviour: LeaveBehaviour) {
        lock(&self.shared.inner)
            .leave
            .insert(group_id.to_ascii_lowercase(), behaviour);
    }

    /// How the namespace listing behaves from now on (default [`ListBehaviour::Normal`]);
    /// restarts the count of [`ListBehaviour::ErrorAfterPages`].
    pub fn set_list(&self, behaviour: ListBehaviour) {
        let mut inner = lock(&self.shared.inner);
        inner.list = behaviour;
        inner.listed = 0;
    }

    /// While false, `/admin-api/peers` answers 503 `{"error":"starting"}` and
    /// `/admin-api/ready` 503 `{"data":{"status":"starting"}}`. Default true.
    pub fn set_ready(&self, ready: bool) {
        lock(&self.shared.inner).ready = ready;
    }

    /// Makes the node a member of this namespace (a membership that existed before; the
    /// account is minted).
    pub fn hold(&self, group_id: &str) {
        let mut inner = lock(&self.shared.inner);
        inner.held.insert(group_id.to_ascii_lowercase());
        inner.minted = true;
    }

    /// The `externalAddrs` `GET /admin-api/network/status` answers from now on (default
    /// none, as a real merod on loopback answers), beside `localPeerId` = the sandbox's
    /// PeerId.
    pub fn set_external_addrs(&self, addrs: &[&str]) {
        lock(&self.shared.inner).external_addrs = addrs.iter().map(|a| (*a).to_owned()).collect();
    }

    /// Whether the node's device and account exist (`GET /admin-api/identity` answers 404
    /// until then). Default false; an admission or [`MerodEmulator::hold`] sets it.
    pub fn set_minted(&self, minted: bool) {
        lock(&self.shared.inner).minted = minted;
    }

    /// Whether `POST /admin-api/tee/registration-attest` exists (default false, as in
    /// 0.11.0-rc.25, which answers it 404).
    pub fn set_registration_attest(&self, present: bool) {
        lock(&self.shared.inner).registration_attest = present;
    }

    /// Makes both quote routes answer this status (`None`: quote again).
    pub fn set_attest_error(&self, status: Option<u16>) {
        lock(&self.shared.inner).attest_error = status;
    }

    /// Drops the membership without a leave call (e.g. evicted by an admin).
    pub fn unhold(&self, group_id: &str) {
        lock(&self.shared.inner)
            .held
            .remove(&group_id.to_ascii_lowercase());
    }

    /// The namespaces the node is a member of (lowercase ids).
    pub fn held(&self) -> BTreeSet<String> {
        lock(&self.shared.inner).held.clone()
    }

    /// Every request so far, in arrival order.
    pub fn calls(&self) -> Vec<CallRecord> {
        lock(&self.shared.inner).calls.clone()
    }

    /// How many requests came so far (as [`MerodEmulator::calls`] would count them, without
    /// copying them).
    pub fn call_count(&self) -> usize {
        lock(&self.shared.inner).calls.len()
    }

    /// Well-formed fleet-join calls for this namespace so far (refused 400s not counted).
    pub fn joins(&self, group_id: &str) -> usize {
        lock(&self.shared.inner)
            .join_counts
            .get(&group_id.to_ascii_lowercase())
            .copied()
            .unwrap_or(0)
    }

    /// Well-formed leave calls for this namespace so far (refused 400s not counted).
    pub fn leaves(&self, group_id: &str) -> usize {
        lock(&self.shared.inner)
            .leave_counts
            .get(&group_id.to_ascii_lowercase())
            .copied()
            .unwrap_or(0)
    }

    /// An older core (true): a fleet-join naming `admitterAddrs` is refused with a 400 that
    /// names the field (its request type refuses unknown fields). Default false (rc.25,
    /// which takes it).
    pub fn set_older_core(&self, older: bool) {
        lock(&self.shared.inner).older_core = older;
    }

    /// The direct subgroups of `group` (64 hex each), as `GET /groups/{id}/subgroups`
    /// answers them; a group of a held namespace's tree is a member's group.
    pub fn set_subgroups(&self, group: &str, children: &[&str]) {
        lock(&self.shared.inner).subgroups.insert(
            group.to_ascii_lowercase(),
            children.iter().map(|c| c.to_ascii_lowercase()).collect(),
        );
    }

    /// The contexts of `group`, in the order `GET /groups/{id}/contexts` pages them.
    pub fn set_contexts(&self, group: &str, contexts: &[String]) {
        lock(&self.shared.inner)
            .contexts
            .insert(group.to_ascii_lowercase(), contexts.to_vec());
    }

    /// The node's capability bits in `group` (`None`: the call is refused with a 500).
    pub fn set_capabilities(&self, group: &str, bits: Option<u32>) {
        lock(&self.shared.inner)
            .capabilities
            .insert(group.to_ascii_lowercase(), bits);
    }

    /// `bytes.total` (and `state`) of `namespace` in `GET /usage`.
    pub fn set_usage_total(&self, namespace: &str, total: u64) {
        lock(&self.shared.inner)
            .usage_total
            .insert(namespace.to_ascii_lowercase(), total);
    }

    /// Makes `GET /usage` answer 500.
    pub fn set_usage_failing(&self, failing: bool) {
        lock(&self.shared.inner).usage_failing = failing;
    }

    /// Makes the inventory's routes (usage, subgroups, contexts, capabilities) answer
    /// `delay` late: a slow walk.
    pub fn set_inventory_delay(&self, delay: Duration) {
        lock(&self.shared.inner).inventory_delay = delay;
    }

    /// Makes the paged group lists (contexts, members) ignore `offset`.
    pub fn set_ignores_offset(&self, ignores: bool) {
        lock(&self.shared.inner).ignores_offset = ignores;
    }

    /// Makes the paged group lists (contexts, members, member devices) serve at most `cap`
    /// rows a page whatever `limit` asks, as a merod capping pages below the size asked
    /// would (`None`: as asked, contexts and devices at most 1,000).
    pub fn set_page_cap(&self, cap: Option<usize>) {
        lock(&self.shared.inner).page_cap = cap;
    }

    /// How many requests the inventory's routes got: `subgroups`, `contexts`, `members`,
    /// `capabilities` or `usage`.
    pub fn inventory_calls(&self, route: &str) -> usize {
        lock(&self.shared.inner)
            .inventory_calls
            .get(route)
            .copied()
            .unwrap_or(0)
    }

    /// The member list of `group` (a group of a held namespace's tree): `(account, role)`
    /// rows in the order `GET /groups/{id}/members` pages them, in place of the recorded one.
    pub fn set_group_members(&self, group: &str, rows: &[(&str, &str)]) {
        lock(&self.shared.inner).group_members.insert(
            group.to_ascii_lowercase(),
            rows.iter()
                .map(|(a, r)| (a.to_ascii_lowercase(), (*r).to_owned()))
                .collect(),
        );
    }

    /// The rows `GET /groups/{id}/member-devices` pages for `group`: each account with its
    /// `(deviceId, signingKey)`s, answered as given (case kept).
    pub fn set_member_devices(&self, group: &str, rows: &[(&str, &[(&str, &str)])]) {
        lock(&self.shared.inner).member_devices.insert(
            group.to_ascii_lowercase(),
            rows.iter()
                .map(|(a, devices)| {
                    (
                        (*a).to_owned(),
                        devices
                            .iter()
                            .map(|(d, k)| ((*d).to_owned(), (*k).to_owned()))
                            .collect(),
                    )
                })
                .collect(),
        );
    }

    /// Whether `POST /groups/{id}/accounts/{account}/seal` exists (off: 404 with no body,
    /// as rc.25 and every core before rc.34 answer).
    pub fn set_seal_route(&self, on: bool) {
        lock(&self.shared.inner).seal_route = on;
    }

    /// What `GET /identity` answers as `data.publicKey` once the node is minted (`None`: the
    /// recorded rc.25 answer's base58 key).
    pub fn set_public_key(&self, key: Option<&str>) {
        lock(&self.shared.inner).public_key = key.map(str::to_owned);
    }

    /// Makes sealing to `account` answer merod's 404 (no root key on record in the group).
    pub fn set_seal_refused(&self, account: &str, on: bool) {
        mark(&mut lock(&self.shared.inner).seal_refused, account, on);
    }

    /// Every plaintext sealed so far: `(group, account, plaintext)`.
    pub fn sealed(&self) -> Vec<(String, String, String)> {
        lock(&self.shared.inner).sealed.clone()
    }

    /// The node's role in one namespace, as `GET /groups/{id}/members` lists it (e.g.
    /// `RelayTee`, `ReadOnlyTee`, `Member`).
    pub fn set_role(&self, group_id: &str, role: &str) {
        lock(&self.shared.inner)
            .roles
            .insert(group_id.to_ascii_lowercase(), role.to_owned());
    }

    /// `n` more member rows listed before the owner and the node (to make the list span
    /// pages).
    pub fn set_extra_members(&self, n: usize) {
        lock(&self.shared.inner).extra_members = n;
    }

    /// While on, `GET /namespaces/{id}` of `group_id` answers merod's own 404 `No namespace
    /// identity found` even while the namespace is held and listed: merod's membership
    /// answer lagging an admission, as seen for tens of seconds after a fleet-join.
    pub fn set_membership_lag(&self, group_id: &str, on: bool) {
        mark(&mut lock(&self.shared.inner).membership_lag, group_id, on);
    }

    /// While on, `GET /namespaces/{id}` of `group_id` answers 404 `{"error":"Not found"}` (a
    /// proxy's or a renamed route's 404, not merod's word on the namespace).
    pub fn set_foreign_404(&self, group_id: &str, on: bool) {
        mark(&mut lock(&self.shared.inner).foreign_404, group_id, on);
    }

    /// The node's account (the recorded `identity-after-join` answer's `accountId`).
    pub fn account(&self) -> String {
        self.shared
            .fixtures
            .account()
            .unwrap_or_default()
            .to_owned()
    }

    /// Stops accepting connections at every address (also happens when the last clone is
    /// dropped).
    pub fn shutdown(&self) {
        self.server.shutdown();
        lock(&self.extra).iter().for_each(ServerHandle::shutdown);
    }

    /// Answers at one more loopback address too (`127.0.0.1:<new port>`, same state), as a
    /// merod with several `[server].listen` addresses does; returns it.
    ///
    /// Errors: the bind's.
    pub async fn listen_also(&self) -> Result<std::net::SocketAddr, std::io::Error> {
        let handler_state = self.shared.clone();
        let server = serve(move |request| handle(handler_state.clone(), request)).await?;
        let addr = server.addr();
        lock(&self.extra).push(server);
        Ok(addr)
    }

    /// Stops accepting connections at `addr` only (the first address or one of
    /// [`MerodEmulator::listen_also`]); idle connections there close, so the next call to it
    /// is refused: merod moving to its other addresses.
    pub fn stop_listening_at(&self, addr: std::net::SocketAddr) {
        if self.server.addr() == addr {
            self.server.shutdown();
        }
        lock(&self.extra)
            .iter()
            .filter(|s| s.addr() == addr)
            .for_each(ServerHandle::shutdown);
    }
}

/// Records every request (status 0 until it is answered, or when the client gave up), then
/// answers it.
async fn handle(shared: Arc<Shared>, request: Received) -> Answer {
    let index = {
        let mut inner = lock(&shared.inner);
        inner.calls.push(CallRecord {
            method: request.method.to_string(),
            path: request.uri.path().to_owned(),
            content_type: content_type(&request.headers),
            body: request
                .body
                .as_ref()
                .map(|bytes| String::from_utf8_lossy(bytes).into_owned())
                .unwrap_or_default(),
            status: 0,
            at: Instant::now(),
        });
        inner.calls.len() - 1
    };
    let path = request.uri.path();
    let inventory_route = path == "/admin-api/usage"
        || (path.starts_with("/admin-api/groups/")
            && (path.ends_with("/subgroups")
                || path.ends_with("/contexts")
                || path.ends_with("/capabilities")
                || path.ends_with("/member-devices")));
    let delay = lock(&shared.inner).inventory_delay;
    if inventory_route && !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    let response = route(&shared, request).await;
    lock(&shared.inner).calls[index].status = response.status().as_u16();
    response
}

/// The admin routes; another method on one of them is 405, anything else 404 (both empty).
async fn route(shared: &Arc<Shared>, request: Received) -> Answer {
    let body = match request.body {
        Ok(body) => body,
        Err(err) => {
            return json_response(
                400,
                json!({ "error": format!("Failed to read body: {err}") }),
            )
        }
    };
    let path = request.uri.path();
    let Some(rest) = path.strip_prefix("/admin-api/") else {
        return not_found();
    };
    let get = request.method == Method::GET;
    let post = request.method == Method::POST;
    match rest {
        "health" | "ready" | "peers" | "namespaces" | "identity" | "network/status" if !get => {
            method_not_allowed()
        }
        "tee/fleet-join" | "tee/attest" if !post => method_not_allowed(),
        "health" => health(shared),
        "ready" => ready(shared),
        "peers" => peers(shared),
        "tee/fleet-join" => fleet_join(shared, &request.headers, body).await,
        "namespaces" => list_namespaces(shared, &request.uri).await,
        "identity" => identity(shared),
        "network/status" => network_status(shared),
        "tee/attest" => quote(shared, &request.headers, &body),
        // Only with set_registration_attest (rc.25 predates it: an unknown route, 404).
        "tee/registration-attest" if post => registration_attest(shared, &request.headers, &body),
        "usage" if get => usage(shared),
        "usage" => method_not_allowed(),
        _ => {
            if let Some((id, tail)) = rest
                .strip_prefix("groups/")
                .and_then(|r| r.split_once('/'))
                .filter(|(id, _)| !id.is_empty())
            {
                let capabilities = tail
                    .strip_prefix("members/")
                    .and_then(|t| t.strip_suffix("/capabilities"))
                    .filter(|a| !a.is_empty() && !a.contains('/'));
                let sealed_to = tail
                    .strip_prefix("accounts/")
                    .and_then(|t| t.strip_suffix("/seal"))
                    .filter(|a| !a.is_empty() && !a.contains('/'));
                if let Some(account) = sealed_to {
                    return seal(shared, id, account, post, &body);
                }
                let answer = match (tail, capabilities) {
                    ("subgroups", _) => Some(group_subgroups(shared, id)),
                    ("contexts", _) => Some(group_contexts(shared, id, &request.uri)),
                    ("member-devices", _) => Some(group_member_devices(shared, id, &request.uri)),
                    (_, Some(_)) => Some(group_capabilities(shared, id)),
                    _ => None,
                };
                if let Some(answer) = answer {
                    return if get { answer } else { method_not_allowed() };
                }
            }
            if let Some(id) = rest
                .strip_prefix("groups/")
                .and_then(|r| r.strip_suffix("/members"))
                .filter(|id| !id.is_empty() && !id.contains('/'))
            {
                return if get {
                    group_members(shared, id, &request.uri)
                } else {
                    method_not_allowed()
                };
            }
            match rest
                .strip_prefix("namespaces/")
                .map(|id| id.split_once('/'))
            {
                Some(None) if rest.len() > "namespaces/".len() => {
                    if get {
                        get_namespace(shared, &rest["namespaces/".len()..])
                    } else {
                        method_not_allowed()
                    }
                }
                Some(Some((id, "leave"))) if !id.is_empty() => {
                    if post {
                        leave_namespace(shared, id).await
                    } else {
                        method_not_allowed()
                    }
                }
                _ => not_found(),
            }
        }
    }
}

/// An empty answer with this status and no content type.
fn empty(status: StatusCode) -> Answer {
    let mut answer = hyper::Response::new(http_body_util::Full::new(Bytes::new()));
    *answer.status_mut() = status;
    answer
}

/// An unknown route: merod answers 404 with an empty body and no content type.
fn not_found() -> Answer {
    empty(StatusCode::NOT_FOUND)
}

/// A known route with another method: 405, empty, as merod answers it.
fn method_not_allowed() -> Answer {
    empty(StatusCode::METHOD_NOT_ALLOWED)
}

/// The group id and the `(offset, limit)` of a paged group list's request, or merod's
/// answer to a bad id or query.
fn paged_request(
    shared: &Shared,
    raw: &str,
    uri: &Uri,
) -> Result<(String, usize, usize), Box<Answer>> {
    let id = parse_id(raw).map_err(|_| Box::new(shared.fixtures.leave_bad_id.respond()))?;
    let (offset, limit) = paging(uri)
        .map_err(|message| Box::new(json_response(400, json!({ "error": message.0 }))))?;
    Ok((id, offset, limit))
}

/// Whether `group` is a held namespace or in the subgroup tree of one.
fn in_held_tree(inner: &Inner, group: &str) -> bool {
    let mut queue: Vec<&str> = inner.held.iter().map(String::as_str).collect();
    let mut seen = BTreeSet::new();
    while let Some(g) = queue.pop() {
        if g == group {
            return true;
        }
        if seen.insert(g) {
            if let Some(children) = inner.subgroups.get(g) {
                queue.extend(children.iter().map(String::as_str));
            }
        }
    }
    false
}

fn count_call<'s>(shared: &'s Shared, route: &'static str) -> std::sync::MutexGuard<'s, Inner> {
    let mut inner = lock(&shared.inner);
    *inner.inventory_calls.entry(route).or_default() += 1;
    inner
}

/// `limit` under the page cap [`MerodEmulator::set_page_cap`] set.
fn capped(inner: &Inner, limit: usize) -> usize {
    inner.page_cap.map_or(limit, |cap| limit.min(cap))
}

fn group_subgroups(shared: &Shared, raw: &str) -> Answer {
    let Ok(id) = parse_id(raw) else {
        return shared.fixtures.leave_bad_id.respond();
    };
    let inner = count_call(shared, "subgroups");
    let rows: Vec<Value> = inner
        .subgroups
        .get(&id)
        .map(|c| c.iter().map(|g| json!({ "groupId": g })).collect())
        .unwrap_or_default();
    json_response(
        shared.fixtures.subgroups.status,
        json!({ "subgroups": rows }),
    )
}

fn group_contexts(shared: &Shared, raw: &str, uri: &Uri) -> Answer {
    let fixtures = &shared.fixtures;
    let (id, offset, limit) = match paged_request(shared, raw, uri) {
        Ok(request) => request,
        Err(answer) => return *answer,
    };
    let inner = count_call(shared, "contexts");
    if !in_held_tree(&inner, &id) {
        return fixtures.contexts_not_held.respond();
    }
    let offset = if inner.ignores_offset { 0 } else { offset };
    let limit = capped(&inner, limit.min(1000));
    let rows: Vec<Value> = inner
        .contexts
        .get(&id)
        .map(|c| {
            c.iter()
                .skip(offset)
                .take(limit)
                .map(|c| json!({ "contextId": c }))
                .collect()
        })
        .unwrap_or_default();
    json_response(fixtures.contexts.status, json!({ "data": rows }))
}

fn group_member_devices(shared: &Shared, raw: &str, uri: &Uri) -> Answer {
    let fixtures = &shared.fixtures;
    let (id, offset, limit) = match paged_request(shared, raw, uri) {
        Ok(request) => request,
        Err(answer) => return *answer,
    };
    let inner = count_call(shared, "member-devices");
    if !in_held_tree(&inner, &id) {
        return fixtures.contexts_not_held.respond();
    }
    let offset = if inner.ignores_offset { 0 } else { offset };
    let rows: Vec<Value> = match inner.member_devices.get(&id) {
        Some(rows) => rows
            .iter()
            .map(|(account, devices)| {
                let devices: Vec<Value> = devices
                    .iter()
                    .map(|(d, k)| json!({ "deviceId": d, "signingKey": k }))
                    .collect();
                json!({ "account": account, "devices": devices })
            })
            .collect(),
        // A member that is no admin sees only its own account, as recorded.
        None => {
            let mut row = fixtures.member_devices.body["members"][0].clone();
            row["account"] = json!(fixtures.account().unwrap_or_default());
            vec![row]
        }
    };
    let limit = capped(&inner, limit.min(1000));
    let rows: Vec<Value> = rows.into_iter().skip(offset).take(limit).collect();
    json_response(fixtures.member_devices.status, json!({ "members": rows }))
}

/// `POST /groups/{id}/accounts/{account}/seal`: 404 with no body unless the route is on
/// (an older core); then the envelope, a fresh key and nonce each call.
fn seal(shared: &Shared, raw: &str, account: &str, post: bool, body: &[u8]) -> Answer {
    let fixtures = &shared.fixtures;
    let mut inner = count_call(shared, "seal");
    if !inner.seal_route {
        // As recorded (seal-member): an unknown route.
        return not_found();
    }
    if !post {
        return method_not_allowed();
    }
    let (Ok(id), Ok(account)) = (parse_id(raw), parse_id(account)) else {
        return fixtures.leave_bad_id.respond();
    };
    let plaintext = serde_json::from_slice::<Value>(body)
        .ok()
        .and_then(|v| {
            v.get("plaintext")
                .and_then(Value::as_str)
                .map(str::to_owned)
        })
        .and_then(|h| hex::decode(h).ok())
        .filter(|p| !p.is_empty());
    let Some(plaintext) = plaintext else {
        return json_response(400, json!({ "error": "plaintext must be non-empty hex" }));
    };
    if !in_held_tree(&inner, &id) {
        return json_response(
            403,
            json!({ "error": format!("this node is not a member of group {id}") }),
        );
    }
    if inner.seal_refused.contains(&account) {
        return json_response(
            404,
            json!({ "error": format!("group {id} knows no account {account} with a root key on record") }),
        );
    }
    // Different on every call, as real sealing's fresh ephemeral key and nonce are.
    let n = inner.sealed.len() + 1;
    let fresh = || format!("{:064x}", n);
    let ciphertext = hex::encode(&plaintext);
    inner.sealed.push((
        id,
        account,
        String::from_utf8_lossy(&plaintext).into_owned(),
    ));
    json_response(
        200,
        json!({ "data": {
            "accountRootEpoch": 1,
            "ephemeralPublicKey": fresh(),
            "nonce": fresh()[..48].to_owned(),
            "ciphertext": ciphertext,
        } }),
    )
}

fn group_capabilities(shared: &Shared, raw: &str) -> Answer {
    let fixtures = &shared.fixtures;
    let Ok(id) = parse_id(raw) else {
        return fixtures.leave_bad_id.respond();
    };
    let inner = count_call(shared, "capabilities");
    if !in_held_tree(&inner, &id) {
        return fixtures.contexts_not_held.respond();
    }
    match inner.capabilities.get(&id) {
        None => fixtures.capabilities.respond(),
        Some(Some(bits)) => json_response(
            fixtures.capabilities.status,
            json!({ "data": { "capabilities": bits } }),
        ),
        Some(None) => fixtures.contexts_not_held.respond(),
    }
}

fn usage(shared: &Shared) -> Answer {
    let fixtures = &shared.fixtures;
    let inner = count_call(shared, "usage");
    if inner.usage_failing {
        return json_response(500, json!({ "error": "Internal server error" }));
    }
    let template = fixtures.usage.body["namespaces"][0].clone();
    let recorded_members = fixtures.members.body["members"]
        .as_array()
        .map_or(0, Vec::len);
    let rows: Vec<Value> = inner
        .held
        .iter()
        .map(|ns| {
            let mut row = template.clone();
            let total = inner.usage_total.get(ns).copied().unwrap_or(0);
            let (contexts, subgroups) = tree_counts(&inner, ns);
            let members = match inner.group_members.get(ns) {
                Some(rows) => rows.len(),
                None => inner.extra_members + recorded_members,
            };
            row["namespaceId"] = json!(ns);
            row["contextCount"] = json!(contexts);
            row["memberCount"] = json!(members);
            row["subgroupCount"] = json!(subgroups);
            row["bytes"]["state"] = json!(total);
            row["bytes"]["total"] = json!(total);
            row
        })
        .collect();
    json_response(fixtures.usage.status, json!({ "namespaces": rows }))
}

/// The contexts and the subgroups of the tree under `namespace` (each group once).
fn tree_counts(inner: &Inner, namespace: &str) -> (usize, usize) {
    let mut seen = BTreeSet::from([namespace.to_owned()]);
    let mut queue = vec![namespace.to_owned()];
    let mut contexts = 0;
    while let Some(group) = queue.pop() {
        contexts += inner.contexts.get(&group).map_or(0, Vec::len);
        for child in inner.subgroups.get(&group).into_iter().flatten() {
            if seen.insert(child.clone()) {
                queue.push(child.clone());
            }
        }
    }
    (contexts, seen.len() - 1)
}

fn group_members(shared: &Shared, raw: &str, uri: &Uri) -> Answer {
    let fixtures = &shared.fixtures;
    let (id, offset, limit) = match paged_request(shared, raw, uri) {
        Ok(request) => request,
        Err(answer) => return *answer,
    };
    let (held, role, extra, offset, given) = {
        let inner = count_call(shared, "members");
        let given = inner
            .group_members
            .get(&id)
            .filter(|_| in_held_tree(&inner, &id))
            .cloned();
        (
            inner.held.contains(&id),
            inner.roles.get(&id).cloned(),
            inner.extra_members,
            if inner.ignores_offset { 0 } else { offset },
            given,
        )
    };
    let limit = capped(&lock(&shared.inner), limit);
    if let Some(given) = given {
        let rows: Vec<Value> = given
            .iter()
            .skip(offset)
            .take(limit)
            .map(|(a, r)| json!({ "identity": a, "role": r }))
            .collect();
        return json_response(fixtures.members.status, json!({ "members": rows }));
    }
    if !held {
        return fixtures.members_not_held.respond();
    }
    let own = fixtures.join_admitted.body["account"].clone();
    let recorded = fixtures.members.body["members"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .into_iter()
        .map(|mut row| {
            if let (true, Some(role)) = (row["identity"] == own, &role) {
                row["role"] = Value::String(role.clone());
            }
            row
        });
    let rows: Vec<Value> = (0..extra)
        .map(|i| json!({ "identity": format!("{i:064x}"), "role": "Member" }))
        .chain(recorded)
        .skip(offset)
        .take(limit)
        .collect();
    json_response(fixtures.members.status, json!({ "members": rows }))
}

fn health(shared: &Shared) -> Answer {
    shared.fixtures.health.respond()
}

fn ready(shared: &Shared) -> Answer {
    if lock(&shared.inner).ready {
        shared.fixtures.ready.respond()
    } else {
        json_response(503, json!({ "data": { "status": "starting" } }))
    }
}

fn peers(shared: &Shared) -> Answer {
    if lock(&shared.inner).ready {
        shared.fixtures.peers.respond()
    } else {
        json_response(503, json!({ "error": "starting" }))
    }
}

enum IdError {
    Length(usize),
    NotHex,
}

/// A 64-hex-char id, lowercased.
fn parse_id(raw: &str) -> Result<String, IdError> {
    if raw.len() != 64 {
        return Err(IdError::Length(raw.len()));
    }
    if !raw.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(IdError::NotHex);
    }
    Ok(raw.to_ascii_lowercase())
}

#[derive(Deserialize)]
struct FleetJoinRequest {
    #[serde(rename = "groupId")]
    group_id: String,
    #[serde(rename = "admitterAddrs", default)]
    admitter_addrs: Option<Vec<String>>,
}

/// What a well-formed fleet-join will do, decided under the lock.
enum JoinPlan {
    Answer {
        delay: Duration,
        hold: bool,
    },
    Refuse {
        delay: Duration,
    },
    Refusals {
        refusals: Vec<(String, String)>,
        under_data: bool,
    },
    Hang,
    Error {
        status: u16,
        message: String,
    },
}

async fn fleet_join(shared: &Arc<Shared>, headers: &HeaderMap, body: Bytes) -> Answer {
    let fixtures = &shared.fixtures;
    if !is_json_content_type(headers) {
        return fixtures.join_no_content_type.respond();
    }
    let request: FleetJoinRequest = match serde_json::from_slice(&body) {
        Ok(request) => request,
        Err(err) => {
            let what = match err.classify() {
                serde_json::error::Category::Data => {
                    "Failed to deserialize the JSON body into the target type"
                }
                _ => "Failed to parse the request body as JSON",
            };
            return json_response(
                fixtures.join_snake_case.status,
                json!({ "error": format!("Invalid JSON data: {what}: {err}") }),
            );
        }
    };
    let id = match parse_id(&request.group_id) {
        Ok(id) => id,
        Err(IdError::Length(got)) => {
            return json_response(
                fixtures.join_short_id.status,
                json!({
                    "error": format!("Field 'group_id' must be exactly 64 characters (got {got})")
                }),
            )
        }
        Err(IdError::NotHex) => return fixtures.join_non_hex.respond(),
    };
    if request.admitter_addrs.is_some() && lock(&shared.inner).older_core {
        return json_response(
            400,
            json!({ "error": "Invalid JSON data: Failed to deserialize the JSON body into the target type: unknown field `admitterAddrs`, expected `groupId` at line 1 column 96" }),
        );
    }

    let plan = {
        let mut inner = lock(&shared.inner);
        *inner.join_counts.entry(id.clone()).or_default() += 1;
        let behaviour = inner.join.get(&id).unwrap_or(&inner.default_join).clone();
        match behaviour {
            JoinBehaviour::Admit { delay } => JoinPlan::Answer { delay, hold: true },
            JoinBehaviour::AdmitWithoutHolding { delay } => JoinPlan::Answer { delay, hold: false },
            JoinBehaviour::RefuseThenAdmit { refusals, delay } => {
                let refused = inner.refused.entry(id.clone()).or_default();
                if *refused < refusals {
                    *refused += 1;
                    JoinPlan::Refuse { delay }
                } else {
                    JoinPlan::Answer { delay, hold: true }
                }
            }
            JoinBehaviour::Refuse {
                refusals,
                under_data,
            } => JoinPlan::Refusals {
                refusals,
                under_data,
            },
            JoinBehaviour::Hang => JoinPlan::Hang,
            JoinBehaviour::Error { status, message } => JoinPlan::Error { status, message },
        }
    };

    match plan {
        JoinPlan::Hang => std::future::pending().await,
        JoinPlan::Error { status, message } => json_response(status, json!({ "error": message })),
        JoinPlan::Refuse { delay } => {
            tokio::time::sleep(delay).await;
            fixtures.join_unknown.with_id(JOIN_ID_FIELDS, &id)
        }
        JoinPlan::Refusals {
            refusals,
            under_data,
        } => {
            let mut body = fixtures.join_unknown.body.clone();
            for pointer in JOIN_ID_FIELDS {
                if let Some(field) = body.pointer_mut(pointer) {
                    *field = Value::String(id.clone());
                }
            }
            body["refusals"] = refusals
                .iter()
                .map(|(peer, reason)| json!({ "peer": peer, "reason": reason }))
                .collect();
            if under_data {
                body = json!({ "data": body });
            }
            json_response(fixtures.join_unknown.status, body)
        }
        JoinPlan::Answer { delay, hold } => {
            // Detached, so the join completes even if the client stops waiting.
            let worker = shared.clone();
            let done = tokio::spawn(async move {
                tokio::time::sleep(delay).await;
                let mut inner = lock(&worker.inner);
                inner.minted = true;
                if hold {
                    inner.held.insert(id.clone());
                }
                drop(inner);
                worker.fixtures.join_admitted.with_id(JOIN_ID_FIELDS, &id)
            });
            done.await.unwrap_or_else(|_| internal_error())
        }
    }
}

/// `status` with `{"error": ...}`: "Internal server error" for 500 (and an impossible
/// status), else the status's reason phrase.
fn error_status(status: u16) -> Answer {
    let message = match StatusCode::from_u16(status) {
        Ok(StatusCode::INTERNAL_SERVER_ERROR) | Err(_) => "Internal server error",
        Ok(code) => code.canonical_reason().unwrap_or("Internal server error"),
    };
    json_response(status, json!({ "error": message }))
}

/// The emulated node's PeerId: `localPeerId` of `GET /network/status`, and what the
/// sandbox writes into its merod config.toml.
pub const PEER_ID: &str = "12D3KooWJ6X2tBZEd8qKWvJyhtH2v2XyP4eQ9dcU2xZ8Y6YrjcVk";

/// Flat, as core 0.11 answers: the node's PeerId and addresses.
fn network_status(shared: &Shared) -> Answer {
    let external = lock(&shared.inner).external_addrs.clone();
    json_response(
        200,
        json!({
            "localPeerId": PEER_ID,
            "listenAddrs": ["/ip4/127.0.0.1/tcp/2428"],
            "externalAddrs": external,
            "relays": [],
            "rendezvous": [],
            "directUpgrades": 0,
            "autonat": null
        }),
    )
}

fn identity(shared: &Shared) -> Answer {
    let inner = lock(&shared.inner);
    if inner.minted {
        let recorded = &shared.fixtures.identity_after;
        match &inner.public_key {
            None => recorded.respond(),
            Some(key) => {
                let mut body = recorded.body.clone();
                body["data"]["publicKey"] = Value::String(key.clone());
                json_response(recorded.status, body)
            }
        }
    } else {
        shared.fixtures.identity_before.respond()
    }
}

#[derive(Deserialize)]
struct AttestRequest {
    nonce: String,
}

/// A quote over the request's nonce (64 hex chars), or 400 as merod answers a bad one.
fn quote(shared: &Shared, headers: &HeaderMap, body: &[u8]) -> Answer {
    if let Some(status) = lock(&shared.inner).attest_error {
        return json_response(status, json!({ "error": "Failed to generate attestation" }));
    }
    if !is_json_content_type(headers) {
        return json_response(
            400,
            json!({ "error": "Expected request with `Content-Type: application/json`" }),
        );
    }
    let fixtures = &shared.fixtures;
    let request: AttestRequest = match serde_json::from_slice(body) {
        Ok(request) => request,
        Err(err) => {
            return json_response(
                400,
                json!({ "error": format!("Invalid JSON data: Failed to deserialize the JSON body into the target type: {err}") }),
            )
        }
    };
    match parse_id(&request.nonce) {
        // The recorded answer: the quote as base64 and parsed, its report data the nonce
        // and 32 zero bytes.
        Ok(nonce) => {
            let mut answer = fixtures.attest.body.clone();
            answer["data"]["quoteB64"] = Value::String(mock_quote(&nonce));
            answer["data"]["quote"]["body"]["reportdata"] =
                Value::String(format!("{nonce}{}", "0".repeat(64)));
            json_response(fixtures.attest.status, answer)
        }
        Err(IdError::Length(got)) => json_response(
            fixtures.attest_short_nonce.status,
            json!({ "error": format!("Field 'nonce' must be exactly 64 characters (got {got})") }),
        ),
        Err(IdError::NotHex) => json_response(
            400,
            json!({ "error": "Field 'nonce' contains invalid hex encoding: contains non-hexadecimal characters" }),
        ),
    }
}

/// `registration-attest`: 404 as on 0.11.0-rc.25 unless the route is switched on.
fn registration_attest(shared: &Shared, headers: &HeaderMap, body: &[u8]) -> Answer {
    if !lock(&shared.inner).registration_attest {
        return not_found();
    }
    quote(shared, headers, body)
}

fn internal_error() -> Answer {
    json_response(500, json!({ "error": "Internal server error" }))
}

async fn leave_namespace(shared: &Arc<Shared>, raw: &str) -> Answer {
    let Ok(id) = parse_id(raw) else {
        return shared.fixtures.leave_bad_id.respond();
    };
    let (behaviour, held) = {
        let mut inner = lock(&shared.inner);
        *inner.leave_counts.entry(id.clone()).or_default() += 1;
        let behaviour = inner.leave.get(&id).unwrap_or(&inner.default_leave).clone();
        (behaviour, inner.held.contains(&id))
    };
    match behaviour {
        LeaveBehaviour::Hang => std::future::pending().await,
        LeaveBehaviour::Error { status } => error_status(status),
        LeaveBehaviour::Normal { .. } if !held => shared.fixtures.leave_again.respond(),
        LeaveBehaviour::Normal { delay } => {
            // Detached, so the leave completes even if the client stops waiting.
            let worker = shared.clone();
            let done = tokio::spawn(async move {
                tokio::time::sleep(delay).await;
                let fixtures = &worker.fixtures;
                if lock(&worker.inner).held.remove(&id) {
                    fixtures.leave_member.with_id(DATA_NAMESPACE_ID, &id)
                } else {
                    // Left meanwhile by a concurrent call.
                    fixtures.leave_again.respond()
                }
            });
            done.await.unwrap_or_else(|_| internal_error())
        }
    }
}

/// Puts `group_id` (lowercased) in `set` when `on`, else takes it out.
fn mark(set: &mut BTreeSet<String>, group_id: &str, on: bool) {
    let id = group_id.to_ascii_lowercase();
    if on {
        set.insert(id);
    } else {
        set.remove(&id);
    }
}

fn get_namespace(shared: &Shared, raw: &str) -> Answer {
    let fixtures = &shared.fixtures;
    let Ok(id) = parse_id(raw) else {
        return fixtures.leave_bad_id.respond();
    };
    let (held, foreign) = {
        let inner = lock(&shared.inner);
        let lags = inner.membership_lag.contains(&id);
        (
            inner.held.contains(&id) && !lags,
            inner.foreign_404.contains(&id),
        )
    };
    if foreign {
        // A proxy's 404 with words of its own (merod's unknown route answers an empty one).
        json_response(404, json!({ "error": "Not found" }))
    } else if held {
        fixtures.get_member.with_id(DATA_NAMESPACE_ID, &id)
    } else {
        fixtures.get_never_joined.respond()
    }
}

/// `offset` and `limit` from the query (default 0 and 100).
fn paging(uri: &Uri) -> Result<(usize, usize), BadRequest> {
    let (mut offset, mut limit) = (0usize, 100usize);
    for pair in uri.query().unwrap_or_default().split('&') {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        let slot = match key {
            "offset" => &mut offset,
            "limit" => &mut limit,
            _ => continue,
        };
        *slot = value.parse().map_err(|_| {
            BadRequest(format!(
                "Invalid query: {key} must be a non-negative integer"
            ))
        })?;
    }
    Ok((offset, limit))
}

async fn list_namespaces(shared: &Shared, uri: &Uri) -> Answer {
    let (offset, limit) = match paging(uri) {
        Ok(paging) => paging,
        Err(message) => return json_response(400, json!({ "error": message.0 })),
    };
    let (behaviour, listed) = {
        let mut inner = lock(&shared.inner);
        inner.listed += 1;
        (inner.list.clone(), inner.listed)
    };
    match behaviour {
        ListBehaviour::ErrorAfterPages { pages, status } if listed > pages => {
            return error_status(status)
        }
        ListBehaviour::Normal
        | ListBehaviour::ErrorAfterPages { .. }
        | ListBehaviour::IgnoresOffset
        | ListBehaviour::LeftAfterFirstPage(_) => {}
        ListBehaviour::Hang => return std::future::pending().await,
        ListBehaviour::Error { status } => return error_status(status),
        ListBehaviour::RawBody(body) => return super::raw_json_response(200, body),
    }
    let offset = match behaviour {
        ListBehaviour::IgnoresOffset => 0,
        _ => offset,
    };
    let held = {
        let mut inner = lock(&shared.inner);
        let held = inner.held.clone();
        if let ListBehaviour::LeftAfterFirstPage(id) = &behaviour {
            inner.held.remove(id);
        }
        held
    };
    let entries: Vec<Value> = held
        .iter()
        .skip(offset)
        .take(limit)
        .map(|id| {
            let mut entry = shared.fixtures.list_entry.clone();
            entry["namespaceId"] = Value::String(id.clone());
            entry
        })
        .collect();
    json_response(200, json!({ "data": entries }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use hyper::header::CONTENT_TYPE;

    const ID: &str = "38069a4cc4285c4245c84587ac60084ba53502a8b91c9b108bca40f10ec4d3df";
    const OTHER: &str = "abababababababababababababababababababababababababababababababab";

    use crate::testing::test_client as client;

    fn endpoint(emu: &MerodEmulator, path: &str) -> Url {
        emu.url().join(path).unwrap()
    }

    async fn answer(response: reqwest::Response) -> (u16, Value) {
        let status = response.status().as_u16();
        let content_type = response
            .headers()
            .get(CONTENT_TYPE)
            .map(|v| v.to_str().unwrap().to_owned());
        assert_eq!(content_type.as_deref(), Some("application/json"));
        (status, response.json().await.unwrap())
    }

    async fn get_json(emu: &MerodEmulator, path: &str) -> (u16, Value) {
        answer(client().get(endpoint(emu, path)).send().await.unwrap()).await
    }

    async fn join(emu: &MerodEmulator, group_id: &str) -> (u16, Value) {
        let response = client()
            .post(endpoint(emu, "admin-api/tee/fleet-join"))
            .json(&json!({ "groupId": group_id }))
            .send()
            .await
            .unwrap();
        answer(response).await
    }

    async fn leave(emu: &MerodEmulator, group_id: &str) -> (u16, Value) {
        let path = format!("admin-api/namespaces/{group_id}/leave");
        answer(client().post(endpoint(emu, &path)).send().await.unwrap()).await
    }

    async fn namespace(emu: &MerodEmulator, group_id: &str) -> (u16, Value) {
        get_json(emu, &format!("admin-api/namespaces/{group_id}")).await
    }

    fn error(message: &str) -> Value {
        json!({ "error": message })
    }

    #[test]
    fn fixtures_load() {
        let fixtures = Fixtures::load();
        assert_eq!(fixtures.join_admitted.status, 200);
        assert_eq!(fixtures.leave_again.status, 500);
        assert_eq!(fixtures.list_entry["namespaceId"], ID);
    }

    #[tokio::test]
    async fn health_ready_and_peers() {
        let emu = MerodEmulator::start().await.unwrap();
        assert_eq!(
            get_json(&emu, "admin-api/health").await,
            (200, json!({ "data": { "status": "alive" } }))
        );
        assert_eq!(
            get_json(&emu, "admin-api/ready").await,
            (200, json!({ "data": { "status": "ready" } }))
        );
        assert_eq!(
            get_json(&emu, "admin-api/peers").await,
            (200, json!({ "count": 1 }))
        );

        emu.set_ready(false);
        assert_eq!(
            get_json(&emu, "admin-api/peers").await,
            (503, error("starting"))
        );
        assert_eq!(
            get_json(&emu, "admin-api/ready").await,
            (503, json!({ "data": { "status": "starting" } }))
        );
        assert_eq!(get_json(&emu, "admin-api/health").await.0, 200);

        emu.set_ready(true);
        assert_eq!(get_json(&emu, "admin-api/peers").await.0, 200);
    }

    #[tokio::test]
    async fn fleet_join_admits_and_holds() {
        let emu = MerodEmulator::start().await.unwrap();
        assert_eq!(
            namespace(&emu, ID).await,
            (404, error("No namespace identity found"))
        );

        let (status, body) = join(&emu, &OTHER.to_uppercase()).await;
        assert_eq!(status, 200);
        assert_eq!(body["status"], "joined");
        assert_eq!(body["admitted"], true);
        assert_eq!(body["auto_follow_enabled"], true);
        assert_eq!(body["group_id"], OTHER);
        assert_eq!(body["namespace_id"], OTHER);
        assert_eq!(
            body["public_key"],
            "8W55hTWXwYgpV5hwnZ3f25G5H1Yt5Qb3bRMwFTFDEyin"
        );
        assert_eq!(body["contexts_joined"], json!([]));
        assert_eq!(emu.held(), BTreeSet::from([OTHER.to_owned()]));
        assert_eq!(emu.joins(OTHER), 1);
        assert_eq!(emu.joins(&OTHER.to_uppercase()), 1);

        let (status, body) = namespace(&emu, OTHER).await;
        assert_eq!(status, 200);
        assert_eq!(body["data"]["namespaceId"], OTHER);
        assert_eq!(body["data"]["memberCount"], 2);

        // Joining again answers admitted at once and keeps holding it.
        assert_eq!(join(&emu, OTHER).await.1["admitted"], true);
        assert_eq!(emu.joins(OTHER), 2);
        assert_eq!(emu.held().len(), 1);

        let call = emu
            .calls()
            .into_iter()
            .find(|c| c.method == "POST")
            .unwrap();
        assert_eq!(call.path, "/admin-api/tee/fleet-join");
        assert_eq!(call.content_type.as_deref(), Some("application/json"));
        assert_eq!(
            serde_json::from_str::<Value>(&call.body).unwrap(),
            json!({ "groupId": OTHER.to_uppercase() })
        );
        assert_eq!(call.status, 200);
    }

    #[tokio::test]
    async fn fleet_join_waits_for_its_delay() {
        let emu = MerodEmulator::start().await.unwrap();
        emu.set_join(
            ID,
            JoinBehaviour::Admit {
                delay: Duration::from_secs(2),
            },
        );
        let started = Instant::now();
        let pending = {
            let emu = emu.clone();
            tokio::spawn(async move { join(&emu, ID).await })
        };
        // Wait for the request to arrive (not a fixed sleep: a loaded machine may be slow to
        // send it), then it must still be pending.
        while emu.calls().is_empty() {
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "no request arrived"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(emu.held().is_empty());
        assert_eq!(emu.calls().last().unwrap().status, 0);

        let (status, body) = pending.await.unwrap();
        assert!(started.elapsed() >= Duration::from_secs(2));
        assert_eq!((status, body["admitted"].clone()), (200, json!(true)));
        assert!(emu.held().contains(ID));
        assert_eq!(emu.calls().last().unwrap().status, 200);
    }

    #[tokio::test]
    async fn refuse_then_admit() {
        let emu = MerodEmulator::start().await.unwrap();
        emu.set_default_join(JoinBehaviour::RefuseThenAdmit {
            refusals: 2,
            delay: Duration::from_millis(10),
        });
        for _ in 0..2 {
            let (status, body) = join(&emu, ID).await;
            assert_eq!(status, 200);
            assert_eq!(body["status"], "announced");
            assert_eq!(body["admitted"], false);
            assert_eq!(body["group_id"], ID);
            assert_eq!(body["namespace_id"], ID);
            assert!(emu.held().is_empty());
        }
        let (status, body) = join(&emu, ID).await;
        assert_eq!(status, 200);
        assert_eq!(body["status"], "joined");
        assert_eq!(body["admitted"], true);
        assert!(emu.held().contains(ID));

        // Counted per namespace.
        assert_eq!(join(&emu, OTHER).await.1["admitted"], false);
        assert_eq!(emu.joins(ID), 3);
        assert_eq!(emu.joins(OTHER), 1);
    }

    #[tokio::test]
    async fn admit_without_holding() {
        let emu = MerodEmulator::start().await.unwrap();
        emu.set_join(
            ID,
            JoinBehaviour::AdmitWithoutHolding {
                delay: Duration::ZERO,
            },
        );
        let (status, body) = join(&emu, ID).await;
        assert_eq!(status, 200);
        assert_eq!(body["admitted"], true);
        assert_eq!(body["status"], "joined");
        assert!(emu.held().is_empty());
        assert_eq!(
            namespace(&emu, ID).await,
            (404, error("No namespace identity found"))
        );
        // Other namespaces keep the default.
        join(&emu, OTHER).await;
        assert!(emu.held().contains(OTHER));
    }

    #[tokio::test]
    async fn fleet_join_error_and_hang() {
        let emu = MerodEmulator::start().await.unwrap();
        emu.set_join(
            ID,
            JoinBehaviour::Error {
                status: 500,
                message: "Failed to generate attestation".into(),
            },
        );
        emu.set_join(OTHER, JoinBehaviour::Hang);
        assert_eq!(
            join(&emu, ID).await,
            (500, error("Failed to generate attestation"))
        );

        let err = reqwest::Client::builder()
            .timeout(Duration::from_millis(300))
            .build()
            .unwrap()
            .post(endpoint(&emu, "admin-api/tee/fleet-join"))
            .json(&json!({ "groupId": OTHER }))
            .send()
            .await
            .unwrap_err();
        assert!(err.is_timeout(), "{err}");
        // The server still answers others.
        assert_eq!(get_json(&emu, "admin-api/health").await.0, 200);
        assert_eq!(emu.joins(OTHER), 1);
        assert!(emu.held().is_empty());
        let hung = emu
            .calls()
            .into_iter()
            .find(|c| c.body.contains(OTHER))
            .unwrap();
        assert_eq!(hung.status, 0);
    }

    #[tokio::test]
    async fn fleet_join_bad_requests_answer_400() {
        let emu = MerodEmulator::start().await.unwrap();
        let url = endpoint(&emu, "admin-api/tee/fleet-join");
        let send = |content_type: Option<&'static str>, body: String| {
            let mut request = client().post(url.clone()).body(body);
            if let Some(content_type) = content_type {
                request = request.header(CONTENT_TYPE, content_type);
            }
            async move { answer(request.send().await.unwrap()).await }
        };

        let good = json!({ "groupId": ID }).to_string();
        assert_eq!(
            send(None, good.clone()).await,
            (
                400,
                error("Expected request with `Content-Type: application/json`")
            )
        );
        assert_eq!(send(Some("text/plain"), good).await.0, 400);

        let (status, body) = send(
            Some("application/json"),
            json!({ "group_id": ID }).to_string(),
        )
        .await;
        assert_eq!(status, 400);
        let message = body["error"].as_str().unwrap();
        assert!(
            message.starts_with(
                "Invalid JSON data: Failed to deserialize the JSON body into the target type: \
                 missing field `groupId`"
            ),
            "{message}"
        );

        let (status, body) = send(Some("application/json"), "{\"groupId\": ".into()).await;
        assert_eq!(status, 400);
        assert!(body["error"]
            .as_str()
            .unwrap()
            .starts_with("Invalid JSON data: Failed to parse the request body as JSON"));

        assert_eq!(
            send(
                Some("application/json"),
                json!({ "groupId": "abcd" }).to_string()
            )
            .await,
            (
                400,
                error("Field 'group_id' must be exactly 64 characters (got 4)")
            )
        );
        assert_eq!(
            send(
                Some("application/json"),
                json!({ "groupId": "z".repeat(64) }).to_string()
            )
            .await,
            (
                400,
                error("Field 'group_id' contains invalid hex encoding: not valid hex")
            )
        );

        assert_eq!(emu.joins(ID), 0);
        assert!(emu.held().is_empty());
        let statuses: Vec<u16> = emu.calls().iter().map(|c| c.status).collect();
        assert_eq!(statuses, vec![400; 6]);
        assert_eq!(emu.calls()[0].content_type, None);
    }

    #[tokio::test]
    async fn leave_held_then_again() {
        let emu = MerodEmulator::start().await.unwrap();
        emu.hold(&ID.to_uppercase());
        assert_eq!(emu.held(), BTreeSet::from([ID.to_owned()]));
        assert_eq!(namespace(&emu, ID).await.0, 200);

        let (status, body) = leave(&emu, &ID.to_uppercase()).await;
        assert_eq!(status, 200);
        assert_eq!(
            body,
            json!({ "data": {
                "namespaceId": ID,
                "memberPublicKey": "8W55hTWXwYgpV5hwnZ3f25G5H1Yt5Qb3bRMwFTFDEyin",
            } })
        );
        assert!(emu.held().is_empty());
        assert_eq!(
            namespace(&emu, ID).await,
            (404, error("No namespace identity found"))
        );

        assert_eq!(leave(&emu, ID).await, (500, error("Internal server error")));
        assert_eq!(
            leave(&emu, OTHER).await,
            (500, error("Internal server error"))
        );
        assert_eq!(emu.leaves(ID), 2);
        assert_eq!(emu.leaves(OTHER), 1);

        let call = emu
            .calls()
            .into_iter()
            .find(|c| c.path.ends_with("/leave"))
            .unwrap();
        assert_eq!(call.method, "POST");
        assert_eq!(
            call.path,
            format!("/admin-api/namespaces/{}/leave", ID.to_uppercase())
        );
        assert_eq!(call.body, "");
    }

    #[tokio::test]
    async fn leave_delay_hang_and_error() {
        let emu = MerodEmulator::start().await.unwrap();
        emu.hold(ID);
        emu.hold(OTHER);
        emu.set_leave(
            ID,
            LeaveBehaviour::Normal {
                delay: Duration::from_millis(200),
            },
        );
        let started = Instant::now();
        assert_eq!(leave(&emu, ID).await.0, 200);
        assert!(started.elapsed() >= Duration::from_millis(200));

        emu.set_default_leave(LeaveBehaviour::Error { status: 503 });
        assert_eq!(
            leave(&emu, OTHER).await,
            (503, error("Service Unavailable"))
        );
        emu.set_leave(OTHER, LeaveBehaviour::Error { status: 500 });
        assert_eq!(
            leave(&emu, OTHER).await,
            (500, error("Internal server error"))
        );
        assert!(emu.held().contains(OTHER));

        emu.set_leave(OTHER, LeaveBehaviour::Hang);
        let err = reqwest::Client::builder()
            .timeout(Duration::from_millis(300))
            .build()
            .unwrap()
            .post(endpoint(
                &emu,
                &format!("admin-api/namespaces/{OTHER}/leave"),
            ))
            .send()
            .await
            .unwrap_err();
        assert!(err.is_timeout(), "{err}");
        assert!(emu.held().contains(OTHER));
        assert_eq!(emu.leaves(OTHER), 3);
    }

    #[tokio::test]
    async fn malformed_namespace_ids_answer_400() {
        let emu = MerodEmulator::start().await.unwrap();
        let bad_id = error("Invalid group id format: expected hex-encoded 32 bytes");
        assert_eq!(leave(&emu, "xyz").await, (400, bad_id.clone()));
        assert_eq!(leave(&emu, &"g".repeat(64)).await, (400, bad_id.clone()));
        assert_eq!(namespace(&emu, "xyz").await, (400, bad_id.clone()));
        assert_eq!(namespace(&emu, &ID[..63]).await, (400, bad_id));
        assert_eq!(emu.leaves("xyz"), 0);
    }

    #[tokio::test]
    async fn list_namespaces_shows_held_ones() {
        let emu = MerodEmulator::start().await.unwrap();
        assert_eq!(
            get_json(&emu, "admin-api/namespaces").await,
            (200, json!({ "data": [] }))
        );
        emu.hold(OTHER);
        emu.hold(ID);
        let (status, body) = get_json(&emu, "admin-api/namespaces").await;
        assert_eq!(status, 200);
        let ids: Vec<&str> = body["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|entry| entry["namespaceId"].as_str().unwrap())
            .collect();
        assert_eq!(ids, vec![ID, OTHER]);
        assert_eq!(body["data"][0]["subgroupCount"], 0);
        assert_eq!(body["data"][1]["contextCount"], 0);

        let (_, body) = get_json(&emu, "admin-api/namespaces?offset=1&limit=5").await;
        assert_eq!(body["data"].as_array().unwrap().len(), 1);
        assert_eq!(body["data"][0]["namespaceId"], OTHER);
        assert_eq!(get_json(&emu, "admin-api/namespaces?limit=-1").await.0, 400);

        emu.unhold(OTHER);
        let (_, body) = get_json(&emu, "admin-api/namespaces").await;
        assert_eq!(body["data"].as_array().unwrap().len(), 1);
    }

    /// Status, content type and body text of a GET.
    async fn get_raw(emu: &MerodEmulator, path: &str) -> (u16, Option<String>, String) {
        let response = client().get(endpoint(emu, path)).send().await.unwrap();
        let status = response.status().as_u16();
        let content_type = response
            .headers()
            .get(CONTENT_TYPE)
            .map(|v| v.to_str().unwrap().to_owned());
        (status, content_type, response.text().await.unwrap())
    }

    /// merod (recorded: `registration-attest` on rc.25; a GET of fleet-join) answers an
    /// unknown route 404 and a known route with another method 405, both empty.
    #[tokio::test]
    async fn the_listing_can_fail_after_some_pages() {
        let emu = MerodEmulator::start().await.unwrap();
        emu.hold(ID);
        emu.set_list(ListBehaviour::ErrorAfterPages {
            pages: 2,
            status: 503,
        });
        let page = "admin-api/namespaces?offset=0&limit=1";
        assert_eq!(get_json(&emu, page).await.0, 200);
        assert_eq!(get_json(&emu, "admin-api/namespaces?limit=x").await.0, 400);
        assert_eq!(get_json(&emu, page).await.0, 200);
        assert_eq!(get_json(&emu, page).await.0, 503);
        assert_eq!(get_json(&emu, page).await.0, 503);
        // Setting it again restarts the count.
        emu.set_list(ListBehaviour::ErrorAfterPages {
            pages: 1,
            status: 500,
        });
        assert_eq!(get_json(&emu, page).await.0, 200);
        assert_eq!(get_json(&emu, page).await.0, 500);
    }

    #[tokio::test]
    async fn unknown_routes_answer_404_other_methods_405_empty_and_are_recorded() {
        let emu = MerodEmulator::start().await.unwrap();
        assert_eq!(
            get_raw(&emu, "admin-api/contexts").await,
            (404, None, String::new())
        );
        assert_eq!(
            get_raw(&emu, "admin-api/tee/fleet-join").await,
            (405, None, String::new())
        );
        let calls = emu.calls();
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0].method, "GET");
        assert_eq!(calls[0].path, "/admin-api/contexts");
        assert_eq!(calls[0].status, 404);
        assert_eq!(calls[1].status, 405);
        assert!(calls[0].at <= calls[1].at);
    }

    #[tokio::test]
    async fn group_members_list_this_node_while_it_holds_the_namespace() {
        let emu = MerodEmulator::start().await.unwrap();
        let path = format!("admin-api/groups/{ID}/members?offset=0&limit=1000");
        assert_eq!(
            get_json(&emu, &path).await,
            (500, error("Internal server error"))
        );
        assert_eq!(join(&emu, ID).await.0, 200);
        let (status, body) = get_json(&emu, &path).await;
        assert_eq!(status, 200);
        let rows = body["members"].as_array().unwrap();
        assert_eq!(rows.len(), 2);
        let account = Fixtures::load().join_admitted.body["account"].clone();
        assert!(rows
            .iter()
            .any(|r| r["role"] == "ReadOnlyTee" && r["identity"] == account));
        assert!(rows.iter().any(|r| r["role"] == "Admin"));
        let (_, page) = get_json(
            &emu,
            &format!("admin-api/groups/{ID}/members?offset=1&limit=1"),
        )
        .await;
        assert_eq!(page["members"].as_array().unwrap().len(), 1);
        assert_eq!(page["members"][0], rows[1]);
        assert_eq!(
            get_json(&emu, "admin-api/groups/xyz/members").await,
            (
                400,
                error("Invalid group id format: expected hex-encoded 32 bytes")
            )
        );
        assert_eq!(leave(&emu, ID).await.0, 200);
        assert_eq!(get_json(&emu, &path).await.0, 500);
    }
}
