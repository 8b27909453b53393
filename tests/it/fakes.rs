//! One in-memory MDMA (`ControlPlane`) and merod (`Node`) for the tests that drive the real
//! loop under tokio's paused clock (`time_rules`, `loop_properties`, `faults`): scripted answers, live
//! answers a test edits between steps, and a record of every call with its tokio `Instant`.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use fleet_sidecar::daemon::Deps;
use fleet_sidecar::mdma::ShouldJoin;
use fleet_sidecar::Config;
use fleet_sidecar::Mrtd;
use fleet_sidecar::{
    mdma::parse_should_join, mdma::ConfirmError, mdma::RequestMethod, ControlPlane, PollError,
    RequestError,
};
use fleet_sidecar::{mdma::Holding, mdma::JoinStatus, mdma::NodeReport, mdma::Polled};
use fleet_sidecar::{merod::MerodOp, merod::NodeAccount, Admission, MerodError, Node, TeeRole};
use fleet_sidecar::{GroupId, PeerId};
use tokio::time::Instant;

use crate::common::{id, merod_err, spawn_loop, Running};

/// One should-join answer.
#[derive(Clone, Debug)]
pub enum Poll {
    /// Assignments and `retain`, as `id(n)` numbers.
    Good(BTreeSet<u8>, BTreeSet<u8>),
    /// A transport error (no answer).
    Transport,
    /// HTTP 503.
    Status,
    /// A body that is not a should-join answer.
    Malformed,
    /// No answer ever: the loop's own deadline ends the poll.
    Hang,
}

/// One fleet-join answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Join {
    /// `admitted: true`; merod holds the namespace from then on.
    Admitted,
    /// As `Admitted`, answered after this many seconds.
    AdmittedAfter(u64),
    /// `admitted: false`, answered at once.
    NotAdmitted,
    /// The call failed.
    Error,
    /// No answer ever.
    Hang,
    /// The call panics (a bug on the client's side): the task ends without an outcome.
    Panic,
}

/// The should-join answer for `Poll::Good(a, r)`.
pub fn desired(a: &BTreeSet<u8>, r: &BTreeSet<u8>) -> ShouldJoin {
    ShouldJoin {
        assignments: a.iter().map(|n| id(*n)).collect(),
        retain: r.iter().map(|n| id(*n)).collect(),
        ..ShouldJoin::default()
    }
}

/// What the fake answers and what it saw.
#[derive(Default)]
pub struct World {
    /// The live should-join answer (used once `poll_script` is spent).
    pub assignments: BTreeSet<GroupId>,
    pub retain: BTreeSet<GroupId>,
    /// Every live poll fails with HTTP 503.
    pub mdma_down: bool,
    /// merod's `externalAddrs`.
    pub external_addrs: Vec<String>,
    /// Every read of merod's network status, with when it came.
    pub network_reads: Vec<Instant>,
    /// The `swarm_addrs` each poll carried (`None`: left out).
    pub swarm_reported: Vec<Option<Vec<String>>>,
    /// merod holds no account yet: its identity answers "not minted".
    pub account_not_minted: bool,
    /// Every read of merod's identity, with when it came.
    pub identity_reads: Vec<Instant>,
    /// The `Retry-After` (seconds) of every refused poll and confirm.
    pub retry_after_secs: Option<u32>,
    /// The first polls' answers, in order; later polls get the live answer.
    pub poll_script: Vec<Poll>,
    /// Fleet-join answers, cycled; empty: admitted.
    pub join_script: Vec<Join>,
    /// Confirm outcomes (true: accepted), cycled; empty: accepted.
    pub confirm_script: Vec<bool>,
    /// Leave outcomes (true: left), cycled; empty: left.
    pub leave_script: Vec<bool>,
    /// From now on every poll gets the live answer and every join, confirm and leave succeeds.
    pub settled: bool,
    /// merod refuses connections: every probe fails.
    pub merod_down: bool,
    /// Readiness probes received.
    pub probes: usize,
    /// The namespaces merod holds.
    pub held: BTreeSet<GroupId>,
    /// Held namespaces its list leaves out (a list that lags what merod holds).
    pub list_hides: BTreeSet<GroupId>,
    /// Namespaces whose membership read answers merod's own "not held" 404 whether held or
    /// not (a membership answer that lags an admission).
    pub membership_lags: BTreeSet<GroupId>,
    /// Every poll: when, and the MRTD (hex) it carried.
    pub polls: Vec<(Instant, Option<String>)>,
    /// The `held_namespaces` each poll carried (`None`: left out).
    pub held_reported: Vec<Option<Vec<GroupId>>>,
    /// The namespaces each poll said joined ([`fleet_sidecar::mdma::Holding::joined`]): the
    /// answer keeps no addresses for them.
    pub joined_said: Vec<Option<BTreeSet<GroupId>>>,
    /// The `executor_account` each poll carried (`None`: left out).
    pub accounts_reported: Vec<Option<String>>,
    /// The `relay_url` each poll carried (`None`: left out).
    pub relays_reported: Vec<Option<String>>,
    /// Every join-status report.
    pub join_statuses: Vec<JoinStatus>,
    /// Every confirm call, in order, with the role it carried.
    pub confirms: Vec<(GroupId, Option<TeeRole>)>,
    /// When each confirm call came.
    pub confirm_times: Vec<Instant>,
    /// The node's role in every namespace it holds (`None`: no TEE role).
    pub role: Option<TeeRole>,
    /// How long each read of the member list (the role read) takes to answer.
    pub members_delay: std::time::Duration,
    /// Every read of the member list fails (HTTP 500).
    pub members_fail: bool,
    /// Every read of the member list, with when it started.
    pub role_reads: Vec<(GroupId, Instant)>,
    /// merod's namespace list never answers (the held refresh job hangs).
    pub list_hangs: bool,
    /// MDMA's join-status never answers (the join-status job hangs).
    pub join_status_hangs: bool,
    /// Every fleet-join call, with when it started.
    pub joins: Vec<(GroupId, Instant)>,
    /// Every leave call (failed ones too), with when it started.
    pub leaves: Vec<(GroupId, Instant)>,
    /// Leaves that broke a safety rule: after a failed poll, before any poll, or of a
    /// namespace the latest poll wants.
    pub violations: Vec<String>,
    /// The latest answered poll: Some(desired) if it was good, None if it failed.
    last_poll: Option<Option<ShouldJoin>>,
    /// The latest successful poll's answer.
    last_good: Option<ShouldJoin>,
    confirms_answered: usize,
    join_answered: usize,
    leaves_answered: usize,
}

