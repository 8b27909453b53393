//! The loop's sets projected into the live status (`/status`, the systemd `STATUS=` line)
//! and the `fleet_sidecar_namespaces` gauges, with the wording of the mass-withdrawal line.
//!
//! An idle cycle changes nothing here: each list is rebuilt only when its set changed, so
//! at 10,000 namespaces a cycle that changed nothing allocates nothing.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use super::{SetLabel, Telemetry};
use crate::ids::GroupId;
use crate::reconcile::{Desired, LeaveWait, MassDrop};
use crate::state::State;

/// What the loop holds that the live status shows, borrowed from the loop.
pub(crate) struct Projection<'a> {
    /// The latest successful poll's answer.
    pub desired: &'a Desired,
    /// The admitted and confirmed sets.
    pub state: &'a State,
    /// Namespaces with a join task running.
    pub joining: &'a BTreeSet<GroupId>,
    /// Namespaces with a leave task running.
    pub leaving: &'a BTreeSet<GroupId>,
    /// Withdrawn namespaces not left yet, with the rule that holds each back.
    pub waiting: &'a BTreeMap<GroupId, LeaveWait>,
    /// Namespaces merod holds that are neither in the state, assigned nor retained.
    pub orphans: &'a BTreeSet<GroupId>,
    /// The mass-withdrawal guard.
    pub mass_drop: MassDrop,
    /// `leave_policy.mass_drop_hold`: how long a mass withdrawal is held.
    pub mass_drop_hold: Duration,
    /// The version of the sets `desired` and `state` hold, when the caller counts them
    /// (`None`: compared id by id).
    pub sets: Option<SetsVersion>,
}

/// Which answer (a count of the answers taken in) and which membership of the state (its
/// record's count of the changes that may touch `admitted`, `confirmed` or `joining`) a
/// [`Projection`]'s sets are: one published before means the same lists, which then are
/// not walked (at 10,000 namespaces, twice a poll, a sixth of an idle cycle).
pub(crate) type SetsVersion = (u64, u64);

impl Telemetry {
    /// Copies the loop's sets into the live status and the namespace gauges, touching only
    /// what changed.
    pub(crate) fn publish(&self, p: &Projection<'_>) {
        for (set, n) in [
            ("desired", p.desired.assigned.len()),
            ("admitted", p.state.admitted.len()),
            ("confirmed", p.state.confirmed.len()),
            ("pending_leave", p.waiting.len()),
        ] {
            self.namespaces
                .get_or_create(&SetLabel { set })
                .set(i64::try_from(n).unwrap_or(i64::MAX));
        }
        let oldest = p
            .waiting
            .keys()
            .filter_map(|id| p.state.absence_observed(id))
            .max()
            .unwrap_or_default();
        self.pending_leave_absence.set(oldest.as_secs_f64());
        let same_sets = {
            let mut published = self
                .published_sets
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            let same = p.sets.is_some() && *published == p.sets;
            *published = p.sets;
            same
        };
        if cfg!(debug_assertions) && same_sets {
            let st = self.status.borrow();
            assert!(
                st.desired.iter().eq(&p.desired.assigned)
                    && st.retain.iter().eq(&p.desired.retain)
                    && st.admitted.iter().eq(&p.state.admitted)
                    && st.confirmed.iter().eq(&p.state.confirmed),
                "the status's lists kept past a change of their sets"
            );
        }
        self.update(|st| {
            if !same_sets {
                refill(&mut st.desired, &p.desired.assigned);
                refill(&mut st.retain, &p.desired.retain);
                refill(&mut st.admitted, &p.state.admitted);
                refill(&mut st.confirmed, &p.state.confirmed);
            }
            refill(&mut st.joining, p.joining);
            refill(&mut st.leaving, p.leaving);
            refill(&mut st.orphans, p.orphans);
            let same_waits = st.pending_leaves.len() == p.waiting.len()
                && st
                    .pending_leaves
                    .iter()
                    .zip(p.waiting)
                    .all(|((a, text), (b, w))| a == b && *text == pending_line(p.state, b, w));
            if !same_waits {
                st.pending_leaves = p
                    .waiting
                    .iter()
                    .map(|(id, w)| (*id, pending_line(p.state, id, w)))
                    .collect();
            }
            match p.mass_drop {
                MassDrop::Idle if st.mass_drop == "idle" => {}
                MassDrop::Released if st.mass_drop == "released" => {}
                other => st.mass_drop = mass_drop_line(other, p.mass_drop_hold),
            }
        });
    }
}

