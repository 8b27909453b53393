//! The recovery envelopes MDMA keeps of each member account of each confirmed namespace:
//! what to seal and when (pure: [`want_full`], [`plaintexts`], [`RecoveryRecord`]), what
//! of a walk of one namespace they need ([`groups_of`]), and the job that seals and writes
//! them beside the loop.
//!
//! The job takes the walks of the namespaces' trees (`trees::walk_tree`: their groups
//! breadth-first, at most `MAX_GROUPS`, each group's members, contexts and member devices,
//! every list paged) that the inventory hands over, or makes them itself when the inventory
//! is off, walking the namespaces merod's usage signal shows changed and every one at least
//! every `WHOLE_EVERY`. Of each walk read whole it builds per member account the v2
//! plaintext (its groups, the union of their contexts, its own devices), and for each whose
//! SHA-256 differs from the one recorded (or all of them on a full pass) seals it through
//! merod to the account's root key and `PUT`s it to MDMA at the recorded version + 1; on a
//! 409 at a version above it that MDMA takes ([`next_offer`]). A namespace not read whole
//! writes and deletes nothing. Members no longer listed, and every entry of a namespace
//! neither confirmed nor held by merod, are `DELETE`d once proven gone: missing from two
//! complete reads at least [`MISSING_FOR`] apart, never on a member list that is empty or
//! lacks the node's own account, at most [`MAX_DELETES_PER_PASS`] a pass. A namespace left
//! with something to do (a failure, a member seen missing once, a search for a version) is
//! asked to be walked again a [`PASS_EVERY`] later. What landed is kept in
//! `fleet-recovery.json` (the Bash sidecar's format) and its journal, written after each
//! change, before the next call: a version MDMA took is never offered again.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, PoisonError};
use std::time::Duration;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::config::Config;
use crate::durable;
use crate::ids::{GroupId, PeerId};
use crate::jobs::{self, Job, Schedule};
use crate::mdma::{CallError, MdmaClient, RecoveryEnvelope, RecoveryKey, RequestError};
use crate::merod::{MemberDevice, MemberDevices, MerodError, Node, OnMerod, SealedEnvelope};
use crate::outcome::Timed;
use crate::telemetry::{unix_now, Telemetry};

use super::inventory::{AccountSource, NamespacesFeed, NamespacesOffer, WALK_BUDGET};
use super::record_file;
use super::trees::{walk_tree, Gap, GroupReader, Handoff, Needs, TreeRead, WalkBook};

/// How often the envelopes are checked (and at once when the confirmed set changes).
pub(crate) const PASS_EVERY: Duration = Duration::from_secs(300);
/// How often every envelope is sealed and written again at the latest.
pub(crate) const FULL_EVERY: Duration = Duration::from_secs(86_400);
/// The state file, in the state directory (the Bash sidecar's name and format).
pub(crate) const RECORD_FILE: &str = "fleet-recovery.json";
/// The journal beside the record: the changes since it was last written whole, one
/// [`Change`] a line.
pub(crate) const JOURNAL_FILE: &str = "fleet-recovery.journal";
/// How large the journal may grow during a pass before the record is written whole.
const COMPACT_DURING_PASS: u64 = 8 * 1024 * 1024;
/// The record and the journal name member accounts: nobody else reads them.
const RECORD_MODE: u32 = 0o600;
/// How long an account must have been missing from complete reads of its namespace (the
/// first such read and a later one at least this far apart) before its envelope is deleted:
/// one odd answer (`200 {"members": []}`) deletes nothing.
pub(crate) const MISSING_FOR: Duration = PASS_EVERY;
/// Most envelopes deleted in one pass; the rest wait for the next passes.
pub(crate) const MAX_DELETES_PER_PASS: usize = 64;
/// Most `PUT`s of one envelope in one pass while MDMA answers 409 (the first included): the
/// search upward for a version MDMA takes goes on from where it stopped at the next pass.
pub(crate) const MAX_PUTS_PER_ENVELOPE: u32 = 16;
/// Most `PUT`s refused with 409 in one pass, all envelopes together: a MDMA that refuses
/// everything costs a bounded number of requests a pass.
pub(crate) const MAX_CONFLICTS_PER_PASS: u32 = 256;
/// Bound of one pass. A pass cut here keeps what landed (recorded as it landed); the next
/// one takes up the rest, as their digests still differ.
const PASS_DEADLINE: Duration = Duration::from_secs(3600);

/// One envelope MDMA took: its version and the SHA-256 of its plaintext (in the file:
/// `{"version", "sha256": "<hex>"}`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Written {
    /// The version MDMA took.
    pub(crate) version: u64,
    /// SHA-256 of the plaintext sealed.
    pub(crate) sha256: Compact,
}

/// A string the record keeps many of (an account, a digest): 64 lowercase hex in 32 bytes
/// with no block of its own, anything else as read. At 30,000 envelopes the record is then
/// a few MB in the map's own nodes, not 60,000 small blocks.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Compact {
    /// 64 lowercase hex.
    Hex([u8; 32]),
    /// Anything else, verbatim.
    Text(Box<str>),
}

impl Compact {
    /// `text`, in 32 bytes when it is 64 lowercase hex.
    pub(crate) fn new(text: &str) -> Self {
        let mut bytes = [0u8; 32];
        let lowercase = !text.bytes().any(|b| b.is_ascii_uppercase());
        if text.len() == 64 && lowercase && hex::decode_to_slice(text, &mut bytes).is_ok() {
            Self::Hex(bytes)
        } else {
            Self::Text(text.into())
        }
    }

    /// Whether it is `text`.
    pub(crate) fn is(&self, text: &str) -> bool {
        *self == Self::new(text)
    }
}

impl std::fmt::Display for Compact {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Hex(bytes) => f.write_str(&hex::encode(bytes)),
            Self::Text(text) => f.write_str(text),
        }
    }
}

/// A record key, `<namespace>/<account>` in the file: the namespace's id and the account.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct EntryKey {
    namespace: GroupId,
    account: Compact,
}

impl EntryKey {
    /// The key of `account` in `namespace`.
    fn new(namespace: GroupId, account: &str) -> Self {
        Self {
            namespace,
            account: Compact::new(account),
        }
    }

    /// `<namespace>/<account>` read back; `None` unless it starts with a namespace id
    /// spelled as this daemon spells it (such an entry is kept aside, as read).
    fn parse(key: &str) -> Option<Self> {
        let (namespace, account) = key.split_once('/')?;
        let id: GroupId = namespace.parse().ok()?;
        (id.to_string() == namespace).then(|| Self::new(id, account))
    }
}

impl std::fmt::Display for EntryKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.account)
    }
}

/// What was written, kept as `fleet-recovery.json`: `{"envelopes": {"<ns>/<account>":
/// {"version", "sha256"}}, "last_full": <Unix s>}`, as the Bash sidecar keeps it (a node
/// switching over goes on from the versions MDMA holds).
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(from = "RecordFile")]
pub(crate) struct RecoveryRecord {
    /// Each envelope this node wrote.
    pub(crate) envelopes: BTreeMap<EntryKey, Written>,
    /// Entries whose key does not start with a namespace id: kept as read, written back.
    pub(crate) foreign: BTreeMap<String, Written>,
    /// When the last full pass started, Unix seconds (0: never).
    pub(crate) last_full: u64,
    /// The highest version offered to MDMA of each envelope that may have landed without
    /// being recorded (a crash or a lost answer after the offer), by `<ns>/<account>`:
    /// never offered again. Not in the Bash sidecar's file; absent when empty.
    pub(crate) offered: BTreeMap<String, u64>,
}

/// [`RecoveryRecord`] as its file has it.
#[derive(Serialize, Deserialize)]
struct RecordFile {
    #[serde(default)]
    envelopes: BTreeMap<String, WrittenFile>,
    #[serde(default)]
    last_full: u64,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    offered: BTreeMap<String, u64>,
}

/// [`Written`] as its file has it.
#[derive(Serialize, Deserialize)]
struct WrittenFile {
    version: u64,
    sha256: String,
}

impl From<RecordFile> for RecoveryRecord {
    fn from(file: RecordFile) -> Self {
        let mut record = Self {
            last_full: file.last_full,
            offered: file.offered,
            ..Self::default()
        };
        for (key, written) in file.envelopes {
            record.insert(key, written.version, &written.sha256);
        }
        record
    }
}

impl Serialize for RecoveryRecord {
    /// As [`RecordFile`]: `envelopes` rendered entry by entry, never copied whole.
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        struct Entries<'a>(&'a RecoveryRecord);
        impl Serialize for Entries<'_> {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                let file = |w: &Written| WrittenFile {
                    version: w.version,
                    sha256: w.sha256.to_string(),
                };
                let ours = self
                    .0
                    .envelopes
                    .iter()
                    .map(|(k, w)| (k.to_string(), file(w)));
                let foreign = self.0.foreign.iter().map(|(k, w)| (k.clone(), file(w)));
                s.collect_map(ours.chain(foreign))
            }
        }
        let fields = if self.offered.is_empty() { 2 } else { 3 };
        let mut out = s.serialize_struct("RecordFile", fields)?;
        out.serialize_field("envelopes", &Entries(self))?;
        out.serialize_field("last_full", &self.last_full)?;
        if !self.offered.is_empty() {
            out.serialize_field("offered", &self.offered)?;
        }
        out.end()
    }
}

/// One change to the [`RecoveryRecord`], a line of [`JOURNAL_FILE`]:
/// `{"offer": {"<ns>/<account>": version, …}}`, `{"landed": {"key", "version", "sha256"}}`,
/// `{"removed": "<ns>/<account>"}` or `{"full": <Unix s>}`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Change {
    /// Versions about to be offered (durable before the first of them goes out).
    Offer(BTreeMap<String, u64>),
    /// What MDMA took.
    Landed {
        /// `<namespace>/<account>`.
        key: String,
        /// The version taken.
        version: u64,
        /// Hex SHA-256 of the plaintext sealed.
        sha256: String,
    },
    /// An envelope MDMA deleted.
    Removed(String),
    /// A full pass started then (Unix seconds).
    Full(u64),
}

/// `<namespace>/<account>`, the record's key.
fn entry_key(namespace: GroupId, account: &str) -> String {
    format!("{namespace}/{account}")
}

impl RecoveryRecord {
    /// Records `version` of `key` with the plaintext's `sha256` (hex).
    fn insert(&mut self, key: String, version: u64, sha256: &str) {
        let written = Written {
            version,
            sha256: Compact::new(sha256),
        };
        match EntryKey::parse(&key) {
            Some(entry) => {
                self.envelopes.insert(entry, written);
            }
            None => {
                self.foreign.insert(key, written);
            }
        }
    }

