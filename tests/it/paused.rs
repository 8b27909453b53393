//! Time-based rules under tokio's paused clock, with in-memory MDMA and merod: minutes of
//! daemon time run in milliseconds, and no test sleeps for real.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use fleet_sidecar::config::Config;
use fleet_sidecar::daemon::{self, Deps};
use fleet_sidecar::ids::{GroupId, PeerId};
use fleet_sidecar::mdma::ShouldJoin;
use fleet_sidecar::mdma::{ConfirmError, ControlPlane, PollError, RequestError};
use fleet_sidecar::merod::{Admission, MerodError, MerodOp, Node};
use fleet_sidecar::mrtd::Mrtd;
use fleet_sidecar::state::{State, StateStore};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::common::*;

#[derive(Default)]
struct World {
    assignments: BTreeSet<GroupId>,
    held: BTreeSet<GroupId>,
    hang_joins: BTreeSet<GroupId>,
    mdma_down: bool,
    polls: Vec<(Instant, Option<String>)>,
    joins: Vec<(GroupId, Instant)>,
    leaves: Vec<(GroupId, Instant)>,
}

#[derive(Clone, Default)]
struct Fake(Arc<Mutex<World>>);

impl Fake {
    fn with<R>(&self, f: impl FnOnce(&mut World) -> R) -> R {
        f(&mut self.0.lock().unwrap())
    }
}

#[async_trait]
impl ControlPlane for Fake {
    async fn should_join(&self, _: &PeerId, mrtd: Option<&Mrtd>) -> Result<ShouldJoin, PollError> {
        if self.with(|w| {
            w.polls.push((Instant::now(), mrtd.map(Mrtd::to_hex)));
            w.mdma_down
        }) {
            return Err(RequestError::Status {
                url: url::Url::parse("https://mdma.test/api/fleet/should-join").unwrap(),
                status: 503,
            }
            .into());
        }
        Ok(self.with(|w| ShouldJoin {
            assignments: w.assignments.clone(),
            retain: BTreeSet::new(),
        }))
    }
    async fn confirm(&self, _: &PeerId, _: GroupId) -> Result<(), ConfirmError> {
        Ok(())
    }
}

#[async_trait]
impl Node for Fake {
    async fn probe(&self) -> Result<(), MerodError> {
        Ok(())
    }
    async fn fleet_join(&self, id: GroupId) -> Result<Admission, MerodError> {
        let hang = self.with(|w| {
            w.joins.push((id, Instant::now()));
            w.hang_joins.contains(&id)
        });
        if hang {
            std::future::pending::<()>().await;
        }
        self.with(|w| w.held.insert(id));
        Ok(Admission {
            admitted: true,
            status: "joined".to_owned(),
            reasons: Vec::new(),
        })
    }
    async fn leave_namespace(&self, id: GroupId) -> Result<(), MerodError> {
        self.with(|w| {
            w.leaves.push((id, Instant::now()));
            w.held.remove(&id);
        });
        Ok(())
    }
    async fn holds_namespace(&self, id: GroupId) -> Result<bool, MerodError> {
        Ok(self.with(|w| w.held.contains(&id)))
    }
}

struct Node0 {
    node: NodeDir,
}

impl Node0 {
    fn new() -> Self {
        Self {
            node: NodeDir::new(),
        }
    }

    fn config(&self, extra: &str) -> Config {
        self.node.config(extra)
    }

    fn seed(&self, held: &BTreeSet<GroupId>) {
        let state = State {
            admitted: held.clone(),
            confirmed: held.clone(),
            absent_polls: Default::default(),
        };
        StateStore::new(self.node.state_file())
            .save(&state)
            .unwrap();
    }

    fn state(&self) -> State {
        if let Ok(bytes) = std::fs::read(self.node.state_file()) {
            crate::schema::assert_state_valid(&bytes);
        }
        StateStore::new(self.node.state_file())
            .load()
            .unwrap()
            .unwrap_or_default()
    }
}

fn ids(n: u8) -> BTreeSet<GroupId> {
    (1..=n).map(|i| GroupId::from_bytes([i; 32])).collect()
}

