//! Issue 8's faults, each as a kind, under tokio's paused clock with in-memory MDMA and
//! merod: join retries back off (errors and `admitted: false` alike) and no leave starts
//! while the state cannot be written.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use fleet_sidecar::daemon::Telemetry;
use fleet_sidecar::daemon::{self, Deps};
use fleet_sidecar::Config;
use fleet_sidecar::Mrtd;
use fleet_sidecar::ShouldJoin;
use fleet_sidecar::{Admission, MerodError, MerodOp, Node};
use fleet_sidecar::{ConfirmError, ControlPlane, PollError};
use fleet_sidecar::{GroupId, PeerId};
use fleet_sidecar::{State, StateStore};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::common::*;

#[derive(Clone, Copy, PartialEq, Eq)]
enum JoinAnswer {
    Admit,
    Error500,
    NotAdmitted,
}

struct World {
    assignments: BTreeSet<GroupId>,
    held: BTreeSet<GroupId>,
    join: JoinAnswer,
    joins: Vec<Instant>,
    leaves: Vec<GroupId>,
}

#[derive(Clone)]
struct Fake(Arc<Mutex<World>>);

impl Fake {
    fn new(join: JoinAnswer) -> Self {
        Self(Arc::new(Mutex::new(World {
            assignments: BTreeSet::new(),
            held: BTreeSet::new(),
            join,
            joins: Vec::new(),
            leaves: Vec::new(),
        })))
    }

    fn with<R>(&self, f: impl FnOnce(&mut World) -> R) -> R {
        f(&mut self.0.lock().unwrap())
    }
}

#[async_trait]
impl ControlPlane for Fake {
    async fn should_join(&self, _: &PeerId, _: Option<&Mrtd>) -> Result<ShouldJoin, PollError> {
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
        let answer = self.with(|w| {
            w.joins.push(Instant::now());
            w.join
        });
        match answer {
            JoinAnswer::Error500 => Err(MerodError::Call {
                op: MerodOp::FleetJoin,
                url: "http://127.0.0.1:2528/admin-api/tee/fleet-join".to_owned(),
                source: "Internal server error".into(),
            }),
            JoinAnswer::NotAdmitted => Ok(Admission {
                admitted: false,
                status: "announced".to_owned(),
                reasons: vec!["no verifier answered".to_owned()],
            }),
            JoinAnswer::Admit => {
                self.with(|w| w.held.insert(id));
                Ok(Admission {
                    admitted: true,
                    status: "joined".to_owned(),
                    reasons: Vec::new(),
                })
            }
        }
    }
    async fn leave_namespace(&self, id: GroupId) -> Result<(), MerodError> {
        self.with(|w| {
            w.leaves.push(id);
            w.held.remove(&id);
        });
        Ok(())
    }
    async fn holds_namespace(&self, id: GroupId) -> Result<bool, MerodError> {
        Ok(self.with(|w| w.held.contains(&id)))
    }
}

fn run(
    fake: &Fake,
    cfg: Config,
) -> (
    CancellationToken,
    Arc<Telemetry>,
    tokio::task::JoinHandle<()>,
) {
    let deps = Deps::new(Arc::new(fake.clone()), Arc::new(fake.clone()));
    let telemetry = Arc::clone(&deps.telemetry);
    let token = CancellationToken::new();
    let t = token.clone();
    let h = tokio::spawn(async move {
        daemon::run(cfg, deps, t).await.unwrap();
    });
    (token, telemetry, h)
}

/// Gaps between consecutive fleet-join calls.
fn gaps(joins: &[Instant]) -> Vec<Duration> {
    joins.windows(2).map(|p| p[1] - p[0]).collect()
}