/// Answer `i` of `script`, cycled; `default` when the script is empty.
fn cycled<T: Copy>(script: &[T], i: &mut usize, default: T) -> T {
    let n = *i;
    *i += 1;
    script
        .get(n % script.len().max(1))
        .copied()
        .unwrap_or(default)
}

/// MDMA and merod in one, shared by clones.
#[derive(Clone, Default)]
pub struct Fake(Arc<Mutex<World>>);

impl Fake {
    pub fn with<R>(&self, f: impl FnOnce(&mut World) -> R) -> R {
        f(&mut self.0.lock().unwrap())
    }

    /// Runs the daemon's loop on this fake with `cfg`.
    pub fn run(&self, cfg: Config) -> Running {
        spawn_loop(
            cfg,
            Deps::new(Arc::new(self.clone()), Arc::new(self.clone())),
        )
    }
}

#[async_trait]
impl ControlPlane for Fake {
    async fn should_join_if_changed(
        &self,
        peer_id: &PeerId,
        mrtd: Option<&Mrtd>,
        report: NodeReport<'_>,
        held: Holding<'_>,
    ) -> Result<Polled, PollError> {
        self.with(|w| w.joined_said.push(held.joined.cloned()));
        let answer = self.should_join(peer_id, mrtd, report).await?;
        Ok(Polled::Changed {
            answer,
            digest: None,
        })
    }

    async fn should_join(
        &self,
        _: &PeerId,
        mrtd: Option<&Mrtd>,
        report: NodeReport<'_>,
    ) -> Result<ShouldJoin, PollError> {
        let next = self.with(|w| {
            w.polls.push((Instant::now(), mrtd.map(Mrtd::to_hex)));
            w.held_reported
                .push(report.held_namespaces.map(<[GroupId]>::to_vec));
            w.accounts_reported
                .push(report.executor_account.map(str::to_owned));
            w.swarm_reported
                .push(report.swarm_addrs.map(<[String]>::to_vec));
            w.relays_reported.push(report.relay_url.map(str::to_owned));
            let scripted = w.poll_script.get(w.polls.len() - 1);
            match scripted {
                Some(p) if !w.settled => Some(p.clone()),
                _ if w.mdma_down && !w.settled => Some(Poll::Status),
                _ => None,
            }
        });
        let url = url::Url::parse("https://mdma.test/api/fleet/should-join").unwrap();
        let result = match next {
            None => Ok(self.with(|w| ShouldJoin {
                assignments: w.assignments.clone(),
                retain: w.retain.clone(),
                ..ShouldJoin::default()
            })),
            Some(Poll::Good(a, r)) => Ok(desired(&a, &r)),
            Some(Poll::Transport) => Err(RequestError::Transport {
                method: RequestMethod::Post,
                url,
                // A real transport error, made without the network: a URL with no host.
                source: reqwest::Client::new()
                    .get("http://")
                    .send()
                    .await
                    .expect_err("no host, no request"),
            }
            .into()),
            Some(Poll::Status) => Err(RequestError::Status {
                method: RequestMethod::Post,
                url,
                status: 503,
                retry_after_secs: self.with(|w| w.retry_after_secs),
                body: Box::default(),
            }
            .into()),
            Some(Poll::Malformed) => Err(PollError::Malformed {
                url,
                source: parse_should_join(b"{\"assignments\":7}").expect_err("not an array"),
            }),
            Some(Poll::Hang) => {
                // The loop's own deadline ends it; record the failure when it does.
                self.with(|w| w.last_poll = Some(None));
                std::future::pending::<()>().await;
                unreachable!()
            }
        };
        self.with(|w| {
            w.last_poll = Some(result.as_ref().ok().cloned());
            if let Ok(good) = &result {
                w.last_good = Some(good.clone());
            }
        });
        result
    }