/// A pending leave as the live status shows it: the absence seen so far, then what it
/// waits for, e.g. `absent 8 s over 8 successful polls; waiting for leave_grace: …`.
pub(crate) fn pending_line(state: &State, id: &GroupId, wait: &LeaveWait) -> String {
    let observed = state.absence_observed(id).unwrap_or_default();
    let polls = state.absent.get(id).map_or(0, |a| a.polls);
    format!(
        "absent {} s over {polls} successful polls; {wait}",
        observed.as_secs()
    )
}

/// The live status's `mass_drop` line: `idle`, `released`, or
/// `holding every leave (N s of H s left)` (whole seconds).
pub(crate) fn mass_drop_line(guard: MassDrop, hold: Duration) -> String {
    match guard {
        MassDrop::Idle => "idle".to_owned(),
        MassDrop::Released => "released".to_owned(),
        MassDrop::Holding { observed } => format!(
            "holding every leave ({:.0} s of {} s left)",
            hold.saturating_sub(observed).as_secs_f64(),
            hold.as_secs()
        ),
    }
}

/// Makes `dst` list `src` in order, touching (and allocating) only when they differ.
fn refill(dst: &mut Vec<GroupId>, src: &BTreeSet<GroupId>) {
    if !dst.iter().eq(src.iter()) {
        dst.clear();
        dst.extend(src.iter().copied());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::ids::test_id as gid;

    #[test]
    fn the_status_lists_follow_the_sets_and_the_gauges_count_them() {
        let t = Telemetry::new();
        let mut desired = Desired::default();
        desired.assigned.extend([gid(1), gid(2)]);
        let mut state = State::default();
        state.admitted.insert(gid(1));
        let joining = BTreeSet::from([gid(2)]);
        let none = BTreeSet::new();
        let waiting = BTreeMap::new();
        let p = Projection {
            desired: &desired,
            state: &state,
            joining: &joining,
            leaving: &none,
            waiting: &waiting,
            orphans: &none,
            mass_drop: MassDrop::Idle,
            mass_drop_hold: Duration::from_secs(600),
            sets: None,
        };
        t.publish(&p);
        let st = t.snapshot();
        assert_eq!(st.desired, vec![gid(1), gid(2)]);
        assert_eq!(st.admitted, vec![gid(1)]);
        assert!(st.confirmed.is_empty());
        assert_eq!(st.joining, vec![gid(2)]);
        assert_eq!(st.mass_drop, "idle");
        let metrics = t.encode_metrics();
        assert!(
            metrics.contains("fleet_sidecar_namespaces{set=\"desired\"} 2"),
            "{metrics}"
        );
        // Published again unchanged: the same status.
        t.publish(&p);
        assert_eq!(t.snapshot(), st);
        assert!(
            metrics.contains("fleet_sidecar_pending_leave_oldest_absence_seconds 0.0"),
            "{metrics}"
        );
    }

    /// A projection with nothing running, no orphans and the guard idle.
    fn quiet<'a>(
        desired: &'a Desired,
        state: &'a State,
        none: &'a BTreeSet<GroupId>,
        waiting: &'a BTreeMap<GroupId, LeaveWait>,
        sets: Option<SetsVersion>,
    ) -> Projection<'a> {
        Projection {
            desired,
            state,
            joining: none,
            leaving: none,
            waiting,
            orphans: none,
            mass_drop: MassDrop::Idle,
            mass_drop_hold: Duration::from_secs(600),
            sets,
        }
    }

    #[test]
    fn the_large_lists_are_refilled_only_when_their_version_is_not_the_one_published() {
        let t = Telemetry::new();
        let none = BTreeSet::new();
        let waiting = BTreeMap::new();
        let publish = |desired: &Desired, state: &State, sets| {
            t.publish(&quiet(desired, state, &none, &waiting, sets))
        };
        let desired = Desired {
            assigned: [gid(1)].into(),
            ..Desired::default()
        };
        let one = State {
            confirmed: [gid(1)].into(),
            ..State::default()
        };
        let two = State {
            confirmed: [gid(1), gid(2)].into(),
            ..State::default()
        };
        publish(&desired, &one, Some((1, 4)));
        assert_eq!(t.snapshot().confirmed, [gid(1)]);
        // The version published: the lists stand as they are, whatever the sets say
        // (debug builds check that they are the same, and so catch this one).
        let kept = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            publish(&desired, &two, Some((1, 4)))
        }));
        assert_eq!(kept.is_err(), cfg!(debug_assertions));
        assert_eq!(t.snapshot().confirmed, [gid(1)]);
        // Another membership, another answer, or none: compared and refilled.
        publish(&desired, &two, Some((1, 5)));
        assert_eq!(t.snapshot().confirmed, [gid(1), gid(2)]);
        publish(&Desired::default(), &two, Some((2, 5)));
        assert!(t.snapshot().desired.is_empty());
        publish(&desired, &one, None);
        assert_eq!(t.snapshot().confirmed, [gid(1)]);
        assert_eq!(t.snapshot().desired, [gid(1)]);
        // After one published without a version, no version vouches.
        publish(&desired, &two, Some((2, 5)));
        assert_eq!(t.snapshot().confirmed, [gid(1), gid(2)]);
    }

    #[test]
    fn each_pending_leave_shows_its_absence_and_the_oldest_is_a_gauge() {
        use crate::state::Absence;
        let t = Telemetry::new();
        let state = State {
            admitted: [gid(1), gid(2)].into(),
            observed_ms: 50_000,
            absent: [
                (
                    gid(1),
                    Absence {
                        polls: 9,
                        since_ms: 42_000,
                    },
                ),
                (
                    gid(2),
                    Absence {
                        polls: 40,
                        since_ms: 5_000,
                    },
                ),
            ]
            .into(),
            ..State::default()
        };
        let waiting = BTreeMap::from([
            (
                gid(1),
                LeaveWait::Grace {
                    observed: Duration::from_secs(8),
                    grace: Duration::from_secs(12),
                },
            ),
            (gid(2), LeaveWait::BackingOff),
        ]);
        let none = BTreeSet::new();
        t.publish(&quiet(&Desired::default(), &state, &none, &waiting, None));
        let st = t.snapshot();
        assert_eq!(
            st.pending_leaves[&gid(1)],
            "absent 8 s over 9 successful polls; waiting for leave_grace: absence observed for 8 s of 12 s"
        );
        assert!(st.pending_leaves[&gid(2)]
            .starts_with("absent 45 s over 40 successful polls; its last leave failed"));
        let metrics = t.encode_metrics();
        assert!(
            metrics.contains("fleet_sidecar_pending_leave_oldest_absence_seconds 45.0"),
            "{metrics}"
        );
    }

    #[test]
    fn the_mass_withdrawal_line_counts_down_the_hold() {
        let hold = Duration::from_secs(600);
        let line = mass_drop_line(
            MassDrop::Holding {
                observed: Duration::from_secs(100),
            },
            hold,
        );
        assert_eq!(line, "holding every leave (500 s of 600 s left)");
        assert_eq!(
            mass_drop_line(MassDrop::Holding { observed: hold * 2 }, hold),
            "holding every leave (0 s of 600 s left)"
        );
        assert_eq!(mass_drop_line(MassDrop::Idle, hold), "idle");
        assert_eq!(mass_drop_line(MassDrop::Released, hold), "released");
    }
}
