//! The reconcile loop: poll, plan, execute, persist — every `poll_interval`.
//!
//! Level-triggered: each cycle recomputes from the latest poll and the persisted state, so
//! a crash at any point leaves a state the next cycle repairs. The poll is the node's
//! heartbeat and runs on its cadence whatever merod does: joins and leaves run as
//! background tasks (at most one per namespace, at most `max_concurrent_joins` joins), each
//! merod and MDMA call bounded by its deadline, and their outcomes come back as events
//! that are folded into the state and persisted.
//!
//! Safety order inside a join task: `fleet-join` → `admitted: true` → merod lists the
//! namespace → the admission is persisted (the loop acknowledges) → confirm to MDMA → the
//! confirmation is persisted. A failed poll plans nothing at all.

pub use crate::status::serve as serve_status;
pub use crate::telemetry::{unix_now, LiveStatus, NotReady, Phase, Telemetry};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot, Semaphore};
use tokio::task::JoinSet;
use tokio::time::{timeout, Instant};
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, info_span, warn, Instrument};

use crate::config::Config;
use crate::identity::{read_peer_id, IdentityError};
use crate::ids::{GroupId, PeerId};
use crate::mdma::{ConfirmError, ControlPlane, PollError, RequestError, MDMA_TIMEOUT};
use crate::merod::{Node, CHECK_TIMEOUT, PROBE_TIMEOUT};
use crate::mrtd::{read_mrtd, Mrtd, MrtdReading, MrtdUnavailable};
use crate::reconcile::{
    self, Desired, Guard, LeaveWait, MassDrop, MassDropEvent, Outcome, PlanInput,
};
use crate::state::{State, StateError, StateStore};
use crate::telemetry::Outcome as Metric;

/// Time between readiness probes.
pub(crate) const PROBE_INTERVAL: Duration = Duration::from_secs(1);
/// Wait before the one retry of reading the PeerId (merod may still be writing its config).
pub(crate) const PEER_ID_RETRY_DELAY: Duration = Duration::from_secs(2);
/// How often an unreadable MRTD is tried again (a later module load can make it appear).
pub(crate) const MRTD_RETRY_INTERVAL: Duration = Duration::from_secs(300);
/// Bound of one MRTD read (sysfs, ioctl with its short retries, configfs-tsm quote).
pub(crate) const MRTD_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// First wait before retrying a join that failed with an error (doubles, up to the cap).
pub(crate) const JOIN_RETRY_MIN: Duration = Duration::from_secs(2);
/// Longest wait before retrying a failing join.
pub(crate) const JOIN_RETRY_MAX: Duration = Duration::from_secs(60);
/// On shutdown, how long running joins and leaves may take to finish before they are cut.
pub(crate) const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);
/// A poll failing the same way is logged again after this many repeats.
pub(crate) const REPEAT_LOG_EVERY: u64 = 60;

/// The outside world the loop drives, and where it reports.
#[derive(Clone)]
pub struct Deps {
    /// MDMA.
    pub mdma: Arc<dyn ControlPlane>,
    /// merod.
    pub merod: Arc<dyn Node>,
    /// Metrics and live status (read by the status listener and the systemd notifier).
    pub telemetry: Arc<Telemetry>,
}

impl Deps {
    /// MDMA and merod with a fresh [`Telemetry`].
    pub fn new(mdma: Arc<dyn ControlPlane>, merod: Arc<dyn Node>) -> Self {
        Self {
            mdma,
            merod,
            telemetry: Arc::new(Telemetry::new()),
        }
    }
}

/// The longest wait before the first poll: a node on a long `poll_interval` still sends its
/// first heartbeat within seconds of a (re)start.
pub(crate) const FIRST_POLL_SPREAD_MAX: Duration = Duration::from_secs(5);

/// The wait before the first poll after start: `min(interval, 5 s) · jitter` for `jitter`
/// in `[0, 1)`, so a fleet started at the same instant (a rollout, a power cut) spreads its
/// polls over one interval instead of hitting MDMA in lock-step, and keeps them spread.
pub(crate) fn first_poll_delay(interval: Duration, jitter: f64) -> Duration {
    interval
        .min(FIRST_POLL_SPREAD_MAX)
        .mul_f64(jitter.clamp(0.0, 1.0))
}

/// The wait before the next poll. After a successful poll: `interval`. After `failures`
/// failed polls in a row: a jittered exponential backoff, so a fleet recovering from an
/// MDMA outage does not poll in lockstep: `base = min(max_backoff, interval · 2^failures)`,
/// wait `base · (1 + jitter) / 2` for `jitter` in `[0, 1)` — never below `interval`.
pub(crate) fn next_poll_delay(
    interval: Duration,
    max_backoff: Duration,
    failures: u64,
    jitter: f64,
) -> Duration {
    if failures == 0 {
        return interval;
    }
    let factor = 2u32.saturating_pow(u32::try_from(failures).unwrap_or(u32::MAX));
    let base = interval
        .saturating_mul(factor)
        .min(max_backoff.max(interval));
    base.mul_f64((1.0 + jitter.clamp(0.0, 1.0)) / 2.0)
        .max(interval)
}