    async fn confirm(
        &self,
        _: &PeerId,
        g: GroupId,
        role: Option<TeeRole>,
    ) -> Result<(), ConfirmError> {
        let ok = self.with(|w| {
            w.confirms.push((g, role));
            w.confirm_times.push(Instant::now());
            if !w
                .last_good
                .as_ref()
                .is_some_and(|d| d.assignments.contains(&g))
            {
                w.violations.push(format!(
                    "confirmed {g}, which the latest successful poll does not assign"
                ));
            }
            w.settled || cycled(&w.confirm_script, &mut w.confirms_answered, true)
        });
        if ok {
            Ok(())
        } else {
            Err(RequestError::Status {
                method: RequestMethod::Post,
                url: url::Url::parse("https://mdma.test/api/fleet/confirm").unwrap(),
                status: 500,
                retry_after_secs: self.with(|w| w.retry_after_secs),
                body: Box::default(),
            })
        }
    }

    async fn join_status(&self, report: &JoinStatus) -> Result<(), RequestError> {
        if self.with(|w| {
            w.join_statuses.push(report.clone());
            w.join_status_hangs
        }) {
            std::future::pending::<()>().await;
        }
        Ok(())
    }
}

#[async_trait]
impl Node for Fake {
    async fn probe(&self) -> Result<(), MerodError> {
        if self.with(|w| {
            w.probes += 1;
            w.merod_down
        }) {
            return Err(merod_err(MerodOp::Peers, "connection refused"));
        }
        Ok(())
    }

    async fn fleet_join(&self, g: GroupId, _: &[String]) -> Result<Admission, MerodError> {
        let answer = self.with(|w| {
            w.joins.push((g, Instant::now()));
            if w.settled {
                return Join::Admitted;
            }
            cycled(&w.join_script, &mut w.join_answered, Join::Admitted)
        });
        if let Join::AdmittedAfter(secs) = answer {
            tokio::time::sleep(std::time::Duration::from_secs(secs)).await;
        }
        match answer {
            Join::Admitted | Join::AdmittedAfter(_) => {
                self.with(|w| w.held.insert(g));
                Ok(Admission {
                    admitted: true,
                    status: "joined".to_owned(),
                    reasons: Vec::new(),
                    refusals: Vec::new(),
                    admitted_by: None,
                })
            }
            Join::NotAdmitted => Ok(Admission {
                admitted: false,
                status: "announced".to_owned(),
                reasons: vec!["no verifier answered".to_owned()],
                refusals: Vec::new(),
                admitted_by: None,
            }),
            Join::Error => Err(merod_err(MerodOp::FleetJoin, "Internal server error")),
            Join::Hang => {
                std::future::pending::<()>().await;
                unreachable!()
            }
            Join::Panic => panic!("emulated panic in fleet-join"),
        }
    }

    async fn leave_namespace(&self, g: GroupId) -> Result<(), MerodError> {
        self.with(|w| {
            w.leaves.push((g, Instant::now()));
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
            if w.settled || cycled(&w.leave_script, &mut w.leaves_answered, true) {
                w.held.remove(&g);
                Ok(())
            } else {
                Err(merod_err(MerodOp::Leave, "emulated"))
            }
        })
    }

    async fn holds_namespace(&self, g: GroupId) -> Result<bool, MerodError> {
        Ok(self.with(|w| w.held.contains(&g) && !w.membership_lags.contains(&g)))
    }

    async fn list_namespaces(&self) -> Result<BTreeSet<GroupId>, MerodError> {
        if self.with(|w| w.list_hangs) {
            std::future::pending::<()>().await;
        }
        if self.with(|w| w.merod_down) {
            return Err(merod_err(MerodOp::ListNamespaces, "connection refused"));
        }
        Ok(self.with(|w| w.held.difference(&w.list_hides).copied().collect()))
    }

    async fn identity(&self) -> Result<NodeAccount, MerodError> {
        let minted = self.with(|w| {
            w.identity_reads.push(Instant::now());
            !w.account_not_minted
        });
        Ok(if minted {
            NodeAccount::Account("ab".repeat(32))
        } else {
            NodeAccount::NotMinted
        })
    }

    async fn network_status(&self) -> Result<fleet_sidecar::merod::NetworkStatus, MerodError> {
        self.with(|w| {
            w.network_reads.push(Instant::now());
            Ok(fleet_sidecar::merod::NetworkStatus {
                local_peer_id: "SELF".to_owned(),
                external_addrs: w.external_addrs.clone(),
            })
        })
    }

    async fn tee_role(&self, g: GroupId, _: &str) -> Result<Option<TeeRole>, MerodError> {
        let delay = self.with(|w| {
            w.role_reads.push((g, Instant::now()));
            w.members_delay
        });
        tokio::time::sleep(delay).await;
        if self.with(|w| w.members_fail) {
            return Err(merod_err(MerodOp::Members, "Internal server error"));
        }
        Ok(self.with(|w| if w.held.contains(&g) { w.role } else { None }))
    }
}
