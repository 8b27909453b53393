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
//!   consecutive successful polls; reappearing resets the count.
//! * Mass-withdrawal guard: when one poll withdraws at least `mass_drop_min` namespaces and
//!   more than half of those held, every leave is held until the withdrawal has persisted
//!   for `mass_drop_hold`; then leaves go ahead, at most `max_leaves_per_minute`.
//! * Nothing with a join or leave in flight is planned again, and nothing whose last join
//!   (or leave) failed is joined (or left) again before its retry wait ends; a leave
//!   backing off does not take from the rate limit.
//! * Prune: `confirmed ← confirmed ∩ (assigned ∪ retain)`, so a re-added namespace is
//!   confirmed anew. `admitted` shrinks only when merod no longer holds a namespace.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt;
use std::time::Duration;

use tokio::time::Instant;

use crate::ids::GroupId;
use crate::mdma::ShouldJoin;
use crate::state::State;

/// When a withdrawn namespace may be left (config keys of the same names).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LeavePolicy {
    /// Consecutive successful polls a namespace must be absent from (≥ 1; 1 = reference).
    pub leave_after_polls: u32,
    /// Withdrawals in one poll that can trigger the mass-withdrawal guard (≥ 1).
    pub mass_drop_min: usize,
    /// How long a mass withdrawal must persist over successful polls before leaves go.
    pub mass_drop_hold: Duration,
    /// Leaves started in any 60 s window (≥ 1).
    pub max_leaves_per_minute: u32,
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

    /// The reference sidecar's behaviour: leave on the first poll that withdraws, no guard.
    pub const REFERENCE: Self = Self {
        leave_after_polls: 1,
        mass_drop_min: usize::MAX,
        mass_drop_hold: Duration::ZERO,
        max_leaves_per_minute: u32::MAX,
    };
}

/// What a successful `should-join` poll said (docs/mdma.md).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Desired {
    /// The `group_id` of every entry of `assignments`: namespaces this node must hold.
    pub assigned: BTreeSet<GroupId>,
    /// `retain`: namespaces the node may keep but must not newly join; never left.
    pub retain: BTreeSet<GroupId>,
}

impl From<ShouldJoin> for Desired {
    fn from(answer: ShouldJoin) -> Self {
        Self {
            assigned: answer.assignments,
            retain: answer.retain,
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
    /// A mass withdrawal seen first at `since`; every leave is held.
    Holding {
        /// The first successful poll that showed it.
        since: Instant,
    },
    /// The withdrawal persisted past the hold; leaves go (rate-limited) while it lasts.
    Released,
}

/// In-memory guard state: the mass-drop phase and the start times of recent leaves.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Guard {
    /// The mass-withdrawal phase.
    pub mass_drop: MassDrop,
    /// When the leaves of the last 60 s started, oldest first.
    pub recent_leaves: VecDeque<Instant>,
}

/// Why a leave candidate is not left in this cycle.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LeaveWait {
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
    /// `max_leaves_per_minute` reached; goes in a later cycle.
    RateLimited,
    /// A join or leave of it is still running.
    InFlight,
}

impl fmt::Display for LeaveWait {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
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
            LeaveWait::RateLimited => f.write_str("waiting for the leave rate limit"),
            LeaveWait::InFlight => f.write_str("a join or leave of it is running"),
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

/// What to do in this cycle, and the state to persist.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    /// Namespaces to `fleet-join` (then confirm), in id order.
    pub joins: Vec<GroupId>,
    /// Namespaces to leave now, in id order.
    pub leaves: Vec<GroupId>,
    /// Leave candidates not left now, and why.
    pub waiting: BTreeMap<GroupId, LeaveWait>,
    /// The state after this poll: absent counts updated, `confirmed` pruned.
    pub state: State,
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
    /// The time of this poll.
    pub now: Instant,
}

/// Plans one cycle from a successful poll.
pub fn plan(input: PlanInput<'_>) -> Plan {
    let change = plan_change(input);
    let mut state = input.state.clone();
    change.state.apply_to(&mut state);
    Plan {
        joins: change.joins,
        leaves: change.leaves,
        waiting: change.waiting,
        state,
        guard: change.guard,
        mass_drop_event: change.mass_drop_event,
    }
}

/// What [`plan`] decides, with the state given as the change to make to `input.state`
/// rather than a copy of it (the daemon's path: an idle cycle at 10,000 namespaces then
/// copies no set).
pub(crate) struct PlanChange {
    pub(crate) joins: Vec<GroupId>,
    pub(crate) leaves: Vec<GroupId>,
    pub(crate) waiting: BTreeMap<GroupId, LeaveWait>,
    pub(crate) state: StateChange,
    pub(crate) guard: Guard,
    pub(crate) mass_drop_event: Option<MassDropEvent>,
}

/// How this poll changes the persisted state: new absence counts, and the confirmed
/// namespaces pruned (neither assigned nor retained).
pub(crate) struct StateChange {
    absent_polls: BTreeMap<GroupId, u32>,
    unconfirmed: Vec<GroupId>,
}

impl StateChange {
    /// Makes the change to `state`, the state the plan was made from.
    pub(crate) fn apply_to(self, state: &mut State) {
        state.absent_polls = self.absent_polls;
        for id in &self.unconfirmed {
            state.confirmed.remove(id);
        }
    }

