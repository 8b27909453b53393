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

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot, Semaphore};
use tokio::task::JoinSet;
use tokio::time::{timeout, Instant, MissedTickBehavior};
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, info_span, warn, Instrument};

use crate::config::Config;
use crate::identity::{read_peer_id, IdentityError};
use crate::ids::{GroupId, PeerId};
use crate::mdma::{ConfirmError, ControlPlane, PollError, MDMA_TIMEOUT};
use crate::merod::Node;
use crate::mrtd::{read_mrtd, Mrtd, MrtdReading, MrtdUnavailable};
use crate::reconcile::{self, Desired, Guard, LeaveWait, MassDropEvent, Outcome};
use crate::state::{State, StateError, StateStore};

/// Bound of one readiness probe of merod.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(5);
/// Time between readiness probes.
pub const PROBE_INTERVAL: Duration = Duration::from_secs(1);
/// Wait before the one retry of reading the PeerId (merod may still be writing its config).
pub const PEER_ID_RETRY_DELAY: Duration = Duration::from_secs(2);
/// Bound of the membership check (`GET /admin-api/namespaces/{id}`).
pub const CHECK_TIMEOUT: Duration = Duration::from_secs(10);
/// How often an unreadable MRTD is tried again (a later module load can make it appear).
pub const MRTD_RETRY_INTERVAL: Duration = Duration::from_secs(300);
/// First wait before retrying a join that failed with an error (doubles, up to the cap).
pub const JOIN_RETRY_MIN: Duration = Duration::from_secs(2);
/// Longest wait before retrying a failing join.
pub const JOIN_RETRY_MAX: Duration = Duration::from_secs(60);
/// On shutdown, how long running joins and leaves may take to finish before they are cut.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);
/// A poll failing the same way is logged again after this many repeats.
pub const REPEAT_LOG_EVERY: u64 = 60;

/// The outside world the loop drives.
#[derive(Clone)]
pub struct Deps {
    /// MDMA.
    pub mdma: Arc<dyn ControlPlane>,
    /// merod.
    pub merod: Arc<dyn Node>,
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
}

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
    NotAdmitted { status: String },
    Failed(String),
    NotHeld,
    NotPersisted,
    ConfirmFailed(ConfirmError),
}

