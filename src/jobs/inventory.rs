//! The context inventory MDMA keeps of each node: what to report and when (pure: [`want_full`],
//! [`plan`], [`InventoryRecord`], [`scanned_of`]) and the job that walks the confirmed
//! namespaces (through `trees`) and reports them.
//!
//! A scan reads merod's usage of every namespace once, then walks the namespaces the
//! [`WalkBook`] picks: every one when a full report is due (every [`FULL_EVERY`], and when
//! the confirmed set changed), else those whose usage signal moved, those not read whole
//! before and those the recovery envelopes asked for. Each walk reads the tree's groups,
//! contexts, whether the node can author there, its role and the member count (and, for the
//! envelopes, every group's members and devices: the walk goes on to them through a
//! [`Handoff`], so no tree is read twice). Namespaces read whole go in the `full` batch;
//! partial ones are added without pruning (`full: false`). Nothing is posted unless
//! something other than `bytes` changed or a full report is due. What was posted is kept in
//! `fleet-inventory.json` ([`InventoryRecord`]); a failed post keeps nothing, so the next
//! scan posts again.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::config::Config;
use crate::ids::{GroupId, PeerId};
use crate::jobs::{self, Job, Schedule};
use crate::mdma::{CallError, GroupInventory, InventoryReport, MdmaClient, NamespaceInventory};
use crate::merod::{NamespaceUsage, TeeRole};
use crate::outcome::Timed;
use crate::telemetry::{unix_now, Telemetry};

use super::record_file;
use super::trees::{
    walk_tree, GroupReader, Handoff, Needs, TreeRead, WalkBook, HANDOFF_WAIT, WHOLE_EVERY,
};

/// How often the confirmed namespaces are walked (and at once when the set changes).
pub(crate) const SCAN_EVERY: Duration = Duration::from_secs(60);
/// How often a full report is sent at the latest (every namespace is walked whole then).
pub(crate) const FULL_EVERY: Duration = WHOLE_EVERY;
/// Bound of the walk of one namespace (its member list, subgroups, contexts, capabilities).
pub(crate) const WALK_BUDGET: Duration = Duration::from_secs(20);
/// The state file, in the state directory.
pub(crate) const RECORD_FILE: &str = "fleet-inventory.json";
/// Bound of one scan: every namespace's walk and the posts. A scan cut here posts nothing
/// and the next one starts over.
const SCAN_DEADLINE: Duration = Duration::from_secs(600);

/// What was last reported, kept as `fleet-inventory.json`: when a full report last landed
/// (Unix seconds, 0 for never) and the [`ReportDigest`] of each namespace as posted.
///
/// Only fingerprints are kept: the record decides whether a scan says anything new, and a
/// report is always made from the scan. At 10,000 namespaces the reports themselves are a
/// few MB of small blocks, rebuilt at every post among what each scan frees; the digests
/// are 640 KB in one block.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct InventoryRecord {
    /// When the last full report landed, Unix seconds (0: never).
    pub(crate) last_full: u64,
    /// Each namespace as last posted, sorted by id, each once (in the file: an object of
    /// ids to hex fingerprints).
    #[serde(serialize_with = "write_posted", deserialize_with = "read_posted")]
    pub(crate) namespaces: Vec<(GroupId, ReportDigest)>,
}

/// What a namespace's report says but for `bytes` (storage moves all the time: a change of
/// bytes alone is not worth a report), as a BLAKE3 digest of its fields (32 bytes). Two
/// reports with the same fingerprint say the same.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ReportDigest([u8; 32]);

impl ReportDigest {
    /// The fingerprint of `ns`: each field but `bytes`, in order, each list with its length
    /// and each string with its length, so no two reports run together.
    pub(crate) fn of(ns: &NamespaceInventory) -> Self {
        let mut h = blake3::Hasher::new();
        // The encoding's version: a change of it is one full report, nothing worse.
        h.update(b"inventory-v1");
        h.update(ns.namespace_id.as_bytes());
        h.update(&(ns.groups.len() as u64).to_le_bytes());
        for g in &ns.groups {
            h.update(g.group_id.as_bytes());
            h.update(&[u8::from(g.authorship_ready)]);
            h.update(&(g.context_ids.len() as u64).to_le_bytes());
            for c in &g.context_ids {
                h.update(&(c.len() as u64).to_le_bytes());
                h.update(c.as_bytes());
            }
        }
        let number = |h: &mut blake3::Hasher, n: Option<u64>| {
            match n {
                None => h.update(&[0]),
                Some(n) => h.update(&[1]).update(&n.to_le_bytes()),
            };
        };
        number(&mut h, ns.member_count);
        number(&mut h, ns.context_count);
        h.update(match ns.tee_role {
            None => b"-",
            Some(None) => b"0",
            Some(Some(TeeRole::RelayTee)) => b"R",
            Some(Some(TeeRole::ReadOnlyTee)) => b"O",
        });
        Self(h.finalize().into())
    }
}