    /// Whether applying it leaves the state as it is.
    #[cfg(test)]
    pub(crate) fn is_none(&self, state: &State) -> bool {
        self.unconfirmed.is_empty() && self.absent_polls == state.absent_polls
    }
}

/// [`plan`] without copying the state: see [`PlanChange`].
pub(crate) fn plan_change(input: PlanInput<'_>) -> PlanChange {
    let PlanInput {
        policy,
        desired,
        state,
        in_flight,
        join_backoff,
        leave_backoff,
        guard,
        now,
    } = input;
    // The large sets are compared with `difference` (one merged walk over two sorted sets
    // of similar size) rather than a lookup per id; the small ones (`retain`, in flight,
    // backing off) are looked up.
    let joins = desired
        .assigned
        .difference(&state.confirmed)
        .filter(|id| {
            !desired.retain.contains(id) && !in_flight.contains(id) && !join_backoff.contains(id)
        })
        .copied()
        .collect();

    // Withdrawn: held (or maybe held: joining) but neither assigned nor retained. Counted
    // before the prune.
    let withdrawn: BTreeSet<GroupId> = state
        .admitted
        .difference(&desired.assigned)
        .chain(state.joining.difference(&desired.assigned))
        .filter(|id| !desired.retain.contains(id))
        .copied()
        .collect();
    // Held, for the guard: the admitted, plus the joining ones this poll withdraws. Joining
    // ones still assigned (joins under way or failing) do not count, so they cannot dilute
    // the guard's protection of what merod certainly holds.
    let held = state.admitted.len()
        + withdrawn
            .iter()
            .filter(|id| !state.admitted.contains(id))
            .count();
    let absent_polls: BTreeMap<GroupId, u32> = withdrawn
        .iter()
        .map(|id| {
            let before = state.absent_polls.get(id).copied().unwrap_or(0);
            (*id, before.saturating_add(1))
        })
        .collect();

    let mut next_guard = guard.clone();
    let mass = withdrawn.len() >= policy.mass_drop_min && withdrawn.len().saturating_mul(2) > held;
    let mut mass_drop_event = None;
    next_guard.mass_drop = match (mass, guard.mass_drop) {
        (false, MassDrop::Idle) => MassDrop::Idle,
        (false, MassDrop::Holding { .. }) => {
            mass_drop_event = Some(MassDropEvent::Cleared);
            MassDrop::Idle
        }
        (false, MassDrop::Released) => MassDrop::Idle,
        (true, MassDrop::Idle) => {
            mass_drop_event = Some(MassDropEvent::HoldStarted {
                withdrawn: withdrawn.len(),
                held,
            });
            if policy.mass_drop_hold.is_zero() {
                MassDrop::Released
            } else {
                MassDrop::Holding { since: now }
            }
        }
        (true, MassDrop::Holding { since }) => {
            if now.saturating_duration_since(since) >= policy.mass_drop_hold {
                mass_drop_event = Some(MassDropEvent::Released {
                    withdrawn: withdrawn.len(),
                });
                MassDrop::Released
            } else {
                MassDrop::Holding { since }
            }
        }
        (true, MassDrop::Released) => MassDrop::Released,
    };

    let window = Duration::from_secs(60);
    while next_guard
        .recent_leaves
        .front()
        .is_some_and(|t| now.saturating_duration_since(*t) >= window)
    {
        next_guard.recent_leaves.pop_front();
    }
    let mut budget = usize::try_from(policy.max_leaves_per_minute)
        .unwrap_or(usize::MAX)
        .saturating_sub(next_guard.recent_leaves.len());

    let mut leaves = Vec::new();
    let mut waiting = BTreeMap::new();
    for (id, polls) in &absent_polls {
        let wait = if in_flight.contains(id) {
            Some(LeaveWait::InFlight)
        } else if let Some(wait) = policy.stability_wait(*polls) {
            Some(wait)
        } else if let MassDrop::Holding { since } = next_guard.mass_drop {
            Some(LeaveWait::MassDropHold {
                remaining: policy
                    .mass_drop_hold
                    .saturating_sub(now.saturating_duration_since(since)),
            })
        } else if leave_backoff.contains(id) {
            Some(LeaveWait::BackingOff)
        } else if budget == 0 {
            Some(LeaveWait::RateLimited)
        } else {
            None
        };
        match wait {
            Some(w) => {
                waiting.insert(*id, w);
            }
            None => {
                budget -= 1;
                next_guard.recent_leaves.push_back(now);
                leaves.push(*id);
            }
        }
    }

    // Pruned: confirmed but neither assigned nor retained (none in an idle cycle).
    let unconfirmed = state
        .confirmed
        .difference(&desired.assigned)
        .filter(|id| !desired.retain.contains(id))
        .copied()
        .collect();

    PlanChange {
        joins,
        leaves,
        waiting,
        state: StateChange {
            absent_polls,
            unconfirmed,
        },
        guard: next_guard,
        mass_drop_event,
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
            state.absent_polls.remove(&id);
        }
    }
}

#[cfg(test)]
mod tests;
