//! The decision of what to join and what to leave: a pure function of the latest
//! successful poll, the persisted [`State`], what is already running, and `now`.
//!
//! Nothing here does I/O or reads a clock (`now` is passed in), so every rule is tested
//! directly. The rules, from the reference sidecar and the
//! fleet's known history (both in docs/mdma.md):
//!
//! * A plan exists only for a successful poll: the caller never calls [`plan`] after a failed
//!   one, so a failed poll joins nothing, leaves nothing, prunes nothing.
//! * Join every assigned namespace not yet confirmed (and not in `retain`, not already
//!   running). Joining again is idempotent in merod.
//! * Leave candidates are `(admitted ∪ joining) − assigned − retain`, computed from the
//!   persisted sets before the prune — so a namespace admitted but never confirmed is still
//!   left, and so is one a fleet-join was sent for whose outcome was never recorded (merod
//!   may hold it: the daemon crashed, or the join timed out here and went through there).
//! * A candidate is left only after it has been absent from `leave_after_polls`
//!   consecutive successful polls *and* for `leave_grace` on the observed clock
//!   ([`State::observed_ms`]: monotonic time between successful polls, summed over runs, so
//!   neither a wall-clock step nor a restart shortens it; downtime does not count).
//!   Reappearing in `assignments` or `retain` resets both; failed polls reset nothing.
//! * Mass-withdrawal guard: when one poll withdraws at least `mass_drop_min` namespaces and
//!   more than half of those held, or everything held whatever the count, every leave is
//!   held until the withdrawal has persisted for `mass_drop_hold` of observed time (the
//!   grace runs meanwhile); then leaves go ahead.
//! * Observed time is only the time between two successful polls with no failed poll
//!   between them: a failed poll ends the observation ([`Guard::poll_failed`]), so an
//!   outage neither advances nor resets the grace or the hold, and the first successful
//!   poll after it adds nothing, as after a restart.
//! * Rate limits: at most `max_leaves_per_minute` and `max_leaves_per_hour` leaves started
//!   in any window of the observed clock, counted from the persisted
//!   [`State::recent_leaves_ms`] (a restart does not reset them); the oldest absence first.
//! * Nothing with a join or leave in flight is planned again, and nothing whose last join
//!   (or leave) failed is joined (or left) again before its retry wait ends; a leave
//!   backing off does not take from the rate limit.
//! * Prune: `confirmed ← confirmed ∩ assigned` (the reference's `confirmed ∩ desired`): a
//!   retained namespace stays admitted, is never left, and is planned as a join once
//!   assigned again (the daemon's join task confirms it without a new fleet-join while merod
//!   still holds it). `admitted` shrinks only when merod no longer
//!   holds a namespace.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::ids::GroupId;
use crate::mdma::ShouldJoin;
use crate::state::{Absence, State};

/// The window of `max_leaves_per_minute`.
pub const MINUTE: Duration = Duration::from_secs(60);
/// The window of `max_leaves_per_hour`, and how long a started leave stays in
/// [`State::recent_leaves_ms`].
pub const HOUR: Duration = Duration::from_secs(3600);

/// When a withdrawn namespace may be left (config keys of the same names).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LeavePolicy {
    /// Consecutive successful polls a namespace must be absent from (≥ 1; 1 = reference).
    pub leave_after_polls: u32,
    /// Absence the daemon must have observed (on its observed clock, see
    /// [`State::observed_ms`]) before a withdrawn namespace is left.
    pub leave_grace: Duration,
    /// Withdrawals in one poll that can trigger the mass-withdrawal guard (≥ 1). A poll that
    /// withdraws everything held is a mass withdrawal whatever this says.
    pub mass_drop_min: usize,
    /// How long a mass withdrawal must persist over successful polls before leaves go.
    pub mass_drop_hold: Duration,
    /// Leaves started in any 60 s window of the observed clock (≥ 1).
    pub max_leaves_per_minute: u32,
    /// Leaves started in any 60 min window of the observed clock (≥ 1).
    pub max_leaves_per_hour: u32,
}

