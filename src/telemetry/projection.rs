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
}

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
        self.update(|st| {
            refill(&mut st.desired, &p.desired.assigned);
            refill(&mut st.retain, &p.desired.retain);
            refill(&mut st.admitted, &p.state.admitted);
            refill(&mut st.confirmed, &p.state.confirmed);
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
        t.publish(&Projection {
            desired: &Desired::default(),
            state: &state,
            joining: &none,
            leaving: &none,
            waiting: &waiting,
            orphans: &none,
            mass_drop: MassDrop::Idle,
            mass_drop_hold: Duration::from_secs(600),
        });
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