/// Why the daemon stopped with an error (exit non-zero).
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    /// The state file is unreadable or corrupt.
    #[error(transparent)]
    State(#[from] StateError),
    /// The PeerId could not be read (after one retry).
    #[error(transparent)]
    Identity(#[from] IdentityError),
    /// merod's admin API did not answer within the wait allowed (`once` only).
    #[error("merod's admin API did not answer within {waited:?}: {last}")]
    MerodNotReady {
        /// How long it was waited for.
        waited: Duration,
        /// What the last probe saw.
        last: String,
    },
    /// `once` ended with changes the state file could not record.
    #[error("the cycle ran but its outcome could not be persisted: {0}")]
    NotPersisted(String),
}

/// How long `once` waits for merod's admin API before giving up.
pub const ONCE_MEROD_WAIT: Duration = Duration::from_secs(60);

/// How one cycle went.
#[derive(Debug)]
pub enum CycleOutcome {
    /// The poll failed: nothing was planned.
    PollFailed(PollError),
    /// The poll succeeded and this was started.
    Planned {
        /// Joins started.
        joins: usize,
        /// Leaves started.
        leaves: usize,
    },
}

/// How a join task ended.
#[derive(Debug)]
enum JoinEnd {
    Confirmed,
    NotAdmitted {
        status: String,
        reasons: Vec<String>,
    },
    /// A merod call (fleet-join or the membership check) failed; `timed_out` when it ran
    /// out of time rather than being refused.
    Failed {
        reason: String,
        timed_out: bool,
    },
    NotHeld,
    NotPersisted,
    ConfirmFailed(ConfirmError),
    ConfirmTimedOut(Duration),
}

#[derive(Debug)]
enum LeaveEnd {
    Left,
    /// merod still lists it, or cannot tell; `timed_out` when the leave call ran out of time.
    StillHeld {
        reason: String,
        timed_out: bool,
    },
}

/// The `outcome` label of a failed poll.
fn poll_outcome(e: &PollError) -> Metric {
    match e {
        PollError::Request(RequestError::Transport { .. }) => Metric::Transport,
        PollError::Request(RequestError::Timeout { .. }) | PollError::Deadline { .. } => {
            Metric::Timeout
        }
        PollError::Request(RequestError::Status { .. }) => Metric::Status,
        PollError::Malformed { .. } => Metric::Malformed,
    }
}

#[derive(Debug)]
enum Event {
    Admitted {
        id: GroupId,
        ack: oneshot::Sender<()>,
    },
    JoinEnded {
        id: GroupId,
        end: JoinEnd,
        /// From the join task's start (waiting for a join slot included) to its end.
        took: Duration,
    },
    LeaveEnded {
        id: GroupId,
        end: LeaveEnd,
        took: Duration,
    },
}

/// Counts failed polls so a failure repeated every second is logged once, then every
/// [`REPEAT_LOG_EVERY`] times, and the recovery once.
#[derive(Debug, Default)]
struct FailureStreak {
    count: u64,
    last: Option<String>,
}

impl FailureStreak {
    fn fail(&mut self, e: &PollError) {
        self.count += 1;
        let reason = e.to_string();
        if self.last.as_deref() != Some(reason.as_str()) {
            warn!(
                error_kind = e.kind(),
                outcome = "failed",
                "poll failed, cycle skipped (nothing joined or left): {reason}"
            );
            self.last = Some(reason);
        } else if self.count % REPEAT_LOG_EVERY == 0 {
            warn!(
                error_kind = e.kind(),
                outcome = "failed",
                failures = self.count,
                "poll still failing: {reason}"
            );
        }
    }

    fn succeed(&mut self) {
        if self.count > 0 {
            info!(failures = self.count, "poll succeeded again");
        }
        *self = Self::default();
    }
}

struct MrtdSlot {
    value: Option<Mrtd>,
    next_try: Option<Instant>,
}

/// The running sidecar: identity known, merod ready, state loaded.
pub struct Sidecar {
    cfg: Config,
    deps: Deps,
    shutdown: CancellationToken,
    peer_id: PeerId,
    mrtd: MrtdSlot,
    store: StateStore,
    state: State,
    guard: Guard,
    joining: BTreeSet<GroupId>,
    leaving: BTreeSet<GroupId>,
    desired: Desired,
    join_retry: crate::backoff::JoinRetries,
    tasks: JoinSet<()>,
    task_ids: HashMap<tokio::task::Id, GroupId>,
    join_permits: Arc<Semaphore>,
    events_tx: mpsc::UnboundedSender<Event>,
    events_rx: mpsc::UnboundedReceiver<Event>,
    failures: FailureStreak,
    waiting: BTreeMap<GroupId, LeaveWait>,
    /// The failing state write, while writes fail: its stable key and its message.
    persist_error: Option<(String, String)>,
}

/// Runs the daemon until `shutdown` is cancelled: load the state, wait for merod, read
/// the identity, then reconcile every `poll_interval`.
///
/// Errors: [`DaemonError`] for an unusable state file or an unreadable PeerId. A shutdown
/// before merod answered returns `Ok`.
pub async fn run(cfg: Config, deps: Deps, shutdown: CancellationToken) -> Result<(), DaemonError> {
    let Some(mut sidecar) = Sidecar::start(cfg, deps, shutdown, None).await? else {
        return Ok(());
    };
    sidecar.run_loop().await;
    Ok(())
}

/// One full cycle (`fleet-sidecar once`): start as [`run`] does (but wait at most
/// [`ONCE_MEROD_WAIT`] for merod), poll once, run the planned joins and leaves to their
/// end, persist.
///
/// Errors: as [`run`], [`DaemonError::MerodNotReady`], and [`DaemonError::NotPersisted`]
/// when the state could not be written. `Ok(None)` when shut down before the cycle.
pub async fn once(
    cfg: Config,
    deps: Deps,
    shutdown: CancellationToken,
) -> Result<Option<CycleOutcome>, DaemonError> {
    let Some(mut sidecar) = Sidecar::start(cfg, deps, shutdown, Some(ONCE_MEROD_WAIT)).await?
    else {
        return Ok(None);
    };
    let outcome = sidecar.cycle().await;
    sidecar.drain(None).await;
    match sidecar.persist_error.take() {
        Some((_, e)) => Err(DaemonError::NotPersisted(e)),
        None => Ok(Some(outcome)),
    }
}

/// How waiting for merod ended.
#[derive(Debug, PartialEq, Eq)]
pub enum Readiness {
    /// merod answered.
    Ready,
    /// Shut down first.
    ShutDown,
    /// `limit` passed; the last probe saw this.
    GaveUp(String),
}

/// Probes merod every second (`PROBE_INTERVAL`) until it answers (or `limit`, if any, passes);
/// logs one line per change of what it sees, and reports each probe as a heartbeat.
pub async fn wait_for_merod(
    merod: &dyn Node,
    telemetry: &Telemetry,
    shutdown: &CancellationToken,
    limit: Option<Duration>,
) -> Readiness {
    let mut last: Option<String> = None;
    let deadline = limit.map(|l| Instant::now() + l);
    loop {
        let reason = match timeout(PROBE_TIMEOUT, merod.probe()).await {
            Ok(Ok(())) => {
                info!("merod admin API answers");
                return Readiness::Ready;
            }
            Ok(Err(e)) => e.to_string(),
            Err(_) => format!("no answer within {PROBE_TIMEOUT:?}"),
        };
        telemetry.mark_alive();
        telemetry.update(|st| {
            st.phase = Phase::WaitingForMerod;
            st.heartbeats += 1;
            st.waiting_for = Some(reason.clone());
        });
        if last.as_deref() != Some(reason.as_str()) {
            info!("waiting for merod: {reason}");
            last = Some(reason);
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return Readiness::GaveUp(last.unwrap_or_default());
        }
        tokio::select! {
            () = tokio::time::sleep(PROBE_INTERVAL) => {}
            () = shutdown.cancelled() => return Readiness::ShutDown,
        }
    }
}

/// Why the MRTD could not be read in this attempt.
#[derive(Debug, thiserror::Error)]
enum MrtdReadError {
    #[error(transparent)]
    Unavailable(#[from] MrtdUnavailable),
    #[error("the MRTD reader stopped: {0}")]
    Stopped(#[source] tokio::task::JoinError),
    #[error("no MRTD source answered within {0:?}")]
    Timeout(Duration),
}

/// Reads the MRTD on the blocking pool (file reads, ioctl), bounded by
/// [`MRTD_READ_TIMEOUT`]. Errors: [`MrtdReadError`], every source's failure.
async fn read_mrtd_blocking(cfg: &Config) -> Result<MrtdReading, MrtdReadError> {
    let tdx = cfg.tdx.clone();
    match timeout(
        MRTD_READ_TIMEOUT,
        tokio::task::spawn_blocking(move || read_mrtd(&tdx)),
    )
    .await
    {
        Ok(Ok(result)) => Ok(result?),
        Ok(Err(e)) => Err(MrtdReadError::Stopped(e)),
        Err(_) => Err(MrtdReadError::Timeout(MRTD_READ_TIMEOUT)),
    }
}

impl Sidecar {
    /// Loads the state and checks it can be written, waits for merod (for at most
    /// `merod_wait`, if set), reads the PeerId (one retry) and the MRTD (logged once if
    /// unreadable: polls then carry the PeerId only).
    ///
    /// Errors: [`DaemonError`]. `Ok(None)` when shut down while waiting for merod.
    pub async fn start(
        cfg: Config,
        deps: Deps,
        shutdown: CancellationToken,
        merod_wait: Option<Duration>,
    ) -> Result<Option<Self>, DaemonError> {
        let mut store = StateStore::new(&cfg.state_file);
        let state = match store.load()? {
            Some(s) => {
                info!(
                    path = %store.path().display(),
                    admitted = s.admitted.len(),
                    confirmed = s.confirmed.len(),
                    "state loaded"
                );
                s
            }
            None => {
                info!(path = %store.path().display(), "no state file yet: starting with nothing confirmed");
                State::default()
            }
        };

        let telemetry = Arc::clone(&deps.telemetry);
        telemetry.update(|st| st.dry_run = cfg.dry_run);
        if cfg.dry_run {
            warn!("dry run: polling and logging plans only; merod is not called, nothing is confirmed, the state file is not written");
        } else {
            let removed = store.remove_stale_temp_files();
            if removed > 0 {
                info!(
                    removed,
                    "removed temp files an interrupted state write left behind"
                );
            }
            store.check_writable()?;
            match wait_for_merod(deps.merod.as_ref(), &telemetry, &shutdown, merod_wait).await {
                Readiness::Ready => {}
                Readiness::ShutDown => return Ok(None),
                Readiness::GaveUp(last) => {
                    return Err(DaemonError::MerodNotReady {
                        waited: merod_wait.unwrap_or_default(),
                        last,
                    })
                }
            }
        }

        let peer_config = cfg.merod.config_toml();
        let peer_id = match read_peer_id(&peer_config) {
            Ok(p) => p,
            Err(first) => {
                warn!("{first}; trying again in {PEER_ID_RETRY_DELAY:?}");
                tokio::time::sleep(PEER_ID_RETRY_DELAY).await;
                read_peer_id(&peer_config)?
            }
        };
        info!(peer_id = %peer_id, "identity read");

        let mut mrtd_source = None;
        let mrtd = match read_mrtd_blocking(&cfg).await {
            Ok(r) => {
                info!(mrtd = %r.mrtd, source = %r.source, "MRTD read");
                telemetry.set_mrtd_source(Some(r.source.as_str()));
                mrtd_source = Some(r.source.to_string());
                MrtdSlot {
                    value: Some(r.mrtd),
                    next_try: None,
                }
            }
            Err(e) => {
                error!(
                    "cannot read the MRTD ({e}); polling with the PeerId only: MDMA assigns no MRTD-gated namespace; retrying every {MRTD_RETRY_INTERVAL:?}"
                );
                telemetry.set_mrtd_source(None);
                MrtdSlot {
                    value: None,
                    next_try: Some(Instant::now() + MRTD_RETRY_INTERVAL),
                }
            }
        };

        telemetry.update(|st| {
            st.phase = Phase::Running;
            st.peer_id = Some(peer_id.to_string());
            st.mrtd = mrtd.value.map(|m| m.to_hex());
            st.mrtd_source = mrtd_source;
            st.waiting_for = None;
        });
        let (events_tx, events_rx) = mpsc::unbounded_channel();
        let sidecar = Self {
            join_permits: Arc::new(Semaphore::new(cfg.max_concurrent_joins)),
            cfg,
            deps,
            shutdown,
            peer_id,
            mrtd,
            store,
            state,
            guard: Guard::default(),
            joining: BTreeSet::new(),
            leaving: BTreeSet::new(),
            desired: Desired::default(),
            join_retry: crate::backoff::JoinRetries::default(),
            tasks: JoinSet::new(),
            task_ids: HashMap::new(),
            events_tx,
            events_rx,
            failures: FailureStreak::default(),
            waiting: BTreeMap::new(),
            persist_error: None,
        };
        sidecar.publish();
        Ok(Some(sidecar))
    }

    /// The node's PeerId.
    pub fn peer_id(&self) -> &PeerId {
        &self.peer_id
    }

    /// The state as of now (in memory; persisted after every change).
    pub fn state(&self) -> &State {
        &self.state
    }

    /// Reconciles every `poll_interval` (backing off while polls fail, see
    /// `next_poll_delay`) until shutdown, then lets running tasks finish for up to
    /// `SHUTDOWN_GRACE` (10 s) and persists.
    pub async fn run_loop(&mut self) {
        let shutdown = self.shutdown.clone();
        let mut next_poll =
            Instant::now() + first_poll_delay(self.cfg.poll_interval, fastrand::f64());
        // A turn at least every second, so the watchdog sees the loop alive between polls.
        let mut alive = tokio::time::interval(Duration::from_secs(1));
        alive.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            self.deps.telemetry.mark_alive();
            tokio::select! {
                biased;
                () = shutdown.cancelled() => break,
                _ = alive.tick() => {}
                Some(event) = self.events_rx.recv() => self.on_event(event),
                Some(done) = self.tasks.join_next_with_id(), if !self.tasks.is_empty() => {
                    self.on_task_done(done);
                }
                () = tokio::time::sleep_until(next_poll) => {
                    let started = Instant::now();
                    tokio::select! {
                        _ = self.cycle() => {}
                        () = shutdown.cancelled() => break,
                    }
                    next_poll = started
                        + next_poll_delay(
                            self.cfg.poll_interval,
                            self.cfg.max_backoff,
                            self.failures.count,
                            fastrand::f64(),
                        );
                }
            }
        }
        info!("shutting down");
        self.deps.telemetry.update(|st| st.phase = Phase::Stopping);
        self.drain(Some(SHUTDOWN_GRACE)).await;
    }

    /// Waits for running tasks (all of them, or until `grace` runs out, then cuts the
    /// rest), folding in their events, and persists.
    async fn drain(&mut self, grace: Option<Duration>) {
        let deadline = grace.map(|g| Instant::now() + g);
        while !self.tasks.is_empty() {
            let until_deadline = async {
                match deadline {
                    Some(d) => tokio::time::sleep_until(d).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                Some(event) = self.events_rx.recv() => self.on_event(event),
                Some(done) = self.tasks.join_next_with_id() => self.on_task_done(done),
                () = until_deadline => {
                    warn!(running = self.tasks.len(), "cutting joins/leaves still running at shutdown; they are retried at the next start");
                    self.tasks.shutdown().await;
                    break;
                }
            }
        }
        while let Ok(event) = self.events_rx.try_recv() {
            self.on_event(event);
        }
        self.persist();
    }

    /// One cycle: poll; on success plan and start the joins and leaves, prune, persist.
    pub async fn cycle(&mut self) -> CycleOutcome {
        self.retry_mrtd_if_due().await;
        let telemetry = Arc::clone(&self.deps.telemetry);
        let started = Instant::now();
        let polled = match timeout(
            MDMA_TIMEOUT + Duration::from_secs(1),
            self.deps
                .mdma
                .should_join(&self.peer_id, self.mrtd.value.as_ref()),
        )
        .instrument(info_span!("poll"))
        .await
        {
            Ok(r) => r,
            Err(_) => Err(PollError::Deadline {
                timeout: MDMA_TIMEOUT + Duration::from_secs(1),
            }),
        };
        telemetry.observe("should_join", started.elapsed());
        let now = unix_now();
        match polled {
            Err(e) => {
                self.failures.fail(&e);
                Telemetry::count(&telemetry.polls, poll_outcome(&e));
                let failures = self.failures.count;
                telemetry.update(|st| {
                    st.heartbeats += 1;
                    st.last_poll_at = Some(now);
                    st.last_poll_error = Some(e.to_string());
                    st.consecutive_failures = failures;
                });
                CycleOutcome::PollFailed(e)
            }
            Ok(answer) => {
                self.failures.succeed();
                Telemetry::count(&telemetry.polls, Metric::Ok);
                telemetry.last_ok_poll.set(now);
                telemetry.update(|st| {
                    st.heartbeats += 1;
                    st.last_poll_at = Some(now);
                    st.last_ok_poll_at = Some(now);
                    st.last_poll_error = None;
                    st.consecutive_failures = 0;
                });
                let desired = Desired::from(answer);
                let outcome = self.reconcile(&desired);
                self.desired = desired;
                self.publish();
                outcome
            }
        }
    }

    /// Copies the sets into the live status and the namespace gauges.
    fn publish(&self) {
        let t = &self.deps.telemetry;
        for (set, n) in [
            ("desired", self.desired.assigned.len()),
            ("admitted", self.state.admitted.len()),
            ("confirmed", self.state.confirmed.len()),
            ("pending_leave", self.waiting.len()),
        ] {
            t.namespaces
                .get_or_create(&crate::telemetry::SetLabel { set })
                .set(i64::try_from(n).unwrap_or(i64::MAX));
        }
        let hold = self.cfg.leave_policy.mass_drop_hold;
        // Only what changed is rebuilt: an idle cycle at 10,000 namespaces allocates nothing here.
        t.update(|st| {
            refill(&mut st.desired, &self.desired.assigned);
            refill(&mut st.retain, &self.desired.retain);
            refill(&mut st.admitted, &self.state.admitted);
            refill(&mut st.confirmed, &self.state.confirmed);
            refill(&mut st.joining, &self.joining);
            refill(&mut st.leaving, &self.leaving);
            let same_waits = st.pending_leaves.len() == self.waiting.len()
                && st
                    .pending_leaves
                    .iter()
                    .zip(&self.waiting)
                    .all(|((a, text), (b, w))| a == b && *text == w.to_string());
            if !same_waits {
                st.pending_leaves = self
                    .waiting
                    .iter()
                    .map(|(id, w)| (*id, w.to_string()))
                    .collect();
            }
            match self.guard.mass_drop {
                MassDrop::Idle if st.mass_drop == "idle" => {}
                MassDrop::Idle => st.mass_drop = "idle".to_owned(),
                MassDrop::Holding { since } => {
                    st.mass_drop = format!(
                        "holding every leave ({:.0} s of {} s left)",
                        hold.saturating_sub(since.elapsed()).as_secs_f64(),
                        hold.as_secs()
                    )
                }
                MassDrop::Released if st.mass_drop == "released" => {}
                MassDrop::Released => st.mass_drop = "released".to_owned(),
            }
        });
    }

    fn reconcile(&mut self, desired: &Desired) -> CycleOutcome {
        let now = Instant::now();
        self.join_retry.keep_only(&desired.assigned);
        let backoff = self.join_retry.waiting(now);
        let in_flight: BTreeSet<GroupId> = self.joining.union(&self.leaving).copied().collect();
        let plan = reconcile::plan_change(PlanInput {
            policy: &self.cfg.leave_policy,
            desired,
            state: &self.state,
            in_flight: &in_flight,
            join_backoff: &backoff,
            guard: &self.guard,
            now,
        });
        match plan.mass_drop_event {
            Some(MassDropEvent::HoldStarted { withdrawn, held }) => error!(
                withdrawn,
                held,
                "MASS WITHDRAWAL: MDMA withdrew {withdrawn} of {held} held namespaces in one poll; holding every leave for {:?} (it goes ahead only if the withdrawal persists)",
                self.cfg.leave_policy.mass_drop_hold
            ),
            Some(MassDropEvent::Released { withdrawn }) => warn!(
                withdrawn,
                "mass withdrawal persisted for {:?}: leaving, at most {} a minute",
                self.cfg.leave_policy.mass_drop_hold,
                self.cfg.leave_policy.max_leaves_per_minute
            ),
            Some(MassDropEvent::Cleared) => {
                info!("mass withdrawal reverted before the hold ended: nothing left")
            }
            None => {}
        }
        for (id, wait) in &plan.waiting {
            if self.waiting.get(id) != Some(wait) {
                debug!(namespace_id = %id, ?wait, "withdrawn, not left yet");
            }
        }
        self.waiting = plan.waiting;
        let outcome = CycleOutcome::Planned {
            joins: plan.joins.len(),
            leaves: plan.leaves.len(),
        };
        if self.cfg.dry_run {
            for id in &plan.joins {
                info!(namespace_id = %id, "dry run: would join (fleet-join, then confirm)");
            }
            for id in &plan.leaves {
                warn!(namespace_id = %id, "dry run: would leave (withdrawn by MDMA)");
            }
            plan.state.apply_to(&mut self.state);
            self.guard = plan.guard;
        } else {
            plan.state.apply_to(&mut self.state);
            let started_before = std::mem::replace(&mut self.guard, plan.guard).recent_leaves;
            // The plan (absence counts included) is recorded before anything starts, and a
            // leave — irreversible — starts only while its outcome can be recorded too.
            let recorded = self.persist();
            for id in plan.joins {
                self.spawn_join(id);
            }
            if !plan.leaves.is_empty() {
                if recorded && self.check_writable() {
                    for id in plan.leaves {
                        self.spawn_leave(id);
                    }
                } else {
                    // Held leaves did not start: they use none of the rate limit.
                    self.guard.recent_leaves = started_before;
                    debug!(
                        held = plan.leaves.len(),
                        "leaves held: the state file cannot be written, so their outcome could not be recorded"
                    );
                }
            }
        }
        outcome
    }

    /// Whether a file can be created next to the state file now (checked before leaves);
    /// a failure is recorded as a state write error.
    fn check_writable(&mut self) -> bool {
        match self.store.check_writable() {
            Ok(()) => true,
            Err(e) => {
                self.record_persist_error(&e);
                false
            }
        }
    }

    /// Logs a state write error once per kind (step and OS error, not the message, which
    /// names a random temp file) and shows it in the live status (`/readyz` not ready).
    fn record_persist_error(&mut self, e: &StateError) {
        let key = e.stable_key();
        let text = e.to_string();
        if self.persist_error.as_ref().map(|(k, _)| k) != Some(&key) {
            error!("{text}; admissions are not confirmed and no leave starts until the state can be written (retried every cycle)");
        }
        self.persist_error = Some((key, text.clone()));
        self.deps
            .telemetry
            .update(|st| st.state_write_error = Some(text));
    }

    fn persist(&mut self) -> bool {
        if self.cfg.dry_run {
            return false;
        }
        // While writes fail, the document is written again every cycle (not only on
        // change), so recovery is noticed.
        if self.persist_error.is_some() {
            self.store.forget_written();
        }
        match self.store.save(&self.state) {
            Ok(_) => {
                if self.persist_error.take().is_some() {
                    info!(path = %self.store.path().display(), "state file written again");
                    self.deps.telemetry.update(|st| st.state_write_error = None);
                }
                true
            }
            Err(e) => {
                self.record_persist_error(&e);
                false
            }
        }
    }

    async fn retry_mrtd_if_due(&mut self) {
        let Some(due) = self.mrtd.next_try else {
            return;
        };
        if Instant::now() < due {
            return;
        }
        match read_mrtd_blocking(&self.cfg).await {
            Ok(r) => {
                info!(mrtd = %r.mrtd, source = %r.source, "MRTD readable now: polls carry it from here on");
                self.deps.telemetry.set_mrtd_source(Some(r.source.as_str()));
                self.deps.telemetry.update(|st| {
                    st.mrtd = Some(r.mrtd.to_hex());
                    st.mrtd_source = Some(r.source.to_string());
                });
                self.mrtd = MrtdSlot {
                    value: Some(r.mrtd),
                    next_try: None,
                };
            }
            Err(e) => {
                debug!("MRTD still unreadable: {e}");
                self.mrtd.next_try = Some(Instant::now() + MRTD_RETRY_INTERVAL);
            }
        }
    }

    fn spawn<F>(&mut self, id: GroupId, fut: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let handle = self.tasks.spawn(fut);
        self.task_ids.insert(handle.id(), id);
    }

    fn spawn_join(&mut self, id: GroupId) {
        info!(namespace_id = %id, "joining (fleet-join)");
        let merod = Arc::clone(&self.deps.merod);
        let mdma = Arc::clone(&self.deps.mdma);
        let peer_id = self.peer_id.clone();
        let permits = Arc::clone(&self.join_permits);
        let events = self.events_tx.clone();
        let join_timeout = self.cfg.join_timeout;
        let telemetry = Arc::clone(&self.deps.telemetry);
        self.joining.insert(id);
        let task = async move {
            let calls = Calls {
                merod,
                mdma,
                telemetry,
            };
            let started = Instant::now();
            let end = join_task(id, &calls, peer_id, permits, join_timeout, &events).await;
            let took = started.elapsed();
            // The loop owns the receiver for the life of every task.
            let _ = events.send(Event::JoinEnded { id, end, took });
        };
        self.spawn(id, task.instrument(info_span!("join", namespace_id = %id)));
    }

    fn spawn_leave(&mut self, id: GroupId) {
        warn!(namespace_id = %id, "leaving: withdrawn by MDMA (irreversible: merod purges this namespace's keys)");
        let merod = Arc::clone(&self.deps.merod);
        let events = self.events_tx.clone();
        let leave_timeout = self.cfg.leave_timeout;
        let telemetry = Arc::clone(&self.deps.telemetry);
        self.leaving.insert(id);
        let task = async move {
            let started = Instant::now();
            let end = leave_task(id, &merod, &telemetry, leave_timeout).await;
            let took = started.elapsed();
            let _ = events.send(Event::LeaveEnded { id, end, took });
        };
        self.spawn(id, task.instrument(info_span!("leave", namespace_id = %id)));
    }

    fn on_task_done(&mut self, done: Result<(tokio::task::Id, ()), tokio::task::JoinError>) {
        let task_id = match &done {
            Ok((id, ())) => *id,
            Err(e) => e.id(),
        };
        let Some(group) = self.task_ids.remove(&task_id) else {
            return;
        };
        if let Err(e) = done {
            if e.is_panic() {
                error!(namespace_id = %group, "join/leave task panicked; retried next cycle");
            }
            self.joining.remove(&group);
            self.leaving.remove(&group);
            self.publish();
        }
    }

    /// Records a failed join; returns the failures in a row and the wait before the next.
    fn back_off_join(&mut self, id: GroupId) -> (u32, Duration) {
        self.join_retry.fail(id, Instant::now(), fastrand::f64())
    }

    fn on_event(&mut self, event: Event) {
        match event {
            Event::Admitted { id, ack } => {
                Telemetry::count(&self.deps.telemetry.joins, Metric::Admitted);
                reconcile::apply(&mut self.state, Outcome::Admitted(id));
                info!(namespace_id = %id, "admitted by merod and listed by it");
                if self.persist() {
                    let _ = ack.send(());
                }
            }
            Event::JoinEnded { id, end, took } => {
                // Journal fields NAMESPACE_ID, OUTCOME, DURATION (s) on every join outcome.
                let duration = took.as_secs_f64();
                self.joining.remove(&id);
                let t = &self.deps.telemetry;
                match &end {
                    JoinEnd::Confirmed => Telemetry::count(&t.confirms, Metric::Ok),
                    JoinEnd::ConfirmFailed(e) if e.is_timeout() => {
                        Telemetry::count(&t.confirms, Metric::Timeout)
                    }
                    JoinEnd::ConfirmFailed(_) => Telemetry::count(&t.confirms, Metric::Error),
                    JoinEnd::ConfirmTimedOut(_) => Telemetry::count(&t.confirms, Metric::Timeout),
                    JoinEnd::NotAdmitted { .. } => Telemetry::count(&t.joins, Metric::NotAdmitted),
                    JoinEnd::Failed {
                        timed_out: true, ..
                    } => Telemetry::count(&t.joins, Metric::Timeout),
                    JoinEnd::Failed { .. } => Telemetry::count(&t.joins, Metric::Error),
                    JoinEnd::NotHeld => Telemetry::count(&t.joins, Metric::NotHeld),
                    JoinEnd::NotPersisted => {}
                }
                match end {
                    JoinEnd::Confirmed => {
                        // Logged before it is recorded: whoever sees the state file
                        // change also finds the line (a log-rotating test relies on it).
                        info!(namespace_id = %id, outcome = "confirmed", duration, "confirmed to MDMA");
                        reconcile::apply(&mut self.state, Outcome::Confirmed(id));
                        self.join_retry.succeed(id);
                        self.persist();
                    }
                    JoinEnd::NotAdmitted { status, reasons } => {
                        let (failures, wait) = self.back_off_join(id);
                        let reasons = if reasons.is_empty() {
                            "merod gave no reason".to_owned()
                        } else {
                            reasons.join("; ")
                        };
                        // Warned at the first refusal of a streak; the retries are info.
                        if failures == 1 {
                            warn!(namespace_id = %id, outcome = "not_admitted", duration, status, "not admitted (admitted: false): {reasons}; retrying in {wait:?}, backing off to {JOIN_RETRY_MAX:?}");
                        } else {
                            info!(namespace_id = %id, outcome = "not_admitted", duration, status, failures, "still not admitted (admitted: false): {reasons}; retrying in {wait:?}");
                        }
                    }
                    JoinEnd::Failed { reason, timed_out } => {
                        self.back_off_join(id);
                        let outcome = if timed_out { "timeout" } else { "error" };
                        warn!(namespace_id = %id, outcome, error_kind = "join", duration, "join failed: {reason}; retrying later");
                    }
                    JoinEnd::NotHeld => {
                        self.back_off_join(id);
                        warn!(namespace_id = %id, outcome = "not_held", duration, "merod said admitted: true but does not list the namespace; not recorded, retrying later");
                    }
                    JoinEnd::NotPersisted => {
                        self.back_off_join(id);
                        warn!(namespace_id = %id, outcome = "not_persisted", error_kind = "state", duration, "admission could not be persisted; not confirmed, retrying later");
                    }
                    JoinEnd::ConfirmFailed(e) => {
                        self.back_off_join(id);
                        warn!(namespace_id = %id, outcome = "confirm_failed", error_kind = "confirm", duration, "confirm failed: {e}; stays unconfirmed, retrying later");
                    }
                    JoinEnd::ConfirmTimedOut(limit) => {
                        self.back_off_join(id);
                        warn!(namespace_id = %id, outcome = "confirm_failed", error_kind = "confirm", duration, "confirm gave no answer within {limit:?}; stays unconfirmed, retrying later");
                    }
                }
            }
            Event::LeaveEnded { id, end, took } => {
                let duration = took.as_secs_f64();
                self.leaving.remove(&id);
                match end {
                    LeaveEnd::Left => {
                        Telemetry::count(&self.deps.telemetry.leaves, Metric::Left);
                        info!(namespace_id = %id, outcome = "left", duration, "left: merod no longer holds the namespace");
                        reconcile::apply(&mut self.state, Outcome::Left(id));
                        self.persist();
                    }
                    LeaveEnd::StillHeld { reason, timed_out } => {
                        let outcome = if timed_out {
                            Metric::Timeout
                        } else {
                            Metric::Failed
                        };
                        Telemetry::count(&self.deps.telemetry.leaves, outcome);
                        warn!(namespace_id = %id, outcome = "failed", error_kind = "leave", duration, "leave not done ({reason}); stays a leave candidate");
                    }
                }
            }
        }
        self.publish();
    }
}

/// What a task needs to make its calls and time them.
struct Calls {
    merod: Arc<dyn Node>,
    mdma: Arc<dyn ControlPlane>,
    telemetry: Arc<Telemetry>,
}

/// Runs `fut` under `limit`, recording its duration as `call`. `None` on timeout.
async fn timed<T>(
    telemetry: &Telemetry,
    call: &'static str,
    limit: Duration,
    fut: impl Future<Output = T>,
) -> Option<T> {
    let started = Instant::now();
    let result = timeout(limit, fut).await.ok();
    telemetry.observe(call, started.elapsed());
    result
}

async fn join_task(
    id: GroupId,
    calls: &Calls,
    peer_id: PeerId,
    permits: Arc<Semaphore>,
    join_timeout: Duration,
    events: &mpsc::UnboundedSender<Event>,
) -> JoinEnd {
    let Ok(_permit) = permits.acquire_owned().await else {
        return JoinEnd::Failed {
            reason: "join slots closed".to_owned(),
            timed_out: false,
        };
    };
    let t = &calls.telemetry;
    let admission = match timed(t, "fleet_join", join_timeout, calls.merod.fleet_join(id)).await {
        None => {
            return JoinEnd::Failed {
                reason: format!("no answer within {join_timeout:?} (abandoned)"),
                timed_out: true,
            }
        }
        Some(Err(e)) => {
            return JoinEnd::Failed {
                timed_out: e.is_timeout(),
                reason: e.to_string(),
            }
        }
        Some(Ok(a)) => a,
    };
    if !admission.admitted {
        return JoinEnd::NotAdmitted {
            status: admission.status,
            reasons: admission.reasons,
        };
    }
    match timed(
        t,
        "namespace_get",
        CHECK_TIMEOUT,
        calls.merod.holds_namespace(id),
    )
    .await
    {
        Some(Ok(true)) => {}
        Some(Ok(false)) => return JoinEnd::NotHeld,
        Some(Err(e)) => {
            return JoinEnd::Failed {
                timed_out: e.is_timeout(),
                reason: format!("admitted, but the membership check failed: {e}"),
            }
        }
        None => {
            return JoinEnd::Failed {
                reason: format!(
                    "admitted, but the membership check gave no answer within {CHECK_TIMEOUT:?}"
                ),
                timed_out: true,
            }
        }
    }
    let (ack, acked) = oneshot::channel();
    if events.send(Event::Admitted { id, ack }).is_err() || acked.await.is_err() {
        return JoinEnd::NotPersisted;
    }
    let limit = MDMA_TIMEOUT + Duration::from_secs(1);
    match timed(t, "confirm", limit, calls.mdma.confirm(&peer_id, id)).await {
        Some(Ok(())) => JoinEnd::Confirmed,
        Some(Err(e)) => JoinEnd::ConfirmFailed(e),
        None => JoinEnd::ConfirmTimedOut(limit),
    }
}

async fn leave_task(
    id: GroupId,
    merod: &Arc<dyn Node>,
    telemetry: &Telemetry,
    leave_timeout: Duration,
) -> LeaveEnd {
    let (leave, timed_out) =
        match timed(telemetry, "leave", leave_timeout, merod.leave_namespace(id)).await {
            Some(Ok(())) => ("left".to_owned(), false),
            Some(Err(e)) => (e.to_string(), e.is_timeout()),
            None => (
                format!("no answer within {leave_timeout:?}: outcome unknown"),
                true,
            ),
        };
    let still_held = |reason: String| LeaveEnd::StillHeld { reason, timed_out };
    match timed(
        telemetry,
        "namespace_get",
        CHECK_TIMEOUT,
        merod.holds_namespace(id),
    )
    .await
    {
        Some(Ok(false)) => LeaveEnd::Left,
        Some(Ok(true)) => still_held(format!("leave: {leave}; merod still lists it")),
        Some(Err(e)) => still_held(format!("leave: {leave}; membership check failed: {e}")),
        None => still_held(format!(
            "leave: {leave}; membership check gave no answer within {CHECK_TIMEOUT:?}"
        )),
    }
}

/// Makes `dst` list `src` in order, touching (and allocating) only when they differ.
fn refill(dst: &mut Vec<GroupId>, src: &BTreeSet<GroupId>) {
    if !dst.iter().eq(src.iter()) {
        dst.clear();
        dst.extend(src.iter().copied());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);
    const MAX: Duration = Duration::from_secs(10);

    #[test]
    fn the_cadence_is_the_interval_while_polls_succeed() {
        assert_eq!(next_poll_delay(S, MAX, 0, 0.0), S);
        assert_eq!(next_poll_delay(S, MAX, 0, 0.99), S);
    }

    #[test]
    fn the_first_poll_waits_a_random_part_of_one_interval() {
        assert_eq!(first_poll_delay(S, 0.0), Duration::ZERO);
        assert_eq!(first_poll_delay(S, 0.25), Duration::from_millis(250));
        for jitter in [-1.0, 0.0, 0.5, 0.999, 1.0, 7.0] {
            assert!(first_poll_delay(S, jitter) <= S, "{jitter}");
        }
        // A long interval still polls within seconds of a start.
        let ten_minutes = Duration::from_secs(600);
        assert_eq!(
            first_poll_delay(ten_minutes, 0.5),
            Duration::from_millis(2500)
        );
        assert!(first_poll_delay(ten_minutes, 0.999) < FIRST_POLL_SPREAD_MAX);
    }

    #[test]
    fn failed_polls_back_off_exponentially_with_jitter_up_to_the_cap() {
        // base 2, 4, 8, 10, 10 s; the wait is between half the base and the base.
        for (failures, base) in [(1, 2.0), (2, 4.0), (3, 8.0), (4, 10.0), (60, 10.0)] {
            let lo = next_poll_delay(S, MAX, failures, 0.0).as_secs_f64();
            let hi = next_poll_delay(S, MAX, failures, 0.999_999).as_secs_f64();
            assert!(
                (lo - (base / 2.0_f64).max(1.0)).abs() < 1e-6,
                "{failures}: {lo}"
            );
            assert!((hi - base).abs() < 1e-3, "{failures}: {hi}");
        }
        // Never past the cap, never below the interval, whatever the jitter says.
        for failures in 0..100 {
            for jitter in [-1.0, 0.0, 0.5, 1.0, 7.0] {
                let d = next_poll_delay(S, MAX, failures, jitter);
                assert!(d >= S && d <= MAX, "{failures} {jitter}: {d:?}");
            }
        }
        // A cap below the interval keeps the interval.
        assert_eq!(
            next_poll_delay(Duration::from_secs(5), S, 3, 0.5),
            Duration::from_secs(5)
        );
    }

    #[test]
    fn a_poll_that_timed_out_is_counted_as_timeout_not_error() {
        let url: url::Url = "https://mdma.test/api/fleet/should-join".parse().unwrap();
        let timeout = PollError::Request(RequestError::Timeout {
            url: url.clone(),
            timeout: Duration::from_secs(10),
        });
        assert_eq!(poll_outcome(&timeout), Metric::Timeout);
        let deadline = PollError::Deadline {
            timeout: Duration::from_secs(11),
        };
        assert_eq!(poll_outcome(&deadline), Metric::Timeout);
        let status = PollError::Request(RequestError::Status { url, status: 503 });
        assert_eq!(poll_outcome(&status), Metric::Status);
    }
}