impl LeavePolicy {
    /// The stability rule: a withdrawn namespace absent from `polls` consecutive successful
    /// polls waits until `leave_after_polls`; `None` once the withdrawal is stable.
    pub fn stability_wait(&self, polls: u32) -> Option<LeaveWait> {
        (polls < self.leave_after_polls).then_some(LeaveWait::NotStable {
            polls,
            needed: self.leave_after_polls,
        })
    }

    /// The grace rule: a withdrawn namespace whose absence has been observed for `observed`
    /// waits until `leave_grace`; `None` once the grace is over.
    pub fn grace_wait(&self, observed: Duration) -> Option<LeaveWait> {
        (observed < self.leave_grace).then_some(LeaveWait::Grace {
            observed,
            grace: self.leave_grace,
        })
    }

    /// The first reference sidecar's behaviour (the seed's): leave on the first poll that
    /// withdraws, no grace, no rate limit, and a mass withdrawal released at once.
    pub const REFERENCE: Self = Self {
        leave_after_polls: 1,
        leave_grace: Duration::ZERO,
        mass_drop_min: usize::MAX,
        mass_drop_hold: Duration::ZERO,
        max_leaves_per_minute: u32::MAX,
        max_leaves_per_hour: u32::MAX,
    };
}

/// What a successful `should-join` poll said (docs/mdma.md).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Desired {
    /// The `group_id` of every entry of `assignments`: namespaces this node must hold.
    pub assigned: BTreeSet<GroupId>,
    /// `retain`: namespaces the node may keep but must not newly join; never left.
    pub retain: BTreeSet<GroupId>,
    /// `assignments[].admitter_addrs`: the admitting nodes to ask directly when joining
    /// (only assignments with some), shared with the answer they came from; not a decision
    /// input.
    pub admitter_addrs: BTreeMap<GroupId, Arc<[String]>>,
}

impl From<ShouldJoin> for Desired {
    fn from(answer: ShouldJoin) -> Self {
        Self {
            assigned: answer.assignments,
            retain: answer.retain,
            admitter_addrs: answer.admitter_addrs,
        }
    }
}

/// The mass-withdrawal guard's state between polls (kept in memory: a restart restarts a
/// hold, which only delays leaves).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum MassDrop {
    /// No mass withdrawal in the latest successful poll.
    #[default]
    Idle,
    /// A mass withdrawal persisting over successful polls; every leave is held.
    Holding {
        /// How long it has been observed so far: the observed time (see [`Guard`]) from the
        /// first successful poll that showed it; an outage adds nothing.
        observed: Duration,
    },
    /// The withdrawal persisted past the hold; leaves go (rate-limited) while it lasts.
    Released,
}

/// In-memory state between polls of one run (a restart starts from the default).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Guard {
    /// The mass-withdrawal phase.
    pub mass_drop: MassDrop,
    /// The monotonic time of the previous successful poll of this run, when no poll has
    /// failed since: the observed clock advances by the time from it to the next one.
    /// `None` after a start and after a failed poll ([`Guard::poll_failed`]), so neither
    /// the time the daemon was down (or starting) nor an outage of MDMA is ever counted as
    /// observed absence or as a held mass withdrawal.
    pub last_ok_poll: Option<Instant>,
}

impl Guard {
    /// A poll failed: the observation ends here. The next successful poll starts a new one
    /// and adds no time to the observed clock or to a mass-withdrawal hold, so an outage
    /// can neither complete a wait that guards a leave nor reset one (the absences, their
    /// poll counts and the hold's observed time are kept).
    pub fn poll_failed(&mut self) {
        self.last_ok_poll = None;
    }
}

/// Which leave rate limit holds a leave.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RateLimit {
    /// `max_leaves_per_minute`.
    PerMinute,
    /// `max_leaves_per_hour`.
    PerHour,
}

