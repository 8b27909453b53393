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
use crate::reconcile::{self, Desired, Guard, LeavePolicy, LeaveWait, Plan, PlanInput, PlanSets};
use crate::state::State;

use crate::jobs::held::Holdings;
use crate::telemetry::SetsVersion;
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
    /// The [`super::record::Record::membership`] when `desired` was read (it keeps no
    /// `admitter_addrs` for the namespaces confirmed then), or when it was last found to
    /// lack none a join needs.
    desired_membership: Option<u64>,
    /// The [`PlanSets`] of `desired` against the state whose
    /// [`super::record::Record::membership`] it holds: kept while neither moves, so an
    /// idle cycle does not walk every id to learn that nothing is to be joined or left.
    /// Dropped when `desired` is replaced.
    sets: Option<(u64, PlanSets)>,
    /// How many answers were taken in ([`Planner::polled`]): which one `desired` is.
    answers: u64,
    /// The [`super::record::Record::membership`] the orphans were last found at, while
    /// neither the answer nor merod's holdings changed since: found again, they would be
    /// the same.
    orphans_found_at: Option<u64>,
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
            desired_membership: None,
            sets: None,
            answers: 0,
            orphans_found_at: None,
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
    /// `digest`: the answer's ([`Planner::desired_digest`]); `membership`: the state's
    /// [`super::record::Record::membership`] whose confirmed namespaces the answer keeps no
    /// addresses for.
    pub(super) fn polled(
        &mut self,
        desired: Desired,
        digest: Option<AnswerDigest>,
        membership: u64,
    ) {
        self.desired = Arc::new(desired);
        self.desired_digest = digest;
        self.desired_membership = Some(membership);
        self.sets = None;
        self.answers += 1;
        self.orphans_found_at = None;
        self.latest_poll.send_replace(Arc::clone(&self.desired));
    }

    /// Which answer [`Planner::desired`] is and which `membership` of the state: the
    /// version of the sets a status shows (see [`SetsVersion`]).
    pub(super) fn sets_version(&self, membership: u64) -> SetsVersion {
        (self.answers, membership)
    }

    /// Plans this cycle ([`reconcile::plan_with`]) from the latest answer, the guard, and
    /// `state`, whose [`super::record::Record::membership`] is `membership`: the
    /// set-derived part is made again only when the answer or `membership` moved.
    pub(super) fn plan(
        &mut self,
        state: &State,
        membership: u64,
        in_flight: &BTreeSet<GroupId>,
        backoffs: (&BTreeSet<GroupId>, &BTreeSet<GroupId>),
        now: Instant,
    ) -> Plan {
        let sets = kept_sets(&mut self.sets, &self.desired, membership, state);
        let (join_backoff, leave_backoff) = backoffs;
        reconcile::plan_with(
            PlanInput {
                policy: &self.policy,
                desired: &self.desired,
                state,
                in_flight,
                join_backoff,
                leave_backoff,
                guard: &self.guard,
                now,
            },
            sets,
        )
    }

    /// The digest of the answer [`Planner::desired`] came from, to poll with: `None` (read
    /// the next answer whole) when a namespace the answer kept no addresses for may need a
    /// join now. The answer leaves out the addresses of the namespaces confirmed when it
    /// was read; once the state's sets moved (`membership`, `state`), an assigned namespace
    /// no longer confirmed and without addresses may be one of them. While every such one
    /// is in `in_flight` (its join or check runs) it is not planned, so the answer is kept
    /// and looked at again next cycle; with none at all, it is kept until the sets move.
    pub(super) fn answer_to_hold(
        &mut self,
        membership: u64,
        state: &State,
        in_flight: impl FnOnce() -> BTreeSet<GroupId>,
    ) -> Option<&AnswerDigest> {
        if self.desired_membership == Some(membership) {
            return self.desired_digest.as_ref();
        }
        let desired = &self.desired;
        let lacking: Vec<GroupId> = desired
            .assigned
            .difference(&state.confirmed)
            .filter(|id| !desired.retain.contains(id) && !desired.admitter_addrs.contains_key(id))
            .copied()
            .collect();
        if lacking.is_empty() {
            self.desired_membership = Some(membership);
            return self.desired_digest.as_ref();
        }
        let in_flight = in_flight();
        if lacking.iter().all(|id| in_flight.contains(id)) {
            return self.desired_digest.as_ref();
        }
        None
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
            self.orphans_found_at = None;
        }
    }

    /// merod admitted `id` (and lists it).
    pub(super) fn admitted(&mut self, id: GroupId) {
        self.held_changed = Some(Instant::now());
        self.orphans_found_at = None;
        if let Some(held) = &mut self.held {
            held.insert(id);
        }
    }

    /// merod no longer holds `id` (left, or never held).
    pub(super) fn left(&mut self, id: GroupId) {
        self.held_changed = Some(Instant::now());
        self.orphans_found_at = None;
        if let Some(held) = &mut self.held {
            held.remove(&id);
        }
        self.orphans.remove(&id);
    }

    /// The orphans in merod's holdings ([`reconcile::orphans`]; none until a read worked).
    /// With `leave_orphans` (outside a dry run) they are returned, to be recorded as
    /// admitted, so the plan leaves them through the stability wait, the guard and the rate
    /// limit; otherwise each new one is reported once, and none is returned. `membership`:
    /// `state`'s [`super::record::Record::membership`]; while it, the answer and the
    /// holdings stand, the orphans are those found last time (already reported, or taken
    /// and recorded, which moves `membership`), and are not looked for again.
    pub(super) fn take_orphans(&mut self, state: &State, membership: u64) -> BTreeSet<GroupId> {
        let Some(held) = &self.held else {
            return BTreeSet::new();
        };
        if self.orphans_found_at == Some(membership) {
            debug_assert_eq!(
                reconcile::orphans(held.iter(), state, &self.desired),
                self.orphans,
                "orphans kept past a change of what they are found from"
            );
            return BTreeSet::new();
        }
        self.orphans_found_at = Some(membership);
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

/// The [`PlanSets`] of `desired` against `state` (whose membership version is
/// `membership`): the ones in `slot` when made at that version (it is emptied when
/// `desired` is replaced), else made now and kept there.
fn kept_sets<'a>(
    slot: &'a mut Option<(u64, PlanSets)>,
    desired: &Desired,
    membership: u64,
    state: &State,
) -> &'a PlanSets {
    if slot.as_ref().is_some_and(|(at, _)| *at != membership) {
        *slot = None;
    }
    &slot
        .get_or_insert_with(|| (membership, PlanSets::new(desired, state)))
        .1
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gid(n: u8) -> GroupId {
        GroupId::from_bytes([n; 32])
    }

    /// A planner holding an answer (digest 7) that assigns 1, 2 and 3 and retains 4, read
    /// at membership 5; `addrs` are the assignments it kept addresses for.
    fn planner(addrs: &[u8]) -> Planner {
        let mut p = Planner::new(LeavePolicy::REFERENCE, false, false);
        let desired = Desired {
            assigned: [gid(1), gid(2), gid(3), gid(4)].into(),
            retain: [gid(4)].into(),
            admitter_addrs: addrs
                .iter()
                .map(|n| (gid(*n), Arc::from(["/ip4/10.0.0.1/tcp/1".to_owned()])))
                .collect(),
        };
        p.polled(desired, Some(HELD), 5);
        p
    }

    fn confirmed(ids: &[u8]) -> State {
        State {
            confirmed: ids.iter().map(|n| gid(*n)).collect(),
            ..State::default()
        }
    }

    fn none_in_flight() -> BTreeSet<GroupId> {
        BTreeSet::new()
    }

    const HELD: AnswerDigest = AnswerDigest::of_test([7; 32]);

    #[test]
    fn the_plan_sets_are_made_again_only_when_the_answer_or_the_membership_moved() {
        let mut p = planner(&[1, 2, 3]);
        let (none, now) = (none_in_flight(), Instant::now());
        let plan = |p: &mut Planner, state: &State, membership: u64| {
            p.plan(state, membership, &none, (&none, &none), now).joins
        };
        assert_eq!(plan(&mut p, &confirmed(&[1]), 5), [gid(2), gid(3)]);
        let kept = p.sets.clone().expect("kept after a plan");
        assert_eq!(kept, (5, PlanSets::new(&p.desired, &confirmed(&[1]))));
        // The same version: kept, whatever the state says (nothing is walked).
        assert_eq!(
            *kept_sets(&mut p.sets, &p.desired, 5, &confirmed(&[1, 2, 3])),
            kept.1
        );
        // The membership moved: made again from the state.
        assert_eq!(plan(&mut p, &confirmed(&[1, 2]), 6), [gid(3)]);
        assert_eq!(plan(&mut p, &confirmed(&[1, 2, 3]), 7), []);
        // A new answer, at the same membership: made again from it.
        let mut desired = p.desired.as_ref().clone();
        desired.assigned.insert(gid(9));
        desired.admitter_addrs.insert(gid(9), Arc::from([]));
        p.polled(desired, Some(HELD), 7);
        assert_eq!(p.sets, None);
        assert_eq!(plan(&mut p, &confirmed(&[1, 2, 3]), 7), [gid(9)]);
    }

    #[test]
    fn orphans_are_looked_for_again_only_when_the_answer_the_holdings_or_the_membership_moved() {
        // Assigned 1-4 (4 retained); merod holds 1 and 8: 8 is an orphan.
        let mut p = planner(&[]);
        let start = Instant::now();
        p.held_read(Arc::from([gid(1), gid(8)]), start);
        let state = confirmed(&[1]);
        assert!(p.take_orphans(&state, 5).is_empty());
        assert_eq!(*p.orphans(), BTreeSet::from([gid(8)]));
        // The same membership, answer and holdings: not looked for (a state that says
        // otherwise is not read; debug builds check that it says the same, and so catch
        // this one).
        let admitted_8 = State {
            admitted: [gid(8)].into(),
            ..state.clone()
        };
        let kept = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            p.take_orphans(&admitted_8, 5)
        }));
        assert_eq!(kept.is_err(), cfg!(debug_assertions));
        assert_eq!(*p.orphans(), BTreeSet::from([gid(8)]));
        // The membership moved: looked for again.
        p.take_orphans(&admitted_8, 6);
        assert!(p.orphans().is_empty());
        // merod's holdings changed: a new read, an admission.
        p.held_read(Arc::from([gid(1), gid(8), gid(9)]), Instant::now());
        p.take_orphans(&admitted_8, 6);
        assert_eq!(*p.orphans(), BTreeSet::from([gid(9)]));
        p.admitted(gid(10));
        p.take_orphans(&admitted_8, 6);
        assert_eq!(*p.orphans(), BTreeSet::from([gid(9), gid(10)]));
        // A leave seen by the loop: its namespace is gone from the holdings.
        p.left(gid(10));
        p.take_orphans(&admitted_8, 6);
        assert_eq!(*p.orphans(), BTreeSet::from([gid(9)]));
        // A new answer that assigns 9.
        let mut desired = p.desired.as_ref().clone();
        desired.assigned.insert(gid(9));
        p.polled(desired, Some(HELD), 6);
        p.take_orphans(&admitted_8, 6);
        assert!(p.orphans().is_empty());
    }

    #[test]
    fn the_answer_is_held_while_the_sets_it_was_read_against_are_the_same() {
        let mut p = planner(&[]);
        // Nothing is walked, whatever the state says: the sets are those seen at the read.
        let held = p.answer_to_hold(5, &confirmed(&[]), || panic!("not asked"));
        assert_eq!(held, Some(&HELD));
    }

    #[test]
    fn a_namespace_no_longer_confirmed_and_without_addresses_has_the_answer_read_again_whole() {
        // 1 lost (was confirmed at the read, so its addresses were left out); 2, 3 confirmed.
        let mut p = planner(&[]);
        assert_eq!(
            p.answer_to_hold(6, &confirmed(&[2, 3]), none_in_flight),
            None
        );
        // While its join or check runs it is not planned: the answer is kept, and looked at
        // again next cycle.
        let running = || BTreeSet::from([gid(1)]);
        assert_eq!(
            p.answer_to_hold(6, &confirmed(&[2, 3]), running),
            Some(&HELD)
        );
        assert_eq!(
            p.answer_to_hold(6, &confirmed(&[2, 3]), none_in_flight),
            None
        );
        // Read again at membership 6: held from then on.
        p.polled(p.desired.as_ref().clone(), Some(HELD), 6);
        assert_eq!(
            p.answer_to_hold(6, &confirmed(&[2, 3]), || panic!("not asked")),
            Some(&HELD)
        );
    }

    #[test]
    fn the_answer_is_kept_when_every_namespace_to_join_has_its_addresses() {
        // 1 unconfirmed but with addresses; 4 retained (never joined): nothing lacks.
        let mut p = planner(&[1]);
        assert_eq!(
            p.answer_to_hold(6, &confirmed(&[2, 3]), || panic!("not asked")),
            Some(&HELD)
        );
        // Found complete at 6: not walked again until the sets move.
        assert_eq!(
            p.answer_to_hold(6, &confirmed(&[]), || panic!("not asked")),
            Some(&HELD)
        );
        // They moved, and now 2 lacks its addresses.
        assert_eq!(p.answer_to_hold(7, &confirmed(&[3]), none_in_flight), None);
    }
}
