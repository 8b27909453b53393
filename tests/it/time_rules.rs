//! Time-based rules under tokio's paused clock, with in-memory MDMA and merod: minutes of
//! daemon time run in milliseconds, and no test sleeps for real.

use std::collections::BTreeSet;
use std::time::Duration;

use fleet_sidecar::daemon;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::common::*;
use crate::fakes::{Fake, Join};

/// Sleeps until `fake` has been polled `n` times in all, then 10 ms more: that cycle ends
/// without the clock moving (every fake answers at once), so it is persisted by then.
async fn until_polls(fake: &Fake, n: usize) {
    while fake.with(|w| w.polls.len()) < n {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(10)).await;
}

#[tokio::test(start_paused = true)]
async fn a_fleet_started_at_the_same_instant_does_not_poll_in_lock_step() {
    // Twenty nodes start together; each first poll waits a random part of one interval.
    let nodes: Vec<(NodeDir, Fake)> = (0..20).map(|_| (NodeDir::new(), Fake::default())).collect();
    let start = Instant::now();
    let running: Vec<_> = nodes
        .iter()
        .map(|(node, fake)| fake.run(node.config("")))
        .collect();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    for r in running {
        r.stop().await;
    }
    let first: BTreeSet<Duration> = nodes
        .iter()
        .map(|(_, fake)| fake.with(|w| w.polls.first().expect("each node polled").0 - start))
        .collect();
    assert!(
        first.iter().all(|t| *t <= Duration::from_secs(1)),
        "every first poll within one interval of the start: {first:?}"
    );
    let windows: BTreeSet<u128> = first.iter().map(|t| t.as_millis() / 100).collect();
    assert!(
        windows.len() >= 4,
        "first polls spread over the interval, not at one instant: {first:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_join_that_never_returns_is_abandoned_at_its_deadline_and_retried() {
    let node = NodeDir::new();
    let fake = Fake::default();
    let a = gid(A);
    fake.with(|w| {
        w.assignments.insert(a);
        w.join_script = vec![Join::Hang];
    });
    let start = Instant::now();
    let running = fake.run(node.config(""));
    tokio::time::sleep(Duration::from_secs(200)).await;
    running.stop().await;
    fake.with(|w| {
        let joins: Vec<Duration> = w.joins.iter().map(|(_, t)| *t - start).collect();
        assert!(joins.len() >= 2, "{joins:?}");
        let gap = joins[1] - joins[0];
        // 180 s by default: merod's own client gives a fleet-join that long.
        assert!(
            gap >= Duration::from_secs(180) && gap <= Duration::from_secs(185),
            "retried after the 180 s deadline (+ backoff): {joins:?}"
        );
        // The heartbeat never stalled: one poll a second throughout.
        assert!(w.polls.len() >= 198, "{} polls in 200 s", w.polls.len());
        let worst = w.polls.windows(2).map(|p| p[1].0 - p[0].0).max().unwrap();
        assert!(worst <= Duration::from_millis(1001), "worst gap {worst:?}");
    });
}

#[tokio::test(start_paused = true)]
async fn a_mass_drop_waits_the_full_hold_then_leaves_rate_limited() {
    let node = NodeDir::new();
    let fake = Fake::default();
    let all = ids(25);
    node.seed(&all, &all);
    let keep = id(1);
    fake.with(|w| {
        w.held = all.clone();
        w.assignments = [keep].into();
    });
    let start = Instant::now();
    // The defaults' 24 h hold is pinned in leave_policy.rs; here a 10 min one, no grace
    // and no hourly limit, to see the per-minute limit.
    let running = fake.run(
        node.config("mass_drop_hold = \"10m\"\nleave_grace = \"0s\"\nmax_leaves_per_hour = 1000"),
    );
    tokio::time::sleep(Duration::from_secs(599)).await;
    assert!(
        fake.with(|w| w.leaves.is_empty()),
        "nothing left during the 10 min hold"
    );
    tokio::time::sleep(Duration::from_secs(200)).await;
    running.stop().await;
    fake.with(|w| {
        assert_eq!(
            w.leaves.len(),
            24,
            "the withdrawal persisted: every one left"
        );
        let at: Vec<u64> = w
            .leaves
            .iter()
            .map(|(_, t)| (*t - start).as_secs())
            .collect();
        assert!(at.iter().all(|s| *s >= 600), "{at:?}");
        for window in 600..800 {
            let n = at
                .iter()
                .filter(|s| **s >= window && **s < window + 60)
                .count();
            assert!(
                n <= 10,
                "at most 10 leaves a minute, {n} from {window}s: {at:?}"
            );
        }
    });
    assert_eq!(node.state().admitted, [keep].into());
}

/// MDMA withdraws everything (the hold starts), is down for 40 s, then withdraws the same
/// again: the outage is not observed time, so the 30 s hold still needs about 26 s of
/// successful polls after MDMA is back (4 s were observed before the outage).
#[tokio::test(start_paused = true)]
async fn an_mdma_outage_does_not_complete_the_mass_withdrawal_hold() {
    let node = NodeDir::new();
    let fake = Fake::default();
    let all = ids(3);
    node.seed(&all, &all);
    fake.with(|w| w.held = all.clone());
    let running = fake.run(node.config(
        "mass_drop_hold = \"30s\"\nleave_grace = \"0s\"\nleave_after_polls = 1\nmax_leaves_per_hour = 1000",
    ));
    until_polls(&fake, 1).await;
    tokio::time::sleep(Duration::from_secs(4)).await;
    fake.with(|w| w.mdma_down = true);
    tokio::time::sleep(Duration::from_secs(40)).await;
    fake.with(|w| w.mdma_down = false);
    let back = fake.with(|w| w.polls.len());
    let back_at = Instant::now();
    tokio::time::sleep(Duration::from_secs(60)).await;
    running.stop().await;
    fake.with(|w| {
        assert_eq!(
            w.leaves.len(),
            3,
            "the withdrawal persisted: every one left"
        );
        // The first answer after the outage, and when the leaves came after it.
        let first_good = w.polls[back].0;
        assert!(first_good - back_at <= Duration::from_secs(10));
        for (id, at) in &w.leaves {
            assert!(
                *at - first_good >= Duration::from_secs(25),
                "{id} left {:?} after MDMA came back: the outage counted toward the hold",
                *at - first_good
            );
        }
    });
}

#[tokio::test(start_paused = true)]
async fn absence_counts_survive_a_restart() {
    let node = NodeDir::new();
    let fake = Fake::default();
    let (a, b) = (gid(A), gid(B));
    node.seed(&[a, b].into(), &[a, b].into());
    fake.with(|w| {
        w.held = [a, b].into();
        w.assignments = [a].into();
    });
    let cfg = "leave_after_polls = 3\nleave_grace = \"0s\"";
    let running = fake.run(node.config(cfg));
    until_polls(&fake, 2).await;
    running.stop().await;
    assert_eq!(node.state().absent.get(&b).map(|a| a.polls), Some(2));
    assert!(fake.with(|w| w.leaves.is_empty()));
    let running = fake.run(node.config(cfg));
    until_polls(&fake, 3).await; // the third poll overall
    running.stop().await;
    assert_eq!(
        fake.with(|w| w.leaves.len()),
        1,
        "left on the third poll overall"
    );
    assert!(!node.state().admitted.contains(&b));
}

#[tokio::test(start_paused = true)]
async fn an_mrtd_that_appears_later_is_picked_up_within_minutes() {
    let node = NodeDir::new();
    let fake = Fake::default();
    let start = Instant::now();
    let running = fake.run(node.config(""));
    tokio::time::sleep(Duration::from_secs(10)).await;
    // A later module load makes the attribute appear.
    std::fs::write(node.dir.path().join("none"), [7u8; 48]).unwrap();
    tokio::time::sleep(Duration::from_secs(300)).await;
    running.stop().await;
    let want = "07".repeat(48);
    fake.with(|w| {
        let first = w
            .polls
            .iter()
            .position(|(_, m)| m.as_deref() == Some(want.as_str()))
            .expect("the MRTD reached a poll");
        assert!(
            w.polls[..first].iter().all(|(_, m)| m.is_none()),
            "PeerId only before"
        );
        assert!(w.polls[first..]
            .iter()
            .all(|(_, m)| m.as_deref() == Some(want.as_str())));
        let at = w.polls[first].0 - start;
        assert!(
            at <= Duration::from_secs(302),
            "picked up by the 5-minute retry: {at:?}"
        );
    });
}

#[tokio::test(start_paused = true)]
async fn failed_polls_back_off_with_jitter_and_the_cadence_returns() {
    let node = NodeDir::new();
    let fake = Fake::default();
    fake.with(|w| w.mdma_down = true);
    let running = fake.run(node.config(""));
    tokio::time::sleep(Duration::from_secs(120)).await;
    fake.with(|w| w.mdma_down = false);
    let recovered = fake.with(|w| w.polls.len());
    tokio::time::sleep(Duration::from_secs(30)).await;
    running.stop().await;
    fake.with(|w| {
        let gaps: Vec<f64> = w
            .polls
            .windows(2)
            .map(|p| (p[1].0 - p[0].0).as_secs_f64())
            .collect();
        let outage = &gaps[..recovered - 1];
        assert!(
            outage.len() < 40,
            "backed off: {} polls in 120 s",
            outage.len() + 1
        );
        assert!(
            outage.iter().all(|g| *g >= 1.0 && *g <= 10.0 + 1e-6),
            "{outage:?}"
        );
        let late = &outage[5..];
        assert!(
            late.iter().all(|g| *g >= 5.0),
            "capped backoff waits 5..10 s: {late:?}"
        );
        let distinct: BTreeSet<u64> = late.iter().map(|g| (g * 1000.0) as u64).collect();
        assert!(
            distinct.len() > late.len() / 2,
            "jittered, not lockstep: {late:?}"
        );
        // The first successful poll resets the cadence to 1 s.
        let after = &gaps[recovered..];
        assert!(after.len() >= 15, "{after:?}");
        assert!(after.iter().all(|g| (*g - 1.0).abs() < 1e-3), "{after:?}");
    });
}

#[tokio::test(start_paused = true)]
async fn the_wait_for_merod_can_be_bounded() {
    let down = Fake::default();
    down.with(|w| w.merod_down = true);
    let telemetry = fleet_sidecar::daemon::Telemetry::new();
    let started = Instant::now();
    let r = daemon::wait_for_merod(
        &down,
        &telemetry,
        &CancellationToken::new(),
        Some(daemon::ONCE_MEROD_WAIT),
    )
    .await;
    assert!(
        matches!(r, daemon::Readiness::GaveUp(ref last) if last.to_string().contains("connection refused")),
        "{r:?}"
    );
    let waited = started.elapsed();
    assert!(
        waited >= daemon::ONCE_MEROD_WAIT
            && waited <= daemon::ONCE_MEROD_WAIT + Duration::from_secs(2),
        "{waited:?}"
    );
    assert!(
        telemetry.snapshot().heartbeats >= 59,
        "a heartbeat every second of the wait"
    );
    // Probes back off: 1, 2, 4 s, then every 5 s (0+1+3+7+12+…+57 s: 14 in 60 s, not 60).
    let probes = down.with(|w| w.probes);
    assert!((12..=16).contains(&probes), "{probes} probes in 60 s");
    assert!(
        down.with(|w| w.joins.is_empty() && w.leaves.is_empty()),
        "nothing but probes while merod is down"
    );
}

/// The loop turns at least once a second (the watchdog's sign of life) but, at a 1 s
/// `poll_interval`, the polls are those turns: no second timer wakes an idle daemon between
/// them (the idle cycle's CPU is mostly wake-ups).
#[tokio::test(start_paused = true)]
async fn an_idle_loop_turns_once_a_second_and_its_polls_are_those_turns() {
    use std::sync::atomic::Ordering;
    for (interval, secs) in [("1s", 30u64), ("10s", 30)] {
        let node = NodeDir::new();
        let fake = Fake::default();
        let running = fake.run(node.config(&format!("poll_interval = \"{interval}\"")));
        // Past the start-up (first poll within min(interval, 5 s)).
        tokio::time::sleep(Duration::from_secs(6)).await;
        let (turns0, polls0) = (
            running.telemetry.loop_turns.load(Ordering::Relaxed),
            fake.with(|w| w.polls.len()),
        );
        tokio::time::sleep(Duration::from_secs(secs)).await;
        let turns = running.telemetry.loop_turns.load(Ordering::Relaxed) - turns0;
        let polls = (fake.with(|w| w.polls.len()) - polls0) as u64;
        running.stop().await;
        assert!(
            turns >= secs - 1,
            "{interval}: at least one turn a second: {turns} in {secs} s"
        );
        if interval == "1s" {
            assert!(
                turns <= polls + 1,
                "{interval}: a turn per poll, no wake-up of its own: {turns} turns, {polls} polls"
            );
        } else {
            assert!(turns <= secs + 1, "{interval}: {turns} turns in {secs} s");
        }
    }
}

/// Counts the spans created and events recorded at `info` and above.
#[derive(Clone, Default)]
struct InfoCount {
    spans: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    events: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for InfoCount {
    fn on_new_span(
        &self,
        _: &tracing::span::Attributes<'_>,
        _: &tracing::span::Id,
        _: tracing_subscriber::layer::Context<'_, S>,
    ) {
        self.spans
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    fn on_event(&self, _: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        self.events
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
}

/// An idle poll (nothing changed) logs nothing and opens no span at the default level, so
/// the log subscriber does no work for it (no log line when nothing changed).
#[tokio::test(start_paused = true)]
async fn an_idle_poll_logs_nothing_and_opens_no_span_at_info() {
    use std::sync::atomic::Ordering;
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::Layer;
    let count = InfoCount::default();
    let _scope = tracing::subscriber::set_default(
        tracing_subscriber::registry().with(
            count
                .clone()
                .with_filter(tracing::level_filters::LevelFilter::INFO),
        ),
    );
    let node = NodeDir::new();
    let fake = Fake::default();
    let a = gid(A);
    node.seed(&[a].into(), &[a].into());
    fake.with(|w| {
        w.assignments.insert(a);
        w.held.insert(a);
    });
    let running = fake.run(node.config(""));
    until_polls(&fake, 2).await;
    let (spans, events) = (
        count.spans.load(Ordering::Relaxed),
        count.events.load(Ordering::Relaxed),
    );
    assert!(
        events > 0,
        "start-up is logged (the counter sees the loop's events)"
    );
    let polls = fake.with(|w| w.polls.len());
    tokio::time::sleep(Duration::from_secs(20)).await;
    assert!(fake.with(|w| w.polls.len()) >= polls + 19);
    assert_eq!(
        count.spans.load(Ordering::Relaxed),
        spans,
        "spans opened by idle polls"
    );
    assert_eq!(
        count.events.load(Ordering::Relaxed),
        events,
        "lines logged by idle polls"
    );
    running.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_join_waiting_for_a_slot_is_not_sent_once_the_latest_poll_withdrew_it() {
    // One join slot: the first join hangs (until its 90 s deadline), the second waits.
    let node = NodeDir::new();
    let fake = Fake::default();
    fake.with(|w| {
        w.assignments.extend([id(1), id(2)]);
        w.join_script = vec![Join::Hang, Join::Admitted];
    });
    // No leave grace: the withdrawn joining namespace is dropped within the test's 100 s.
    let running = fake
        .run(node.config("max_concurrent_joins = 1\nleave_grace = \"0s\"\njoin_timeout = \"90s\""));
    tokio::time::sleep(Duration::from_secs(5)).await;
    let (first, waiting) = fake.with(|w| {
        assert_eq!(w.joins.len(), 1, "one slot: {:?}", w.joins);
        let first = w.joins[0].0;
        (first, if first == id(1) { id(2) } else { id(1) })
    });
    // MDMA withdraws the waiting one; polls go on while the first join hangs.
    fake.with(|w| w.assignments.remove(&waiting));
    tokio::time::sleep(Duration::from_secs(100)).await;
    running.stop().await;
    fake.with(|w| {
        assert!(
            w.joins.iter().all(|(g, _)| *g != waiting),
            "a join the latest poll withdrew was sent when its slot came free: {:?}",
            w.joins
        );
        // The slot did come free: the first join was abandoned and sent again.
        assert!(
            w.joins.iter().filter(|(g, _)| *g == first).count() >= 2,
            "{:?}",
            w.joins
        );
        assert!(w.violations.is_empty(), "{:?}", w.violations);
    });
    assert!(
        !node.state().joining.contains(&waiting),
        "dropped after merod said it does not hold it"
    );
}