/// Why a leave candidate is not left in this cycle.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LeaveWait {
    /// The absence observed so far is shorter than `leave_grace`.
    Grace {
        /// Absence observed so far.
        observed: Duration,
        /// `leave_grace`.
        grace: Duration,
    },
    /// Absent from `polls` successful polls so far; leaves at `needed`.
    NotStable {
        /// Consecutive successful polls it has been absent from, this one included.
        polls: u32,
        /// `leave_after_polls`.
        needed: u32,
    },
    /// Held by the mass-withdrawal guard for `remaining` more.
    MassDropHold {
        /// Time left of the hold.
        remaining: Duration,
    },
    /// The last leave of it failed and its retry wait has not ended (the wait doubles from
    /// 2 s to 60 s per failure in a row); does not take from the rate limit.
    BackingOff,
    /// A leave rate limit is reached; goes in a later cycle (the oldest absence first).
    RateLimited(RateLimit),
    /// A join or leave of it is still running, or planned and waiting for the state write
    /// that records it to end.
    InFlight,
}

impl fmt::Display for LeaveWait {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LeaveWait::Grace { observed, grace } => write!(
                f,
                "waiting for leave_grace: absence observed for {} s of {} s",
                observed.as_secs(),
                grace.as_secs()
            ),
            LeaveWait::NotStable { polls, needed } => {
                write!(
                    f,
                    "absent from {polls} of the {needed} successful polls needed"
                )
            }
            LeaveWait::MassDropHold { remaining } => write!(
                f,
                "held by the mass-withdrawal guard for {} s more",
                remaining.as_secs()
            ),
            LeaveWait::BackingOff => {
                f.write_str("its last leave failed; retried when the back-off ends")
            }
            LeaveWait::RateLimited(RateLimit::PerMinute) => {
                f.write_str("waiting for the leave rate limit (max_leaves_per_minute)")
            }
            LeaveWait::RateLimited(RateLimit::PerHour) => {
                f.write_str("waiting for the leave rate limit (max_leaves_per_hour)")
            }
            LeaveWait::InFlight => {
                f.write_str("a join or leave of it is running (or starts once it is recorded)")
            }
        }
    }
}

/// A change of the mass-withdrawal guard worth a loud log line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MassDropEvent {
    /// A hold started: `withdrawn` of `held` namespaces withdrawn in one poll.
    HoldStarted {
        /// Namespaces withdrawn.
        withdrawn: usize,
        /// Namespaces held before this poll: the admitted, plus the joining ones it withdraws.
        held: usize,
    },
    /// The withdrawal persisted for the whole hold: leaves go ahead.
    Released {
        /// Namespaces withdrawn.
        withdrawn: usize,
    },
    /// The withdrawal was reverted or shrank below the threshold before the hold ended.
    Cleared,
}

/// What to do in this cycle, and how the state changes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    /// Namespaces to `fleet-join` (then confirm), in id order.
    pub joins: Vec<GroupId>,
    /// Namespaces to leave now, the oldest absence first (ties in id order).
    pub leaves: Vec<GroupId>,
    /// Leave candidates not left now, and why.
    pub waiting: BTreeMap<GroupId, LeaveWait>,
    /// How this poll changes the state the plan was made from: apply it with
    /// [`StateChange::apply_to`].
    pub state: StateChange,
    /// The guard after this poll.
    pub guard: Guard,
    /// Set when the mass-withdrawal guard changed phase.
    pub mass_drop_event: Option<MassDropEvent>,
}

/// Everything [`plan`] decides from, by name.
#[derive(Clone, Copy, Debug)]
pub struct PlanInput<'a> {
    /// The leave rules from the config.
    pub policy: &'a LeavePolicy,
    /// This poll's assignments and retains.
    pub desired: &'a Desired,
    /// The persisted sets before this poll.
    pub state: &'a State,
    /// Namespaces with a join or leave task running (planned neither way).
    pub in_flight: &'a BTreeSet<GroupId>,
    /// Namespaces whose last join failed recently (not joined yet again).
    pub join_backoff: &'a BTreeSet<GroupId>,
    /// Namespaces whose last leave failed recently (not left yet again:
    /// [`LeaveWait::BackingOff`]).
    pub leave_backoff: &'a BTreeSet<GroupId>,
    /// The guard state after the previous successful poll.
    pub guard: &'a Guard,
    /// The monotonic time of this poll.
    pub now: Instant,
}