#[derive(Debug)]
enum LeaveEnd {
    Left,
    StillHeld(String),
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
    },
    LeaveEnded {
        id: GroupId,
        end: LeaveEnd,
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
                kind = e.kind(),
                "poll failed, cycle skipped (nothing joined or left): {reason}"
            );
            self.last = Some(reason);
        } else if self.count % REPEAT_LOG_EVERY == 0 {
            warn!(
                kind = e.kind(),
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
    in_flight: BTreeSet<GroupId>,
    join_retry: BTreeMap<GroupId, (Instant, Duration)>,
    tasks: JoinSet<()>,
    task_ids: HashMap<tokio::task::Id, GroupId>,
    join_permits: Arc<Semaphore>,
    events_tx: mpsc::UnboundedSender<Event>,
    events_rx: mpsc::UnboundedReceiver<Event>,
    failures: FailureStreak,
    waiting: BTreeMap<GroupId, LeaveWait>,
}

/// Runs the daemon until `shutdown` is cancelled: load the state, wait for merod, read
/// the identity, then reconcile every `poll_interval`.
///
/// Errors: [`DaemonError`] for an unusable state file or an unreadable PeerId. A shutdown
/// before merod answered returns `Ok`.
pub async fn run(cfg: Config, deps: Deps, shutdown: CancellationToken) -> Result<(), DaemonError> {
    let Some(mut sidecar) = Sidecar::start(cfg, deps, shutdown).await? else {
        return Ok(());
    };
    sidecar.run_loop().await;
    Ok(())
}

/// One full cycle (`fleet-sidecar once`): start as [`run`] does, poll once, run the
/// planned joins and leaves to their end, persist.
///
/// Errors: as [`run`]. `Ok(None)` when shut down before the cycle.
pub async fn once(
    cfg: Config,
    deps: Deps,
    shutdown: CancellationToken,
) -> Result<Option<CycleOutcome>, DaemonError> {
    let Some(mut sidecar) = Sidecar::start(cfg, deps, shutdown).await? else {
        return Ok(None);
    };
    let outcome = sidecar.cycle().await;
    sidecar.drain(None).await;
    Ok(Some(outcome))
}

/// Probes merod every [`PROBE_INTERVAL`] until it answers; logs one line per change of
/// what it sees. `false` if shut down first.
pub async fn wait_for_merod(merod: &dyn Node, shutdown: &CancellationToken) -> bool {
    let mut last: Option<String> = None;
    loop {
        let reason = match timeout(PROBE_TIMEOUT, merod.probe()).await {
            Ok(Ok(())) => {
                info!("merod admin API answers");
                return true;
            }
            Ok(Err(e)) => e.to_string(),
            Err(_) => format!("no answer within {PROBE_TIMEOUT:?}"),
        };
        if last.as_deref() != Some(reason.as_str()) {
            info!("waiting for merod: {reason}");
            last = Some(reason);
        }
        tokio::select! {
            () = tokio::time::sleep(PROBE_INTERVAL) => {}
            () = shutdown.cancelled() => return false,
        }
    }
}

/// Reads the MRTD on the blocking pool (file reads, ioctl). Errors: every source's
/// failure, as text.
async fn read_mrtd_blocking(cfg: &Config) -> Result<MrtdReading, String> {
    let tdx = cfg.tdx.clone();
    match tokio::task::spawn_blocking(move || read_mrtd(&tdx)).await {
        Ok(result) => result.map_err(|e: MrtdUnavailable| e.to_string()),
        Err(e) => Err(format!("the MRTD reader stopped: {e}")),
    }
}

impl Sidecar {
    /// Loads the state, waits for merod, reads the PeerId (one retry) and the MRTD
    /// (logged once if unreadable: polls then carry the PeerId only).
    ///
    /// Errors: [`DaemonError`]. `Ok(None)` when shut down while waiting for merod.
    pub async fn start(
        cfg: Config,
        deps: Deps,
        shutdown: CancellationToken,
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

        if !wait_for_merod(deps.merod.as_ref(), &shutdown).await {
            return Ok(None);
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

        let mrtd = match read_mrtd_blocking(&cfg).await {
            Ok(r) => {
                info!(mrtd = %r.mrtd, source = %r.source, "MRTD read");
                MrtdSlot {
                    value: Some(r.mrtd),
                    next_try: None,
                }
            }
            Err(e) => {
                error!(
                    "cannot read the MRTD ({e}); polling with the PeerId only: MDMA assigns no MRTD-gated namespace; retrying every {MRTD_RETRY_INTERVAL:?}"
                );
                MrtdSlot {
                    value: None,
                    next_try: Some(Instant::now() + MRTD_RETRY_INTERVAL),
                }
            }
        };

        let (events_tx, events_rx) = mpsc::unbounded_channel();
        Ok(Some(Self {
            join_permits: Arc::new(Semaphore::new(cfg.max_concurrent_joins)),
            cfg,
            deps,
            shutdown,
            peer_id,
            mrtd,
            store,
            state,
            guard: Guard::default(),
            in_flight: BTreeSet::new(),
            join_retry: BTreeMap::new(),
            tasks: JoinSet::new(),
            task_ids: HashMap::new(),
            events_tx,
            events_rx,
            failures: FailureStreak::default(),
            waiting: BTreeMap::new(),
        }))
    }

    /// The node's PeerId.
    pub fn peer_id(&self) -> &PeerId {
        &self.peer_id
    }

    /// The state as of now (in memory; persisted after every change).
    pub fn state(&self) -> &State {
        &self.state
    }

    /// Reconciles every `poll_interval` until shutdown, then lets running tasks finish for
    /// up to [`SHUTDOWN_GRACE`] and persists.
    pub async fn run_loop(&mut self) {
        let mut ticker = tokio::time::interval(self.cfg.poll_interval);
        ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let shutdown = self.shutdown.clone();
        loop {
            tokio::select! {
                biased;
                () = shutdown.cancelled() => break,
                Some(event) = self.events_rx.recv() => self.on_event(event),
                Some(done) = self.tasks.join_next_with_id(), if !self.tasks.is_empty() => {
                    self.on_task_done(done);
                }
                _ = ticker.tick() => {
                    tokio::select! {
                        _ = self.cycle() => {}
                        () = shutdown.cancelled() => break,
                    }
                }
            }
        }
        info!("shutting down");
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
        match polled {
            Err(e) => {
                self.failures.fail(&e);
                CycleOutcome::PollFailed(e)
            }
            Ok(desired) => {
                self.failures.succeed();
                self.reconcile(&desired)
            }
        }
    }

    fn reconcile(&mut self, desired: &Desired) -> CycleOutcome {
        let now = Instant::now();
        self.join_retry.retain(|_, (until, _)| *until > now);
        let backoff: BTreeSet<GroupId> = self.join_retry.keys().copied().collect();
        let plan = reconcile::plan(
            &self.cfg.leave_policy,
            desired,
            &self.state,
            &self.in_flight,
            &backoff,
            &self.guard,
            now,
        );
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
                debug!(group_id = %id, ?wait, "withdrawn, not left yet");
            }
        }
        self.waiting = plan.waiting;
        let outcome = CycleOutcome::Planned {
            joins: plan.joins.len(),
            leaves: plan.leaves.len(),
        };
        for id in plan.joins {
            self.spawn_join(id);
        }
        for id in plan.leaves {
            self.spawn_leave(id);
        }
        self.state = plan.state;
        self.guard = plan.guard;
        self.persist();
        outcome
    }

    fn persist(&mut self) -> bool {
        match self.store.save(&self.state) {
            Ok(_) => true,
            Err(e) => {
                error!("{e}; admissions are not confirmed until the state can be written");
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
        self.in_flight.insert(id);
        let handle = self.tasks.spawn(fut);
        self.task_ids.insert(handle.id(), id);
    }

    fn spawn_join(&mut self, id: GroupId) {
        info!(group_id = %id, "joining (fleet-join)");
        let merod = Arc::clone(&self.deps.merod);
        let mdma = Arc::clone(&self.deps.mdma);
        let peer_id = self.peer_id.clone();
        let permits = Arc::clone(&self.join_permits);
        let events = self.events_tx.clone();
        let join_timeout = self.cfg.join_timeout;
        let task = async move {
            let end = join_task(id, merod, mdma, peer_id, permits, join_timeout, &events).await;
            // The loop owns the receiver for the life of every task.
            let _ = events.send(Event::JoinEnded { id, end });
        };
        self.spawn(id, task.instrument(info_span!("join", group_id = %id)));
    }

    fn spawn_leave(&mut self, id: GroupId) {
        warn!(group_id = %id, "leaving: withdrawn by MDMA (irreversible: merod purges this namespace's keys)");
        let merod = Arc::clone(&self.deps.merod);
        let events = self.events_tx.clone();
        let leave_timeout = self.cfg.leave_timeout;
        let task = async move {
            let end = leave_task(id, merod, leave_timeout).await;
            let _ = events.send(Event::LeaveEnded { id, end });
        };
        self.spawn(id, task.instrument(info_span!("leave", group_id = %id)));
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
                error!(group_id = %group, "join/leave task panicked; retried next cycle");
            }
            self.in_flight.remove(&group);
        }
    }

    fn back_off_join(&mut self, id: GroupId) {
        let next = self
            .join_retry
            .get(&id)
            .map_or(JOIN_RETRY_MIN, |(_, last)| (*last * 2).min(JOIN_RETRY_MAX));
        self.join_retry.insert(id, (Instant::now() + next, next));
    }

    fn on_event(&mut self, event: Event) {
        match event {
            Event::Admitted { id, ack } => {
                reconcile::apply(&mut self.state, Outcome::Admitted(id));
                info!(group_id = %id, "admitted by merod and listed by it");
                if self.persist() {
                    let _ = ack.send(());
                }
            }
            Event::JoinEnded { id, end } => {
                self.in_flight.remove(&id);
                match end {
                    JoinEnd::Confirmed => {
                        reconcile::apply(&mut self.state, Outcome::Confirmed(id));
                        self.join_retry.remove(&id);
                        self.persist();
                        info!(group_id = %id, "confirmed to MDMA");
                    }
                    JoinEnd::NotAdmitted { status } => {
                        warn!(group_id = %id, status, "not admitted (admitted: false); retrying next cycle");
                    }
                    JoinEnd::Failed(reason) => {
                        self.back_off_join(id);
                        warn!(group_id = %id, "join failed: {reason}; retrying later");
                    }
                    JoinEnd::NotHeld => {
                        self.back_off_join(id);
                        warn!(group_id = %id, "merod said admitted: true but does not list the namespace; not recorded, retrying later");
                    }
                    JoinEnd::NotPersisted => {
                        self.back_off_join(id);
                        warn!(group_id = %id, "admission could not be persisted; not confirmed, retrying later");
                    }
                    JoinEnd::ConfirmFailed(e) => {
                        self.back_off_join(id);
                        warn!(group_id = %id, "confirm failed: {e}; stays unconfirmed, retrying later");
                    }
                }
            }
            Event::LeaveEnded { id, end } => {
                self.in_flight.remove(&id);
                match end {
                    LeaveEnd::Left => {
                        reconcile::apply(&mut self.state, Outcome::Left(id));
                        self.persist();
                        info!(group_id = %id, "left: merod no longer holds the namespace");
                    }
                    LeaveEnd::StillHeld(reason) => {
                        warn!(group_id = %id, "leave not done ({reason}); stays a leave candidate");
                    }
                }
            }
        }
    }
}