    /// Forgets `key`.
    fn remove(&mut self, key: &str) {
        match EntryKey::parse(key) {
            Some(entry) => self.envelopes.remove(&entry),
            None => self.foreign.remove(key),
        };
        self.offered.remove(key);
    }

    /// Whether `key` (`<ns>/<account>`) is recorded.
    pub(crate) fn contains(&self, key: &str) -> bool {
        EntryKey::parse(key).is_some_and(|entry| self.envelopes.contains_key(&entry))
            || self.foreign.contains_key(key)
    }

    /// The accounts recorded for `namespace`.
    pub(crate) fn accounts(&self, namespace: GroupId) -> Vec<String> {
        let first = EntryKey {
            namespace,
            account: Compact::Hex([0; 32]),
        };
        self.envelopes
            .range(first..)
            .take_while(|(k, _)| k.namespace == namespace)
            .map(|(k, _)| k.account.to_string())
            .collect()
    }

    /// The namespaces recorded (entries whose key does not start with an id are ignored).
    pub(crate) fn namespaces(&self) -> BTreeSet<GroupId> {
        self.envelopes.keys().map(|k| k.namespace).collect()
    }

    /// Whether the envelope of `account` in `namespace` is due: never written, its
    /// plaintext changed, or `full`.
    pub(crate) fn due(&self, namespace: GroupId, account: &str, sha256: &str, full: bool) -> bool {
        full || self
            .envelopes
            .get(&EntryKey::new(namespace, account))
            .is_none_or(|w| !w.sha256.is(sha256))
    }

    /// The version to write next for `account` in `namespace`: one above the recorded one
    /// and above any offered since (1 for a new envelope).
    pub(crate) fn next_version(&self, namespace: GroupId, account: &str) -> u64 {
        let recorded = self
            .envelopes
            .get(&EntryKey::new(namespace, account))
            .map_or(0, |w| w.version);
        let key = entry_key(namespace, account);
        let offered = self.offered.get(&key).copied().unwrap_or(0);
        recorded.max(offered).saturating_add(1)
    }

    /// The record after `change`.
    pub(crate) fn apply(&mut self, change: Change) {
        match change {
            Change::Offer(versions) => {
                for (key, version) in versions {
                    let at = self.offered.entry(key).or_insert(0);
                    *at = (*at).max(version);
                }
            }
            Change::Landed {
                key,
                version,
                sha256,
            } => {
                if self.offered.get(&key).is_some_and(|v| *v <= version) {
                    self.offered.remove(&key);
                }
                self.insert(key, version, &sha256);
            }
            Change::Removed(key) => self.remove(&key),
            Change::Full(at) => self.last_full = at,
        }
    }
}

/// Whether this pass seals everything: the confirmed set changed since an earlier pass, or
/// [`FULL_EVERY`] passed since the last full pass (`last_full` ahead of `now`, a clock
/// stepped back, counts as due).
pub(crate) fn want_full(set_changed: bool, last_full: u64, now_unix: u64) -> bool {
    set_changed || last_full > now_unix || now_unix - last_full >= FULL_EVERY.as_secs()
}

/// One group of a namespace as read: its direct members, contexts and member devices.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct GroupRead {
    /// The group.
    pub(crate) id: GroupId,
    /// Its member accounts (lowercase hex).
    pub(crate) members: Vec<String>,
    /// Its contexts.
    pub(crate) contexts: Vec<String>,
    /// Its `member-devices` rows.
    pub(crate) devices: Vec<MemberDevices>,
}

/// One account's plaintext and its digest.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Plaintext {
    /// The v2 plaintext (compact JSON, keys sorted).
    pub(crate) bytes: Vec<u8>,
    /// Hex SHA-256 of `bytes`.
    pub(crate) sha256: String,
}

/// The v2 plaintext; its fields are declared in key order, so it renders with sorted keys.
#[derive(Serialize)]
struct PlaintextV2<'a> {
    contexts: Vec<&'a str>,
    devices: Vec<&'a MemberDevice>,
    groups: Vec<String>,
    namespace_id: String,
    v: u8,
}

/// The plaintext of every member account of `namespace` read as `groups`:
/// `{"contexts": [sorted], "devices": [{"device_id", "signing_key"} sorted by id],
/// "groups": [sorted], "namespace_id", "v": 2}`, compact, keys sorted; `groups` are those
/// where the account has a direct row, `contexts` the union of theirs, `devices` the
/// account's own from every group's `member-devices`, each device id once (its first row in
/// walk order), signing keys verbatim.
pub(crate) fn plaintexts(namespace: GroupId, groups: &[GroupRead]) -> BTreeMap<String, Plaintext> {
    let mut of: BTreeMap<&str, (BTreeSet<GroupId>, BTreeSet<&str>)> = BTreeMap::new();
    for group in groups {
        for account in &group.members {
            let entry = of.entry(account.as_str()).or_default();
            entry.0.insert(group.id);
            entry.1.extend(group.contexts.iter().map(String::as_str));
        }
    }
    let mut devices: BTreeMap<&str, BTreeMap<&str, &MemberDevice>> = BTreeMap::new();
    for row in groups.iter().flat_map(|g| &g.devices) {
        let own = devices.entry(row.account.as_str()).or_default();
        for device in &row.devices {
            own.entry(device.device_id.as_str()).or_insert(device);
        }
    }
    of.into_iter()
        .map(|(account, (in_groups, contexts))| {
            let body = PlaintextV2 {
                contexts: contexts.into_iter().collect(),
                devices: devices
                    .get(account)
                    .map(|d| d.values().copied().collect())
                    .unwrap_or_default(),
                groups: in_groups.iter().map(GroupId::to_string).collect(),
                namespace_id: namespace.to_string(),
                v: 2,
            };
            // Strings, a number and lists of them always render.
            let bytes = serde_json::to_vec(&body).unwrap_or_default();
            let sha256 = hex::encode(Sha256::digest(&bytes));
            (account.to_owned(), Plaintext { bytes, sha256 })
        })
        .collect()
}

/// The merod calls the envelopes need beyond the group reads ([`MerodClient`](crate::merod::MerodClient)'s; a fake in
/// tests).
#[async_trait]
pub(crate) trait EnvelopeReader: GroupReader {
    /// Itself as the reads of a walk.
    fn reader(&self) -> &dyn GroupReader;
    /// [`MerodClient::seal_to_account`](crate::merod::MerodClient::seal_to_account).
    async fn seal(
        &self,
        group: GroupId,
        account: &str,
        plaintext: &[u8],
    ) -> Result<Option<SealedEnvelope>, MerodError>;
    /// [`MerodClient::lacks_seal_route`](crate::merod::MerodClient::lacks_seal_route).
    fn lacks_seal_route(&self) -> bool;
    /// The namespaces merod holds ([`Node::list_namespaces`]).
    async fn held(&self) -> Result<BTreeSet<GroupId>, MerodError>;
}

#[async_trait]
impl<T: OnMerod> EnvelopeReader for T {
    fn reader(&self) -> &dyn GroupReader {
        self
    }
    async fn seal(
        &self,
        group: GroupId,
        account: &str,
        plaintext: &[u8],
    ) -> Result<Option<SealedEnvelope>, MerodError> {
        self.merod()
            .seal_to_account(group, account, plaintext)
            .await
    }
    fn lacks_seal_route(&self) -> bool {
        self.merod().lacks_seal_route()
    }
    async fn held(&self) -> Result<BTreeSet<GroupId>, MerodError> {
        Node::list_namespaces(self.merod()).await
    }
}

/// Where the envelopes go ([`MdmaClient`]'s routes; a fake in tests).
#[async_trait]
pub(crate) trait EnvelopeSink: Send + Sync {
    /// [`MdmaClient::put_recovery_envelope`].
    async fn put(&self, envelope: &RecoveryEnvelope) -> Result<(), CallError>;
    /// [`MdmaClient::delete_recovery_envelope`].
    async fn delete(&self, key: &RecoveryKey) -> Result<(), CallError>;
}

#[async_trait]
impl EnvelopeSink for MdmaClient {
    async fn put(&self, envelope: &RecoveryEnvelope) -> Result<(), CallError> {
        self.put_recovery_envelope(envelope).await
    }
    async fn delete(&self, key: &RecoveryKey) -> Result<(), CallError> {
        self.delete_recovery_envelope(key).await
    }
}

/// The outside world the envelopes need: merod's reads and seal, MDMA's route.
#[derive(Clone)]
pub(crate) struct RecoveryDeps {
    /// merod.
    pub(crate) merod: Arc<dyn EnvelopeReader>,
    /// MDMA.
    pub(crate) mdma: Arc<dyn EnvelopeSink>,
}

/// The groups of a walk as the envelopes need them: each group's member accounts,
/// contexts and member devices.
///
/// Errors: the walk's [`Gap`] (a failed read, the budget spent, a tree too large): nothing
/// of a walk not read whole is used.
pub(crate) fn groups_of(read: TreeRead) -> Result<Vec<GroupRead>, Gap> {
    if let Some(gap) = read.gap {
        return Err(gap);
    }
    let mut own = read.members;
    read.groups
        .into_iter()
        .map(|node| {
            let members = if node.id == read.namespace {
                own.take()
            } else {
                node.members
            };
            match (members, node.contexts, node.devices) {
                (Some(members), Some(contexts), Some(devices)) => Ok(GroupRead {
                    id: node.id,
                    members: members.into_iter().map(|m| m.identity).collect(),
                    contexts,
                    devices,
                }),
                _ => Err(Gap::NotAsked),
            }
        })
        .collect()
}

/// Why a pass did not do all it had to (the harness says each change once; the next pass
/// takes up what is left).
#[derive(Debug, thiserror::Error)]
pub(crate) enum PassError {
    /// merod has no seal route: the job waits (see the module docs of `merod::seal`).
    #[error("merod has no seal route (POST /admin-api/groups/{{id}}/accounts/{{account}}/seal, 0.11.0-rc.34 or newer); asking again after merod restarts or within {:?}", crate::merod::SEAL_ROUTE_RETRY)]
    NoSealRoute,
    /// What landed could not be recorded: no further envelope is written until it can be.
    #[error(
        "the recovery record cannot be written ({0}); writing no further envelope until it can"
    )]
    Record(String),
    /// Some envelopes were not written or removed, or some namespaces not read whole.
    #[error("{failed} envelope(s) not written or removed, {incomplete} namespace(s) not read whole; the first: {first}")]
    Partly {
        /// Envelopes not sealed, written or removed.
        failed: usize,
        /// Namespaces not read whole.
        incomplete: usize,
        /// The first failure.
        first: String,
    },
}