/// How a poll changes the persisted state: the observed clock advanced, the absences
/// updated, the leaves started stamped, the confirmed namespaces no longer assigned pruned.
/// Given as a change rather than a copy of the state, so an idle cycle at 10,000
/// namespaces copies no set.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StateChange {
    observed_ms: u64,
    absent: BTreeMap<GroupId, Absence>,
    recent_leaves_ms: Vec<u64>,
    unconfirmed: Vec<GroupId>,
}

impl StateChange {
    /// Makes the change to `state`, the state the plan was made from.
    pub fn apply_to(self, state: &mut State) {
        state.observed_ms = self.observed_ms;
        state.absent = self.absent;
        state.recent_leaves_ms = self.recent_leaves_ms;
        for id in &self.unconfirmed {
            state.confirmed.remove(id);
        }
    }

    /// Whether applying it changes a set (`confirmed`: a prune); else only the clock,
    /// the absences and the leave stamps move.
    #[cfg(feature = "daemon")] // the daemon's alone: a tool's build leaves it out
    pub(crate) fn changes_membership(&self) -> bool {
        !self.unconfirmed.is_empty()
    }

    /// Whether applying it leaves the sets of `state` as they are (the observed clock may
    /// still advance).
    #[cfg(test)]
    pub(crate) fn keeps_sets(&self, state: &State) -> bool {
        self.unconfirmed.is_empty()
            && self.absent == state.absent
            && self.recent_leaves_ms == state.recent_leaves_ms
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// Plans one cycle from a successful poll ([`plan_with`] the [`PlanSets`] of its
/// `desired` and `state`).
pub fn plan(input: PlanInput<'_>) -> Plan {
    plan_with(input, &PlanSets::new(input.desired, input.state))
}

/// The part of a plan that the sets alone decide: this poll's `assigned` and `retain`
/// against the state's `admitted`, `confirmed` and `joining`. Making it walks every id of
/// them (three merged walks; at 10,000 namespaces most of what planning an idle cycle
/// costs), and it is the same from one poll to the next while none of those sets moves: a
/// caller that can tell they did not (the daemon: the same answer, the same membership
/// version of the state) keeps it and hands it to [`plan_with`], which then does only
/// what the clock, the guard and the work in flight decide.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PlanSets {
    /// Assigned, neither confirmed nor retained, in id order: the joins before the ones in
    /// flight or backing off are taken out.
    unjoined: Vec<GroupId>,
    /// Held (admitted or joining) but neither assigned nor retained ([`withdrawn`]).
    withdrawn: BTreeSet<GroupId>,
    /// Held, for the mass-withdrawal guard: the admitted, plus the joining ones withdrawn.
    held: usize,
    /// Confirmed but no longer assigned: pruned by the plan.
    unconfirmed: Vec<GroupId>,
}

impl PlanSets {
    /// The set-derived part of the plan for `desired` against `state` (linear in the sizes
    /// of the sets).
    pub fn new(desired: &Desired, state: &State) -> Self {
        // The large sets are compared with `difference` (one merged walk over two sorted
        // sets of similar size) rather than a lookup per id; `retain`, small, is looked up.
        let unjoined = desired
            .assigned
            .difference(&state.confirmed)
            .filter(|id| !desired.retain.contains(id))
            .copied()
            .collect();
        let withdrawn = withdrawn(state, desired);
        // Joining ones still assigned (joins under way or failing) do not count, so they
        // cannot dilute the guard's protection of what merod certainly holds.
        let held = state.admitted.len()
            + withdrawn
                .iter()
                .filter(|id| !state.admitted.contains(id))
                .count();
        // Pruned: confirmed but no longer assigned (retained ones included: they stay
        // admitted, and are joined and confirmed again once assigned again). None in an
        // idle cycle.
        let unconfirmed = state
            .confirmed
            .difference(&desired.assigned)
            .copied()
            .collect();
        Self {
            unjoined,
            withdrawn,
            held,
            unconfirmed,
        }
    }
}

/// [`plan`], from `sets`: they must be the [`PlanSets::new`] of `input.desired` and
/// `input.state` (kept from an earlier poll only while none of those sets moved; stale
/// ones would plan from sets that are no longer so). Debug builds check it.
pub fn plan_with(input: PlanInput<'_>, sets: &PlanSets) -> Plan {
    let PlanInput {
        policy,
        state,
        in_flight,
        join_backoff,
        guard,
        now,
        ..
    } = input;
    debug_assert_eq!(
        *sets,
        PlanSets::new(input.desired, state),
        "plan_with was handed the PlanSets of other sets"
    );
    // The observed clock: monotonic time between successful polls of this run, added to
    // what earlier runs observed. The first poll of a run adds nothing (downtime is not
    // observed), and a wall-clock step cannot reach it.
    let elapsed = guard
        .last_ok_poll
        .map_or(Duration::ZERO, |t| now.saturating_duration_since(t));
    let observed_ms = state.observed_ms.saturating_add(millis(elapsed));
    let joins = sets
        .unjoined
        .iter()
        .filter(|id| !in_flight.contains(id) && !join_backoff.contains(id))
        .copied()
        .collect();
    let absent = absences(state, &sets.withdrawn, observed_ms);
    let (mass_drop, mass_drop_event) = next_mass_drop(
        policy,
        guard.mass_drop,
        sets.withdrawn.len(),
        sets.held,
        elapsed,
    );
    let next_guard = Guard {
        mass_drop,
        last_ok_poll: Some(now),
    };
    let (leaves, waiting, recent_leaves_ms) =
        schedule_leaves(&input, &absent, mass_drop, observed_ms);

    Plan {
        joins,
        leaves,
        waiting,
        state: StateChange {
            observed_ms,
            absent,
            recent_leaves_ms,
            unconfirmed: sets.unconfirmed.clone(),
        },
        guard: next_guard,
        mass_drop_event,
    }
}

/// Withdrawn: held (or maybe held: joining) but neither assigned nor retained by this poll.
/// Counted before the prune.
fn withdrawn(state: &State, desired: &Desired) -> BTreeSet<GroupId> {
    state
        .admitted
        .difference(&desired.assigned)
        .chain(state.joining.difference(&desired.assigned))
        .filter(|id| !desired.retain.contains(id))
        .copied()
        .collect()
}

/// The absence of each `withdrawn` namespace after this poll: one more successful poll, the
/// observed clock's reading of the first one kept (`observed_ms` for a new absence).
fn absences(
    state: &State,
    withdrawn: &BTreeSet<GroupId>,
    observed_ms: u64,
) -> BTreeMap<GroupId, Absence> {
    withdrawn
        .iter()
        .map(|id| {
            let absence = match state.absent.get(id) {
                Some(a) => Absence {
                    polls: a.polls.saturating_add(1),
                    since_ms: a.since_ms.min(observed_ms),
                },
                None => Absence {
                    polls: 1,
                    since_ms: observed_ms,
                },
            };
            (*id, absence)
        })
        .collect()
}

/// The mass-withdrawal guard after a poll that withdrew `withdrawn` of `held` namespaces,
/// `elapsed` observed time after the previous successful poll (zero across a failed one),
/// and the change worth a loud log line, if any. A mass withdrawal is at least
/// `mass_drop_min` and more than half of what is held, or everything held (however little
/// that is).
fn next_mass_drop(
    policy: &LeavePolicy,
    previous: MassDrop,
    withdrawn: usize,
    held: usize,
    elapsed: Duration,
) -> (MassDrop, Option<MassDropEvent>) {
    let mass = withdrawn > 0
        && ((withdrawn >= policy.mass_drop_min && withdrawn.saturating_mul(2) > held)
            || withdrawn >= held);
    match (mass, previous) {
        (false, MassDrop::Idle | MassDrop::Released) => (MassDrop::Idle, None),
        (false, MassDrop::Holding { .. }) => (MassDrop::Idle, Some(MassDropEvent::Cleared)),
        (true, MassDrop::Idle) => {
            let event = Some(MassDropEvent::HoldStarted { withdrawn, held });
            if policy.mass_drop_hold.is_zero() {
                (MassDrop::Released, event)
            } else {
                let observed = Duration::ZERO;
                (MassDrop::Holding { observed }, event)
            }
        }
        (true, MassDrop::Holding { observed }) => {
            // Only the observed time since the previous successful poll (none across a
            // failed one): an outage does not count toward the hold.
            let observed = observed.saturating_add(elapsed);
            if observed >= policy.mass_drop_hold {
                let event = Some(MassDropEvent::Released { withdrawn });
                (MassDrop::Released, event)
            } else {
                (MassDrop::Holding { observed }, None)
            }
        }
        (true, MassDrop::Released) => (MassDrop::Released, None),
    }
}

/// The leaves of this poll among the `absent` candidates, the oldest absence first (ties
/// in id order, so the rate limits let the longest-withdrawn go first); the rest waiting,
/// each with the first rule that holds it back; and the leave stamps of the last hour of
/// the observed clock with this poll's leaves added (persisted: a restart, or a crash loop,
/// does not reset the budgets).
fn schedule_leaves(
    input: &PlanInput<'_>,
    absent: &BTreeMap<GroupId, Absence>,
    mass_drop: MassDrop,
    observed_ms: u64,
) -> (Vec<GroupId>, BTreeMap<GroupId, LeaveWait>, Vec<u64>) {
    let policy = input.policy;
    let age = |t: u64| Duration::from_millis(observed_ms.saturating_sub(t));
    let mut recent_leaves_ms: Vec<u64> = input
        .state
        .recent_leaves_ms
        .iter()
        .copied()
        .filter(|t| age(*t) < HOUR)
        .collect();
    let allowance = |max: u32, used: usize| {
        usize::try_from(max)
            .unwrap_or(usize::MAX)
            .saturating_sub(used)
    };
    let last_minute = recent_leaves_ms.iter().filter(|t| age(**t) < MINUTE);
    let mut budget = LeaveBudget {
        minute: allowance(policy.max_leaves_per_minute, last_minute.count()),
        hour: allowance(policy.max_leaves_per_hour, recent_leaves_ms.len()),
    };
    let mut candidates: Vec<(&GroupId, &Absence)> = absent.iter().collect();
    candidates.sort_by_key(|(id, a)| (a.since_ms, **id));
    let mut leaves = Vec::new();
    let mut waiting = BTreeMap::new();
    for (id, absence) in candidates {
        let absent_for = age(absence.since_ms);
        match leave_wait(input, *id, absence.polls, absent_for, mass_drop, &budget) {
            Some(w) => {
                waiting.insert(*id, w);
            }
            None => {
                budget.minute -= 1;
                budget.hour -= 1;
                recent_leaves_ms.push(observed_ms);
                leaves.push(*id);
            }
        }
    }
    (leaves, waiting, recent_leaves_ms)
}

/// The leaves still allowed by the rate limits in this poll.
struct LeaveBudget {
    /// Under `max_leaves_per_minute`.
    minute: usize,
    /// Under `max_leaves_per_hour`.
    hour: usize,
}

/// The first rule that holds back the leave of `id`, absent from `polls` successful polls
/// over `absent_for` of observed time, in the order they are checked; `None`: it is left now.
fn leave_wait(
    input: &PlanInput<'_>,
    id: GroupId,
    polls: u32,
    absent_for: Duration,
    mass_drop: MassDrop,
    budget: &LeaveBudget,
) -> Option<LeaveWait> {
    let policy = input.policy;
    if input.in_flight.contains(&id) {
        Some(LeaveWait::InFlight)
    } else if let Some(wait) = policy.grace_wait(absent_for) {
        Some(wait)
    } else if let Some(wait) = policy.stability_wait(polls) {
        Some(wait)
    } else if let MassDrop::Holding { observed } = mass_drop {
        Some(LeaveWait::MassDropHold {
            remaining: policy.mass_drop_hold.saturating_sub(observed),
        })
    } else if input.leave_backoff.contains(&id) {
        Some(LeaveWait::BackingOff)
    } else if budget.minute == 0 {
        Some(LeaveWait::RateLimited(RateLimit::PerMinute))
    } else if budget.hour == 0 {
        Some(LeaveWait::RateLimited(RateLimit::PerHour))
    } else {
        None
    }
}

/// Orphans: namespaces merod holds (`held`, its latest list, any order) that are neither in the state
/// (admitted or joining), assigned nor retained by the latest successful poll. Nothing the
/// sidecar did or will do explains them (a join by hand, the Bash sidecar's, a state file
/// lost with a RAM `/var`). Pure; `leave_orphans` decides what is done with them (the
/// default: nothing but reporting them). Linear in the sizes of the five sets when `held`
/// comes in ascending order (a walk along each set: the daemon runs this every poll, over
/// 10,000 namespaces); any other order costs a lookup per id.
pub fn orphans<'a>(
    held: impl IntoIterator<Item = &'a GroupId>,
    state: &State,
    desired: &Desired,
) -> BTreeSet<GroupId> {
    let mut sets = [
        Walk::new(&state.admitted),
        Walk::new(&state.joining),
        Walk::new(&desired.assigned),
        Walk::new(&desired.retain),
    ];
    held.into_iter()
        .filter(|id| !sets.iter_mut().any(|s| s.contains(id)))
        .copied()
        .collect()
}