/// [`InventoryRecord::namespaces`] in the file: `{"<id>": "<64 hex>", ...}`.
fn write_posted<S: serde::Serializer>(
    posted: &[(GroupId, ReportDigest)],
    s: S,
) -> Result<S::Ok, S::Error> {
    s.collect_map(posted.iter().map(|(id, fp)| (id, hex::encode(fp.0))))
}

/// [`InventoryRecord::namespaces`] from the file (see [`write_posted`]).
fn read_posted<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<Vec<(GroupId, ReportDigest)>, D::Error> {
    use serde::de::Error as _;
    BTreeMap::<GroupId, String>::deserialize(d)?
        .into_iter()
        .map(|(id, text)| {
            let mut fp = [0u8; 32];
            hex::decode_to_slice(&text, &mut fp)
                .map_err(|e| D::Error::custom(format!("fingerprint of {id}: {e}")))?;
            Ok((id, ReportDigest(fp)))
        })
        .collect()
}

impl InventoryRecord {
    /// The fingerprint of `id` as last posted.
    pub(crate) fn get(&self, id: &GroupId) -> Option<&ReportDigest> {
        self.namespaces
            .binary_search_by_key(id, |(k, _)| *k)
            .ok()
            .map(|i| &self.namespaces[i].1)
    }

    /// Forgets the namespaces no longer `confirmed` (MDMA withdrew them, or the node left).
    pub(crate) fn prune(&mut self, confirmed: &BTreeSet<GroupId>) -> bool {
        let before = self.namespaces.len();
        self.namespaces.retain(|(id, _)| confirmed.contains(id));
        self.namespaces.len() != before
    }

    /// Keeps what a post that landed carried (`namespaces`); a `full` one also stamps
    /// `last_full`. The list is made again in one block (merged in one pass: at 10,000
    /// namespaces an insert each would move it 10,000 times). Whether a fingerprint moved
    /// (one added included): only then is the record worth writing.
    pub(crate) fn posted(
        &mut self,
        namespaces: &[NamespaceInventory],
        full: bool,
        now_unix: u64,
    ) -> bool {
        let mut new: Vec<(GroupId, ReportDigest)> = namespaces
            .iter()
            .map(|ns| (ns.namespace_id, ReportDigest::of(ns)))
            .collect();
        // Stable: of one id posted twice, the later is kept.
        new.sort_by_key(|(id, _)| *id);
        new.reverse();
        new.dedup_by_key(|(id, _)| *id);
        new.reverse();
        let old = std::mem::take(&mut self.namespaces);
        let mut moved = false;
        let mut merged = Vec::with_capacity(old.len() + new.len());
        let (mut old, mut new) = (old.into_iter().peekable(), new.into_iter().peekable());
        loop {
            let next = match (old.peek(), new.peek()) {
                (Some(o), Some(n)) if o.0 < n.0 => old.next(),
                (Some(o), Some(n)) if o.0 == n.0 => {
                    moved |= o.1 != n.1;
                    old.next();
                    new.next()
                }
                (_, Some(_)) => {
                    moved = true;
                    new.next()
                }
                (Some(_), None) => old.next(),
                (None, None) => break,
            };
            merged.extend(next);
        }
        merged.shrink_to_fit();
        self.namespaces = merged;
        if full {
            self.last_full = now_unix;
        }
        moved
    }
}

/// One namespace as walked: what it says, and whether it was read whole.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Scanned {
    /// The report.
    pub(crate) inventory: NamespaceInventory,
    /// Read whole: every group's contexts, the whole tree.
    pub(crate) complete: bool,
}

/// One `POST /api/fleet/inventory` to send.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Post {
    /// `full`.
    pub(crate) full: bool,
    /// `namespaces`.
    pub(crate) namespaces: Vec<NamespaceInventory>,
}

/// Whether this scan reports in full: the confirmed set changed since an earlier scan, or
/// [`FULL_EVERY`] passed since the last full report landed (`last_full` ahead of `now`, a
/// clock stepped back, counts as due: a clock fault never silences the report).
pub(crate) fn want_full(set_changed: bool, last_full: u64, now_unix: u64) -> bool {
    set_changed || last_full > now_unix || now_unix - last_full >= FULL_EVERY.as_secs()
}

/// The posts for `scanned` given what was last posted: the whole namespaces (`full` =
/// `want_full`) when a full report is due or something other than `bytes` changed, then the
/// partial ones (`full: false`) when something changed. Empty when nothing is to be said.
/// The scan moves into the posts: at 10,000 namespaces a copy of it is megabytes.
pub(crate) fn plan(scanned: Vec<Scanned>, record: &InventoryRecord, want_full: bool) -> Vec<Post> {
    let changed = scanned
        .iter()
        .any(|s| record.get(&s.inventory.namespace_id) != Some(&ReportDigest::of(&s.inventory)));
    let (whole, partial): (Vec<Scanned>, Vec<Scanned>) =
        scanned.into_iter().partition(|s| s.complete);
    let batch = |scans: Vec<Scanned>| -> Vec<NamespaceInventory> {
        scans.into_iter().map(|s| s.inventory).collect()
    };
    let mut posts = Vec::new();
    if want_full || changed {
        posts.push(Post {
            full: want_full,
            namespaces: batch(whole),
        });
    }
    if changed && !partial.is_empty() {
        posts.push(Post {
            full: false,
            namespaces: batch(partial),
        });
    }
    posts
}