async fn join_task(
    id: GroupId,
    merod: Arc<dyn Node>,
    mdma: Arc<dyn ControlPlane>,
    peer_id: PeerId,
    permits: Arc<Semaphore>,
    join_timeout: Duration,
    events: &mpsc::UnboundedSender<Event>,
) -> JoinEnd {
    let Ok(_permit) = permits.acquire_owned().await else {
        return JoinEnd::Failed("join slots closed".to_owned());
    };
    let admission = match timeout(join_timeout, merod.fleet_join(id)).await {
        Err(_) => return JoinEnd::Failed(format!("no answer within {join_timeout:?} (abandoned)")),
        Ok(Err(e)) => return JoinEnd::Failed(e.to_string()),
        Ok(Ok(a)) => a,
    };
    if !admission.admitted {
        return JoinEnd::NotAdmitted {
            status: admission.status,
        };
    }
    match timeout(CHECK_TIMEOUT, merod.holds_namespace(id)).await {
        Ok(Ok(true)) => {}
        Ok(Ok(false)) => return JoinEnd::NotHeld,
        Ok(Err(e)) => {
            return JoinEnd::Failed(format!("admitted, but the membership check failed: {e}"))
        }
        Err(_) => {
            return JoinEnd::Failed(format!(
                "admitted, but the membership check gave no answer within {CHECK_TIMEOUT:?}"
            ))
        }
    }
    let (ack, acked) = oneshot::channel();
    if events.send(Event::Admitted { id, ack }).is_err() || acked.await.is_err() {
        return JoinEnd::NotPersisted;
    }
    match timeout(
        MDMA_TIMEOUT + Duration::from_secs(1),
        mdma.confirm(&peer_id, id),
    )
    .await
    {
        Ok(Ok(())) => JoinEnd::Confirmed,
        Ok(Err(e)) => JoinEnd::ConfirmFailed(e),
        Err(_) => JoinEnd::Failed(format!("confirm gave no answer within {MDMA_TIMEOUT:?}")),
    }
}

async fn leave_task(id: GroupId, merod: Arc<dyn Node>, leave_timeout: Duration) -> LeaveEnd {
    let leave = match timeout(leave_timeout, merod.leave_namespace(id)).await {
        Ok(Ok(())) => "left".to_owned(),
        Ok(Err(e)) => e.to_string(),
        Err(_) => format!("no answer within {leave_timeout:?}: outcome unknown"),
    };
    match timeout(CHECK_TIMEOUT, merod.holds_namespace(id)).await {
        Ok(Ok(false)) => LeaveEnd::Left,
        Ok(Ok(true)) => LeaveEnd::StillHeld(format!("leave: {leave}; merod still lists it")),
        Ok(Err(e)) => LeaveEnd::StillHeld(format!("leave: {leave}; membership check failed: {e}")),
        Err(_) => LeaveEnd::StillHeld(format!(
            "leave: {leave}; membership check gave no answer within {CHECK_TIMEOUT:?}"
        )),
    }
}
