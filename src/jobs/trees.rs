//! The walk of a namespace's tree that the context inventory and the recovery envelopes
//! share, and which namespaces to walk again.
//!
//! One walk ([`walk_tree`]) reads what both jobs need of a namespace: its groups
//! breadth-first ([`TreeWalk`], at most [`MAX_GROUPS`]), each group's members, contexts and,
//! when the envelopes are kept, member devices, and for a `RelayTee` node its capabilities
//! in each group with contexts. The inventory walks; what it read goes to the envelopes
//! through a [`Handoff`], so a tree is read once for both.
//!
//! Between whole walks (every [`WHOLE_EVERY`] at the latest), merod's one-call
//! `GET /admin-api/usage` decides which namespaces to walk again ([`WalkBook`]): one whose
//! [`TreeSignal`] (its context, member and subgroup counts and its governance bytes) moved
//! since its last whole read, one never read whole, one with no row, and every one when the
//! usage cannot be read (unknown is "may have changed", never "unchanged"). A change the
//! signal cannot show (a member replaced by another, a role or a device changed, a context
//! moved between groups) waits for the next whole walk.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::ids::GroupId;
use crate::merod::{GroupMember, MemberDevices, MerodError, NamespaceUsage, OnMerod, TeeRole};

/// Most groups of one namespace walked; a tree left over makes the read partial.
pub(crate) const MAX_GROUPS: usize = 512;
/// Longest time between two whole walks of every namespace (the inventory's full report).
pub(crate) const WHOLE_EVERY: Duration = Duration::from_secs(900);
/// Most walks waiting in a [`Handoff`] for the envelopes (a few KB each): one more is not
/// handed over but asked for again at the next scan.
pub(crate) const HANDOFF_CAP: usize = 1024;
/// Longest a scan waits, all namespaces together, for room in a full [`Handoff`]: the
/// envelopes are slow (a seal and a `PUT` each), the inventory never waits long for them.
pub(crate) const HANDOFF_WAIT: Duration = Duration::from_secs(10);

/// The merod reads a walk needs ([`MerodClient`](crate::merod::MerodClient)'s; a fake in tests).
#[async_trait]
pub(crate) trait GroupReader: Send + Sync {
    /// [`MerodClient::subgroups`](crate::merod::MerodClient::subgroups).
    async fn subgroups(&self, group: GroupId) -> Result<Vec<GroupId>, MerodError>;
    /// [`MerodClient::group_contexts`](crate::merod::MerodClient::group_contexts).
    async fn contexts(&self, group: GroupId) -> Result<Vec<String>, MerodError>;
    /// [`MerodClient::group_members`](crate::merod::MerodClient::group_members).
    async fn members(&self, group: GroupId) -> Result<Vec<GroupMember>, MerodError>;
    /// [`MerodClient::member_capabilities`](crate::merod::MerodClient::member_capabilities).
    async fn capabilities(&self, group: GroupId, account: &str) -> Result<u32, MerodError>;
    /// [`MerodClient::member_devices`](crate::merod::MerodClient::member_devices).
    async fn member_devices(&self, group: GroupId) -> Result<Vec<MemberDevices>, MerodError>;
    /// [`MerodClient::namespace_usage`](crate::merod::MerodClient::namespace_usage).
    async fn usage(&self) -> Result<BTreeMap<GroupId, NamespaceUsage>, MerodError>;
}

#[async_trait]
impl<T: OnMerod> GroupReader for T {
    async fn subgroups(&self, group: GroupId) -> Result<Vec<GroupId>, MerodError> {
        self.merod().subgroups(group).await
    }
    async fn contexts(&self, group: GroupId) -> Result<Vec<String>, MerodError> {
        self.merod().group_contexts(group).await
    }
    async fn members(&self, group: GroupId) -> Result<Vec<GroupMember>, MerodError> {
        self.merod().group_members(group).await
    }
    async fn capabilities(&self, group: GroupId, account: &str) -> Result<u32, MerodError> {
        self.merod().member_capabilities(group, account).await
    }
    async fn member_devices(&self, group: GroupId) -> Result<Vec<MemberDevices>, MerodError> {
        self.merod().member_devices(group).await
    }
    async fn usage(&self) -> Result<BTreeMap<GroupId, NamespaceUsage>, MerodError> {
        self.merod().namespace_usage().await
    }
}

/// The groups of a namespace's tree, breadth-first from the namespace, each once, at most
/// [`MAX_GROUPS`].
pub(crate) struct TreeWalk {
    queue: VecDeque<GroupId>,
    seen: BTreeSet<GroupId>,
    walked: usize,
    /// A subgroup list could not be read: groups under it may be missing.
    lost: bool,
}

/// The tree has more than [`MAX_GROUPS`] groups: what was walked is not all of it.
#[derive(Debug)]
pub(crate) struct TreeTooLarge;

impl TreeWalk {
    /// A walk from `root`.
    pub(crate) fn new(root: GroupId) -> Self {
        Self {
            queue: VecDeque::from([root]),
            seen: BTreeSet::from([root]),
            walked: 0,
            lost: false,
        }
    }

