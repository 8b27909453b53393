//! Property test of the real loop (src/daemon/ + reconcile.rs) under tokio's paused clock:
//! random sequences of poll outcomes (good with random sets, failed of each kind, hung),
//! join outcomes (admitted, not admitted, error, hang), confirm outcomes and leave outcomes.
//!
//! Invariants: no leave follows a failed poll; nothing in the latest successful poll's
//! assignments or `retain` is ever left; confirmed ⊆ admitted in the persisted state; and
//! once polls are good and stable, every namespace merod admitted that MDMA no longer
//! assigns is eventually left.

use std::collections::BTreeMap;
use std::time::Duration;

use fleet_sidecar::StateStore;
use proptest::prelude::*;

use crate::common::NodeDir;
use crate::fakes::{desired, Fake, Join, Poll};

fn poll() -> impl Strategy<Value = Poll> {
    let set = || prop::collection::btree_set(1u8..7, 0..6);
    prop_oneof![
        6 => (set(), prop::collection::btree_set(1u8..7, 0..2)).prop_map(|(a, r)| Poll::Good(a, r)),
        1 => Just(Poll::Transport),
        1 => Just(Poll::Status),
        1 => Just(Poll::Malformed),
        1 => Just(Poll::Hang),
    ]
}

fn join() -> impl Strategy<Value = Join> {
    prop_oneof![
        3 => Just(Join::Admitted),
        1 => Just(Join::NotAdmitted),
        1 => Just(Join::Error),
        1 => Just(Join::Hang),
    ]
}

fn history(
    polls: Vec<Poll>,
    joins: Vec<Join>,
    confirms: Vec<bool>,
    leaves: Vec<bool>,
    leave_after: u32,
) -> Result<(), TestCaseError> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .unwrap();
    let node = NodeDir::new();
    let cfg = node.config(&format!(
        "leave_after_polls = {leave_after}\nleave_grace = \"0s\"\nmass_drop_hold = \"30s\"\nmax_leaves_per_hour = 1000\njoin_timeout = \"20s\""
    ));
    let fake = Fake::default();
    let scripted = polls.len();
    fake.with(|w| {
        w.poll_script = polls.clone();
        w.join_script = joins;
        w.confirm_script = confirms;
        w.leave_script = leaves;
    });
    let state_path = node.state_file();
    let mut confirmed_outside_admitted = Vec::new();
    rt.block_on(async {
        let running = fake.run(cfg);
        // The scripted polls (a hung one takes the 11 s deadline), checking the state as it goes.
        while fake.with(|w| w.polls.len()) < scripted {
            tokio::time::sleep(Duration::from_millis(500)).await;
            if let Ok(Some(s)) = StateStore::new(&state_path).load() {
                if !s.confirmed.is_subset(&s.admitted) {
                    confirmed_outside_admitted.push(format!("{s:?}"));
                }
            }
        }
        let last_good = polls
            .iter()
            .rev()
            .find_map(|p| match p {
                Poll::Good(a, r) => Some(desired(a, r)),
                _ => None,
            })
            .unwrap_or_default();
        fake.with(|w| {
            w.assignments = last_good.assignments;
            w.retain = last_good.retain;
            w.settled = true;
        });
        // Good, stable polls: long enough for hung joins (20 s), stability, the 30 s
        // mass-drop hold and the leave rate limit.
        tokio::time::sleep(Duration::from_secs(180)).await;
        running.stop().await;
    });
    let violations = fake.with(|w| w.violations.clone());
    prop_assert!(violations.is_empty(), "{violations:?}");
    prop_assert!(
        confirmed_outside_admitted.is_empty(),
        "{confirmed_outside_admitted:?}"
    );
    let s = StateStore::new(&state_path)
        .load()
        .unwrap()
        .unwrap_or_default();
    prop_assert!(s.confirmed.is_subset(&s.admitted));
    let (held, assignments, retain) =
        fake.with(|w| (w.held.clone(), w.assignments.clone(), w.retain.clone()));
    let stray: BTreeMap<_, _> = held
        .iter()
        .filter(|g| !assignments.contains(g) && !retain.contains(g))
        .map(|g| (g.to_string(), s.admitted.contains(g)))
        .collect();
    prop_assert!(
        stray.is_empty(),
        "held though withdrawn (id → tracked): {stray:?}"
    );
    prop_assert!(
        held.is_subset(&s.admitted),
        "merod holds what the state does not track"
    );
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn the_loop_keeps_its_invariants_over_random_histories(
        polls in prop::collection::vec(poll(), 1..25),
        joins in prop::collection::vec(join(), 1..6),
        confirms in prop::collection::vec(any::<bool>(), 1..4),
        leaves in prop::collection::vec(prop::bool::weighted(0.7), 1..4),
        leave_after in 1u32..4,
    ) {
        history(polls, joins, confirms, leaves, leave_after)?;
    }
}