impl Timed for PassError {
    fn is_timeout(&self) -> bool {
        false
    }
}

/// What a pass did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct PassDone {
    /// Envelopes written.
    pub(crate) written: usize,
    /// Envelopes removed.
    pub(crate) removed: usize,
}

/// The loop's side of the recovery job: hands it the confirmed namespaces.
#[derive(Clone, Debug)]
pub(crate) struct RecoveryView {
    confirmed: NamespacesOffer,
    /// The namespaces the state records as admitted: a leave that ends drops one and wakes
    /// the job, which then deletes what merod no longer holds.
    recorded: NamespacesOffer,
}

impl RecoveryView {
    /// Whether [`RecoveryView::start`] starts the job.
    pub(crate) fn starts(cfg: &Config, deps: Option<&RecoveryDeps>) -> bool {
        deps.is_some() && cfg.recovery.enabled && !cfg.dry_run
    }

    /// Starts the job for the node `peer_id` (its account read from `account` at each pass)
    /// when `[recovery] enabled` (not in a dry run, not without `deps`), its record kept
    /// beside the state file. With `walks`, it takes the walks the inventory hands over
    /// there; without, it walks the namespaces itself.
    pub(crate) fn start(
        cfg: &Config,
        deps: Option<RecoveryDeps>,
        peer_id: PeerId,
        account: AccountSource,
        walks: Option<Arc<Handoff>>,
        telemetry: Arc<Telemetry>,
        shutdown: CancellationToken,
    ) -> Option<Self> {
        if !Self::starts(cfg, deps.as_ref()) {
            return None;
        }
        let deps = deps?;
        let (confirmed, feed) = NamespacesOffer::channel();
        let (recorded, recorded_feed) = NamespacesOffer::channel();
        let path = record_file::beside_state(cfg, RECORD_FILE);
        let feeds = (feed, recorded_feed);
        let job = PassJob::new(deps, peer_id, account, feeds, &path, walks);
        jobs::spawn(job, telemetry, shutdown);
        Some(Self {
            confirmed,
            recorded,
        })
    }

    /// Hands over the confirmed namespaces and the admitted ones (`recorded`); the job wakes
    /// only when one differs from the set handed over before.
    pub(crate) fn offer(&self, confirmed: &BTreeSet<GroupId>, recorded: &BTreeSet<GroupId>) {
        self.confirmed.offer(confirmed);
        self.recorded.offer(recorded);
    }
}

/// The record at `path` with the changes of the journal at `journal` applied in order; an
/// empty one when there is none or it cannot be read (said: MDMA may then hold versions this
/// node no longer knows, and answer 409 until they are passed). A journal line that does not
/// parse ends the replay there (a crash in the middle of an append tears only the last).
fn load_record(path: &Path, journal: &Path) -> RecoveryRecord {
    let lost = |why: String| {
        warn!(path = %path.display(), "the recovery record is lost ({why}): envelopes start again at version 1, and where MDMA holds a newer one (409) the job looks for a version above it");
        RecoveryRecord::default()
    };
    let mut record = record_file::read(path).unwrap_or_else(|e| lost(e.to_string()));
    let bytes = match durable::read_capped(journal, record_file::MAX_RECORD) {
        Ok(bytes) => bytes.unwrap_or_default(),
        Err(e) => {
            warn!(path = %journal.display(), "the recovery journal cannot be read ({e}): the changes since the record was last written are lost");
            Vec::new()
        }
    };
    let mut lines = bytes.split(|b| *b == b'\n').filter(|l| !l.is_empty());
    for line in lines.by_ref() {
        match serde_json::from_slice::<Change>(line) {
            Ok(change) => record.apply(change),
            Err(e) => {
                warn!(path = %journal.display(), "the recovery journal ends in a line that does not parse ({e}): the changes from there on are lost");
                break;
            }
        }
    }
    record
}

/// The recovery envelopes' job: one pass a run.
pub(crate) struct PassJob {
    deps: RecoveryDeps,
    peer_id: PeerId,
    confirmed: NamespacesFeed,
    /// What the node may hold; only wakes the job.
    recorded: NamespacesFeed,
    /// The set changed since a full pass last started: the next pass is full.
    pending_full: bool,
    record: RecoveryRecord,
    /// Where the record is kept.
    kept: Kept,
    /// The node's own account: a member list without it proves no one left.
    account: AccountSource,
    /// Record keys missing from a complete read, and the start of the pass that first saw
    /// it; forgotten when the account is listed again. Kept in memory only: after a
    /// restart an account must be seen missing twice again.
    missing: BTreeMap<String, Instant>,
    /// Record keys whose `PUT` drew 409s: the next version to offer and the refusals so far.
    searching: BTreeMap<String, (u64, u32)>,
    /// Whether MDMA holding newer versions than the record was said (once a run).
    behind_said: bool,
    /// The walks to take (the inventory's), and the namespaces to walk again.
    walks: Arc<Handoff>,
    /// Which namespaces were read whole, with what signal, when the job walks them itself
    /// (`None`: the inventory walks).
    own_walk: Option<WalkBook>,
    /// The namespaces whose next walk read whole a full pass writes in full.
    full_left: BTreeSet<GroupId>,
    /// When the envelopes of namespaces left were last removed.
    swept: Option<Instant>,
}

/// What one pass did and may still do.
struct Tally {
    done: PassDone,
    failed: usize,
    incomplete: usize,
    first: Option<String>,
    /// Deletes this pass may still make.
    deletes_left: usize,
    /// Deletes proven but left for a later pass (the bound was reached).
    deferred: usize,
    /// 409s this pass may still draw.
    conflicts_left: u32,
}

impl Tally {
    fn new() -> Self {
        Self {
            done: PassDone::default(),
            failed: 0,
            incomplete: 0,
            first: None,
            deletes_left: MAX_DELETES_PER_PASS,
            deferred: 0,
            conflicts_left: MAX_CONFLICTS_PER_PASS,
        }
    }

    fn failed(&mut self, why: String) {
        debug!("{why}");
        self.failed += 1;
        self.first.get_or_insert(why);
    }
}

/// Where the record is kept: written whole ([`RECORD_FILE`]) now and then, its changes since
/// in the journal ([`JOURNAL_FILE`]) beside it.
struct Kept {
    path: PathBuf,
    journal_path: PathBuf,
    /// Opened at the first change.
    journal: Arc<std::sync::Mutex<Option<durable::Journal>>>,
    /// Bytes of the record as last written whole (read at start).
    written_len: u64,
}

impl Kept {
    /// The record at `path` and its journal beside it.
    fn at(path: PathBuf) -> Self {
        let journal_path = path.with_file_name(JOURNAL_FILE);
        let written_len = std::fs::metadata(&path).map_or(0, |m| m.len());
        Self {
            path,
            journal_path,
            journal: Arc::new(std::sync::Mutex::new(None)),
            written_len,
        }
    }

    /// The record and its journal as they are on disk.
    fn load(&self) -> RecoveryRecord {
        load_record(&self.path, &self.journal_path)
    }
}

impl PassJob {
    /// The job writing for `peer_id` the envelopes of the namespaces the first feed hands
    /// it (the second: those the node may hold), its record at `path` (read now), taking
    /// the walks `walks` hands over, or walking itself without.
    pub(crate) fn new(
        deps: RecoveryDeps,
        peer_id: PeerId,
        account: AccountSource,
        (confirmed, recorded): (NamespacesFeed, NamespacesFeed),
        path: &Path,
        walks: Option<Arc<Handoff>>,
    ) -> Self {
        let kept = Kept::at(path.to_path_buf());
        Self {
            record: kept.load(),
            kept,
            deps,
            peer_id,
            confirmed,
            recorded,
            pending_full: false,
            account,
            missing: BTreeMap::new(),
            searching: BTreeMap::new(),
            behind_said: false,
            own_walk: walks.is_none().then(WalkBook::default),
            walks: walks.unwrap_or_default(),
            full_left: BTreeSet::new(),
            swept: None,
        }
    }