    /// The next group to read; `None` when the tree is walked.
    ///
    /// Errors: [`TreeTooLarge`] when [`MAX_GROUPS`] were walked and more are left.
    pub(crate) fn next_group(&mut self) -> Result<Option<GroupId>, TreeTooLarge> {
        if self.queue.is_empty() {
            return Ok(None);
        }
        if self.walked == MAX_GROUPS {
            return Err(TreeTooLarge);
        }
        self.walked += 1;
        Ok(self.queue.pop_front())
    }

    /// The subgroups of the group last handed out (one seen before is not walked again).
    pub(crate) fn found(&mut self, children: Vec<GroupId>) {
        let seen = &mut self.seen;
        self.queue
            .extend(children.into_iter().filter(|c| seen.insert(*c)));
    }
}

/// `call`, unless `deadline` passed first (`None`: out of budget).
pub(crate) async fn within<T>(
    deadline: Instant,
    call: impl std::future::Future<Output = Result<T, MerodError>>,
) -> Option<Result<T, MerodError>> {
    tokio::time::timeout_at(deadline, call).await.ok()
}

/// What one walk reads beyond the tree, its contexts and the namespace's member list.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Needs<'a> {
    /// The node's own account (lowercase hex), once known: its role, and for a `RelayTee`
    /// its capabilities in each group with contexts.
    pub(crate) account: Option<&'a str>,
    /// Every group's members and member devices (the recovery envelopes are kept).
    pub(crate) devices: bool,
    /// The capabilities of a `RelayTee` (the inventory is reported).
    pub(crate) capabilities: bool,
}

/// Why a walk did not read all it asked for (the first reason).
#[derive(Debug, thiserror::Error)]
pub(crate) enum Gap {
    /// A read failed.
    #[error("{0}")]
    Read(#[from] MerodError),
    /// The walk's budget ran out.
    #[error("no whole read within {0:?}")]
    Budget(Duration),
    /// The tree is larger than the walk takes.
    #[error("more than {MAX_GROUPS} groups")]
    TooLarge,
    /// The walk was not asked for every group's members and devices.
    #[error("the walk did not read every group's members and devices")]
    NotAsked,
}

/// One group as walked; `None` for a read that failed or was not asked for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct GroupNode {
    /// The group.
    pub(crate) id: GroupId,
    /// Its members (the namespace's own are [`TreeRead::members`]).
    pub(crate) members: Option<Vec<GroupMember>>,
    /// Its contexts.
    pub(crate) contexts: Option<Vec<String>>,
    /// Its `member-devices` rows.
    pub(crate) devices: Option<Vec<MemberDevices>>,
    /// Whether merod answered the node's capabilities there.
    pub(crate) authorship_ready: bool,
}

/// One namespace as walked: what was read, and the first gap if any.
#[derive(Debug)]
pub(crate) struct TreeRead {
    /// The namespace.
    pub(crate) namespace: GroupId,
    /// The namespace's member list (`None`: it failed).
    pub(crate) members: Option<Vec<GroupMember>>,
    /// The node's role there, by its account in `members` (`None`: not known; `Some(None)`:
    /// no TEE role).
    pub(crate) role: Option<Option<TeeRole>>,
    /// The groups walked, breadth-first.
    pub(crate) groups: Vec<GroupNode>,
    /// Every group of the tree was walked (no subgroup list failed, the budget and
    /// [`MAX_GROUPS`] held).
    pub(crate) tree_whole: bool,
    /// The first read asked for that failed, if any.
    pub(crate) gap: Option<Gap>,
}

impl TreeRead {
    /// Whether everything asked for was read.
    pub(crate) fn complete(&self) -> bool {
        self.gap.is_none()
    }
}

/// Walks `namespace` through `merod` within `budget`: the namespace's member list (the
/// node's role, by `needs.account`), the groups breadth-first (at most [`MAX_GROUPS`]),
/// each group's contexts and, as `needs` asks, members, member devices and capabilities.
/// A failed read is noted ([`TreeRead::gap`]) and the walk goes on (a failed subgroup list
/// leaves that group's children out); the budget spent ends it.
pub(crate) async fn walk_tree(
    merod: &dyn GroupReader,
    namespace: GroupId,
    needs: Needs<'_>,
    budget: Duration,
) -> TreeRead {
    let deadline = Instant::now() + budget;
    let mut read = TreeRead {
        namespace,
        members: None,
        role: None,
        groups: Vec::new(),
        tree_whole: true,
        gap: None,
    };
    let note = |gap: &mut Option<Gap>, why: Gap| {
        gap.get_or_insert(why);
    };
    match within(deadline, merod.members(namespace)).await {
        Some(Ok(rows)) => {
            read.role = needs.account.map(|account| {
                let account = account.to_ascii_lowercase();
                rows.iter()
                    .find(|m| m.identity == account)
                    .and_then(|m| TeeRole::from_merod(&m.role))
            });
            read.members = Some(rows);
        }
        Some(Err(e)) => note(&mut read.gap, Gap::Read(e)),
        None => {
            read.tree_whole = false;
            note(&mut read.gap, Gap::Budget(budget));
            return read;
        }
    }
    let relay = match (read.role, needs.account) {
        (Some(Some(TeeRole::RelayTee)), Some(a)) if needs.capabilities => Some(a),
        _ => None,
    };
    let mut tree = TreeWalk::new(namespace);
    loop {
        let id = match tree.next_group() {
            Ok(Some(id)) => id,
            Ok(None) => break,
            Err(TreeTooLarge) => {
                read.tree_whole = false;
                note(&mut read.gap, Gap::TooLarge);
                break;
            }
        };
        let mut node = GroupNode {
            id,
            members: None,
            contexts: None,
            devices: None,
            authorship_ready: false,
        };
        // Each read in turn; the budget spent ends the walk with what was read.
        let out_of_time = read_group(merod, namespace, needs, deadline, &mut node, &mut tree)
            .await
            .map_or(true, |gaps| {
                for gap in gaps {
                    note(&mut read.gap, gap);
                }
                false
            });
        if out_of_time {
            read.tree_whole = false;
            note(&mut read.gap, Gap::Budget(budget));
            read.groups.push(node);
            break;
        }
        if let (Some(account), Some(contexts)) = (relay, &node.contexts) {
            if !contexts.is_empty() {
                node.authorship_ready = matches!(
                    within(deadline, merod.capabilities(id, account)).await,
                    Some(Ok(_))
                );
            }
        }
        read.groups.push(node);
    }
    read.tree_whole &= !tree.lost;
    read
}