fn run(fake: &Fake, cfg: Config) -> (CancellationToken, tokio::task::JoinHandle<()>) {
    let deps = Deps::new(Arc::new(fake.clone()), Arc::new(fake.clone()));
    let token = CancellationToken::new();
    let t = token.clone();
    let h = tokio::spawn(async move {
        daemon::run(cfg, deps, t).await.unwrap();
    });
    (token, h)
}

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
    let nodes: Vec<(Node0, Fake)> = (0..20).map(|_| (Node0::new(), Fake::default())).collect();
    let start = Instant::now();
    let running: Vec<_> = nodes
        .iter()
        .map(|(node, fake)| run(fake, node.config("")))
        .collect();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    for (stop, h) in running {
        stop.cancel();
        h.await.unwrap();
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
    let node = Node0::new();
    let fake = Fake::default();
    let a = gid(A);
    fake.with(|w| {
        w.assignments.insert(a);
        w.hang_joins.insert(a);
    });
    let start = Instant::now();
    let (stop, h) = run(&fake, node.config(""));
    tokio::time::sleep(Duration::from_secs(200)).await;
    stop.cancel();
    h.await.unwrap();
    fake.with(|w| {
        let joins: Vec<Duration> = w.joins.iter().map(|(_, t)| *t - start).collect();
        assert!(joins.len() >= 2, "{joins:?}");
        let gap = joins[1] - joins[0];
        assert!(
            gap >= Duration::from_secs(90) && gap <= Duration::from_secs(95),
            "retried after the 90 s deadline (+ backoff): {joins:?}"
        );
        // The heartbeat never stalled: one poll a second throughout.
        assert!(w.polls.len() >= 198, "{} polls in 200 s", w.polls.len());
        let worst = w.polls.windows(2).map(|p| p[1].0 - p[0].0).max().unwrap();
        assert!(worst <= Duration::from_millis(1001), "worst gap {worst:?}");
    });
}

#[tokio::test(start_paused = true)]
async fn a_mass_drop_waits_the_full_default_hold_then_leaves_rate_limited() {
    let node = Node0::new();
    let fake = Fake::default();
    let all = ids(25);
    node.seed(&all);
    let keep = GroupId::from_bytes([1; 32]);
    fake.with(|w| {
        w.held = all.clone();
        w.assignments = [keep].into();
    });
    let start = Instant::now();
    let (stop, h) = run(&fake, node.config(""));
    tokio::time::sleep(Duration::from_secs(599)).await;
    assert!(
        fake.with(|w| w.leaves.is_empty()),
        "nothing left during the 10 min hold"
    );
    tokio::time::sleep(Duration::from_secs(200)).await;
    stop.cancel();
    h.await.unwrap();
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

#[tokio::test(start_paused = true)]
async fn absence_counts_survive_a_restart() {
    let node = Node0::new();
    let fake = Fake::default();
    let (a, b) = (gid(A), gid(B));
    node.seed(&[a, b].into());
    fake.with(|w| {
        w.held = [a, b].into();
        w.assignments = [a].into();
    });
    let (stop, h) = run(&fake, node.config("leave_after_polls = 3"));
    until_polls(&fake, 2).await;
    stop.cancel();
    h.await.unwrap();
    assert_eq!(node.state().absent_polls.get(&b), Some(&2));
    assert!(fake.with(|w| w.leaves.is_empty()));
    let (stop, h) = run(&fake, node.config("leave_after_polls = 3"));
    until_polls(&fake, 3).await; // the third poll overall
    stop.cancel();
    h.await.unwrap();
    assert_eq!(
        fake.with(|w| w.leaves.len()),
        1,
        "left on the third poll overall"
    );
    assert!(!node.state().admitted.contains(&b));
}

#[tokio::test(start_paused = true)]
async fn an_mrtd_that_appears_later_is_picked_up_within_minutes() {
    let node = Node0::new();
    let fake = Fake::default();
    let start = Instant::now();
    let (stop, h) = run(&fake, node.config(""));
    tokio::time::sleep(Duration::from_secs(10)).await;
    // A later module load makes the attribute appear.
    std::fs::write(node.node.dir.path().join("none"), [7u8; 48]).unwrap();
    tokio::time::sleep(Duration::from_secs(300)).await;
    stop.cancel();
    h.await.unwrap();
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
    let node = Node0::new();
    let fake = Fake::default();
    fake.with(|w| w.mdma_down = true);
    let (stop, h) = run(&fake, node.config(""));
    tokio::time::sleep(Duration::from_secs(120)).await;
    fake.with(|w| w.mdma_down = false);
    let recovered = fake.with(|w| w.polls.len());
    tokio::time::sleep(Duration::from_secs(30)).await;
    stop.cancel();
    h.await.unwrap();
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
    struct Down;
    #[async_trait]
    impl Node for Down {
        async fn probe(&self) -> Result<(), MerodError> {
            Err(MerodError::Call {
                op: MerodOp::Peers,
                url: "http://127.0.0.1:2528/admin-api/peers".into(),
                source: "connection refused".into(),
            })
        }
        async fn fleet_join(&self, _: GroupId) -> Result<Admission, MerodError> {
            unreachable!("never called while merod is down")
        }
        async fn leave_namespace(&self, _: GroupId) -> Result<(), MerodError> {
            unreachable!("never called while merod is down")
        }
        async fn holds_namespace(&self, _: GroupId) -> Result<bool, MerodError> {
            unreachable!("never called while merod is down")
        }
    }
    let telemetry = fleet_sidecar::telemetry::Telemetry::new();
    let started = Instant::now();
    let r = daemon::wait_for_merod(
        &Down,
        &telemetry,
        &CancellationToken::new(),
        Some(daemon::ONCE_MEROD_WAIT),
    )
    .await;
    assert!(
        matches!(r, daemon::Readiness::GaveUp(ref last) if last.contains("connection refused")),
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
        "each probe is a heartbeat"
    );
}