    /// Appends `changes` to the journal (durable before it returns when `sync`), then
    /// applies them to the record. An offer is synced before the `PUT`s it covers go out;
    /// what landed, a delete or a full pass's start need not be: lost to a crash, the offer
    /// still keeps the versions from being offered again, and a delete or a full pass is
    /// merely done again.
    ///
    /// Errors: [`PassError::Record`] when the journal cannot be written.
    async fn change(&mut self, changes: Vec<Change>, sync: bool) -> Result<(), PassError> {
        let lines = changes
            .iter()
            .map(serde_json::to_vec)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| PassError::Record(e.to_string()))?;
        let (journal, path) = (
            Arc::clone(&self.kept.journal),
            self.kept.journal_path.clone(),
        );
        tokio::task::spawn_blocking(move || {
            let mut journal = journal.lock().unwrap_or_else(PoisonError::into_inner);
            if journal.is_none() {
                *journal = Some(durable::Journal::open(&path, RECORD_MODE)?);
            }
            let Some(journal) = journal.as_mut() else {
                return Ok(());
            };
            for line in &lines {
                journal.append(line)?;
            }
            if sync {
                journal.sync()?;
            }
            Ok::<(), durable::WriteError>(())
        })
        .await
        .map_err(|e| PassError::Record(e.to_string()))?
        .map_err(|e| PassError::Record(e.to_string()))?;
        for change in changes {
            self.record.apply(change);
        }
        Ok(())
    }

    /// Writes the record whole and empties the journal once the journal holds at least
    /// `floor` bytes and half the record's size: the record's writes then cost at most twice
    /// its changes, whatever its size.
    ///
    /// Errors: [`PassError::Record`] when the record cannot be written (the journal then
    /// still holds every change).
    async fn compact(&mut self, floor: u64) -> Result<(), PassError> {
        let journal = Arc::clone(&self.kept.journal);
        let pending = journal
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
            .map_or(0, durable::Journal::len);
        if pending == 0 || pending < floor || pending.saturating_mul(2) < self.kept.written_len {
            return Ok(());
        }
        let path = self.kept.path.clone();
        let emptied = move || {
            let mut journal = journal.lock().unwrap_or_else(PoisonError::into_inner);
            match journal.as_mut() {
                Some(journal) => journal.clear(),
                None => Ok(()),
            }
        };
        let len = record_file::write_whole(&self.record, path, RECORD_MODE, emptied)
            .await
            .map_err(|e| PassError::Record(e.to_string()))?;
        self.kept.written_len = len;
        Ok(())
    }

    fn key(&self, namespace: GroupId, account: &str) -> RecoveryKey {
        RecoveryKey {
            peer_id: self.peer_id.clone(),
            account_id: account.to_owned(),
            namespace_id: namespace,
        }
    }

    /// Takes the walks the inventory handed over until none waits.
    async fn take_walks(
        &mut self,
        confirmed: &BTreeSet<GroupId>,
        tally: &mut Tally,
    ) -> Result<(), PassError> {
        loop {
            let walks = self.walks.take();
            if walks.is_empty() {
                return Ok(());
            }
            for (namespace, read) in walks {
                // This walk answers what was asked of it (a full pass's included).
                self.walks.walked(namespace);
                self.take_walk(read, confirmed, tally).await?;
                // A long first pass keeps its journal bounded.
                self.compact(COMPACT_DURING_PASS).await?;
            }
        }
    }

    /// Walks, with the inventory off, the namespaces `book` picks by merod's usage signal
    /// (every one when a whole walk is due) and those asked for by `now`, taking each walk
    /// as it is read.
    async fn walk_own(
        &mut self,
        book: &mut WalkBook,
        confirmed: &BTreeSet<GroupId>,
        now: Instant,
        tally: &mut Tally,
    ) -> Result<(), PassError> {
        let usage = match self.deps.merod.usage().await {
            Ok(usage) => Some(usage),
            Err(e) => {
                debug!("merod's usage did not answer ({e}): walking every namespace");
                None
            }
        };
        let whole = book.whole_due(now);
        let mut to_walk = book.pick(confirmed, usage.as_ref(), whole, now);
        to_walk.extend(self.walks.wanted(now, usize::MAX));
        to_walk.sort_unstable();
        to_walk.dedup();
        let account = (self.account)();
        let needs = Needs {
            account: account.as_deref(),
            devices: true,
            capabilities: false,
        };
        for namespace in to_walk {
            let read = walk_tree(self.deps.merod.reader(), namespace, needs, WALK_BUDGET).await;
            book.walked(namespace, usage.as_ref(), read.complete());
            self.walks.walked(namespace);
            self.take_walk(read, confirmed, tally).await?;
            self.compact(COMPACT_DURING_PASS).await?;
        }
        Ok(())
    }

    /// Takes one walk: for a confirmed namespace read whole, its envelopes
    /// ([`PassJob::pass_namespace`], in full when a full pass still owes it one); a walk not
    /// read whole writes nothing. A namespace left with something to do is asked to be
    /// walked again a [`PASS_EVERY`] later.
    async fn take_walk(
        &mut self,
        read: TreeRead,
        confirmed: &BTreeSet<GroupId>,
        tally: &mut Tally,
    ) -> Result<(), PassError> {
        let namespace = read.namespace;
        if !confirmed.contains(&namespace) {
            return Ok(());
        }
        let before = (tally.failed, tally.incomplete, tally.deferred);
        match groups_of(read) {
            Ok(groups) => {
                let full = self.full_left.remove(&namespace);
                self.pass_namespace(namespace, &groups, full, tally).await?;
            }
            Err(why) => {
                warn!(namespace_id = %namespace, "Recovery plan for {namespace} is incomplete ({why}); writing nothing rather than a partial list");
                tally.incomplete += 1;
                tally
                    .first
                    .get_or_insert_with(|| format!("{namespace}: {why}"));
            }
        }
        let prefix = format!("{namespace}/");
        let pending = |keys: &mut dyn Iterator<Item = &String>| {
            keys.next().is_some_and(|k| k.starts_with(&prefix))
        };
        let unsettled = before != (tally.failed, tally.incomplete, tally.deferred)
            || pending(&mut self.missing.range(prefix.clone()..).map(|(k, _)| k))
            || pending(&mut self.searching.range(prefix.clone()..).map(|(k, _)| k));
        if unsettled {
            self.walks.want(namespace, Instant::now() + PASS_EVERY);
        }
        Ok(())
    }

    /// Seals and writes the due envelopes of `namespace` as read whole (`groups`), then
    /// removes those of members proven gone ([`PassJob::proven_missing`]), unless the member
    /// list is empty or lacks the node's own account (then the read is not trusted to say
    /// who left).
    async fn pass_namespace(
        &mut self,
        namespace: GroupId,
        groups: &[GroupRead],
        full: bool,
        tally: &mut Tally,
    ) -> Result<(), PassError> {
        let plan = plaintexts(namespace, groups);
        let offers: BTreeMap<String, u64> = plan
            .iter()
            .filter(|(account, p)| self.record.due(namespace, account, &p.sha256, full))
            .map(|(account, _)| {
                let key = entry_key(namespace, account);
                let version = self
                    .searching
                    .get(&key)
                    .map_or_else(|| self.record.next_version(namespace, account), |s| s.0);
                (key, version)
            })
            .collect();
        // Sealed first: a seal that fails spends no version and writes nothing.
        let mut sealed = Vec::with_capacity(offers.len());
        for (account, plaintext) in &plan {
            let key = entry_key(namespace, account);
            let Some(&version) = offers.get(&key) else {
                continue;
            };
            match self
                .deps
                .merod
                .seal(namespace, account, &plaintext.bytes)
                .await
            {
                Ok(Some(envelope)) => sealed.push((key, version, account, plaintext, envelope)),
                Ok(None) => return Err(PassError::NoSealRoute),
                Err(e) => tally.failed(format!("sealing for {account} in {namespace}: {e}")),
            }
        }
        if sealed.is_empty() {
            return self.remove_left(namespace, &plan, tally).await;
        }
        // The versions about to be offered, durable before the first goes out: one fsync
        // for the namespace, and no version that may land is ever offered again.
        let offered = sealed
            .iter()
            .map(|(key, v, ..)| (key.clone(), *v))
            .collect();
        self.change(vec![Change::Offer(offered)], true).await?;
        for (_, version, account, plaintext, envelope) in sealed {
            let envelope = RecoveryEnvelope {
                key: self.key(namespace, account),
                ciphertext: envelope.to_json_string(),
                version,
            };
            self.put(envelope, &plaintext.sha256, tally).await?;
        }
        self.remove_left(namespace, &plan, tally).await
    }

    /// Removes the envelopes of the members of `namespace` no longer in `plan` (its complete
    /// read) once proven gone ([`PassJob::proven_missing`]), unless the member list is empty
    /// or lacks the node's own account.
    async fn remove_left(
        &mut self,
        namespace: GroupId,
        plan: &BTreeMap<String, Plaintext>,
        tally: &mut Tally,
    ) -> Result<(), PassError> {
        let own = (self.account)().map(|a| a.trim().to_ascii_lowercase());
        let trusted = match &own {
            Some(own) => plan.contains_key(own),
            None => false,
        };
        let recorded = self.record.accounts(namespace);
        let listed: Vec<&String> = recorded.iter().filter(|a| plan.contains_key(*a)).collect();
        for account in listed {
            self.missing.remove(&entry_key(namespace, account));
        }
        if !trusted {
            if recorded.iter().any(|a| !plan.contains_key(a)) {
                debug!(namespace_id = %namespace, "the member list of {namespace} is empty or lacks the node's own account: no envelope of it is removed on that read");
            }
            return Ok(());
        }
        for account in recorded {
            if !plan.contains_key(&account) && self.proven_missing(namespace, &account, tally) {
                self.remove(namespace, &account, "no longer a member", tally)
                    .await?;
            }
        }
        Ok(())
    }

    /// Whether the envelope of `account` in `namespace`, missing from a complete read taken
    /// now, may be deleted: it was missing from an earlier complete read taken at least
    /// [`MISSING_FOR`] before, and this pass's deletes are not spent. Otherwise the first
    /// sighting is kept (or noted now) and `false`.
    fn proven_missing(&mut self, namespace: GroupId, account: &str, tally: &mut Tally) -> bool {
        let now = Instant::now();
        let since = *self
            .missing
            .entry(entry_key(namespace, account))
            .or_insert(now);
        if now.saturating_duration_since(since) < MISSING_FOR {
            return false;
        }
        if tally.deletes_left == 0 {
            tally.deferred += 1;
            return false;
        }
        tally.deletes_left -= 1;
        true
    }

    /// `PUT`s `envelope` (its version set here) and records it once MDMA took it. The version
    /// offered is the recorded one + 1, or where a search left off; on a 409 the next one
    /// is above what MDMA says it holds ([`held_version`]) or found by [`next_offer`], at
    /// most [`MAX_PUTS_PER_ENVELOPE`] `PUT`s of one envelope and [`MAX_CONFLICTS_PER_PASS`]
    /// refusals a pass. The same sealed ciphertext goes with every version tried.
    ///
    /// Errors: [`PassError::Record`] when what MDMA took cannot be recorded.
    async fn put(
        &mut self,
        mut envelope: RecoveryEnvelope,
        sha256: &str,
        tally: &mut Tally,
    ) -> Result<(), PassError> {
        let namespace = envelope.key.namespace_id;
        let account = envelope.key.account_id.clone();
        let key = entry_key(namespace, &account);
        let mut version = envelope.version;
        let mut refusals = self.searching.get(&key).map_or(0, |s| s.1);
        let mut puts = 0;
        loop {
            envelope.version = version;
            puts += 1;
            match self.deps.mdma.put(&envelope).await {
                Ok(()) => {
                    self.searching.remove(&key);
                    let landed = Change::Landed {
                        key,
                        version,
                        sha256: sha256.to_owned(),
                    };
                    self.change(vec![landed], false).await?;
                    tally.done.written += 1;
                    if refusals > 0 {
                        info!(namespace_id = %namespace, "Recovery envelope written for {account} in {namespace} (v{version}, above the {refusals} version(s) MDMA refused as held)");
                    } else {
                        info!(namespace_id = %namespace, "Recovery envelope written for {account} in {namespace} (v{version})");
                    }
                    return Ok(());
                }
                Err(e) => {
                    let Some(said) = conflict(&e) else {
                        tally.failed(format!(
                            "writing the envelope of {account} in {namespace} (v{version}): {e}"
                        ));
                        return Ok(());
                    };
                    refusals += 1;
                    let next = next_offer(version, said, refusals);
                    self.searching.insert(key.clone(), (next, refusals));
                    if !self.behind_said {
                        self.behind_said = true;
                        warn!(namespace_id = %namespace, "MDMA holds a newer recovery envelope of {account} in {namespace} than v{version}, the version the record gives (the record was lost or is behind): looking for a version MDMA takes; said once");
                    }
                    tally.conflicts_left = tally.conflicts_left.saturating_sub(1);
                    if puts >= MAX_PUTS_PER_ENVELOPE || tally.conflicts_left == 0 {
                        tally.failed(format!(
                            "writing the envelope of {account} in {namespace}: MDMA refused v{version} as held (409); the next pass offers v{next}"
                        ));
                        return Ok(());
                    }
                    self.change(
                        vec![Change::Offer(BTreeMap::from([(key.clone(), next)]))],
                        true,
                    )
                    .await?;
                    version = next;
                }
            }
        }
    }

    /// Deletes the envelope of `account` in `namespace` and forgets it once MDMA took that.
    async fn remove(
        &mut self,
        namespace: GroupId,
        account: &str,
        why: &str,
        tally: &mut Tally,
    ) -> Result<(), PassError> {
        match self.deps.mdma.delete(&self.key(namespace, account)).await {
            Ok(()) => {
                let key = entry_key(namespace, account);
                self.missing.remove(&key);
                self.searching.remove(&key);
                self.change(vec![Change::Removed(key)], false).await?;
                tally.done.removed += 1;
                info!(namespace_id = %namespace, "Recovery envelope removed for {account} in {namespace}: {why}");
            }
            Err(e) => tally.failed(format!(
                "removing the envelope of {account} in {namespace}: {e}"
            )),
        }
        Ok(())
    }

    /// Removes the entries of the recorded namespaces that are neither `confirmed` nor held
    /// by merod, each once proven ([`PassJob::proven_missing`]: gone from merod's list on two
    /// reads at least [`MISSING_FOR`] apart). A failed read of merod's holdings removes
    /// nothing and proves nothing.
    async fn remove_gone(
        &mut self,
        confirmed: &BTreeSet<GroupId>,
        tally: &mut Tally,
    ) -> Result<(), PassError> {
        let gone: Vec<GroupId> = self
            .record
            .namespaces()
            .into_iter()
            .filter(|ns| !confirmed.contains(ns))
            .collect();
        if gone.is_empty() {
            return Ok(());
        }
        let held = match self.deps.merod.held().await {
            Ok(held) => held,
            Err(e) => {
                tally.failed(format!(
                    "merod's namespaces could not be read, so no envelope of a namespace left is removed: {e}"
                ));
                return Ok(());
            }
        };
        for namespace in gone {
            let accounts = self.record.accounts(namespace);
            if held.contains(&namespace) {
                for account in &accounts {
                    self.missing.remove(&entry_key(namespace, account));
                }
                continue;
            }
            for account in accounts {
                if self.proven_missing(namespace, &account, tally) {
                    self.remove(
                        namespace,
                        &account,
                        "the node no longer holds the namespace",
                        tally,
                    )
                    .await?;
                }
            }
        }
        Ok(())
    }
}

