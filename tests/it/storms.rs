//! Request storms, under tokio's paused clock with in-memory MDMA and merod: what the node
//! sends when its inputs flap, measured against what a quiet node sends.

use std::collections::BTreeSet;
use std::time::Duration;

use crate::common::*;
use crate::fakes::{Fake, Join, Poll};

/// Ten polls assigning namespace 1, then `flips` polls that withdraw and assign it in turn
/// (two MDMA replicas that disagree), then the live answer (assigned).
fn flapping(flips: usize) -> Vec<Poll> {
    let assigned = || Poll::Good(BTreeSet::from([1]), BTreeSet::new());
    let withdrawn = || Poll::Good(BTreeSet::new(), BTreeSet::new());
    let mut script: Vec<Poll> = (0..10).map(|_| assigned()).collect();
    script.extend((0..flips).map(|i| if i % 2 == 0 { withdrawn() } else { assigned() }));
    script
}

#[tokio::test(start_paused = true)]
async fn a_held_namespace_assigned_again_is_confirmed_not_joined_and_flaps_back_off() {
    let node = NodeDir::new();
    let fake = Fake::default();
    fake.with(|w| {
        w.poll_script = flapping(40);
        w.assignments.insert(id(1));
    });
    let running = fake.run(node.config(""));
    // 10 s assigned, 40 s of flips (20 re-assignments), then 60 s assigned.
    tokio::time::sleep(Duration::from_secs(110)).await;
    running.stop().await;
    fake.with(|w| {
        assert_eq!(
            w.joins.len(),
            1,
            "one attested fleet-join; merod held it throughout: {:?}",
            w.joins
        );
        // One confirm after the join, then re-confirms spaced 2, 4, 8, 16… s apart (jittered
        // down to half, never below 2 s: at most 6 in the 40 s of flips and one after
        // them, one more for the polls' whole seconds), not one per re-assignment (20).
        let confirms = w.confirms.len();
        assert!(
            (3..=9).contains(&confirms),
            "{confirms} confirms: {:?}",
            w.confirms
        );
        assert!(w.leaves.is_empty(), "{:?}", w.leaves);
        assert!(w.violations.is_empty(), "{:?}", w.violations);
    });
    let state = node.state();
    assert!(
        state.confirmed.contains(&id(1)),
        "confirmed at the end: {state:?}"
    );
    assert!(state.joining.is_empty());
}

#[tokio::test(start_paused = true)]
async fn a_failing_join_of_a_flapping_namespace_backs_off_across_the_flips() {
    let node = NodeDir::new();
    let fake = Fake::default();
    fake.with(|w| {
        w.poll_script = flapping(40);
        w.assignments.insert(id(1));
        w.join_script = vec![Join::Error];
    });
    let running = fake.run(node.config(""));
    tokio::time::sleep(Duration::from_secs(50)).await;
    running.stop().await;
    fake.with(|w| {
        // Backed off 2, 4, 8, 16, 32 s (jittered down to half): at most 10 in 50 s; a
        // back-off forgotten at every withdrawal would send one at each of the 20
        // re-assignments besides.
        let joins = w.joins.len();
        assert!(
            (3..=10).contains(&joins),
            "{joins} fleet-joins: {:?}",
            w.joins
        );
        // The fourth failure in a row waits at least 8 s (16 s jittered down to half).
        let gaps: Vec<Duration> = w.joins.windows(2).map(|p| p[1].1 - p[0].1).collect();
        assert!(
            gaps.iter()
                .max()
                .is_some_and(|g| *g >= Duration::from_secs(8)),
            "the waits grow across the flips: {gaps:?}"
        );
    });
}

#[tokio::test(start_paused = true)]
async fn a_refused_poll_s_retry_after_is_honoured_up_to_60_s() {
    let node = NodeDir::new();
    let fake = Fake::default();
    fake.with(|w| {
        w.mdma_down = true;
        w.retry_after_secs = Some(30);
    });
    let running = fake.run(node.config(""));
    // `429, Retry-After: 30`: one poll, and the next 30 s later (the back-off alone would
    // send 5 or 6 in those 30 s, at most `max_backoff` = 10 s apart).
    tokio::time::sleep(Duration::from_secs(65)).await;
    let gaps = |w: &crate::fakes::World| -> Vec<Duration> {
        w.polls.windows(2).map(|p| p[1].0 - p[0].0).collect()
    };
    fake.with(|w| {
        let g = gaps(w);
        assert_eq!(w.polls.len(), 3, "{g:?}");
        assert!(g.iter().all(|d| *d >= Duration::from_secs(30)), "{g:?}");
    });
    // An hour asked: never silent longer than 60 s.
    fake.with(|w| {
        w.retry_after_secs = Some(3600);
        w.polls.clear();
    });
    tokio::time::sleep(Duration::from_secs(200)).await;
    fake.with(|w| {
        let g = gaps(w);
        assert!(w.polls.len() >= 3, "{g:?}");
        assert!(g.iter().all(|d| *d <= Duration::from_secs(61)), "{g:?}");
    });
    running.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_refused_confirm_s_retry_after_is_honoured_before_it_is_sent_again() {
    let node = NodeDir::new();
    let fake = Fake::default();
    fake.with(|w| {
        w.assignments.insert(id(1));
        w.confirm_script = vec![false, false, true];
        w.retry_after_secs = Some(30);
    });
    let running = fake.run(node.config(""));
    tokio::time::sleep(Duration::from_secs(100)).await;
    running.stop().await;
    fake.with(|w| {
        // Refused twice with `Retry-After: 30`: sent again 30 s later each time (the
        // back-off alone would wait 2 s, then 4 s), as a confirm alone (merod holds it).
        let gaps: Vec<Duration> = w.confirm_times.windows(2).map(|t| t[1] - t[0]).collect();
        assert_eq!(w.confirms.len(), 3, "{gaps:?}");
        assert!(
            gaps.iter().all(|d| *d >= Duration::from_secs(30)),
            "{gaps:?}"
        );
        assert_eq!(w.joins.len(), 1, "{:?}", w.joins);
    });
    assert!(node.state().confirmed.contains(&id(1)));
}