/// The budget of a walk ran out.
struct OutOfTime;

/// `answer`'s value; `None` for a read that failed (pushed onto `gaps`).
///
/// Errors: [`OutOfTime`] when the budget ran out first.
fn answered<T>(
    answer: Option<Result<T, MerodError>>,
    gaps: &mut Vec<Gap>,
) -> Result<Option<T>, OutOfTime> {
    match answer {
        Some(Ok(value)) => Ok(Some(value)),
        Some(Err(e)) => {
            gaps.push(Gap::Read(e));
            Ok(None)
        }
        None => Err(OutOfTime),
    }
}

/// Reads group `node.id` of `namespace`'s tree by `deadline`: its subgroups (handed to
/// `tree`; a failed list marks the tree not whole), its contexts (sorted, each once) and as
/// `needs` asks its members (the namespace's own are read before) and member devices, into
/// `node`. The failed reads, in order.
///
/// Errors: [`OutOfTime`] when the budget ran out (what was read is in `node`).
async fn read_group(
    merod: &dyn GroupReader,
    namespace: GroupId,
    needs: Needs<'_>,
    deadline: Instant,
    node: &mut GroupNode,
    tree: &mut TreeWalk,
) -> Result<Vec<Gap>, OutOfTime> {
    let id = node.id;
    let mut gaps = Vec::new();
    match answered(within(deadline, merod.subgroups(id)).await, &mut gaps)? {
        Some(children) => tree.found(children),
        None => tree.lost = true,
    }
    if needs.devices && id != namespace {
        node.members = answered(within(deadline, merod.members(id)).await, &mut gaps)?;
    }
    node.contexts = answered(within(deadline, merod.contexts(id)).await, &mut gaps)?.map(
        |mut contexts: Vec<String>| {
            contexts.sort_unstable();
            contexts.dedup();
            contexts
        },
    );
    if needs.devices {
        node.devices = answered(within(deadline, merod.member_devices(id)).await, &mut gaps)?;
    }
    Ok(gaps)
}

/// What `GET /admin-api/usage` says of one namespace's tree: its counts and its governance
/// bytes. Equal signals a scan apart say, as far as merod counts, that the tree did not
/// change; storage of the contexts' state (which moves all the time) is left out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct TreeSignal {
    contexts: Option<u64>,
    members: Option<u64>,
    subgroups: Option<u64>,
    governance: u64,
}

impl From<&NamespaceUsage> for TreeSignal {
    fn from(usage: &NamespaceUsage) -> Self {
        Self {
            contexts: usage.contexts,
            members: usage.members,
            subgroups: usage.subgroups,
            governance: usage.bytes.governance,
        }
    }
}

/// The signal of each namespace at its last whole read, and when every namespace was last
/// walked whole: which namespaces a scan walks ([`WalkBook::pick`]).
#[derive(Debug, Default)]
pub(crate) struct WalkBook {
    /// Each namespace read whole, with the signal read before that walk (`None`: merod gave
    /// no row then, so the next scan walks it again).
    read: BTreeMap<GroupId, Option<TreeSignal>>,
    /// When the last whole walk started.
    whole_at: Option<Instant>,
}

impl WalkBook {
    /// Whether a whole walk is due at `now`: none yet, or [`WHOLE_EVERY`] since the last.
    pub(crate) fn whole_due(&self, now: Instant) -> bool {
        self.whole_at
            .is_none_or(|at| now.saturating_duration_since(at) >= WHOLE_EVERY)
    }

    /// Makes the next whole walk due now.
    pub(crate) fn whole_now(&mut self) {
        self.whole_at = None;
    }

    /// The namespaces of `confirmed` to walk: all of them when `whole` (stamped at `now`),
    /// else those never read whole, those whose signal in `usage` moved since, those with
    /// no row, and all of them when `usage` is `None` (it could not be read).
    pub(crate) fn pick(
        &mut self,
        confirmed: &BTreeSet<GroupId>,
        usage: Option<&BTreeMap<GroupId, NamespaceUsage>>,
        whole: bool,
        now: Instant,
    ) -> Vec<GroupId> {
        self.read.retain(|id, _| confirmed.contains(id));
        if whole {
            self.whole_at = Some(now);
        }
        confirmed
            .iter()
            .filter(|id| {
                whole
                    || match (self.read.get(id), usage.map(|u| u.get(id))) {
                        (Some(Some(before)), Some(Some(row))) => *before != TreeSignal::from(row),
                        _ => true,
                    }
            })
            .copied()
            .collect()
    }

