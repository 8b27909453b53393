//! What merod holds, as the loop learns it, under tokio's paused clock with the in-memory
//! MDMA and merod: `held_namespaces` in the polls, and a namespace the state records as held
//! that merod no longer holds.

use std::time::Duration;

use tokio::time::Instant;

use crate::common::*;
use crate::fakes::Fake;

/// The `held_namespaces` of the latest poll.
fn last_report(fake: &Fake) -> Option<Vec<fleet_sidecar::GroupId>> {
    fake.with(|w| w.held_reported.last().cloned().flatten())
}

#[tokio::test(start_paused = true)]
async fn polls_carry_what_merod_holds_sorted_and_refreshed_after_a_join() {
    let node = NodeDir::new();
    let fake = Fake::default();
    // merod holds C (unknown to the state: an orphan) and nothing else yet.
    fake.with(|w| {
        w.held.insert(id(3));
        w.assignments.insert(id(1));
    });
    let running = fake.run(node.config(""));
    tokio::time::sleep(Duration::from_secs(20)).await;
    let reports = fake.with(|w| w.held_reported.clone());
    running.stop().await;
    // The first read is made at start: the report is there from the first polls on, and
    // after A's join (a refresh is asked for at each outcome) it holds both, sorted.
    assert!(
        reports
            .iter()
            .take(3)
            .any(|r| r.as_deref() == Some(&[id(3)][..])),
        "{reports:?}"
    );
    assert_eq!(reports.last().cloned().flatten(), Some(vec![id(1), id(3)]));
    // Never an empty list in place of an unknown one: every report is a whole read.
    assert!(
        reports.iter().flatten().all(|r| !r.is_empty()),
        "{reports:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_failed_read_leaves_the_field_out_and_an_empty_merod_reports_an_empty_list() {
    let node = NodeDir::new();
    let fake = Fake::default();
    let running = fake.run(node.config(""));
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert_eq!(
        last_report(&fake),
        Some(Vec::new()),
        "[] means merod holds nothing"
    );
    // merod stops answering: from the next read on (every 60 s), the field is absent.
    fake.with(|w| w.merod_down = true);
    tokio::time::sleep(Duration::from_secs(61)).await;
    let reports = fake.with(|w| w.held_reported.clone());
    running.stop().await;
    assert_eq!(reports.last(), Some(&None), "absent after a failed read");
    let n = reports.len();
    assert!(
        reports[n - 5..].iter().all(Option::is_none),
        "never the old list after a failed read: {:?}",
        &reports[n - 5..]
    );
}

#[tokio::test(start_paused = true)]
async fn more_than_512_held_namespaces_are_not_reported() {
    let node = NodeDir::new();
    let fake = Fake::default();
    fake.with(|w| {
        for i in 0..513u16 {
            let mut b = [7u8; 32];
            b[..2].copy_from_slice(&i.to_be_bytes());
            w.held.insert(fleet_sidecar::GroupId::from_bytes(b));
        }
    });
    let running = fake.run(node.config(""));
    tokio::time::sleep(Duration::from_secs(10)).await;
    let reports = fake.with(|w| w.held_reported.clone());
    running.stop().await;
    assert!(reports.len() >= 5, "{} polls", reports.len());
    assert!(
        reports.iter().all(Option::is_none),
        "a cut list is never sent"
    );
}

#[tokio::test(start_paused = true)]
async fn a_namespace_merod_no_longer_holds_is_joined_again_within_minutes_and_reported() {
    let node = NodeDir::new();
    let (a, b) = (id(1), id(2));
    // The state says A and B are held and confirmed (a restored snapshot); merod holds only B.
    node.seed(&[a, b].into(), &[a, b].into());
    let fake = Fake::default();
    fake.with(|w| {
        w.assignments = [a, b].into();
        w.held.insert(b);
    });
    let start = Instant::now();
    let running = fake.run(node.config(""));
    tokio::time::sleep(Duration::from_secs(240)).await;
    let metrics = running.telemetry.encode_metrics();
    running.stop().await;
    let joins = fake.with(|w| w.joins.clone());
    // Found by the held refresh (missing from two reads a minute apart, then merod asked),
    // and joined again: within a few minutes, not never.
    let rejoin = joins
        .iter()
        .find(|(id, _)| *id == a)
        .map(|(_, t)| *t - start)
        .expect("A joined again");
    assert!(
        rejoin <= Duration::from_secs(180),
        "joined again after {rejoin:?}"
    );
    assert!(
        joins.iter().all(|(id, _)| *id == a),
        "B was never touched: {joins:?}"
    );
    assert!(fake.with(|w| w.held.contains(&a)));
    let state = node.state();
    assert!(
        state.confirmed.contains(&a) && state.confirmed.contains(&b),
        "{state:?}"
    );
    assert_eq!(
        metric(&metrics, "fleet_sidecar_held_drift_total"),
        1.0,
        "{metrics}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_namespace_missing_from_the_list_but_held_when_asked_is_kept() {
    let node = NodeDir::new();
    let a = id(1);
    node.seed(&[a].into(), &[a].into());
    let fake = Fake::default();
    fake.with(|w| {
        w.assignments = [a].into();
        w.held.insert(a);
        // The list lags (read-after-write): it never shows A, but asking about A says held.
        w.list_hides.insert(a);
    });
    let running = fake.run(node.config(""));
    tokio::time::sleep(Duration::from_secs(240)).await;
    running.stop().await;
    assert!(fake.with(|w| w.joins.is_empty()), "nothing joined again");
    assert!(
        node.state().confirmed.contains(&a),
        "never dropped without merod saying so"
    );
}

/// merod's holdings for the orphans come from the held refresh, not only from a
/// read at start. merod holds nothing unexplained at start; an operator joins C by hand
/// afterwards (nothing of ours asks for a read): the next refresh reports it.
#[tokio::test(start_paused = true)]
async fn an_orphan_that_appears_after_start_is_reported_within_a_refresh() {
    let node = NodeDir::new();
    let (a, c) = (id(1), id(3));
    node.seed(&[a].into(), &[a].into());
    let fake = Fake::default();
    fake.with(|w| {
        w.assignments = [a].into();
        w.held.insert(a);
    });
    let running = fake.run(node.config(""));
    tokio::time::sleep(Duration::from_secs(20)).await;
    assert!(running.telemetry.snapshot().orphans.is_empty());
    fake.with(|w| w.held.insert(c));
    // The refresh reads every 60 s; the poll after that read finds the orphan.
    tokio::time::sleep(Duration::from_secs(60 + 35)).await;
    let status = running.telemetry.snapshot();
    let metrics = running.telemetry.encode_metrics();
    running.stop().await;
    assert_eq!(status.orphans, vec![c], "reported within a refresh");
    assert_eq!(metric(&metrics, "fleet_sidecar_orphan_namespaces"), 1.0);
    fake.with(|w| {
        assert!(w.leaves.is_empty(), "never touched: {:?}", w.leaves);
        assert!(w.held.contains(&c));
    });
    assert!(
        !node.state().admitted.contains(&c),
        "not taken into the state"
    );
}

/// With `leave_orphans = true`, an orphan that appears after start, found by the
/// refresh, is taken as admitted and left like any withdrawn namespace: only once
/// `leave_grace` of absence was observed.
#[tokio::test(start_paused = true)]
async fn with_leave_orphans_an_orphan_that_appears_after_start_is_left_only_after_the_grace() {
    let node = NodeDir::new();
    let (a, c) = (id(1), id(3));
    node.seed(&[a].into(), &[a].into());
    let fake = Fake::default();
    fake.with(|w| {
        w.assignments = [a].into();
        w.held.insert(a);
    });
    let running = fake.run(node.config(
        "leave_orphans = true\nleave_after_polls = 1\nleave_grace = \"300s\"\nmass_drop_min = 1000",
    ));
    tokio::time::sleep(Duration::from_secs(20)).await;
    fake.with(|w| w.held.insert(c));
    let mut found = None;
    for _ in 0..200 {
        tokio::time::sleep(Duration::from_secs(1)).await;
        if node.state().admitted.contains(&c) {
            found = Some(Instant::now());
            break;
        }
    }
    let found = found.expect("the orphan was taken as admitted after a refresh");
    // Within the grace: held, not left.
    tokio::time::sleep(Duration::from_secs(240)).await;
    assert!(
        fake.with(|w| w.leaves.is_empty()),
        "left before leave_grace"
    );
    tokio::time::sleep(Duration::from_secs(120)).await;
    running.stop().await;
    fake.with(|w| {
        let left: Vec<_> = w.leaves.iter().map(|(id, t)| (*id, *t)).collect();
        assert_eq!(left.len(), 1, "{left:?}");
        assert_eq!(left[0].0, c);
        assert!(
            left[0].1 - found >= Duration::from_secs(298),
            "left {:?} after it was found",
            left[0].1 - found
        );
        assert!(w.violations.is_empty(), "{:?}", w.violations);
        assert!(w.joins.is_empty());
    });
    assert!(!node.state().admitted.contains(&c));
}

#[tokio::test(start_paused = true)]
async fn each_poll_says_which_namespaces_are_joined_so_their_addresses_are_not_kept() {
    let node = NodeDir::new();
    let (a, b, c) = (id(1), id(2), id(3));
    node.seed(&[a, b].into(), &[a, b].into());
    let fake = Fake::default();
    fake.with(|w| {
        w.assignments = [a, b, c].into();
        w.held.extend([a, b]);
    });
    let running = fake.run(node.config(""));
    tokio::time::sleep(Duration::from_secs(10)).await;
    running.stop().await;
    let said = fake.with(|w| w.joined_said.clone());
    // The confirmed ones, as they are at each poll: C once its join is confirmed.
    assert_eq!(said.first(), Some(&Some([a, b].into())), "{said:?}");
    assert_eq!(said.last(), Some(&Some([a, b, c].into())), "{said:?}");
}