/// What a 409 says MDMA holds: `Some(Some(v))` when its body names the version, `Some(None)`
/// when it does not; `None` for any other failure. See [`held_version`].
fn conflict(e: &CallError) -> Option<Option<u64>> {
    match e {
        CallError::Request(RequestError::Status {
            status: 409, body, ..
        }) => Some(held_version(body)),
        _ => None,
    }
}

/// The version a 409's body says MDMA holds: a JSON object with a whole `current_version`
/// or `version` (≥ 1), at its top or under `data`. Anything else says nothing.
pub(crate) fn held_version(body: &str) -> Option<u64> {
    let value: serde_json::Value = serde_json::from_str(body).ok()?;
    let object = value.as_object()?;
    let scopes = [Some(object), object.get("data").and_then(|d| d.as_object())];
    let held = scopes.into_iter().flatten().find_map(|scope| {
        ["current_version", "version"]
            .into_iter()
            .find_map(|name| scope.get(name)?.as_u64())
            .filter(|v| *v > 0)
    });
    held
}

/// The version to offer after `refused` drew its `refusals`-th 409 (from 1): one above what
/// MDMA `said` it holds when that is at or above `refused`; otherwise `refused` plus a step
/// doubling with each refusal (1, 2, 4, …), so a record behind by `n` versions catches up
/// in about log2(n) refusals. Saturates at `u64::MAX`.
pub(crate) fn next_offer(refused: u64, said: Option<u64>, refusals: u32) -> u64 {
    match said {
        Some(held) if held >= refused => held.saturating_add(1),
        _ => {
            let step = 1u64
                .checked_shl(refusals.saturating_sub(1))
                .unwrap_or(u64::MAX);
            refused.saturating_add(step)
        }
    }
}

impl Job for PassJob {
    type Output = PassDone;
    type Error = PassError;
    const NAME: &'static str = "recovery";
    const WALKS_EVERY_NAMESPACE: bool = true;
    const FAILING: &'static str = "the recovery envelopes are not all written";
    const EFFECT: &'static str = "MDMA keeps the envelopes it has; the next pass tries again";
    const RECOVERED: &'static str = "the recovery envelopes are written again";

    fn schedule(&self) -> Schedule {
        Schedule::every(PASS_EVERY, PASS_DEADLINE).min_gap(Duration::from_secs(1))
    }

    async fn run(&mut self) -> Result<PassDone, PassError> {
        let passed = self.pass().await;
        if let Err(PassError::NoSealRoute) = passed {
            // Nothing can be written: the inventory's walks stop reading devices for it.
            self.walks.close();
        }
        passed
    }

    fn idle(&self) -> bool {
        self.confirmed.is_empty() || self.deps.merod.lacks_seal_route()
    }

    async fn wake(&mut self) {
        tokio::select! {
            () = self.confirmed.changed() => {}
            () = self.recorded.changed() => {}
            () = self.walks.delivered() => {}
        }
    }
}