    /// After a walk of `id` that began with `usage` read: kept when the walk read everything
    /// (`complete`), forgotten otherwise, so the next scan walks it again.
    pub(crate) fn walked(
        &mut self,
        id: GroupId,
        usage: Option<&BTreeMap<GroupId, NamespaceUsage>>,
        complete: bool,
    ) {
        if complete {
            let signal = usage.and_then(|u| u.get(&id)).map(TreeSignal::from);
            self.read.insert(id, signal);
        } else {
            self.read.remove(&id);
        }
    }
}

/// Walks the inventory made, waiting for the envelopes, and the namespaces the envelopes
/// ask to be walked again (and from when). Shared by the two jobs: the inventory walks and
/// hands over; the envelopes take, and ask.
#[derive(Debug, Default)]
pub(crate) struct Handoff {
    inner: Mutex<HandoffInner>,
    /// Rung at each walk handed over.
    delivered: Notify,
    /// Rung when the walks are taken.
    taken: Notify,
}

#[derive(Debug, Default)]
struct HandoffInner {
    reads: BTreeMap<GroupId, TreeRead>,
    wants: BTreeMap<GroupId, Instant>,
    /// The envelopes cannot be written (merod has no seal route): nothing is handed over,
    /// and the walks read no devices.
    closed: bool,
}

impl Handoff {
    fn lock(&self) -> std::sync::MutexGuard<'_, HandoffInner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Hands `read` over, replacing an older walk of its namespace not yet taken. When
    /// [`HANDOFF_CAP`] walks wait already, it is dropped and its namespace asked for again
    /// (the next scan walks it); `false` then.
    pub(crate) fn deliver(&self, read: TreeRead) -> bool {
        let mut inner = self.lock();
        if inner.closed {
            return false;
        }
        let id = read.namespace;
        let fits = inner.reads.len() < HANDOFF_CAP || inner.reads.contains_key(&id);
        if fits {
            inner.reads.insert(id, read);
            inner.wants.remove(&id);
        } else {
            inner.wants.entry(id).or_insert_with(Instant::now);
        }
        drop(inner);
        if fits {
            self.delivered.notify_one();
        }
        fits
    }

    /// Waits at most `wait` for a full handoff to have room (cancel-safe); whether it has.
    pub(crate) async fn room_within(&self, wait: Duration) -> bool {
        let deadline = Instant::now() + wait;
        loop {
            let taken = self.taken.notified();
            if self.lock().reads.len() < HANDOFF_CAP {
                return true;
            }
            if tokio::time::timeout_at(deadline, taken).await.is_err() {
                return false;
            }
        }
    }

    /// The walks waiting, by namespace (they leave the handoff).
    pub(crate) fn take(&self) -> BTreeMap<GroupId, TreeRead> {
        let reads = std::mem::take(&mut self.lock().reads);
        self.taken.notify_waiters();
        reads
    }

    /// Asks for `id` to be walked again from `from` on (an earlier ask stands).
    pub(crate) fn want(&self, id: GroupId, from: Instant) {
        let mut inner = self.lock();
        let at = inner.wants.entry(id).or_insert(from);
        *at = (*at).min(from);
    }

    /// The namespaces asked for by `now`, at most `most` (the earliest asked first ones by
    /// id); they stay asked for until a walk of them is handed over.
    pub(crate) fn wanted(&self, now: Instant, most: usize) -> Vec<GroupId> {
        let inner = self.lock();
        if inner.closed {
            return Vec::new();
        }
        inner
            .wants
            .iter()
            .filter(|(_, at)| **at <= now)
            .map(|(id, _)| *id)
            .take(most)
            .collect()
    }

    /// Whether walks are handed over (the envelopes can be written).
    pub(crate) fn is_open(&self) -> bool {
        !self.lock().closed
    }

    /// Stops handing walks over, dropping those waiting and what was asked for: the
    /// envelopes cannot be written (merod has no seal route), so the walks read no devices.
    pub(crate) fn close(&self) {
        let mut inner = self.lock();
        inner.closed = true;
        inner.reads.clear();
        inner.wants.clear();
    }

    /// Hands walks over again after [`Handoff::close`], asking for every namespace of
    /// `confirmed` from `now` (none was handed over meanwhile); nothing when open.
    pub(crate) fn reopen(&self, confirmed: &BTreeSet<GroupId>, now: Instant) {
        let mut inner = self.lock();
        if inner.closed {
            inner.closed = false;
            inner.wants = confirmed.iter().map(|id| (*id, now)).collect();
        }
    }

    /// Forgets that `id` was asked for: a walk of it was just taken.
    pub(crate) fn walked(&self, id: GroupId) {
        self.lock().wants.remove(&id);
    }

    /// Room left before [`HANDOFF_CAP`].
    pub(crate) fn room(&self) -> usize {
        HANDOFF_CAP.saturating_sub(self.lock().reads.len())
    }