/// Membership in a set of ids asked in ascending order, by walking it once; an id below
/// the one asked before starts a new walk from it.
struct Walk<'a> {
    set: &'a BTreeSet<GroupId>,
    at: std::iter::Peekable<std::collections::btree_set::Range<'a, GroupId>>,
    last: Option<GroupId>,
}

impl<'a> Walk<'a> {
    fn new(set: &'a BTreeSet<GroupId>) -> Self {
        Self {
            set,
            at: set.range(..).peekable(),
            last: None,
        }
    }

    fn contains(&mut self, id: &GroupId) -> bool {
        if self.last.is_some_and(|last| *id < last) {
            self.at = self.set.range(id..).peekable();
        }
        self.last = Some(*id);
        while self.at.next_if(|x| *x < id).is_some() {}
        self.at.peek() == Some(&id)
    }
}

/// What an executed action established, to fold into the state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// A fleet-join is about to be sent: merod may hold the namespace from now on until its
    /// admission is recorded or it is left. Recorded before the call.
    JoinStarted(GroupId),
    /// merod admitted the namespace and lists it: it is held.
    Admitted(GroupId),
    /// MDMA acknowledged the admission.
    Confirmed(GroupId),
    /// merod no longer holds the namespace (left, or found gone).
    Left(GroupId),
}

/// Folds one outcome into the state. Keeps `confirmed ⊆ admitted` (a confirm of a
/// namespace not, or no longer, admitted is not recorded) and `joining` apart from
/// `admitted`.
pub fn apply(state: &mut State, outcome: Outcome) {
    match outcome {
        Outcome::JoinStarted(id) => {
            if !state.admitted.contains(&id) {
                state.joining.insert(id);
            }
        }
        Outcome::Admitted(id) => {
            state.joining.remove(&id);
            state.admitted.insert(id);
        }
        Outcome::Confirmed(id) => {
            if state.admitted.contains(&id) {
                state.confirmed.insert(id);
            }
        }
        Outcome::Left(id) => {
            state.admitted.remove(&id);
            state.joining.remove(&id);
            state.confirmed.remove(&id);
            state.absent.remove(&id);
        }
    }
}

#[cfg(test)]
mod tests;
