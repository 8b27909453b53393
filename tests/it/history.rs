//! Property test of the real loop (daemon.rs + reconcile.rs) under tokio's paused clock:
//! random sequences of poll outcomes (good with random sets, failed of each kind, hung),
//! join outcomes (admitted, not admitted, error, hang), confirm outcomes and leave outcomes.
//!
//! Invariants: no leave follows a failed poll; nothing in the latest successful poll's
//! assignments or `retain` is ever left; confirmed ⊆ admitted in the persisted state; and
//! once polls are good and stable, every namespace merod admitted that MDMA no longer
//! assigns is eventually left.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use fleet_sidecar::daemon::{self, Deps};
use fleet_sidecar::Mrtd;
use fleet_sidecar::ShouldJoin;
use fleet_sidecar::StateStore;
use fleet_sidecar::{parse_should_join, ConfirmError, ControlPlane, PollError, RequestError};
use fleet_sidecar::{Admission, MerodError, MerodOp, Node};
use fleet_sidecar::{GroupId, PeerId};
use proptest::prelude::*;
use tokio_util::sync::CancellationToken;

use crate::common::NodeDir;

#[derive(Clone, Debug)]
enum Poll {
    Good(BTreeSet<u8>, BTreeSet<u8>),
    Transport,
    Status,
    Malformed,
    Hang,
}

#[derive(Clone, Copy, Debug)]
enum Join {
    Admitted,
    NotAdmitted,
    Error,
    Hang,
}

fn id(n: u8) -> GroupId {
    GroupId::from_bytes([n; 32])
}

#[derive(Default)]
struct World {
    polls: Vec<Poll>,
    joins: Vec<Join>,
    confirms: Vec<bool>,
    leaves: Vec<bool>,
    /// Set for the settle phase: every later poll answers this and every action succeeds.
    settled: Option<ShouldJoin>,
    /// The latest answered poll: Some(desired) if it was good, None if it failed.
    last_poll: Option<Option<ShouldJoin>>,
    held: BTreeSet<GroupId>,
    violations: Vec<String>,
    counters: [usize; 4],
}

#[derive(Clone, Default)]
struct Fake(Arc<Mutex<World>>);

impl Fake {
    fn with<R>(&self, f: impl FnOnce(&mut World) -> R) -> R {
        f(&mut self.0.lock().unwrap())
    }
}

fn desired(a: &BTreeSet<u8>, r: &BTreeSet<u8>) -> ShouldJoin {
    ShouldJoin {
        assignments: a.iter().map(|n| id(*n)).collect(),
        retain: r.iter().map(|n| id(*n)).collect(),
    }
}

#[async_trait]
impl ControlPlane for Fake {
    async fn should_join(&self, _: &PeerId, _: Option<&Mrtd>) -> Result<ShouldJoin, PollError> {
        let next = self.with(|w| {
            if let Some(d) = &w.settled {
                return Poll::Good(
                    d.assignments.iter().map(|g| g.as_bytes()[0]).collect(),
                    d.retain.iter().map(|g| g.as_bytes()[0]).collect(),
                );
            }
            let i = w.counters[0];
            w.counters[0] += 1;
            w.polls
                .get(i)
                .cloned()
                .unwrap_or(Poll::Good(BTreeSet::new(), BTreeSet::new()))
        });
        let url = url::Url::parse("https://mdma.test/api/fleet/should-join").unwrap();
        let result = match next {
            Poll::Good(a, r) => Ok(desired(&a, &r)),
            Poll::Transport => Err(RequestError::Transport {
                url,
                // A real transport error, made without the network: a URL with no host.
                source: reqwest::Client::new()
                    .get("http://")
                    .send()
                    .await
                    .expect_err("no host, no request"),
            }
            .into()),
            Poll::Status => Err(RequestError::Status { url, status: 503 }.into()),
            Poll::Malformed => Err(PollError::Malformed {
                url,
                source: parse_should_join(b"{\"assignments\":7}").expect_err("not an array"),
            }),
            Poll::Hang => {
                // The loop's own deadline ends it; record the failure when it does.
                self.with(|w| w.last_poll = Some(None));
                std::future::pending::<()>().await;
                unreachable!()
            }
        };
        self.with(|w| w.last_poll = Some(result.as_ref().ok().cloned()));
        result
    }