    /// Forgets what is asked for or waits of namespaces not in `confirmed`.
    pub(crate) fn retain(&self, confirmed: &BTreeSet<GroupId>) {
        let mut inner = self.lock();
        inner.wants.retain(|id, _| confirmed.contains(id));
        inner.reads.retain(|id, _| confirmed.contains(id));
    }

    /// Waits for a walk to be handed over (cancel-safe: a walk handed over meanwhile is a
    /// stored permit).
    pub(crate) async fn delivered(&self) {
        self.delivered.notified().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    use super::super::inventory::{
        InventoryDeps, InventorySink, NamespacesOffer, ScanJob, SCAN_EVERY,
    };
    use super::super::recovery::{
        EnvelopeReader, EnvelopeSink, PassJob, RecoveryDeps, MISSING_FOR, PASS_EVERY,
    };
    use crate::jobs::Job;
    use crate::mdma::{
        CallError, InventoryReport, NamespaceInventory, RecoveryEnvelope, RecoveryKey,
    };
    use crate::merod::{MemberDevice, MerodOp, SealedEnvelope, StorageBytes};

    const PEER: &str = "12D3KooWNXNMakaAKyWpBemRiWWqusgQCrxvwjtJdRQMzLScTJDT";

    fn gid(n: u8) -> GroupId {
        format!("{n:02x}").repeat(32).parse().unwrap()
    }

    fn acct(name: &str) -> String {
        let hex: String = name.bytes().map(|b| format!("{b:02x}")).collect();
        format!("{hex:0<64}")
    }

    /// A namespace of one group: its member accounts and its contexts.
    type OneGroup = (Vec<String>, Vec<String>);

    /// A merod of one-group namespaces: each one's members (the node is `alice`, a
    /// `ReadOnlyTee`) and contexts; usage counts them as merod does. Every read but the
    /// usage is counted, by namespace.
    #[derive(Default)]
    struct Node {
        trees: Mutex<BTreeMap<GroupId, OneGroup>>,
        usage_fails: Mutex<bool>,
        /// merod has no seal route.
        no_route: Mutex<bool>,
        reads: Mutex<BTreeMap<GroupId, usize>>,
    }

    impl Node {
        fn with(namespaces: &[(u8, &[&str])]) -> Arc<Self> {
            let node = Self::default();
            for (n, members) in namespaces {
                let members = members.iter().map(|m| acct(m)).collect();
                let contexts = vec![format!("ctx{n}")];
                node.trees
                    .lock()
                    .unwrap()
                    .insert(gid(*n), (members, contexts));
            }
            Arc::new(node)
        }
        fn tree<T>(
            &self,
            group: GroupId,
            f: impl FnOnce(&mut (Vec<String>, Vec<String>)) -> T,
        ) -> T {
            f(self.trees.lock().unwrap().get_mut(&group).unwrap())
        }
        fn read(&self, group: GroupId) -> Result<OneGroup, MerodError> {
            *self.reads.lock().unwrap().entry(group).or_default() += 1;
            self.trees
                .lock()
                .unwrap()
                .get(&group)
                .cloned()
                .ok_or(MerodError::Status {
                    op: MerodOp::Members,
                    url: "http://127.0.0.1/".to_owned(),
                    status: 500,
                })
        }
        /// Reads of each namespace so far.
        fn reads(&self) -> BTreeMap<GroupId, usize> {
            self.reads.lock().unwrap().clone()
        }
    }

    #[async_trait]
    impl GroupReader for Node {
        async fn subgroups(&self, group: GroupId) -> Result<Vec<GroupId>, MerodError> {
            self.read(group).map(|_| Vec::new())
        }
        async fn contexts(&self, group: GroupId) -> Result<Vec<String>, MerodError> {
            self.read(group).map(|t| t.1)
        }
        async fn members(&self, group: GroupId) -> Result<Vec<GroupMember>, MerodError> {
            let rows = self.read(group)?.0.into_iter().map(|identity| GroupMember {
                role: if identity == acct("alice") {
                    "ReadOnlyTee"
                } else {
                    "Member"
                }
                .to_owned(),
                identity,
            });
            Ok(rows.collect())
        }
        async fn capabilities(&self, group: GroupId, _: &str) -> Result<u32, MerodError> {
            self.read(group).map(|_| 4)
        }
        async fn member_devices(&self, group: GroupId) -> Result<Vec<MemberDevices>, MerodError> {
            let rows = self
                .read(group)?
                .0
                .into_iter()
                .map(|account| MemberDevices {
                    devices: vec![MemberDevice {
                        device_id: format!("d{}", &account[..8]),
                        signing_key: "k".to_owned(),
                    }],
                    account,
                });
            Ok(rows.collect())
        }
        async fn usage(&self) -> Result<BTreeMap<GroupId, NamespaceUsage>, MerodError> {
            if *self.usage_fails.lock().unwrap() {
                return Err(MerodError::Status {
                    op: MerodOp::Usage,
                    url: "http://127.0.0.1/".to_owned(),
                    status: 500,
                });
            }
            let trees = self.trees.lock().unwrap();
            Ok(trees
                .iter()
                .map(|(id, (members, contexts))| {
                    let mut row = NamespaceUsage::of_bytes(StorageBytes::default());
                    row.contexts = Some(contexts.len() as u64);
                    row.members = Some(members.len() as u64);
                    row.subgroups = Some(0);
                    (*id, row)
                })
                .collect())
        }
    }

    #[async_trait]
    impl EnvelopeReader for Node {
        fn reader(&self) -> &dyn GroupReader {
            self
        }
        async fn seal(
            &self,
            _: GroupId,
            _: &str,
            _: &[u8],
        ) -> Result<Option<SealedEnvelope>, MerodError> {
            if *self.no_route.lock().unwrap() {
                return Ok(None);
            }
            Ok(Some(SealedEnvelope {
                account_root_epoch: 1,
                ciphertext: "c".to_owned(),
                ephemeral_public_key: "e".to_owned(),
                nonce: "n".to_owned(),
            }))
        }
        fn lacks_seal_route(&self) -> bool {
            false
        }
        async fn held(&self) -> Result<BTreeSet<GroupId>, MerodError> {
            Ok(self.trees.lock().unwrap().keys().copied().collect())
        }
    }

    /// MDMA taking every report and envelope.
    #[derive(Default)]
    struct Mdma {
        reports: Mutex<Vec<InventoryReport>>,
        puts: Mutex<Vec<RecoveryEnvelope>>,
        deletes: Mutex<Vec<RecoveryKey>>,
    }

    #[async_trait]
    impl InventorySink for Mdma {
        async fn report(&self, report: &InventoryReport) -> Result<(), CallError> {
            self.reports.lock().unwrap().push(report.clone());
            Ok(())
        }
    }

    #[async_trait]
    impl EnvelopeSink for Mdma {
        async fn put(&self, envelope: &RecoveryEnvelope) -> Result<(), CallError> {
            self.puts.lock().unwrap().push(envelope.clone());
            Ok(())
        }
        async fn delete(&self, key: &RecoveryKey) -> Result<(), CallError> {
            self.deletes.lock().unwrap().push(key.clone());
            Ok(())
        }
    }

    /// The inventory and the envelopes over one handoff, as the daemon runs them.
    struct Rig {
        scan: ScanJob,
        pass: PassJob,
        node: Arc<Node>,
        mdma: Arc<Mdma>,
        walks: Arc<Handoff>,
        _offers: Vec<NamespacesOffer>,
        _dir: tempfile::TempDir,
    }

    impl Rig {
        fn new(node: Arc<Node>) -> Self {
            let dir = tempfile::tempdir().unwrap();
            let mdma = Arc::new(Mdma::default());
            let confirmed: BTreeSet<GroupId> = node.trees.lock().unwrap().keys().copied().collect();
            let offers: Vec<_> = (0..3).map(|_| NamespacesOffer::channel()).collect();
            let mut feeds = Vec::new();
            let mut senders = Vec::new();
            for (tx, rx) in offers {
                tx.offer(&confirmed);
                senders.push(tx);
                feeds.push(rx);
            }
            let walks = Arc::new(Handoff::default());
            let account: super::super::inventory::AccountSource = Arc::new(|| Some(acct("alice")));
            let (recorded, confirmed_rec, confirmed_inv) = (
                feeds.pop().unwrap(),
                feeds.pop().unwrap(),
                feeds.pop().unwrap(),
            );
            let scan = ScanJob::new(
                InventoryDeps {
                    merod: Arc::clone(&node) as _,
                    mdma: Arc::clone(&mdma) as _,
                },
                PEER.parse().unwrap(),
                Arc::clone(&account),
                confirmed_inv,
                dir.path().join("fleet-inventory.json"),
                Some(Arc::clone(&walks)),
            );
            let handoff = Arc::clone(&walks);
            let pass = PassJob::new(
                RecoveryDeps {
                    merod: Arc::clone(&node) as _,
                    mdma: Arc::clone(&mdma) as _,
                },
                PEER.parse().unwrap(),
                account,
                (confirmed_rec, recorded),
                &dir.path().join("fleet-recovery.json"),
                Some(walks),
            );
            Self {
                scan,
                pass,
                node,
                mdma,
                walks: handoff,
                _offers: senders,
                _dir: dir,
            }
        }

        /// One scan, then the envelopes take what it walked; `after` of the clock first.
        async fn tick(&mut self, after: Duration) {
            tokio::time::advance(after).await;
            self.scan.run().await.unwrap();
            self.pass.run().await.unwrap();
        }

        fn scan_handoff_room(&self) -> usize {
            self.walks.room()
        }
        fn reports(&self) -> Vec<InventoryReport> {
            self.mdma.reports.lock().unwrap().clone()
        }
        fn last_report_of(&self, n: u8) -> Option<NamespaceInventory> {
            self.reports()
                .iter()
                .rev()
                .flat_map(|r| r.namespaces.iter())
                .find(|ns| ns.namespace_id == gid(n))
                .cloned()
        }
        /// Envelopes written: (namespace, account, version).
        fn puts(&self) -> Vec<(GroupId, String, u64)> {
            let puts = self.mdma.puts.lock().unwrap();
            puts.iter()
                .map(|p| (p.key.namespace_id, p.key.account_id.clone(), p.version))
                .collect()
        }
        fn deletes(&self) -> Vec<(GroupId, String)> {
            let deletes = self.mdma.deletes.lock().unwrap();
            deletes
                .iter()
                .map(|d| (d.namespace_id, d.account_id.clone()))
                .collect()
        }
    }

    /// Each namespace's reads one walk makes for both jobs: the member list, the subgroups,
    /// the contexts and the member devices of its one group.
    const ONE_WALK: usize = 4;

    fn two_namespaces() -> Arc<Node> {
        Node::with(&[
            (1, &["alice", "bob", "carol"]),
            (2, &["alice", "dave", "erin"]),
        ])
    }

    #[tokio::test(start_paused = true)]
    async fn one_walk_feeds_both_jobs_and_a_quiet_node_reads_only_its_usage() {
        let mut r = Rig::new(two_namespaces());
        r.tick(Duration::ZERO).await;
        let reads = BTreeMap::from([(gid(1), ONE_WALK), (gid(2), ONE_WALK)]);
        assert_eq!(r.node.reads(), reads, "each tree read once for both jobs");
        assert_eq!(r.reports().len(), 1);
        assert!(r.reports()[0].full);
        assert_eq!(r.puts().len(), 6);
        for _ in 0..10 {
            r.tick(SCAN_EVERY).await;
        }
        assert_eq!(r.node.reads(), reads, "nothing changed: nothing walked");
        assert_eq!(r.reports().len(), 1);
        assert_eq!(r.puts().len(), 6);
    }

    #[tokio::test(start_paused = true)]
    async fn a_context_added_is_reported_and_sealed_within_a_scan_walking_that_namespace_only() {
        let mut r = Rig::new(two_namespaces());
        r.tick(Duration::ZERO).await;
        r.node.tree(gid(1), |t| t.1.push("ctxnew".to_owned()));
        r.tick(SCAN_EVERY).await;
        assert_eq!(r.node.reads()[&gid(1)], 2 * ONE_WALK);
        assert_eq!(r.node.reads()[&gid(2)], ONE_WALK, "the other is not walked");
        let report = r.reports().pop().unwrap();
        assert!(!report.full);
        assert_eq!(report.namespaces.len(), 1);
        let ns = &report.namespaces[0];
        assert_eq!(ns.context_count, Some(2));
        assert!(ns.groups[0].context_ids.contains(&"ctxnew".to_owned()));
        // Each member's envelope names the contexts: all three written again, at v2.
        let again: Vec<_> = r.puts().into_iter().skip(6).collect();
        assert_eq!(again.len(), 3);
        assert!(again.iter().all(|(ns, _, v)| *ns == gid(1) && *v == 2));
    }

    #[tokio::test(start_paused = true)]
    async fn a_member_added_is_reported_and_gets_its_envelope_within_a_scan() {
        let mut r = Rig::new(two_namespaces());
        r.tick(Duration::ZERO).await;
        r.node.tree(gid(1), |t| t.0.push(acct("frank")));
        r.tick(SCAN_EVERY).await;
        assert_eq!(r.last_report_of(1).unwrap().member_count, Some(4));
        let again: Vec<_> = r.puts().into_iter().skip(6).collect();
        assert_eq!(again, [(gid(1), acct("frank"), 1)]);
        assert_eq!(r.node.reads()[&gid(2)], ONE_WALK);
    }

    #[tokio::test(start_paused = true)]
    async fn a_member_gone_is_reported_within_a_scan_and_its_envelope_deleted_once_proven() {
        let mut r = Rig::new(two_namespaces());
        r.tick(Duration::ZERO).await;
        r.node.tree(gid(1), |t| t.0.retain(|a| *a != acct("bob")));
        r.tick(SCAN_EVERY).await;
        assert_eq!(r.last_report_of(1).unwrap().member_count, Some(2));
        assert!(r.deletes().is_empty(), "one read proves nothing");
        // Walked again once MISSING_FOR has passed: deleted at the first scan after.
        let mut waited = SCAN_EVERY;
        while r.deletes().is_empty() {
            assert!(
                waited <= MISSING_FOR + SCAN_EVERY,
                "not deleted within its bound"
            );
            r.tick(SCAN_EVERY).await;
            waited += SCAN_EVERY;
        }
        assert!(waited >= MISSING_FOR, "deleted before it was proven");
        assert_eq!(r.deletes(), [(gid(1), acct("bob"))]);
        assert_eq!(
            r.node.reads()[&gid(2)],
            ONE_WALK,
            "the other is never walked"
        );
        assert!(PASS_EVERY <= WHOLE_EVERY);
    }

    #[tokio::test(start_paused = true)]
    async fn a_change_usage_cannot_show_waits_for_the_whole_walk() {
        let mut r = Rig::new(two_namespaces());
        r.tick(Duration::ZERO).await;
        // Bob replaced by grace: the same counts.
        r.node.tree(gid(1), |t| {
            t.0.retain(|a| *a != acct("bob"));
            t.0.push(acct("grace"));
        });
        let mut waited = Duration::ZERO;
        while !r.puts().iter().any(|p| p.1 == acct("grace")) {
            assert!(waited < WHOLE_EVERY, "not written by the whole walk");
            r.tick(SCAN_EVERY).await;
            waited += SCAN_EVERY;
        }
        assert_eq!(waited, WHOLE_EVERY, "no walk before the whole one");
        assert_eq!(r.node.reads()[&gid(2)], 2 * ONE_WALK);
    }

    #[tokio::test(start_paused = true)]
    async fn without_usage_every_namespace_is_walked_each_scan() {
        let mut r = Rig::new(two_namespaces());
        r.tick(Duration::ZERO).await;
        *r.node.usage_fails.lock().unwrap() = true;
        r.tick(SCAN_EVERY).await;
        let reads = BTreeMap::from([(gid(1), 2 * ONE_WALK), (gid(2), 2 * ONE_WALK)]);
        assert_eq!(r.node.reads(), reads);
        assert_eq!(r.puts().len(), 6, "read again, nothing to write");
    }

    #[tokio::test(start_paused = true)]
    async fn without_a_seal_route_the_walks_read_no_devices_until_it_is_back() {
        let node = two_namespaces();
        *node.no_route.lock().unwrap() = true;
        let mut r = Rig::new(node);
        r.scan.run().await.unwrap();
        assert!(r.pass.run().await.is_err(), "no seal route");
        let first = BTreeMap::from([(gid(1), ONE_WALK), (gid(2), ONE_WALK)]);
        assert_eq!(r.node.reads(), first);
        // The next whole walk reads no member devices, and hands nothing over.
        r.scan.walk_whole_next();
        tokio::time::advance(SCAN_EVERY).await;
        r.scan.run().await.unwrap();
        let without = BTreeMap::from([(gid(1), 2 * ONE_WALK - 1), (gid(2), 2 * ONE_WALK - 1)]);
        assert_eq!(r.node.reads(), without);
        assert_eq!(r.scan_handoff_room(), HANDOFF_CAP);
        // The route is back: every namespace is walked again for the envelopes.
        *r.node.no_route.lock().unwrap() = false;
        r.tick(Duration::ZERO).await;
        r.tick(SCAN_EVERY).await;
        assert_eq!(r.puts().len(), 6);
    }

    fn usage(rows: &[(u8, u64)]) -> BTreeMap<GroupId, NamespaceUsage> {
        rows.iter()
            .map(|(n, contexts)| {
                let mut row = NamespaceUsage::of_bytes(StorageBytes::default());
                row.contexts = Some(*contexts);
                (gid(*n), row)
            })
            .collect()
    }

    #[tokio::test(start_paused = true)]
    async fn the_book_walks_what_moved_what_it_cannot_judge_and_everything_when_whole() {
        let confirmed = BTreeSet::from([gid(1), gid(2), gid(3)]);
        let mut book = WalkBook::default();
        let now = Instant::now();
        assert!(book.whole_due(now), "no whole walk yet");
        let before = usage(&[(1, 1), (2, 1), (3, 1)]);
        assert_eq!(book.pick(&confirmed, Some(&before), true, now).len(), 3);
        book.walked(gid(1), Some(&before), true);
        book.walked(gid(2), Some(&before), true);
        book.walked(gid(3), Some(&before), false);
        assert!(!book.whole_due(now + WHOLE_EVERY - Duration::from_secs(1)));
        assert!(book.whole_due(now + WHOLE_EVERY));
        // 3 was partial; 2's contexts moved; bytes of the state alone say nothing.
        let mut after = usage(&[(1, 1), (2, 2), (3, 1)]);
        after.get_mut(&gid(1)).unwrap().bytes.state = 99;
        assert_eq!(
            book.pick(&confirmed, Some(&after), false, now),
            [gid(2), gid(3)]
        );
        // Its governance bytes moved: walked.
        after.get_mut(&gid(1)).unwrap().bytes.governance = 1;
        assert!(book
            .pick(&confirmed, Some(&after), false, now)
            .contains(&gid(1)));
        // No usage, or no row: unknown, so walked.
        assert_eq!(book.pick(&confirmed, None, false, now).len(), 3);
        let without_1 = usage(&[(2, 1), (3, 1)]);
        assert!(book
            .pick(&confirmed, Some(&without_1), false, now)
            .contains(&gid(1)));
        // A namespace no longer confirmed is forgotten.
        let _ = book.pick(&BTreeSet::from([gid(2)]), Some(&before), false, now);
        assert_eq!(book.read.len(), 1);
    }

    #[tokio::test]
    async fn a_full_handoff_asks_for_the_walk_again_and_a_taken_one_makes_room() {
        let handoff = Handoff::default();
        let read = |n: u32| TreeRead {
            namespace: format!("{n:064x}").parse().unwrap(),
            members: None,
            role: None,
            groups: Vec::new(),
            tree_whole: true,
            gap: None,
        };
        for n in 0..HANDOFF_CAP as u32 {
            assert!(handoff.deliver(read(n)));
        }
        assert_eq!(handoff.room(), 0);
        assert!(
            handoff.deliver(read(0)),
            "a newer walk of one waiting replaces it"
        );
        assert!(!handoff.deliver(read(u32::MAX)));
        let now = Instant::now();
        assert_eq!(
            handoff.wanted(now, usize::MAX),
            [format!("{:064x}", u32::MAX).parse::<GroupId>().unwrap()]
        );
        assert!(!handoff.room_within(Duration::from_millis(10)).await);
        assert_eq!(handoff.take().len(), HANDOFF_CAP);
        assert!(handoff.room_within(Duration::ZERO).await);
        assert!(handoff.deliver(read(u32::MAX)));
        assert!(
            handoff.wanted(now, usize::MAX).is_empty(),
            "handed over: no longer asked for"
        );
    }
}