impl PassJob {
    /// One pass (see the module docs).
    ///
    /// Errors: as [`Job::run`].
    async fn pass(&mut self) -> Result<PassDone, PassError> {
        if self.deps.merod.lacks_seal_route() {
            return Err(PassError::NoSealRoute);
        }
        let Some((confirmed, changed)) = self.confirmed.take() else {
            return Ok(PassDone::default());
        };
        self.walks.reopen(&confirmed, Instant::now());
        self.pending_full |= changed;
        // Whole seconds; a clock before 1970 reads as 0 (a full pass is then due).
        let now = unix_now().max(0.0) as u64;
        let full = want_full(self.pending_full, self.record.last_full, now);
        let started = Instant::now();
        self.walks.retain(&confirmed);
        self.full_left.retain(|ns| confirmed.contains(ns));
        if full {
            // Stamped at the start: a pass cut short is not begun again in full.
            self.pending_full = false;
            self.change(vec![Change::Full(now)], false).await?;
            self.full_left = (*confirmed).clone();
            for namespace in confirmed.iter() {
                self.walks.want(*namespace, started);
            }
        }
        let mut tally = Tally::new();
        match self.own_walk.take() {
            Some(mut book) => {
                let walked = self
                    .walk_own(&mut book, &confirmed, started, &mut tally)
                    .await;
                self.own_walk = Some(book);
                walked?;
            }
            None => self.take_walks(&confirmed, &mut tally).await?,
        }
        let recorded_changed = self.recorded.take().is_some_and(|(_, changed)| changed);
        let sweep_due = self
            .swept
            .is_none_or(|at| started.saturating_duration_since(at) >= PASS_EVERY);
        if recorded_changed || sweep_due {
            self.swept = Some(started);
            self.remove_gone(&confirmed, &mut tally).await?;
        }
        self.compact(0).await?;
        // Sightings of entries since removed (a leave, a delete) go with them.
        let record = &self.record;
        self.missing.retain(|k, _| record.contains(k));
        if tally.deferred > 0 {
            info!(
                "{} recovery envelope(s) to remove wait for the next pass (at most {MAX_DELETES_PER_PASS} a pass)",
                tally.deferred
            );
        }
        match tally.first {
            None => Ok(tally.done),
            Some(first) => Err(PassError::Partly {
                failed: tally.failed,
                incomplete: tally.incomplete,
                first,
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::merod::{GroupMember, MemberDevices, MerodError, MerodOp, NamespaceUsage};
    use std::collections::HashMap;
    use std::sync::Mutex;

    /// What the envelopes ask of a walk.
    fn needs() -> Needs<'static> {
        Needs {
            account: None,
            devices: true,
            capabilities: false,
        }
    }

    const PEER: &str = "12D3KooWNXNMakaAKyWpBemRiWWqusgQCrxvwjtJdRQMzLScTJDT";

    fn gid(n: u8) -> GroupId {
        format!("{n:02x}").repeat(32).parse().unwrap()
    }

    fn acct(name: &str) -> String {
        // A hex account per name, readable in failures.
        format!("{:0<64}", hex::encode(name))
    }

    fn fail(op: MerodOp) -> MerodError {
        MerodError::Status {
            op,
            url: "http://127.0.0.1/".to_owned(),
            status: 500,
        }
    }

    /// A merod of groups: children, members, contexts (missing: the read fails), devices.
    #[derive(Default)]
    struct Merod {
        children: HashMap<GroupId, Vec<GroupId>>,
        members: HashMap<GroupId, Vec<String>>,
        contexts: HashMap<GroupId, Vec<String>>,
        devices: HashMap<GroupId, Vec<MemberDevices>>,
        held: BTreeSet<GroupId>,
        no_route: bool,
        lacks: bool,
        seals: Mutex<Vec<(GroupId, String, String)>>,
        /// Accounts sealing to which fails.
        refused: Mutex<BTreeSet<String>>,
    }

    #[async_trait]
    impl GroupReader for Merod {
        async fn subgroups(&self, group: GroupId) -> Result<Vec<GroupId>, MerodError> {
            Ok(self.children.get(&group).cloned().unwrap_or_default())
        }
        async fn contexts(&self, group: GroupId) -> Result<Vec<String>, MerodError> {
            self.contexts
                .get(&group)
                .cloned()
                .ok_or_else(|| fail(MerodOp::Contexts))
        }
        async fn members(&self, group: GroupId) -> Result<Vec<GroupMember>, MerodError> {
            Ok(self
                .members
                .get(&group)
                .cloned()
                .unwrap_or_default()
                .into_iter()
                .map(|identity| GroupMember {
                    identity,
                    role: "Member".to_owned(),
                })
                .collect())
        }
        async fn capabilities(&self, _: GroupId, _: &str) -> Result<u32, MerodError> {
            Err(fail(MerodOp::Capabilities))
        }
        async fn member_devices(&self, group: GroupId) -> Result<Vec<MemberDevices>, MerodError> {
            Ok(self.devices.get(&group).cloned().unwrap_or_default())
        }
        async fn usage(&self) -> Result<BTreeMap<GroupId, NamespaceUsage>, MerodError> {
            Ok(BTreeMap::new())
        }
    }

    #[async_trait]
    impl EnvelopeReader for Merod {
        fn reader(&self) -> &dyn GroupReader {
            self
        }
        async fn seal(
            &self,
            group: GroupId,
            account: &str,
            plaintext: &[u8],
        ) -> Result<Option<SealedEnvelope>, MerodError> {
            if self.no_route {
                return Ok(None);
            }
            if self.refused.lock().unwrap().contains(account) {
                return Err(fail(MerodOp::Seal));
            }
            let mut seals = self.seals.lock().unwrap();
            seals.push((
                group,
                account.to_owned(),
                String::from_utf8(plaintext.to_vec()).unwrap(),
            ));
            // A fresh ciphertext every call, as real sealing.
            Ok(Some(SealedEnvelope {
                account_root_epoch: 3,
                ciphertext: format!("ct{}", seals.len()),
                ephemeral_public_key: format!("eph{}", seals.len()),
                nonce: format!("n{}", seals.len()),
            }))
        }
        fn lacks_seal_route(&self) -> bool {
            self.lacks
        }
        async fn held(&self) -> Result<BTreeSet<GroupId>, MerodError> {
            Ok(self.held.clone())
        }
    }

    /// MDMA's recovery route as the emulator keeps it: a `PUT` is taken only above the
    /// version held (409 otherwise, naming it when `names_held`); `status` answers every
    /// `PUT` instead when set.
    #[derive(Default)]
    struct Mdma {
        puts: Mutex<Vec<RecoveryEnvelope>>,
        deletes: Mutex<Vec<RecoveryKey>>,
        held: Mutex<HashMap<(GroupId, String), u64>>,
        status: Mutex<Option<u16>>,
        names_held: Mutex<bool>,
        refusals: Mutex<u32>,
    }

    fn refused(status: u16, body: &str) -> CallError {
        CallError::Request(RequestError::Status {
            method: crate::mdma::RequestMethod::Put,
            url: "https://mdma.test/api/fleet/recovery-envelope"
                .parse()
                .unwrap(),
            status,
            retry_after_secs: None,
            body: body.into(),
        })
    }

    impl Mdma {
        /// MDMA holds `version` of every envelope of `accounts` in `namespace`.
        fn holding(&self, namespace: GroupId, accounts: &[&str], version: u64) {
            let mut held = self.held.lock().unwrap();
            for a in accounts {
                held.insert((namespace, acct(a)), version);
            }
        }
    }

    #[async_trait]
    impl EnvelopeSink for Mdma {
        async fn put(&self, envelope: &RecoveryEnvelope) -> Result<(), CallError> {
            if let Some(status) = *self.status.lock().unwrap() {
                *self.refusals.lock().unwrap() += 1;
                return Err(refused(status, r#"{"error":"emulated"}"#));
            }
            let key = (envelope.key.namespace_id, envelope.key.account_id.clone());
            let mut held = self.held.lock().unwrap();
            if let Some(&h) = held.get(&key).filter(|h| envelope.version <= **h) {
                *self.refusals.lock().unwrap() += 1;
                let body = if *self.names_held.lock().unwrap() {
                    format!(
                        r#"{{"error":"a newer or equal version is held","current_version":{h}}}"#
                    )
                } else {
                    r#"{"error":"a newer or equal version is held"}"#.to_owned()
                };
                return Err(refused(409, &body));
            }
            held.insert(key, envelope.version);
            self.puts.lock().unwrap().push(envelope.clone());
            Ok(())
        }
        async fn delete(&self, key: &RecoveryKey) -> Result<(), CallError> {
            self.deletes.lock().unwrap().push(key.clone());
            self.held
                .lock()
                .unwrap()
                .remove(&(key.namespace_id, key.account_id.clone()));
            Ok(())
        }
    }

    fn device(id: &str) -> MemberDevice {
        MemberDevice {
            device_id: id.to_owned(),
            signing_key: format!("Sk-{id}"),
        }
    }

    /// Namespace 1: alice, bob and carol; context ctx1; alice has d2 and d1, bob d3, carol
    /// none.
    fn three_members() -> Merod {
        let mut m = Merod::default();
        m.members
            .insert(gid(1), vec![acct("alice"), acct("bob"), acct("carol")]);
        m.contexts.insert(gid(1), vec!["ctx1".into()]);
        m.devices.insert(
            gid(1),
            vec![
                MemberDevices {
                    account: acct("alice"),
                    devices: vec![device("d2"), device("d1")],
                },
                MemberDevices {
                    account: acct("bob"),
                    devices: vec![device("d3")],
                },
                MemberDevices {
                    account: acct("carol"),
                    devices: vec![],
                },
            ],
        );
        m.held.insert(gid(1));
        m
    }

    struct Rig {
        job: PassJob,
        merod: Arc<Merod>,
        mdma: Arc<Mdma>,
        _confirmed: NamespacesOffer,
        _dir: tempfile::TempDir,
    }

    fn rig_in(dir: tempfile::TempDir, merod: Merod, confirmed: &[GroupId]) -> Rig {
        let merod = Arc::new(merod);
        let mdma = Arc::new(Mdma::default());
        let (tx, feed) = NamespacesOffer::channel();
        let (_, recorded) = NamespacesOffer::channel();
        tx.offer(&confirmed.iter().copied().collect());
        let job = PassJob::new(
            RecoveryDeps {
                merod: Arc::clone(&merod) as _,
                mdma: Arc::clone(&mdma) as _,
            },
            PEER.parse().unwrap(),
            Arc::new(|| Some(acct("alice"))),
            (feed, recorded),
            &dir.path().join(RECORD_FILE),
            None,
        );
        Rig {
            job,
            merod,
            mdma,
            _confirmed: tx,
            _dir: dir,
        }
    }

    fn rig(merod: Merod, confirmed: &[GroupId]) -> Rig {
        rig_in(tempfile::tempdir().unwrap(), merod, confirmed)
    }

    impl Rig {
        fn puts(&self) -> Vec<RecoveryEnvelope> {
            self.mdma.puts.lock().unwrap().clone()
        }
        fn sealed(&self) -> Vec<String> {
            self.merod
                .seals
                .lock()
                .unwrap()
                .iter()
                .map(|s| s.2.clone())
                .collect()
        }
        /// The job again over the same record file, as after a restart.
        fn restarted(self, merod: Merod, confirmed: &[GroupId]) -> Rig {
            rig_in(self._dir, merod, confirmed)
        }
    }

    #[tokio::test]
    async fn each_member_gets_one_envelope_with_its_own_devices() {
        let mut r = rig(three_members(), &[gid(1)]);
        let done = r.job.run().await.unwrap();
        assert_eq!(done.written, 3);
        let puts = r.puts();
        let accounts: Vec<&str> = puts.iter().map(|p| p.key.account_id.as_str()).collect();
        assert_eq!(accounts, [acct("alice"), acct("bob"), acct("carol")]);
        assert!(puts.iter().all(|p| p.key.namespace_id == gid(1)
            && p.version == 1
            && p.key.peer_id.to_string() == PEER));
        // The ciphertext MDMA stores: the sealed envelope as one sorted, compact string.
        assert_eq!(
            puts[0].ciphertext,
            r#"{"accountRootEpoch":3,"ciphertext":"ct1","ephemeralPublicKey":"eph1","nonce":"n1"}"#
        );
        let sealed = r.sealed();
        let ns = gid(1).to_string();
        assert_eq!(
            sealed[0],
            format!(
                r#"{{"contexts":["ctx1"],"devices":[{{"device_id":"d1","signing_key":"Sk-d1"}},{{"device_id":"d2","signing_key":"Sk-d2"}}],"groups":["{ns}"],"namespace_id":"{ns}","v":2}}"#
            ),
            "sorted keys, compact, alice's devices sorted, keys verbatim"
        );
        assert_eq!(
            sealed
                .iter()
                .filter(|p| p.contains(r#""device_id":"d3""#))
                .count(),
            1,
            "bob's device is in bob's envelope only"
        );
        assert!(
            sealed[2].contains(r#""devices":[]"#),
            "carol: an empty list"
        );
    }

    #[tokio::test]
    async fn only_a_changed_plaintext_is_written_again_and_the_version_survives_a_restart() {
        let mut r = rig(three_members(), &[gid(1)]);
        r.job.run().await.unwrap();
        assert_eq!(r.job.run().await.unwrap().written, 0, "nothing changed");
        assert_eq!(r.puts().len(), 3);
        // The fake's ciphertexts differ on every seal: only the plaintext's digest counts.
        let mut changed = three_members();
        changed
            .contexts
            .insert(gid(1), vec!["ctx1".into(), "ctx2".into()]);
        let mut r = r.restarted(changed, &[gid(1)]);
        assert_eq!(r.job.run().await.unwrap().written, 3);
        assert!(r.puts().iter().all(|p| p.version == 2));
        let mut again = three_members();
        again
            .contexts
            .insert(gid(1), vec!["ctx1".into(), "ctx2".into(), "ctx3".into()]);
        let mut r = r.restarted(again, &[gid(1)]);
        r.job.run().await.unwrap();
        assert!(r.puts().iter().all(|p| p.version == 3), "{:?}", r.puts());
    }

    #[tokio::test]
    async fn an_incomplete_read_or_no_member_writes_nothing() {
        let mut m = three_members();
        m.contexts.clear();
        let mut r = rig(m, &[gid(1)]);
        let err = r.job.run().await.unwrap_err();
        assert!(
            matches!(
                err,
                PassError::Partly {
                    incomplete: 1,
                    failed: 0,
                    ..
                }
            ),
            "{err}"
        );
        assert!(r.puts().is_empty() && r.sealed().is_empty());
        // A subgroup that cannot be read makes the namespace incomplete too.
        let mut m = three_members();
        m.children.insert(gid(1), vec![gid(2)]);
        let mut r = rig(m, &[gid(1)]);
        assert!(r.job.run().await.is_err());
        assert!(r.puts().is_empty());
        let mut m = three_members();
        m.members.clear();
        m.devices.clear();
        let mut r = rig(m, &[gid(1)]);
        assert_eq!(r.job.run().await.unwrap(), PassDone::default());
        assert!(r.puts().is_empty());
    }

    #[tokio::test]
    async fn a_refused_put_records_nothing_and_is_offered_again_above_its_version() {
        let mut r = rig(three_members(), &[gid(1)]);
        *r.mdma.status.lock().unwrap() = Some(503);
        let err = r.job.run().await.unwrap_err();
        assert!(err.to_string().contains("503"), "{err}");
        assert!(r.job.record.envelopes.is_empty());
        assert_eq!(
            *r.mdma.refusals.lock().unwrap(),
            3,
            "one PUT each, no search"
        );
        *r.mdma.status.lock().unwrap() = None;
        assert_eq!(r.job.run().await.unwrap().written, 3);
        // v1 went out once and could have landed unanswered: never offered again.
        assert!(r.puts().iter().all(|p| p.version == 2));
    }

    #[tokio::test]
    async fn a_seal_that_fails_spends_no_version_and_writes_nothing() {
        let mut r = rig(three_members(), &[gid(1)]);
        r.merod.refused.lock().unwrap().insert(acct("carol"));
        assert!(r.job.run().await.is_err());
        assert_eq!(r.puts().len(), 2);
        let carol = entry_key(gid(1), &acct("carol"));
        assert!(
            !r.job.record.offered.contains_key(&carol),
            "nothing offered"
        );
        let journal = std::fs::read_to_string(r._dir.path().join(JOURNAL_FILE)).unwrap();
        assert!(!journal.contains(&acct("carol")), "{journal}");
        // Its seal works again: its first version goes out.
        r.merod.refused.lock().unwrap().clear();
        assert_eq!(r.job.run().await.unwrap().written, 1);
        let last = r.puts().pop().unwrap();
        assert_eq!((last.key.account_id, last.version), (acct("carol"), 1));
    }

    #[tokio::test]
    async fn a_version_offered_is_never_offered_again_after_a_restart() {
        let mut r = rig(three_members(), &[gid(1)]);
        r.job.run().await.unwrap();
        // A crash after alice's v7 went out and before MDMA's answer was recorded.
        let key = entry_key(gid(1), &acct("alice"));
        r.job
            .change(vec![Change::Offer(BTreeMap::from([(key, 7)]))], true)
            .await
            .unwrap();
        let mut changed = three_members();
        changed.contexts.insert(gid(1), vec!["ctx2".into()]);
        let mut r = r.restarted(changed, &[gid(1)]);
        r.job.run().await.unwrap();
        let versions: BTreeMap<String, u64> = r
            .puts()
            .iter()
            .map(|p| (p.key.account_id.clone(), p.version))
            .collect();
        assert_eq!(versions[&acct("alice")], 8);
        assert_eq!(versions[&acct("bob")], 2);
    }

    #[tokio::test]
    async fn the_record_s_disk_writes_follow_what_changed_not_its_size() {
        let names: Vec<String> = (0..300).map(|i| format!("m{i:03}")).collect();
        let mut m = three_members();
        let mut all = vec![acct("alice")];
        all.extend(names.iter().map(|n| acct(n)));
        m.members.insert(gid(1), all.clone());
        let mut r = rig(m, &[gid(1)]);
        assert_eq!(r.job.run().await.unwrap().written, 301);
        let record = r.job.kept.path.clone();
        let journal = r.job.kept.journal_path.clone();
        // The first pass ends in the record written whole and the journal emptied.
        let whole = std::fs::read(&record).unwrap();
        assert!(whole.len() > 301 * 100, "{}", whole.len());
        assert_eq!(std::fs::metadata(&journal).unwrap().len(), 0);
        // One member's envelope changes: the record is not written again, the journal
        // gains its offer and its landing, a few hundred bytes.
        let mut m = three_members();
        m.members.insert(gid(1), all);
        m.devices.entry(gid(1)).or_default().push(MemberDevices {
            account: acct("m007"),
            devices: vec![device("d9")],
        });
        r.merod_now(m);
        assert_eq!(r.job.run().await.unwrap().written, 1);
        assert_eq!(std::fs::read(&record).unwrap(), whole, "not rewritten");
        let journal_len = std::fs::metadata(&journal).unwrap().len();
        assert!(journal_len > 0 && journal_len < 512, "{journal_len}");
        // Nothing changed: nothing written at all.
        r.job.run().await.unwrap();
        assert_eq!(std::fs::metadata(&journal).unwrap().len(), journal_len);
        // What the journal holds is read back on a restart.
        let reloaded = r.job.kept.load();
        assert_eq!(reloaded, r.job.record);
        assert_eq!(reloaded.next_version(gid(1), &acct("m007")), 3);
    }

    #[test]
    fn a_journal_torn_at_its_end_is_read_up_to_the_tear() {
        let dir = tempfile::tempdir().unwrap();
        let kept = Kept::at(dir.path().join(RECORD_FILE));
        let key = entry_key(gid(1), &acct("alice"));
        let landed = serde_json::to_string(&Change::Landed {
            key: key.clone(),
            version: 4,
            sha256: "ab".into(),
        })
        .unwrap();
        std::fs::write(
            &kept.journal_path,
            format!("{landed}\n{{\"offer\":{{\"{key}\":"),
        )
        .unwrap();
        let record = kept.load();
        assert_eq!(record.next_version(gid(1), &acct("alice")), 5);
        assert!(record.offered.is_empty());
    }

    #[tokio::test]
    async fn a_lost_record_converges_on_versions_mdma_takes_sealing_each_envelope_once() {
        // MDMA holds v5 of every envelope; the record is empty (lost).
        let mut r = rig(three_members(), &[gid(1)]);
        r.mdma.holding(gid(1), &["alice", "bob", "carol"], 5);
        let done = r.job.run().await.unwrap();
        assert_eq!(done.written, 3);
        // 1, 2, 4 refused, 8 taken: three 409s each, one seal each.
        assert_eq!(*r.mdma.refusals.lock().unwrap(), 9);
        assert_eq!(r.sealed().len(), 3);
        assert!(r.puts().iter().all(|p| p.version == 8), "{:?}", r.puts());
        assert_eq!(r.job.record.next_version(gid(1), &acct("bob")), 9);
        // Converged: the next pass writes nothing, and a change goes on from the record.
        assert_eq!(r.job.run().await.unwrap().written, 0);
        let mut changed = three_members();
        changed.contexts.insert(gid(1), vec!["ctx2".into()]);
        let mut r = r.restarted(changed, &[gid(1)]);
        r.mdma.holding(gid(1), &["alice", "bob", "carol"], 8);
        assert_eq!(r.job.run().await.unwrap().written, 3);
        assert!(r.puts().iter().all(|p| p.version == 9));
        assert_eq!(*r.mdma.refusals.lock().unwrap(), 0);
    }

    #[tokio::test]
    async fn a_409_naming_the_held_version_is_passed_in_one_step() {
        let mut r = rig(three_members(), &[gid(1)]);
        r.mdma.holding(gid(1), &["alice", "bob", "carol"], 41);
        *r.mdma.names_held.lock().unwrap() = true;
        assert_eq!(r.job.run().await.unwrap().written, 3);
        assert_eq!(*r.mdma.refusals.lock().unwrap(), 3);
        assert!(r.puts().iter().all(|p| p.version == 42));
    }

    #[tokio::test]
    async fn a_search_is_bounded_a_pass_and_goes_on_at_the_next() {
        let mut r = rig(three_members(), &[gid(1)]);
        // Far ahead: more than one pass's PUTs of the search reach.
        r.mdma.holding(gid(1), &["alice"], 1 << 20);
        let err = r.job.run().await.unwrap_err();
        assert!(err.to_string().contains("409"), "{err}");
        assert_eq!(
            *r.mdma.refusals.lock().unwrap(),
            MAX_PUTS_PER_ENVELOPE,
            "bounded a pass"
        );
        assert_eq!(r.puts().len(), 2, "bob and carol were written");
        r.job.run().await.unwrap();
        let alice: Vec<u64> = r
            .puts()
            .iter()
            .filter(|p| p.key.account_id == acct("alice"))
            .map(|p| p.version)
            .collect();
        assert_eq!(alice.len(), 1);
        assert!(alice[0] > 1 << 20, "{alice:?}");
        assert!(*r.mdma.refusals.lock().unwrap() < 2 * MAX_PUTS_PER_ENVELOPE);
        // MDMA refusing everything with 409: the search stops at MAX_CONFLICTS_PER_PASS
        // refusals (16 envelopes of 16 PUTs); each envelope after it gets its one PUT, as
        // every envelope does without a search.
        let mut many = Merod::default();
        let names: Vec<String> = (0..40).map(|i| format!("m{i:02}")).collect();
        many.members
            .insert(gid(1), names.iter().map(|n| acct(n)).collect());
        many.contexts.insert(gid(1), vec![]);
        let mut r = rig(many, &[gid(1)]);
        *r.mdma.status.lock().unwrap() = Some(409);
        assert!(r.job.run().await.is_err());
        assert_eq!(
            *r.mdma.refusals.lock().unwrap(),
            MAX_CONFLICTS_PER_PASS + (40 - MAX_CONFLICTS_PER_PASS / MAX_PUTS_PER_ENVELOPE)
        );
    }

    #[test]
    fn the_version_after_a_409_is_above_the_one_named_or_a_doubling_step() {
        assert_eq!(next_offer(3, Some(9), 1), 10);
        assert_eq!(next_offer(3, Some(3), 1), 4);
        // Naming a version below the one refused says nothing usable.
        assert_eq!(next_offer(3, Some(2), 1), 4);
        assert_eq!(next_offer(3, None, 1), 4);
        assert_eq!(next_offer(4, None, 2), 6);
        assert_eq!(next_offer(6, None, 3), 10);
        assert_eq!(next_offer(u64::MAX - 1, None, 70), u64::MAX);
        assert_eq!(next_offer(1, Some(u64::MAX), 1), u64::MAX);
        for (body, want) in [
            (r#"{"current_version":7}"#, Some(7)),
            (r#"{"error":"held","version":7}"#, Some(7)),
            (r#"{"data":{"current_version":7}}"#, Some(7)),
            (r#"{"current_version":0}"#, None),
            (r#"{"current_version":-1}"#, None),
            (r#"{"current_version":"7"}"#, None),
            (r#"{"current_version":7.5}"#, None),
            ("[7]", None),
            ("held: 7", None),
            ("", None),
        ] {
            assert_eq!(held_version(body), want, "{body}");
        }
    }

    #[tokio::test]
    async fn a_subgroup_s_members_get_its_groups_and_contexts_and_the_union_for_both() {
        let mut m = three_members();
        m.children.insert(gid(1), vec![gid(2)]);
        m.members.insert(gid(2), vec![acct("alice"), acct("dave")]);
        m.contexts.insert(gid(2), vec!["ctx9".into()]);
        // A device listed in two groups is in the envelope once.
        m.devices.insert(
            gid(2),
            vec![MemberDevices {
                account: acct("alice"),
                devices: vec![device("d1")],
            }],
        );
        let plan = plaintexts(
            gid(1),
            &groups_of(walk_tree(&m, gid(1), needs(), WALK_BUDGET).await).unwrap(),
        );
        let text = |a: &str| String::from_utf8(plan[&acct(a)].bytes.clone()).unwrap();
        let (g1, g2) = (gid(1).to_string(), gid(2).to_string());
        assert!(text("alice").contains(r#""contexts":["ctx1","ctx9"]"#));
        assert!(text("alice").contains(&format!(r#""groups":["{g1}","{g2}"]"#)));
        assert_eq!(text("alice").matches(r#""device_id":"d1""#).count(), 1);
        assert!(text("dave").contains(&format!(r#""groups":["{g2}"],"#)));
        assert!(text("dave").contains(r#""contexts":["ctx9"]"#));
        assert!(text("bob").contains(r#""contexts":["ctx1"]"#));
    }

    impl Rig {
        fn deleted(&self) -> Vec<(GroupId, String)> {
            self.mdma
                .deletes
                .lock()
                .unwrap()
                .iter()
                .map(|k| (k.namespace_id, k.account_id.clone()))
                .collect()
        }
        /// merod's answers from now on (the record, the sightings and the clock kept).
        fn merod_now(&mut self, merod: Merod) {
            let merod = Arc::new(merod);
            self.job.deps.merod = Arc::clone(&merod) as _;
            self.merod = merod;
        }
    }

    /// Namespace 1 as [`three_members`] but for carol.
    fn carol_left() -> Merod {
        let mut m = three_members();
        m.members.insert(gid(1), vec![acct("alice"), acct("bob")]);
        m
    }

    #[tokio::test(start_paused = true)]
    async fn a_member_is_deleted_once_missing_from_two_complete_reads_a_pass_apart() {
        let mut r = rig(three_members(), &[gid(1)]);
        assert_eq!(r.job.run().await.unwrap().written, 3);
        // Carol is missing from one read: nothing is deleted, nor on a read soon after.
        r.merod_now(carol_left());
        assert_eq!(r.job.run().await.unwrap().removed, 0);
        tokio::time::advance(MISSING_FOR - Duration::from_secs(1)).await;
        assert_eq!(r.job.run().await.unwrap().removed, 0);
        assert!(r.deleted().is_empty());
        // A pass apart: proven, deleted.
        tokio::time::advance(Duration::from_secs(1)).await;
        assert_eq!(r.job.run().await.unwrap().removed, 1);
        assert_eq!(r.deleted(), [(gid(1), acct("carol"))]);
        // Listed again in between: the first sighting is forgotten.
        let mut r = rig(three_members(), &[gid(1)]);
        r.job.run().await.unwrap();
        r.merod_now(carol_left());
        r.job.run().await.unwrap();
        r.merod_now(three_members());
        r.job.run().await.unwrap();
        r.merod_now(carol_left());
        tokio::time::advance(MISSING_FOR).await;
        assert_eq!(r.job.run().await.unwrap().removed, 0);
        tokio::time::advance(MISSING_FOR).await;
        assert_eq!(r.job.run().await.unwrap().removed, 1);
        // Carol is back: her envelope starts again at v1 (her entry was dropped).
        r.merod_now(three_members());
        r.job.run().await.unwrap();
        let carol: Vec<u64> = r
            .puts()
            .iter()
            .filter(|p| p.key.account_id == acct("carol"))
            .map(|p| p.version)
            .collect();
        assert_eq!(carol, [1, 1]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_member_list_that_is_empty_or_lacks_the_node_deletes_nothing() {
        let mut r = rig(three_members(), &[gid(1)]);
        r.job.run().await.unwrap();
        // `200 {"members": []}`, read after read for an hour; then a list without the
        // node's own account (alice); then one without its account known.
        let mut empty = three_members();
        empty.members.insert(gid(1), vec![]);
        let mut no_node = three_members();
        no_node.members.insert(gid(1), vec![acct("bob")]);
        for merod in [empty, no_node] {
            r.merod_now(merod);
            for _ in 0..12 {
                assert_eq!(r.job.run().await.unwrap().removed, 0);
                tokio::time::advance(PASS_EVERY).await;
            }
        }
        r.job.account = Arc::new(|| None);
        r.merod_now(carol_left());
        for _ in 0..3 {
            assert_eq!(r.job.run().await.unwrap().removed, 0);
            tokio::time::advance(PASS_EVERY).await;
        }
        assert!(r.deleted().is_empty());
        assert_eq!(r.job.record.envelopes.len(), 3);
    }

    #[tokio::test(start_paused = true)]
    async fn deletes_are_bounded_a_pass() {
        let names: Vec<String> = (0..100).map(|i| format!("m{i:03}")).collect();
        let mut m = three_members();
        let mut all = vec![acct("alice")];
        all.extend(names.iter().map(|n| acct(n)));
        m.members.insert(gid(1), all);
        let mut r = rig(m, &[gid(1)]);
        assert_eq!(r.job.run().await.unwrap().written, 101);
        let mut left = three_members();
        left.members.insert(gid(1), vec![acct("alice")]);
        r.merod_now(left);
        r.job.run().await.unwrap();
        tokio::time::advance(MISSING_FOR).await;
        assert_eq!(r.job.run().await.unwrap().removed, MAX_DELETES_PER_PASS);
        assert_eq!(
            r.job.run().await.unwrap().removed,
            100 - MAX_DELETES_PER_PASS
        );
        assert_eq!(r.job.record.envelopes.len(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_namespace_gone_from_merod_is_deleted_once_missing_from_two_reads_a_pass_apart() {
        let mut m = three_members();
        m.members.insert(gid(2), vec![acct("erin")]);
        m.contexts.insert(gid(2), vec![]);
        m.held.insert(gid(2));
        let mut r = rig(m, &[gid(1), gid(2)]);
        assert_eq!(r.job.run().await.unwrap().written, 4);
        // Namespace 2 is withdrawn but still held: kept, however long.
        let mut m = three_members();
        m.held.insert(gid(2));
        let mut r = r.restarted(m, &[gid(1)]);
        r.job.run().await.unwrap();
        tokio::time::advance(MISSING_FOR).await;
        assert_eq!(r.job.run().await.unwrap().removed, 0);
        // merod no longer lists it: deleted on the second read a pass apart, not the first
        // (merod's list is read once a pass).
        r.merod_now(three_members());
        assert_eq!(r.job.run().await.unwrap().removed, 0);
        tokio::time::advance(PASS_EVERY).await;
        assert_eq!(r.job.run().await.unwrap().removed, 0);
        tokio::time::advance(MISSING_FOR).await;
        assert_eq!(r.job.run().await.unwrap().removed, 1);
        assert_eq!(r.deleted(), [(gid(2), acct("erin"))]);
        assert_eq!(r.job.record.namespaces(), BTreeSet::from([gid(1)]));
    }

    #[tokio::test]
    async fn no_seal_route_stops_the_pass_and_the_job_idles_while_it_is_known() {
        let mut m = three_members();
        m.no_route = true;
        let mut r = rig(m, &[gid(1)]);
        assert!(matches!(r.job.run().await, Err(PassError::NoSealRoute)));
        assert!(r.puts().is_empty());
        let mut m = three_members();
        m.lacks = true;
        let mut r = rig(m, &[gid(1)]);
        assert!(r.job.idle(), "a known lack: no run, no merod call");
        assert!(matches!(r.job.run().await, Err(PassError::NoSealRoute)));
        assert!(r.sealed().is_empty());
    }

    #[test]
    fn a_full_pass_is_daily_after_a_set_change_or_a_clock_stepped_back() {
        assert!(want_full(false, 0, 1_000_000));
        assert!(!want_full(false, 1_000_000, 1_000_000 + 86_399));
        assert!(want_full(false, 1_000_000, 1_000_000 + 86_400));
        assert!(want_full(true, 1_000_000, 1_000_001));
        assert!(want_full(false, 1_000_000, 999_999));
    }

    #[tokio::test]
    async fn a_full_pass_writes_every_envelope_again_at_the_next_version() {
        let mut r = rig(three_members(), &[gid(1)]);
        r.job.run().await.unwrap();
        r.job.record.last_full -= FULL_EVERY.as_secs();
        assert_eq!(r.job.run().await.unwrap().written, 3);
        assert!(r.puts()[3..].iter().all(|p| p.version == 2));
    }

    #[test]
    fn the_record_keeps_every_entry_as_read_in_its_compact_form() {
        let upper = acct("bob").to_ascii_uppercase();
        let (a, c) = ("a".repeat(64), "c".repeat(64));
        let text = serde_json::json!({"envelopes": {
            format!("{}/{}", gid(1), acct("alice")): {"version": 2, "sha256": a},
            format!("{}/{}", gid(1), upper): {"version": 3, "sha256": "XY"},
            "not-a-namespace/carol": {"version": 1, "sha256": c},
            format!("{}/{}", "AB".repeat(32), acct("dave")): {"version": 1, "sha256": c},
        }, "last_full": 5});
        let record: RecoveryRecord = serde_json::from_value(text.clone()).unwrap();
        assert_eq!(
            serde_json::to_value(&record).unwrap(),
            text,
            "written back as read"
        );
        assert_eq!(record.accounts(gid(1)), [acct("alice"), upper.clone()]);
        assert!(!record.due(gid(1), &acct("alice"), &a, false));
        assert!(record.due(gid(1), &acct("alice"), &c, false));
        assert!(!record.due(gid(1), &upper, "XY", false));
        assert_eq!(record.next_version(gid(1), &upper), 4);
        assert_eq!(record.namespaces(), BTreeSet::from([gid(1)]));
        assert!(record.contains("not-a-namespace/carol"));
        assert!(record.contains(&entry_key(gid(1), &acct("alice"))));
        assert!(!record.contains(&entry_key(gid(1), &acct("carol"))));
    }

    #[test]
    fn the_record_reads_the_bash_sidecar_s_file() {
        let text = format!(
            r#"{{"envelopes":{{"{}/{}":{{"version":4,"sha256":"ab"}}}},"last_full":1700000000}}"#,
            gid(1),
            acct("alice")
        );
        let record: RecoveryRecord = serde_json::from_str(&text).unwrap();
        assert_eq!(record.next_version(gid(1), &acct("alice")), 5);
        assert_eq!(record.last_full, 1_700_000_000);
        assert_eq!(serde_json::to_string(&record).unwrap(), text);
    }
}
