//! The leave policy in the real loop under tokio's paused clock (in-memory MDMA and
//! merod): `leave_grace` across a restart and at its 24 h default, the leave budgets across
//! restarts, the state writes of a pending leave, and no confirm of an admission MDMA no
//! longer assigns.

use std::time::Duration;

use fleet_sidecar::GroupId;
use tokio::time::Instant;

use crate::common::*;
use crate::fakes::{Fake, Join};

/// Sleeps until `fake` has been polled `n` times in all, then 10 ms more.
async fn until_polls(fake: &Fake, n: usize) {
    while fake.with(|w| w.polls.len()) < n {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(10)).await;
}

/// Holds and confirms `id(1)..=id(held)`, MDMA assigning `id(1)..=id(assigned)`.
fn world(node: &NodeDir, fake: &Fake, held: u8, assigned: u8) {
    node.seed(&ids(held), &ids(held));
    fake.with(|w| {
        w.held = ids(held);
        w.assignments = ids(assigned);
    });
}

fn state_writes(running: &Running) -> f64 {
    metric(
        &running.telemetry.encode_metrics(),
        "fleet_sidecar_state_writes_total{outcome=\"ok\"}",
    )
}

#[tokio::test(start_paused = true)]
async fn a_restart_8_s_into_a_12_s_grace_neither_resets_nor_skips_it() {
    let node = NodeDir::new();
    let fake = Fake::default();
    world(&node, &fake, 4, 3);
    let gone = id(4);
    let cfg = "leave_grace = \"12s\"\nleave_after_polls = 1";
    let running = fake.run(node.config(cfg));
    // The first poll sees it absent (0 s observed), the ninth 8 s later.
    until_polls(&fake, 9).await;
    running.stop().await;
    assert!(fake.with(|w| w.leaves.is_empty()));
    assert_eq!(
        node.state().absence_observed(&gone),
        Some(Duration::from_secs(8)),
        "the absence observed is persisted at shutdown"
    );
    // A minute down: not observed, so not counted.
    tokio::time::sleep(Duration::from_secs(60)).await;
    let running = fake.run(node.config(cfg));
    until_polls(&fake, 10).await;
    let first_after = fake.with(|w| w.polls[9].0);
    while fake.with(|w| w.leaves.is_empty()) {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    running.stop().await;
    let left_at = fake.with(|w| w.leaves[0].1);
    let after = left_at - first_after;
    assert!(
        after >= Duration::from_secs(4) && after < Duration::from_millis(4100),
        "left 4 s after the first poll after the restart (8 s + 4 s observed), not {after:?}"
    );
    assert!(!node.state().admitted.contains(&gone));
}

#[tokio::test(start_paused = true)]
async fn by_default_a_withdrawal_is_left_after_24_hours_and_its_wait_writes_once_a_minute() {
    let node = NodeDir::new();
    let fake = Fake::default();
    world(&node, &fake, 5, 4);
    let gone = id(5);
    let running = fake.run(node.config(""));
    until_polls(&fake, 1).await;
    let first_absent = fake.with(|w| w.polls[0].0);
    tokio::time::sleep(Duration::from_secs(3600)).await;
    let before = state_writes(&running);
    tokio::time::sleep(Duration::from_secs(3600)).await;
    let in_the_second_hour = state_writes(&running) - before;
    println!("durable state writes in the second hour of one pending leave: {in_the_second_hour}");
    assert!(
        (59.0..=61.0).contains(&in_the_second_hour),
        "one write a minute while only time changes, not one a poll: {in_the_second_hour}"
    );
    let status = running.telemetry.snapshot();
    let line = &status.pending_leaves[&gone];
    assert!(
        line.starts_with("absent 7200 s over 7201 successful polls; waiting for leave_grace"),
        "{line}"
    );
    // 24 h after the first poll that showed it absent, less a poll: still held.
    let until = first_absent + Duration::from_secs(86_399) - Instant::now();
    tokio::time::sleep(until).await;
    assert!(fake.with(|w| w.leaves.is_empty()), "left before 24 h");
    tokio::time::sleep(Duration::from_secs(2)).await;
    running.stop().await;
    let leaves = fake.with(|w| w.leaves.clone());
    assert_eq!(leaves.len(), 1, "{leaves:?}");
    assert!(leaves[0].1 - first_absent >= Duration::from_secs(86_400));
    assert_eq!(node.state().admitted, ids(4));
}

#[tokio::test(start_paused = true)]
async fn leave_budgets_survive_restarts_so_a_crash_loop_cannot_exceed_them() {
    let node = NodeDir::new();
    let fake = Fake::default();
    // 6 of 20 withdrawn: not a mass withdrawal.
    world(&node, &fake, 20, 14);
    let cfg = "leave_grace = \"0s\"\nleave_after_polls = 1\nmax_leaves_per_hour = 2";
    for _ in 0..10 {
        let running = fake.run(node.config(cfg));
        tokio::time::sleep(Duration::from_secs(30)).await;
        running.stop().await;
    }
    let leaves = fake.with(|w| w.leaves.clone());
    assert_eq!(
        leaves.len(),
        2,
        "two leaves in five minutes of ten runs: {leaves:?}"
    );
    assert_eq!(node.state().recent_leaves_ms.len(), 2);
    // An observed hour after them, two more go.
    let running = fake.run(node.config(cfg));
    tokio::time::sleep(Duration::from_secs(3600)).await;
    running.stop().await;
    assert_eq!(fake.with(|w| w.leaves.len()), 4);
}

#[tokio::test(start_paused = true)]
async fn an_admission_that_completes_after_a_withdrawal_is_kept_unconfirmed_and_graced() {
    let node = NodeDir::new();
    let fake = Fake::default();
    world(&node, &fake, 3, 3);
    let late: GroupId = id(9);
    fake.with(|w| {
        w.assignments.insert(late);
        w.join_script = vec![Join::AdmittedAfter(5)];
    });
    let running = fake.run(node.config("leave_grace = \"30s\"\nleave_after_polls = 1"));
    // The join is sent at the first poll; MDMA withdraws the namespace two polls later.
    until_polls(&fake, 2).await;
    fake.with(|w| w.assignments.remove(&late));
    let withdrawn_from = fake.with(|w| w.polls.len());
    tokio::time::sleep(Duration::from_secs(10)).await;
    let s = node.state();
    assert!(s.admitted.contains(&late), "the admission is recorded");
    assert!(!s.confirmed.contains(&late), "but not confirmed");
    assert!(
        !fake.with(|w| w.confirms.iter().any(|(g, _)| *g == late)),
        "MDMA is not told"
    );
    while fake.with(|w| w.leaves.is_empty()) {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    running.stop().await;
    fake.with(|w| {
        let first_absent = w.polls[withdrawn_from].0;
        assert!(
            w.leaves[0].1 - first_absent >= Duration::from_secs(30),
            "left like any withdrawn namespace, after the grace"
        );
    });
}

#[tokio::test(start_paused = true)]
async fn a_retained_namespace_drops_out_of_confirmed_and_is_confirmed_again_once_reassigned() {
    let node = NodeDir::new();
    let fake = Fake::default();
    world(&node, &fake, 3, 3);
    let moved = id(3);
    fake.with(|w| {
        w.assignments.remove(&moved);
        w.retain.insert(moved);
    });
    let running = fake.run(node.config("leave_grace = \"0s\"\nleave_after_polls = 1"));
    until_polls(&fake, 5).await;
    let s = node.state();
    assert!(s.admitted.contains(&moved) && !s.confirmed.contains(&moved));
    assert!(
        fake.with(|w| w.leaves.is_empty()),
        "never left while retained"
    );
    fake.with(|w| {
        w.retain.clear();
        w.assignments.insert(moved);
    });
    until_polls(&fake, 8).await;
    running.stop().await;
    fake.with(|w| {
        assert!(
            !w.joins.iter().any(|(g, _)| *g == moved),
            "merod held it throughout: no new fleet-join"
        );
        assert!(
            w.confirms.iter().any(|(g, _)| *g == moved),
            "and confirmed again"
        );
    });
    assert!(node.state().confirmed.contains(&moved));
}