/// A join that keeps failing (an error or an `admitted: false` answered at once) is retried
/// 2 s, 4 s, 8 s … up to 60 s apart (jittered down to half), not every poll.
async fn a_failing_join_backs_off(answer: JoinAnswer) {
    let node = NodeDir::new();
    let fake = Fake::new(answer);
    let c = gid(C);
    fake.with(|w| {
        w.assignments.insert(c);
    });
    let (stop, _t, h) = run(&fake, node.config(""));
    tokio::time::sleep(Duration::from_secs(600)).await;
    let joins = fake.with(|w| w.joins.clone());
    // Doubling from 2 s to 60 s: ≥ 2+2+4+8+16+30 s for the first 6 retries, then ≥ 30 s each;
    // ≤ 2+4+8+16+32 s (+1 s poll alignment each) then ≤ 61 s each.
    assert!(
        (10..=24).contains(&joins.len()),
        "{} fleet-joins in 600 s: {:?}",
        joins.len(),
        gaps(&joins)
    );
    let g = gaps(&joins);
    assert!(g[0] >= Duration::from_secs(2), "{g:?}");
    assert!(
        g[6..]
            .iter()
            .all(|d| *d >= Duration::from_secs(30) && *d <= Duration::from_secs(62)),
        "capped at 60 s, jittered: {g:?}"
    );

    // Once MDMA no longer assigns it the retry state is dropped: a new assignment starts at 2 s.
    fake.with(|w| w.assignments.clear());
    tokio::time::sleep(Duration::from_secs(5)).await;
    fake.with(|w| {
        w.assignments.insert(c);
        w.joins.clear();
    });
    tokio::time::sleep(Duration::from_secs(8)).await;
    let again = fake.with(|w| w.joins.clone());
    assert!(again.len() >= 2, "restarted at 2 s: {:?}", gaps(&again));
    assert!(
        gaps(&again)[0] <= Duration::from_secs(3),
        "{:?}",
        gaps(&again)
    );

    // A success resets it too: the state is gone, so the next failure waits 2 s again.
    fake.with(|w| w.join = JoinAnswer::Admit);
    tokio::time::sleep(Duration::from_secs(70)).await;
    assert!(fake.with(|w| w.held.contains(&c)));
    stop.cancel();
    h.await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_join_failing_with_an_error_backs_off_to_60_s() {
    a_failing_join_backs_off(JoinAnswer::Error500).await;
}

#[tokio::test(start_paused = true)]
async fn admitted_false_answered_at_once_backs_off_the_same_way() {
    a_failing_join_backs_off(JoinAnswer::NotAdmitted).await;
}

/// Replaces the state file's directory by a regular file (root cannot create a file under a
/// regular file either), returning where the directory went.
fn break_state_dir(dir: &std::path::Path) -> std::path::PathBuf {
    let aside = dir.with_extension("aside");
    std::fs::rename(dir, &aside).unwrap();
    std::fs::write(dir, b"not a directory").unwrap();
    aside
}

fn mend_state_dir(dir: &std::path::Path, aside: &std::path::Path) {
    std::fs::remove_file(dir).unwrap();
    std::fs::rename(aside, dir).unwrap();
}

#[tokio::test(start_paused = true)]
async fn no_leave_starts_while_the_state_cannot_be_written_and_readyz_says_so() {
    let node = NodeDir::new();
    let state_dir = node.dir.path().join("state");
    std::fs::create_dir(&state_dir).unwrap();
    let state_file = state_dir.join("state.json");
    let a = gid(A);
    StateStore::new(&state_file)
        .save(&State {
            admitted: [a].into(),
            confirmed: [a].into(),
            absent_polls: Default::default(),
        })
        .unwrap();
    let fake = Fake::new(JoinAnswer::Admit);
    fake.with(|w| {
        w.held.insert(a);
        w.assignments.insert(a);
    });
    let cfg = Config {
        state_file: state_file.clone(),
        ..node.config(REFERENCE)
    };
    let (stop, telemetry, h) = run(&fake, cfg);
    tokio::time::sleep(Duration::from_secs(3)).await;
    let ready = || {
        telemetry
            .snapshot()
            .readiness(fleet_sidecar::daemon::unix_now(), Duration::from_secs(30))
    };
    assert_eq!(ready(), Ok(()));

    let aside = break_state_dir(&state_dir);
    fake.with(|w| w.assignments.clear());
    tokio::time::sleep(Duration::from_secs(20)).await;
    assert!(
        fake.with(|w| w.leaves.is_empty()),
        "no irreversible leave while its outcome cannot be recorded"
    );
    let why = ready().unwrap_err();
    assert!(why.to_string().contains("state file"), "{why}");

    mend_state_dir(&state_dir, &aside);
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(
        fake.with(|w| w.leaves.clone()),
        vec![a],
        "the leave proceeds once it can be recorded"
    );
    assert_eq!(ready(), Ok(()));
    stop.cancel();
    h.await.unwrap();
    let state = StateStore::new(&state_file).load().unwrap().unwrap();
    assert!(state.admitted.is_empty(), "{state:?}");
}