    async fn confirm(&self, _: &PeerId, _: GroupId) -> Result<(), ConfirmError> {
        let ok = self.with(|w| {
            if w.settled.is_some() {
                return true;
            }
            let i = w.counters[2];
            w.counters[2] += 1;
            w.confirms
                .get(i % w.confirms.len().max(1))
                .copied()
                .unwrap_or(true)
        });
        if ok {
            Ok(())
        } else {
            Err(RequestError::Status {
                url: url::Url::parse("https://mdma.test/api/fleet/confirm").unwrap(),
                status: 500,
            })
        }
    }
}

fn merod_err(op: MerodOp) -> MerodError {
    MerodError::Call {
        op,
        url: "http://merod.test/".into(),
        source: "emulated".into(),
    }
}

#[async_trait]
impl Node for Fake {
    async fn probe(&self) -> Result<(), MerodError> {
        Ok(())
    }

    async fn fleet_join(&self, g: GroupId) -> Result<Admission, MerodError> {
        let outcome = self.with(|w| {
            if w.settled.is_some() {
                return Join::Admitted;
            }
            let i = w.counters[1];
            w.counters[1] += 1;
            w.joins
                .get(i % w.joins.len().max(1))
                .copied()
                .unwrap_or(Join::Admitted)
        });
        match outcome {
            Join::Admitted => {
                self.with(|w| w.held.insert(g));
                Ok(Admission {
                    admitted: true,
                    status: "joined".into(),
                    reasons: Vec::new(),
                })
            }
            Join::NotAdmitted => Ok(Admission {
                admitted: false,
                status: "announced".into(),
                reasons: Vec::new(),
            }),
            Join::Error => Err(merod_err(MerodOp::FleetJoin)),
            Join::Hang => {
                std::future::pending::<()>().await;
                unreachable!()
            }
        }
    }

    async fn leave_namespace(&self, g: GroupId) -> Result<(), MerodError> {
        self.with(|w| {
            match &w.last_poll {
                Some(Some(d)) => {
                    if d.assignments.contains(&g) || d.retain.contains(&g) {
                        w.violations
                            .push(format!("left {g} which the latest poll wants"));
                    }
                }
                Some(None) => w
                    .violations
                    .push(format!("left {g} right after a failed poll")),
                None => w.violations.push(format!("left {g} before any poll")),
            }
            let ok = w.settled.is_some() || {
                let i = w.counters[3];
                w.counters[3] += 1;
                w.leaves
                    .get(i % w.leaves.len().max(1))
                    .copied()
                    .unwrap_or(true)
            };
            if ok {
                w.held.remove(&g);
                Ok(())
            } else {
                Err(merod_err(MerodOp::Leave))
            }
        })
    }

    async fn holds_namespace(&self, g: GroupId) -> Result<bool, MerodError> {
        Ok(self.with(|w| w.held.contains(&g)))
    }
}

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
        "leave_after_polls = {leave_after}\nmass_drop_hold = \"30s\"\njoin_timeout = \"20s\""
    ));
    let fake = Fake::default();
    let scripted = polls.len();
    fake.with(|w| {
        w.polls = polls.clone();
        w.joins = joins;
        w.confirms = confirms;
        w.leaves = leaves;
    });
    let state_path = node.state_file();
    let mut confirmed_outside_admitted = Vec::new();
    rt.block_on(async {
        let deps = Deps::new(Arc::new(fake.clone()), Arc::new(fake.clone()));
        let stop = CancellationToken::new();
        let task = tokio::spawn(daemon::run(cfg, deps, stop.clone()));
        // The scripted polls (a hung one takes the 11 s deadline), checking the state as it goes.
        while fake.with(|w| w.counters[0]) < scripted {
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
        fake.with(|w| w.settled = Some(last_good));
        // Good, stable polls: long enough for hung joins (20 s), stability, the 30 s
        // mass-drop hold and the leave rate limit.
        tokio::time::sleep(Duration::from_secs(180)).await;
        stop.cancel();
        task.await.unwrap().unwrap();
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
    let (held, d) = fake.with(|w| (w.held.clone(), w.settled.clone().unwrap_or_default()));
    let stray: BTreeMap<_, _> = held
        .iter()
        .filter(|g| !d.assignments.contains(g) && !d.retain.contains(g))
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