/// Where an inventory report goes ([`MdmaClient::report_inventory`]; a fake in tests).
#[async_trait]
pub(crate) trait InventorySink: Send + Sync {
    /// Posts `report`.
    ///
    /// Errors: [`CallError`] when it did not land.
    async fn report(&self, report: &InventoryReport) -> Result<(), CallError>;
}

#[async_trait]
impl InventorySink for MdmaClient {
    async fn report(&self, report: &InventoryReport) -> Result<(), CallError> {
        self.report_inventory(report).await
    }
}

/// The outside world the inventory needs: merod's reads and MDMA's route.
#[derive(Clone)]
pub(crate) struct InventoryDeps {
    /// merod.
    pub(crate) merod: Arc<dyn GroupReader>,
    /// MDMA.
    pub(crate) mdma: Arc<dyn InventorySink>,
}

/// Why a scan reported nothing (the next scan tries again).
#[derive(Debug, thiserror::Error)]
pub(crate) enum ScanError {
    /// A post did not land.
    #[error("POST /api/fleet/inventory (full={full}): {source}")]
    Post {
        /// The post's `full`.
        full: bool,
        /// Why.
        #[source]
        source: CallError,
    },
}

impl Timed for ScanError {
    fn is_timeout(&self) -> bool {
        false
    }
}

/// A set of namespaces the loop hands to a job beside it (the confirmed ones to the
/// inventory and the recovery envelopes): the loop's side.
#[derive(Clone, Debug)]
pub(crate) struct NamespacesOffer(watch::Sender<Option<Arc<BTreeSet<GroupId>>>>);

/// The job's side of [`NamespacesOffer`]: the latest set, and whether it changed since the
/// set the job took before.
#[derive(Debug)]
pub(crate) struct NamespacesFeed {
    rx: watch::Receiver<Option<Arc<BTreeSet<GroupId>>>>,
    /// The set taken last.
    taken: Option<Arc<BTreeSet<GroupId>>>,
}

impl NamespacesOffer {
    /// A new offer and its feed, with no set yet.
    pub(crate) fn channel() -> (Self, NamespacesFeed) {
        let (tx, rx) = watch::channel(None);
        (Self(tx), NamespacesFeed { rx, taken: None })
    }

    /// Hands over `confirmed`; the job wakes only when it differs from the set handed over
    /// before (cloned only then).
    pub(crate) fn offer(&self, confirmed: &BTreeSet<GroupId>) {
        self.0.send_if_modified(|current| {
            if current.as_deref() == Some(confirmed) {
                return false;
            }
            *current = Some(Arc::new(confirmed.clone()));
            true
        });
    }
}

impl NamespacesFeed {
    /// The latest set and whether it differs from one taken before (`false` the first
    /// time); `None` before the loop handed any.
    pub(crate) fn take(&mut self) -> Option<(Arc<BTreeSet<GroupId>>, bool)> {
        let confirmed = self.rx.borrow_and_update().clone()?;
        let changed = self
            .taken
            .as_ref()
            .is_some_and(|before| before != &confirmed);
        self.taken = Some(Arc::clone(&confirmed));
        Some((confirmed, changed))
    }

    /// Whether the loop has handed no set yet.
    pub(crate) fn is_empty(&self) -> bool {
        self.rx.borrow().is_none()
    }

