//! The jobs beside the loop (the held refresh, merod's readiness watch, join-status) never
//! decide a join or a leave and never hold up the loop: with every one of them hanging or
//! failing, the heartbeat keeps its cadence and joins still go through. Under tokio's paused
//! clock with the in-memory fakes.

use std::time::Duration;

use tokio::time::Instant;

use crate::common::*;
use crate::fakes::Fake;

/// The worst gap between two polls of `fake`, and how many there were.
fn cadence(fake: &Fake) -> (Duration, usize) {
    fake.with(|w| {
        let worst = w.polls.windows(2).map(|p| p[1].0 - p[0].0).max();
        (worst.unwrap_or_default(), w.polls.len())
    })
}

#[tokio::test(start_paused = true)]
async fn the_heartbeat_keeps_its_cadence_while_every_job_hangs_or_fails() {
    // merod does not answer at start: the readiness watch fails probe after probe, and the
    // held refresh hangs on every read.
    let node = NodeDir::new();
    let fake = Fake::default();
    let a = id(1);
    fake.with(|w| {
        w.assignments.insert(a);
        w.merod_down = true;
        w.list_hangs = true;
        w.join_status_hangs = true;
    });
    let running = fake.run(node.config(""));
    tokio::time::sleep(Duration::from_secs(120)).await;
    let (worst, polls) = cadence(&fake);
    assert!(polls >= 118, "{polls} polls in 120 s");
    assert!(worst <= Duration::from_millis(1001), "worst gap {worst:?}");
    assert!(
        fake.with(|w| w.joins.is_empty()),
        "no join before merod answers"
    );

    // merod answers; its list and MDMA's join-status still hang: A is joined and confirmed
    // all the same, and the heartbeat never missed a beat.
    fake.with(|w| w.merod_down = false);
    let t = Instant::now();
    while !node.state().confirmed.contains(&a) {
        assert!(t.elapsed() < Duration::from_secs(60), "A not confirmed");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_secs(120)).await;
    running.stop().await;
    let (worst, polls) = cadence(&fake);
    assert!(worst <= Duration::from_millis(1001), "worst gap {worst:?}");
    assert!(polls >= 238, "{polls} polls");
    fake.with(|w| {
        assert!(!w.join_statuses.is_empty(), "join-status was tried");
        assert!(w.violations.is_empty(), "{:?}", w.violations);
    });
}
