//! What planning works from besides the state: the latest successful poll's answer, and
//! what it remembers between polls (the mass-withdrawal guard, the withdrawn namespaces not
//! left yet, merod's holdings and the orphans found in them).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use tokio::sync::watch;
use tokio::time::Instant;

use tracing::warn;

use crate::ids::GroupId;
use crate::mdma::AnswerDigest;
use crate::reconcile::{self, Desired, Guard, LeavePolicy, LeaveWait};
use crate::state::State;

use super::held::Holdings;
/// What planning works from besides the state: the last successful poll's answer, and what
/// it remembers between polls.
pub(super) struct Planner {
    /// `leave_policy`.
    pub(super) policy: LeavePolicy,
    /// `dry_run`: plans are logged, nothing is started.
    dry_run: bool,
    /// The latest successful poll's answer.
    pub(super) desired: Arc<Desired>,
    /// The digest of the answer `desired` came from, when MDMA's client gave one: the
    /// next poll is told it, and an answer byte-for-byte that one is not taken in again.
    desired_digest: Option<AnswerDigest>,
    /// Every successful poll's answer, for the joins waiting for a slot.
    latest_poll: watch::Sender<Arc<Desired>>,
    /// The mass-withdrawal guard and the leave rate limit.
    pub(super) guard: Guard,
    /// Withdrawn namespaces not left yet, with the rule that holds each back.
    pub(super) waiting: BTreeMap<GroupId, LeaveWait>,
    /// merod's latest list of the namespaces it holds (the `held_namespaces` refresh's
    /// latest good read, kept up to date with the admissions and leaves seen since);
    /// `None` until a read worked: no orphan is found.
    held: Option<Holdings>,
    /// When the loop last changed `held` itself (an admission or a leave): a read that
    /// started before it may predate that change, so it does not replace `held` (the
    /// outcome asked for a newer read).
    held_changed: Option<Instant>,
    /// `leave_orphans`: orphans are recorded as admitted, then left like any withdrawn one.
    leave_orphans: bool,
    /// Orphans by the latest successful poll and `held` (reported only).
    orphans: BTreeSet<GroupId>,
}

impl Planner {
    /// Nothing polled yet, nothing known of what merod holds.
    pub(super) fn new(policy: LeavePolicy, dry_run: bool, leave_orphans: bool) -> Self {
        Self {
            policy,
            dry_run,
            desired: Arc::default(),
            desired_digest: None,
            latest_poll: watch::Sender::new(Arc::default()),
            guard: Guard::default(),
            waiting: BTreeMap::new(),
            held: None,
            held_changed: None,
            leave_orphans,
            orphans: BTreeSet::new(),
        }
    }

    /// `dry_run`: plans are logged, nothing is started.
    pub(super) fn dry_run(&self) -> bool {
        self.dry_run
    }

    /// A successful poll's answer becomes the latest: planned from, and seen by the joins
    /// waiting for a slot and by the confirm gate.
    /// `digest`: the answer's ([`Planner::desired_digest`]).
    pub(super) fn polled(&mut self, desired: Desired, digest: Option<AnswerDigest>) {
        self.desired = Arc::new(desired);
        self.desired_digest = digest;
        self.latest_poll.send_replace(Arc::clone(&self.desired));
    }

    /// The digest of the answer [`Planner::desired`] came from, if known.
    pub(super) fn desired_digest(&self) -> Option<&AnswerDigest> {
        self.desired_digest.as_ref()
    }

    /// Every successful poll's answer from now on, for a task.
    pub(super) fn latest_poll(&self) -> watch::Receiver<Arc<Desired>> {
        self.latest_poll.subscribe()
    }

    /// Orphans by the latest successful poll and merod's holdings (reported only).
    pub(super) fn orphans(&self) -> &BTreeSet<GroupId> {
        &self.orphans
    }

    /// A new read of what merod holds (`read`, started at `started`) becomes its holdings,
    /// unless the loop saw an admission or a leave after the read started (that outcome
    /// asked for a newer read).
    pub(super) fn held_read(&mut self, read: Arc<[GroupId]>, started: Instant) {
        if self.held_changed.is_none_or(|changed| started >= changed) {
            self.held = Some(Holdings::new(read));
        }
    }

    /// merod admitted `id` (and lists it).
    pub(super) fn admitted(&mut self, id: GroupId) {
        self.held_changed = Some(Instant::now());
        if let Some(held) = &mut self.held {
            held.insert(id);
        }
    }

    /// merod no longer holds `id` (left, or never held).
    pub(super) fn left(&mut self, id: GroupId) {
        self.held_changed = Some(Instant::now());
        if let Some(held) = &mut self.held {
            held.remove(&id);
        }
        self.orphans.remove(&id);
    }

    /// The orphans in merod's holdings ([`reconcile::orphans`]; none until a read worked).
    /// With `leave_orphans` (outside a dry run) they are returned, to be recorded as
    /// admitted, so the plan leaves them through the stability wait, the guard and the rate
    /// limit; otherwise each new one is reported once, and none is returned.
    pub(super) fn take_orphans(&mut self, state: &State) -> BTreeSet<GroupId> {
        let Some(held) = &self.held else {
            return BTreeSet::new();
        };
        let found = reconcile::orphans(held.iter(), state, &self.desired);
        if self.leave_orphans && !found.is_empty() && !self.dry_run {
            warn!(
                orphans = found.len(),
                "leave_orphans: taking the namespaces merod holds that are neither in the state, assigned nor retained as admitted; they are left like any withdrawn namespace"
            );
            self.orphans.clear();
            return found;
        }
        for id in found.difference(&self.orphans) {
            warn!(namespace_id = %id, "orphan: merod holds it but it is neither in the state, assigned nor retained; left alone (set leave_orphans = true on a dedicated fleet node to leave it)");
        }
        self.orphans = found;
        BTreeSet::new()
    }
}