    /// Waits for another set (cancel-safe); never ends once the loop is gone (shutdown).
    pub(crate) async fn changed(&mut self) {
        if self.rx.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

/// The loop's side of the inventory job: hands it the confirmed namespaces.
#[derive(Clone, Debug)]
pub(crate) struct InventoryView {
    confirmed: NamespacesOffer,
}

impl InventoryView {
    /// Whether [`InventoryView::start`] starts the job.
    pub(crate) fn starts(cfg: &Config, deps: Option<&InventoryDeps>) -> bool {
        deps.is_some() && cfg.inventory.enabled && !cfg.dry_run
    }

    /// Starts the job for the node `peer_id` when `[inventory] enabled` (not in a dry run,
    /// not without `deps`), its record kept beside the state file. With `recovery`, each
    /// walk also reads what the recovery envelopes need and is handed to them there.
    pub(crate) fn start(
        cfg: &Config,
        deps: Option<InventoryDeps>,
        peer_id: PeerId,
        account: AccountSource,
        recovery: Option<Arc<Handoff>>,
        telemetry: Arc<Telemetry>,
        shutdown: CancellationToken,
    ) -> Option<Self> {
        if !Self::starts(cfg, deps.as_ref()) {
            return None;
        }
        let deps = deps?;
        let (confirmed, feed) = NamespacesOffer::channel();
        let path = record_file::beside_state(cfg, RECORD_FILE);
        let job = ScanJob::new(deps, peer_id, account, feed, path, recovery);
        jobs::spawn(job, telemetry, shutdown);
        Some(Self { confirmed })
    }

    /// Hands over the confirmed namespaces; the job wakes (scans at once) only when they
    /// differ from the set handed over before. Cloned only then.
    pub(crate) fn offer(&self, confirmed: &BTreeSet<GroupId>) {
        self.confirmed.offer(confirmed);
    }
}

/// The record at `path`; an empty one when there is none or it cannot be read (said: the
/// next scan then reports in full, which is what a lost record needs).
fn load_record(path: &Path) -> InventoryRecord {
    record_file::read(path).unwrap_or_else(|e| {
        warn!(path = %path.display(), "the inventory record {e}: reporting in full");
        InventoryRecord::default()
    })
}

/// The node's account once known (the loop's account cache), read at each scan.
pub(crate) type AccountSource = Arc<dyn Fn() -> Option<String> + Send + Sync>;

/// The inventory job: one scan a run.
pub(crate) struct ScanJob {
    deps: InventoryDeps,
    peer_id: PeerId,
    account: AccountSource,
    confirmed: NamespacesFeed,
    /// The set changed since a full report last landed: the next reports are full.
    pending_full: bool,
    record: InventoryRecord,
    path: PathBuf,
    /// Which namespaces were read whole, with what signal.
    book: WalkBook,
    /// Where each walk goes on to the recovery envelopes (when they are kept).
    recovery: Option<Arc<Handoff>>,
}

impl ScanJob {
    /// The job reporting for `peer_id` the namespaces `confirmed` hands it, its record at
    /// `path` (read now), each walk handed on to `recovery` when given.
    pub(crate) fn new(
        deps: InventoryDeps,
        peer_id: PeerId,
        account: AccountSource,
        confirmed: NamespacesFeed,
        path: PathBuf,
        recovery: Option<Arc<Handoff>>,
    ) -> Self {
        Self {
            record: load_record(&path),
            path,
            deps,
            peer_id,
            account,
            confirmed,
            pending_full: false,
            book: WalkBook::default(),
            recovery,
        }
    }

    /// Makes the next scan walk every namespace (the [`WalkBook`]'s whole walk is due).
    pub(crate) fn walk_whole_next(&mut self) {
        self.book.whole_now();
    }

    /// Writes the record (a failure is said: the next scan may post again what landed).
    async fn keep(&self) {
        let path = self.path.clone();
        if let Err(e) = record_file::write_whole(&self.record, path, 0o644, || Ok(())).await {
            warn!(path = %self.path.display(), "the inventory record is not kept: {e}");
        }
    }
}

impl Job for ScanJob {
    /// How many namespaces the last scan reported.
    type Output = usize;
    type Error = ScanError;
    const NAME: &'static str = "inventory";
    const WALKS_EVERY_NAMESPACE: bool = true;
    const FAILING: &'static str = "the context inventory cannot be reported";
    const EFFECT: &'static str = "MDMA keeps its older copy; the next scan reports again";
    const RECOVERED: &'static str = "the context inventory is reported again";

    fn schedule(&self) -> Schedule {
        Schedule::every(SCAN_EVERY, SCAN_DEADLINE).min_gap(Duration::from_secs(1))
    }

    async fn run(&mut self) -> Result<usize, ScanError> {
        let Some((confirmed, changed)) = self.confirmed.take() else {
            return Ok(0);
        };
        self.pending_full |= changed;
        // Whole seconds; a clock before 1970 reads as 0 (a full report is then due).
        let now = unix_now().max(0.0) as u64;
        let full = want_full(self.pending_full, self.record.last_full, now);
        let usage = match self.deps.merod.usage().await {
            Ok(u) => Some(u),
            Err(e) => {
                warn!("merod's usage did not answer ({e}); reporting the inventory without bytes and walking every namespace");
                None
            }
        };
        let started = Instant::now();
        let whole = full || self.book.whole_due(started);
        let mut to_walk = self.book.pick(&confirmed, usage.as_ref(), whole, started);
        if let Some(handoff) = &self.recovery {
            handoff.retain(&confirmed);
            let asked = handoff.wanted(started, handoff.room());
            to_walk.extend(asked);
            to_walk.sort_unstable();
            to_walk.dedup();
        }
        let account = (self.account)();
        let needs = Needs {
            account: account.as_deref(),
            devices: self.recovery.as_ref().is_some_and(|h| h.is_open()),
            capabilities: true,
        };
        let mut wait_left = HANDOFF_WAIT;
        let mut scanned = Vec::with_capacity(to_walk.len());
        for id in to_walk {
            let read = walk_tree(self.deps.merod.as_ref(), id, needs, WALK_BUDGET).await;
            self.book.walked(id, usage.as_ref(), read.complete());
            match scanned_of(&read, usage.as_ref()) {
                Some(s) => scanned.push(s),
                None => {
                    warn!(namespace_id = %id, "could not read the context inventory; leaving MDMA's copy untouched")
                }
            }
            if let Some(handoff) = &self.recovery {
                if handoff.room() == 0 && !wait_left.is_zero() {
                    let waited = Instant::now();
                    handoff.room_within(wait_left).await;
                    wait_left = wait_left.saturating_sub(waited.elapsed());
                }
                handoff.deliver(read);
            }
        }
        drop(usage);
        let mut changed = self.record.prune(&confirmed);
        let reported = scanned.len();
        // At 10,000 namespaces each copy of the inventory is megabytes: the scan moves into
        // the posts, and what a post carries into the report.
        let posts = plan(scanned, &self.record, full);
        for Post { full, namespaces } in posts {
            let report = InventoryReport {
                peer_id: self.peer_id.clone(),
                namespaces,
                full,
            };
            if let Err(source) = self.deps.mdma.report(&report).await {
                if changed {
                    self.keep().await;
                }
                return Err(ScanError::Post { full, source });
            }
            let count = report.namespaces.len();
            // A full report that moved no fingerprint only stamps `last_full`: not worth
            // rewriting the record (1.3 MB at 10,000 namespaces every 15 minutes). After a
            // restart the first scan walks every namespace anyway, and reports in full if due.
            changed |= self.record.posted(&report.namespaces, full, now);
            drop(report);
            if full {
                self.pending_full = false;
            }
            info!(
                full,
                "reported the context inventory for {count} namespace(s)"
            );
        }
        if changed {
            self.keep().await;
        }
        Ok(reported)
    }

    fn idle(&self) -> bool {
        self.confirmed.is_empty()
    }

    async fn wake(&mut self) {
        self.confirmed.changed().await;
    }
}

/// The report of a walk of its namespace ([`walk_tree`]), `bytes` from `usage`: the groups
/// whose contexts were read, each group without any left out, its contexts sorted once;
/// the member count and the node's role from the namespace's member list (left out when it
/// failed); `authorship_ready` where merod answered a `RelayTee`'s capabilities.
///
/// Partial (not `complete`): a subgroup list or a context list that could not be read (that
/// group is left out), a tree larger than `MAX_GROUPS`, the budget spent. A failed member
/// list or capabilities read only leaves its fields out (or `false`). `None` when nothing
/// usable was read (no group, and the read was partial): MDMA's copy is left as it is.
pub(crate) fn scanned_of(
    read: &TreeRead,
    usage: Option<&BTreeMap<GroupId, NamespaceUsage>>,
) -> Option<Scanned> {
    let mut complete = read.tree_whole;
    let mut groups = Vec::new();
    for node in &read.groups {
        let Some(contexts) = &node.contexts else {
            complete = false;
            continue;
        };
        if contexts.is_empty() {
            continue;
        }
        groups.push(GroupInventory {
            group_id: node.id,
            context_ids: contexts.clone(),
            authorship_ready: node.authorship_ready,
        });
    }
    if groups.is_empty() && !complete {
        return None;
    }
    let context_count = complete.then(|| {
        groups
            .iter()
            .flat_map(|g| g.context_ids.iter())
            .collect::<BTreeSet<_>>()
            .len() as u64
    });
    Some(Scanned {
        inventory: NamespaceInventory {
            namespace_id: read.namespace,
            groups,
            member_count: read.members.as_ref().map(|m| m.len() as u64),
            tee_role: read.role,
            context_count,
            bytes: usage.and_then(|u| u.get(&read.namespace)).map(|u| u.bytes),
        },
        complete,
    })
}

#[cfg(test)]
mod tests {
    use super::super::trees::MAX_GROUPS;
    use super::*;
    use crate::merod::{GroupMember, MemberDevices, MerodError, StorageBytes};
    use std::collections::HashMap;
    use std::sync::Mutex;

    /// One walk as the inventory alone makes it, and its report.
    async fn walk_namespace(
        merod: &dyn GroupReader,
        namespace: GroupId,
        account: Option<&str>,
        usage: Option<&BTreeMap<GroupId, NamespaceUsage>>,
        budget: Duration,
    ) -> Option<Scanned> {
        let needs = Needs {
            account,
            devices: false,
            capabilities: true,
        };
        scanned_of(&walk_tree(merod, namespace, needs, budget).await, usage)
    }

    const ACCOUNT: &str = "4ff91b6ee8c12aec3a9a2106452ccf87fae3f7cce0bfd0630f77fcca73813d38";

    fn gid(n: u8) -> GroupId {
        format!("{n:02x}").repeat(32).parse().unwrap()
    }

    fn fail() -> MerodError {
        MerodError::Status {
            op: crate::merod::MerodOp::Contexts,
            url: "http://127.0.0.1/".to_owned(),
            status: 500,
        }
    }

    /// A merod of a tree: children, contexts, members and capabilities per group; a group
    /// missing from `contexts` fails its context read.
    #[derive(Default)]
    struct Tree {
        children: HashMap<GroupId, Vec<GroupId>>,
        contexts: HashMap<GroupId, Vec<String>>,
        members: Option<Vec<GroupMember>>,
        capable: BTreeSet<GroupId>,
        slow: Option<Duration>,
        calls: Mutex<usize>,
    }

    #[async_trait]
    impl GroupReader for Tree {
        async fn subgroups(&self, group: GroupId) -> Result<Vec<GroupId>, MerodError> {
            *self.calls.lock().unwrap() += 1;
            if let Some(d) = self.slow {
                tokio::time::sleep(d).await;
            }
            Ok(self.children.get(&group).cloned().unwrap_or_default())
        }
        async fn contexts(&self, group: GroupId) -> Result<Vec<String>, MerodError> {
            self.contexts.get(&group).cloned().ok_or_else(fail)
        }
        async fn members(&self, _: GroupId) -> Result<Vec<GroupMember>, MerodError> {
            self.members.clone().ok_or_else(fail)
        }
        async fn capabilities(&self, group: GroupId, _: &str) -> Result<u32, MerodError> {
            if self.capable.contains(&group) {
                Ok(4)
            } else {
                Err(fail())
            }
        }
        async fn member_devices(&self, _: GroupId) -> Result<Vec<MemberDevices>, MerodError> {
            Err(fail())
        }
        async fn usage(&self) -> Result<BTreeMap<GroupId, NamespaceUsage>, MerodError> {
            Ok(BTreeMap::new())
        }
    }

    fn member(identity: &str, role: &str) -> GroupMember {
        GroupMember {
            identity: identity.to_owned(),
            role: role.to_owned(),
        }
    }

    /// A namespace 1 with a subgroup 2 (and an empty subgroup 3), two contexts under 1 and
    /// one under 2, four members with the node as `role`.
    fn tree(role: &str) -> Tree {
        let mut t = Tree::default();
        t.children.insert(gid(1), vec![gid(2), gid(3)]);
        t.contexts
            .insert(gid(1), vec!["b".into(), "a".into(), "a".into()]);
        t.contexts.insert(gid(2), vec!["c".into()]);
        t.contexts.insert(gid(3), vec![]);
        t.members = Some(vec![
            member(&"1".repeat(64), "Admin"),
            member(&"2".repeat(64), "Member"),
            member(&"3".repeat(64), "ReadOnly"),
            member(ACCOUNT, role),
        ]);
        t.capable = BTreeSet::from([gid(1), gid(2)]);
        t
    }

    async fn walk(t: &Tree) -> Option<Scanned> {
        walk_namespace(t, gid(1), Some(ACCOUNT), None, WALK_BUDGET).await
    }

    #[tokio::test]
    async fn contexts_are_reported_under_their_own_group_with_the_counts() {
        let s = walk(&tree("ReadOnlyTee")).await.unwrap();
        assert!(s.complete);
        let groups: Vec<(GroupId, Vec<String>)> = s
            .inventory
            .groups
            .iter()
            .map(|g| (g.group_id, g.context_ids.clone()))
            .collect();
        // The empty group 3 is left out; contexts sorted, each once.
        assert_eq!(
            groups,
            [
                (gid(1), vec!["a".to_owned(), "b".to_owned()]),
                (gid(2), vec!["c".to_owned()])
            ]
        );
        assert_eq!(s.inventory.member_count, Some(4));
        assert_eq!(s.inventory.context_count, Some(3));
        assert_eq!(s.inventory.tee_role, Some(Some(TeeRole::ReadOnlyTee)));
        // A ReadOnlyTee is never ready, whatever its capability bits.
        assert!(s.inventory.groups.iter().all(|g| !g.authorship_ready));
        // No account id on the wire.
        let wire = serde_json::to_string(&s.inventory).unwrap();
        assert!(!wire.contains(ACCOUNT), "{wire}");
    }

    #[tokio::test]
    async fn a_relay_tee_is_ready_where_its_capabilities_are_answered() {
        let mut t = tree("RelayTee");
        t.capable.remove(&gid(2));
        let s = walk(&t).await.unwrap();
        let ready: Vec<bool> = s
            .inventory
            .groups
            .iter()
            .map(|g| g.authorship_ready)
            .collect();
        assert_eq!(ready, [true, false]);
        assert!(
            s.complete,
            "a failed capabilities read does not make it partial"
        );
    }

    #[tokio::test]
    async fn unread_members_or_role_leave_their_fields_out_and_nothing_ready() {
        let mut t = tree("RelayTee");
        t.members = None;
        let s = walk(&t).await.unwrap();
        assert!(s.complete);
        assert_eq!(s.inventory.member_count, None);
        assert_eq!(s.inventory.tee_role, None);
        assert!(s.inventory.groups.iter().all(|g| !g.authorship_ready));
        // Without the account the role is unknown too.
        let s = walk_namespace(&tree("RelayTee"), gid(1), None, None, WALK_BUDGET)
            .await
            .unwrap();
        assert_eq!(s.inventory.tee_role, None);
        assert_eq!(s.inventory.member_count, Some(4));
        // Read, and no TEE role: null.
        let s = walk(&tree("Member")).await.unwrap();
        assert_eq!(s.inventory.tee_role, Some(None));
    }

    #[tokio::test]
    async fn a_failed_contexts_read_is_partial_without_a_count_and_nothing_read_is_no_report() {
        let mut t = tree("ReadOnlyTee");
        t.contexts.remove(&gid(2));
        let s = walk(&t).await.unwrap();
        assert!(!s.complete);
        assert_eq!(s.inventory.context_count, None);
        assert_eq!(s.inventory.groups.len(), 1);
        let mut t = tree("ReadOnlyTee");
        t.contexts.clear();
        assert_eq!(walk(&t).await, None, "no group and partial: not reported");
    }

    #[tokio::test]
    async fn bytes_come_from_usage_for_the_namespace_asked_only() {
        let usage = BTreeMap::from([
            (
                gid(1),
                NamespaceUsage::of_bytes(StorageBytes {
                    total: 9,
                    ..StorageBytes::default()
                }),
            ),
            (
                gid(9),
                NamespaceUsage::of_bytes(StorageBytes {
                    total: 1,
                    ..StorageBytes::default()
                }),
            ),
        ]);
        let s = walk_namespace(
            &tree("Member"),
            gid(1),
            Some(ACCOUNT),
            Some(&usage),
            WALK_BUDGET,
        )
        .await
        .unwrap();
        assert_eq!(s.inventory.bytes.map(|b| b.total), Some(9));
        let s = walk(&tree("Member")).await.unwrap();
        assert_eq!(
            s.inventory.bytes, None,
            "no usage: bytes left out, still whole"
        );
        assert!(s.complete);
    }

    #[tokio::test]
    async fn a_tree_past_512_groups_or_the_budget_is_partial_and_bounded() {
        let mut t = tree("Member");
        // A chain of 600 groups, each with a context.
        let ids: Vec<GroupId> = (0..600u32)
            .map(|i| format!("{i:064x}").parse().unwrap())
            .collect();
        t.children.insert(gid(1), vec![ids[0]]);
        for w in ids.windows(2) {
            t.children.insert(w[0], vec![w[1]]);
        }
        for id in &ids {
            t.contexts.insert(*id, vec!["x".into()]);
        }
        let s = walk(&t).await.unwrap();
        assert!(!s.complete);
        assert_eq!(*t.calls.lock().unwrap(), MAX_GROUPS);
        assert_eq!(s.inventory.groups.len(), MAX_GROUPS);

        let mut t = tree("Member");
        t.slow = Some(Duration::from_millis(300));
        let started = Instant::now();
        let s = walk_namespace(&t, gid(1), Some(ACCOUNT), None, Duration::from_millis(500))
            .await
            .unwrap();
        assert!(started.elapsed() < Duration::from_secs(2));
        assert!(!s.complete, "the budget ran out");
    }

    fn scanned(n: u8, complete: bool, total: u64) -> Scanned {
        Scanned {
            inventory: NamespaceInventory {
                namespace_id: gid(n),
                groups: vec![GroupInventory {
                    group_id: gid(n),
                    context_ids: vec!["c".into()],
                    authorship_ready: false,
                }],
                member_count: Some(2),
                tee_role: Some(None),
                context_count: complete.then_some(1),
                bytes: Some(StorageBytes {
                    total,
                    ..StorageBytes::default()
                }),
            },
            complete,
        }
    }

    #[test]
    fn the_first_post_is_full_and_the_steady_state_is_silent() {
        let mut record = InventoryRecord::default();
        let scan = [scanned(1, true, 5)];
        assert!(want_full(false, record.last_full, 1_000_000));
        let posts = plan(scan.to_vec(), &record, true);
        assert_eq!(posts.len(), 1);
        assert!(posts[0].full);
        record.posted(&posts[0].namespaces, posts[0].full, 1_000_000);
        assert_eq!(record.last_full, 1_000_000);
        let want = want_full(false, record.last_full, 1_000_060);
        assert!(!want);
        assert!(
            plan(scan.to_vec(), &record, want).is_empty(),
            "nothing changed"
        );
        // Bytes alone do not post, but the next post carries them.
        let moved = [scanned(1, true, 99)];
        assert!(plan(moved.to_vec(), &record, false).is_empty());
        let posts = plan(moved.to_vec(), &record, true);
        assert_eq!(posts[0].namespaces[0].bytes.unwrap().total, 99);
        // 900 s after the last full one, and a clock stepped back, are due.
        assert!(want_full(false, 1_000_000, 1_000_900));
        assert!(want_full(false, 1_000_000, 999_000));
        assert!(want_full(true, 1_000_000, 1_000_001), "the set changed");
    }

    #[test]
    fn partial_namespaces_go_additively_and_only_on_a_change() {
        let record = InventoryRecord::default();
        let scan = [scanned(1, true, 0), scanned(2, false, 0)];
        let posts = plan(scan.to_vec(), &record, true);
        assert_eq!(posts.len(), 2);
        assert!(posts[0].full && posts[0].namespaces[0].namespace_id == gid(1));
        assert!(!posts[1].full && posts[1].namespaces[0].namespace_id == gid(2));
        let mut record = record;
        for p in &posts {
            record.posted(&p.namespaces, p.full, 10);
        }
        // Unchanged: a due full report carries the whole ones only.
        let posts = plan(scan.to_vec(), &record, true);
        assert_eq!(posts.len(), 1);
        assert!(posts[0].full);
        assert_eq!(posts[0].namespaces.len(), 1);
    }

    #[test]
    fn a_fingerprint_moves_with_every_field_but_bytes() {
        let base = scanned(1, true, 5).inventory;
        let fp = ReportDigest::of(&base);
        let same = NamespaceInventory {
            bytes: None,
            ..base.clone()
        };
        assert_eq!(ReportDigest::of(&same), fp, "bytes alone say nothing new");
        let group = |ids: &[&str], ready: bool| GroupInventory {
            group_id: gid(1),
            context_ids: ids.iter().map(|c| (*c).to_owned()).collect(),
            authorship_ready: ready,
        };
        let changes: Vec<NamespaceInventory> = vec![
            NamespaceInventory {
                namespace_id: gid(2),
                ..base.clone()
            },
            NamespaceInventory {
                member_count: Some(3),
                ..base.clone()
            },
            NamespaceInventory {
                member_count: None,
                ..base.clone()
            },
            NamespaceInventory {
                context_count: None,
                ..base.clone()
            },
            NamespaceInventory {
                tee_role: None,
                ..base.clone()
            },
            NamespaceInventory {
                tee_role: Some(Some(TeeRole::RelayTee)),
                ..base.clone()
            },
            NamespaceInventory {
                groups: vec![group(&["c"], true)],
                ..base.clone()
            },
            NamespaceInventory {
                groups: vec![group(&["c", "d"], false)],
                ..base.clone()
            },
            NamespaceInventory {
                groups: vec![],
                ..base.clone()
            },
        ];
        let mut seen = vec![fp];
        for changed in &changes {
            let other = ReportDigest::of(changed);
            assert!(!seen.contains(&other), "{changed:?}");
            seen.push(other);
        }
        // Strings do not run together.
        let ab_c = NamespaceInventory {
            groups: vec![group(&["ab", "c"], false)],
            ..base.clone()
        };
        let a_bc = NamespaceInventory {
            groups: vec![group(&["a", "bc"], false)],
            ..base
        };
        assert_ne!(ReportDigest::of(&ab_c), ReportDigest::of(&a_bc));
    }

    #[test]
    fn the_record_keeps_the_latest_fingerprint_of_each_namespace_sorted_and_reads_back() {
        let mut record = InventoryRecord::default();
        let ns = |n: u8, members: u64| NamespaceInventory {
            member_count: Some(members),
            ..scanned(n, true, 0).inventory
        };
        assert!(record.posted(&[ns(3, 1), ns(1, 1)], true, 10));
        // 3 again (and twice in one post: the later counts), 2 new, 1 untouched.
        assert!(record.posted(&[ns(3, 2), ns(2, 1), ns(3, 3)], false, 20));
        assert_eq!(
            record.last_full, 10,
            "a partial post does not stamp last_full"
        );
        let ids: Vec<GroupId> = record.namespaces.iter().map(|(id, _)| *id).collect();
        assert_eq!(ids, [gid(1), gid(2), gid(3)]);
        assert_eq!(record.get(&gid(3)), Some(&ReportDigest::of(&ns(3, 3))));
        assert_eq!(record.get(&gid(1)), Some(&ReportDigest::of(&ns(1, 1))));
        assert_eq!(record.get(&gid(4)), None);

        let file = serde_json::to_value(&record).unwrap();
        assert_eq!(
            file["namespaces"][gid(2).to_string()],
            serde_json::json!(hex::encode(ReportDigest::of(&ns(2, 1)).0))
        );
        let back: InventoryRecord = serde_json::from_value(file).unwrap();
        assert_eq!(back, record);
        // A full report saying what was said: stamped, and nothing worth writing.
        let mut again = record.clone();
        assert!(!again.posted(&[ns(1, 1), ns(2, 1), ns(3, 3)], true, 30));
        assert_eq!(again.last_full, 30);
        assert_eq!(again.namespaces, record.namespaces);

        // A record of the earlier form (each namespace's whole report) is not read: the
        // next scan reports in full.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(RECORD_FILE);
        let earlier = serde_json::json!({
            "last_full": 10,
            "namespaces": { gid(1).to_string(): serde_json::to_value(ns(1, 1)).unwrap() }
        });
        std::fs::write(&path, earlier.to_string()).unwrap();
        assert_eq!(load_record(&path), InventoryRecord::default());
    }

    #[test]
    fn a_failed_post_keeps_nothing_and_no_longer_confirmed_ones_are_pruned() {
        let mut record = InventoryRecord::default();
        let scan = [scanned(1, true, 0), scanned(2, true, 0)];
        let posts = plan(scan.to_vec(), &record, true);
        // The post failed: the record is not touched, so the next scan posts again.
        assert_eq!(
            plan(scan.to_vec(), &record, false),
            posts
                .iter()
                .map(|p| Post {
                    full: false,
                    ..p.clone()
                })
                .collect::<Vec<_>>()
        );
        record.posted(&posts[0].namespaces, posts[0].full, 10);
        assert!(record.prune(&BTreeSet::from([gid(2)])));
        assert_eq!(
            record
                .namespaces
                .iter()
                .map(|(id, _)| *id)
                .collect::<Vec<_>>(),
            [gid(2)]
        );
        assert!(!record.prune(&BTreeSet::from([gid(2)])));
        let text = serde_json::to_string(&record).unwrap();
        let back: InventoryRecord = serde_json::from_str(&text).unwrap();
        assert_eq!(back, record);
    }
}
