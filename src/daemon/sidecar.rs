//! The running sidecar and its loop: start-up, the cadence of cycles, one cycle (poll,
//! plan, start tasks, persist), and the events of the tasks folded into the state. The
//! [`Sidecar`] holds the owners below it (`record`, `work`, `cadence`, `planner`, `view`,
//! `beside`, `identity`) and is the only one that holds them all.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::oneshot;
use tokio::time::{timeout, Instant};
use tokio_util::sync::CancellationToken;
use tracing::{debug, debug_span, error, info, warn, Instrument};

use crate::config::Config;
use crate::ids::{GroupId, PeerId};
use crate::mdma::{Holding, NodeReport, PollError, Polled};
use crate::merod::TeeRole;
use crate::reconcile::{Desired, LeaveWait, MassDropEvent, Outcome};
use crate::state::{State, StateStore};
use crate::telemetry::{unix_now, Phase, Projection, SetsVersion, Telemetry};

use super::beside::Beside;
use super::deps::{DaemonError, Deps, NotPersisted};
use super::merod_view::MerodView;
use super::planner::Planner;
use super::poll::Cadence;
use super::record::{AfterWrite, Record, Written};
use super::startup::{self, Identity};
use super::tasks::{Calls, CheckFailed, Event, InFlight, JoinEnd, LeaveEnd, Next};
use crate::jobs::held::HELD_READ_TIMEOUT;
use crate::jobs::join_status::Attempt;
use crate::jobs::limits::{ALIVE_TURN, MDMA_DEADLINE, SHUTDOWN_GRACE, SHUTDOWN_WRITE_WAIT};

/// How one cycle went.
#[derive(Debug)]
pub enum CycleOutcome {
    /// The poll failed: nothing was planned.
    PollFailed(PollError),
    /// The poll succeeded, but merod has not answered since start-up: nothing was planned
    /// (joins and leaves wait for merod; the poll is the heartbeat).
    WaitingForMerod,
    /// The poll succeeded and this was started.
    Planned {
        /// Joins started.
        joins: usize,
        /// Leaves started.
        leaves: usize,
    },
}

/// The running sidecar: identity known, merod ready, state loaded. Each field is an owner
/// of one part of the loop's state; only the loop (this struct's methods) holds them all.
///
/// Not an API: public for the benches and `examples/cycle-profile` only, which time one
/// cycle; embed the loop with [`run`] or [`once`].
#[doc(hidden)]
pub struct Sidecar {
    /// MDMA, merod and the telemetry the loop reports to.
    deps: Deps,
    /// Cancelled to stop the loop.
    shutdown: CancellationToken,
    /// Who the node is: its PeerId and MRTD (retried while unreadable).
    identity: Identity,
    /// The state and its file: changed only by recording an outcome, which persists it.
    record: Record,
    /// The joins and leaves in flight, their join permits and both retry tables.
    work: InFlight,
    /// When the next poll is due, and the streak of failed polls.
    cadence: Cadence,
    /// What the last successful poll asked for and what planning remembers between polls
    /// (the mass-withdrawal guard, the withdrawn namespaces not left yet).
    planner: Planner,
    /// The background jobs watching merod (readiness, what it holds, join-status) and
    /// what the loop keeps of their reads.
    view: MerodView,
    /// The jobs the poll feeds and reads beside the loop: the node's files, the relay URL,
    /// what polls deliver, the inventory and the recovery envelopes.
    beside: Beside,
}

impl Sidecar {
    /// Loads the state and checks it can be written, reads the PeerId (merod's
    /// `config.toml` is there before merod answers) and the MRTD (logged once if
    /// unreadable: polls then carry the PeerId only). With `merod_wait` (`once`), merod is
    /// waited for first, at most that long; without it (`run`) merod is watched in the
    /// background and the loop polls from the start, joins and leaves waiting for merod.
    /// A PeerId that cannot be read before merod answers is read again after it has (one
    /// retry then).
    ///
    /// Errors: [`DaemonError`]. `Ok(None)` when shut down while waiting for merod.
    pub async fn start(
        cfg: Config,
        deps: Deps,
        shutdown: CancellationToken,
        merod_wait: Option<Duration>,
    ) -> Result<Option<Self>, DaemonError> {
        let mut store = StateStore::new(&cfg.state_file);
        let state = startup::load_state(&mut store)?;
        let telemetry = Arc::clone(&deps.telemetry);
        telemetry.update(|st| st.dry_run = cfg.dry_run);
        startup::warn_if_on_ram(&cfg.state_file, &telemetry);
        // merod is never called in a dry run; otherwise, whether it has answered yet.
        let Some(merod_answered) =
            startup::prepare(&cfg, &deps, &shutdown, &mut store, merod_wait).await?
        else {
            return Ok(None);
        };
        let Some((peer_id, merod_answered)) =
            startup::read_peer_id_at_start(&cfg, &deps, &shutdown, merod_answered).await?
        else {
            return Ok(None);
        };
        info!(peer_id = %peer_id, "identity read");
        startup::start_token_job(&cfg, &deps, &peer_id, &shutdown).await;
        let identity = Identity::read(peer_id, &cfg.tdx, &telemetry).await;
        identity.show_running(&telemetry, merod_answered);
        let view = if cfg.dry_run {
            MerodView::idle()
        } else {
            MerodView::start(
                &deps,
                &cfg.state_file,
                &identity.peer_id,
                merod_answered,
                &shutdown,
            )
        };
        let beside = Beside::start(&cfg, &deps, &identity.peer_id, &view.account, &shutdown);
        let mut sidecar = Self {
            view,
            beside,
            identity,
            record: Record::new(state, store, cfg.dry_run, Arc::clone(&telemetry)),
            work: InFlight::new(&cfg),
            cadence: Cadence::new(cfg.poll_interval, cfg.max_backoff),
            planner: Planner::new(cfg.leave_policy, cfg.dry_run, cfg.leave_orphans),
            deps,
            shutdown,
        };
        sidecar.publish();
        Ok(Some(sidecar))
    }

    /// `once`'s cycle after start-up: with `[registration]` and no stored token, waits for
    /// the first registration attempt to end (registered or not); waits for the first held
    /// read; polls once, runs the planned joins and leaves to their end, persists.
    ///
    /// Errors: [`DaemonError::NotPersisted`] when the state could not be written. `Ok(None)`
    /// when shut down before the cycle.
    pub(super) async fn once_cycle(&mut self) -> Result<Option<CycleOutcome>, DaemonError> {
        if let Some(job) = self.deps.token_job.clone() {
            tokio::select! {
                () = self.shutdown.cancelled() => return Ok(None),
                () = job.settled() => {}
            }
        }
        let mut held = self.view.held.clone();
        held.first_read(HELD_READ_TIMEOUT).await;
        let outcome = self.cycle().await;
        let persisted = self.drain(None).await;
        match self.record.write_error() {
            Some(e) => Err(DaemonError::NotPersisted(NotPersisted::Failed(e))),
            None if !persisted => Err(DaemonError::NotPersisted(NotPersisted::Unfinished(
                SHUTDOWN_WRITE_WAIT,
            ))),
            None => Ok(Some(outcome)),
        }
    }

    /// The node's PeerId.
    pub fn peer_id(&self) -> &PeerId {
        &self.identity.peer_id
    }

    /// The state as of now (in memory; persisted after every change).
    pub fn state(&self) -> &State {
        self.record.state()
    }

    /// Shows the loop's sets in the live status and the namespace gauges, and hands them to
    /// the jobs reporting on them when they may have changed since they were handed over.
    fn publish(&mut self) {
        let membership = self.record.membership();
        let sets = Some(self.planner.sets_version(membership));
        publish(
            &self.deps,
            &self.planner,
            &self.work,
            self.record.state(),
            sets,
        );
        self.beside
            .offer_membership(membership, self.record.state());
    }

    /// Reconciles every `poll_interval` (backing off while polls fail, see
    /// `next_poll_delay`) until shutdown, then lets running tasks finish for up to
    /// `SHUTDOWN_GRACE` (10 s) and persists.
    pub async fn run_loop(&mut self) {
        let shutdown = self.shutdown.clone();
        let mut next_poll = self.cadence.first_poll(Instant::now());
        // A turn at least every second, so the watchdog sees the loop alive between polls;
        // one timer for both, so polls a second apart are those turns (no wake-up of its own).
        let mut alive_at = Instant::now() + ALIVE_TURN;
        loop {
            self.deps.telemetry.mark_alive();
            let stalls_at = self.record.stalls_at();
            tokio::select! {
                biased;
                () = shutdown.cancelled() => break,
                next = self.work.next() => self.on_next(next),
                written = self.record.written() => self.on_written(written, true),
                () = crate::jobs::sleep_until(stalls_at) => self.record.on_stalled(),
                () = tokio::time::sleep_until(next_poll.min(alive_at)) => {
                    let started = Instant::now();
                    alive_at = started + ALIVE_TURN;
                    if started < next_poll {
                        continue;
                    }
                    tokio::select! {
                        _ = self.cycle() => {}
                        () = shutdown.cancelled() => break,
                    }
                    next_poll = self.cadence.next_poll(started);
                }
            }
        }
        info!("shutting down");
        self.deps.telemetry.update(|st| st.phase = Phase::Stopping);
        self.drain(Some(SHUTDOWN_GRACE)).await;
    }

    /// Waits for running tasks (all of them, or until `grace` runs out, then cuts the
    /// rest), folding in their events and the writes that end, and persists (waiting at
    /// most `SHUTDOWN_WRITE_WAIT` for the state writes). Without `grace` (`once`), the
    /// joins and leaves waiting for a write start when it ends and are waited for too; with
    /// it (shutdown), they are not started. `true`: the state is on disk.
    pub(super) async fn drain(&mut self, grace: Option<Duration>) -> bool {
        let deadline = grace.map(|g| Instant::now() + g);
        let start = grace.is_none();
        while self.work.running() > 0 || (start && self.record.writing()) {
            let stalls_at = self.record.stalls_at();
            tokio::select! {
                next = self.work.next() => self.on_next(next),
                written = self.record.written() => self.on_written(written, start),
                () = crate::jobs::sleep_until(stalls_at) => self.record.on_stalled(),
                () = crate::jobs::sleep_until(deadline) => {
                    warn!(running = self.work.running(), "cutting joins/leaves still running at shutdown; they are retried at the next start");
                    self.work.cut().await;
                    break;
                }
            }
        }
        while let Some(event) = self.work.try_event() {
            self.on_event(event);
        }
        self.persist_all().await
    }

    /// One cycle: poll; on success plan and start the joins and leaves, prune, persist.
    pub async fn cycle(&mut self) -> CycleOutcome {
        let telemetry = &self.deps.telemetry;
        self.identity.retry_mrtd_if_due(telemetry).await;
        let started = Instant::now();
        // Whatever the held refresh last published; the poll never waits for merod.
        let held = self.view.held.poll_field(started);
        let (files, relay_url) = self.beside.report();
        let account = self.view.account.get();
        let swarm = self.view.swarm.poll_field();
        let report = NodeReport {
            relay_url: Some(&relay_url),
            swarm_addrs: Some(&swarm),
            executor_account: Some(account.as_deref().unwrap_or_default()),
            held_namespaces: held.as_deref(),
            tls_cert_not_after: files.tls_cert_not_after.as_deref(),
            logs_token_fp: files.logs_token_fp.as_deref(),
        };
        // The answer keeps no addresses for the namespaces confirmed now: only a join uses
        // them (at 10,000 × 8 they are about 12 MB).
        let membership = self.record.membership();
        let (work, record) = (&self.work, &self.record);
        let answer = self.planner.answer_to_hold(membership, record.state(), || {
            let mut in_flight = work.in_flight();
            in_flight.extend(record.awaiting());
            in_flight
        });
        let held = Holding {
            answer,
            joined: Some(&record.state().confirmed),
        };
        let polled = match timeout(
            MDMA_DEADLINE,
            self.deps.mdma.should_join_if_changed(
                &self.identity.peer_id,
                self.identity.mrtd.as_ref(),
                report,
                held,
            ),
        )
        .instrument(debug_span!("poll"))
        .await
        {
            Ok(r) => r,
            Err(_) => Err(PollError::Deadline {
                timeout: MDMA_DEADLINE,
            }),
        };
        telemetry.observe("should_join", started.elapsed());
        let now = unix_now();
        match polled {
            Err(e) => {
                // Whatever the outage lasts, it is not observed time: no wait that guards a
                // leave (the grace, a mass-withdrawal hold) advances over it.
                self.planner.guard.poll_failed();
                let failures = self.cadence.fail(&e);
                Telemetry::count(&telemetry.polls, e.metric_label());
                telemetry.update(|st| {
                    st.heartbeats += 1;
                    st.last_poll_at = Some(now);
                    st.last_poll_error = Some(e.to_string());
                    st.consecutive_failures = failures;
                });
                CycleOutcome::PollFailed(e)
            }
            Ok(polled) => {
                self.cadence.succeed();
                Telemetry::count(&telemetry.polls, "ok");
                telemetry.last_ok_poll.set(now);
                telemetry.update(|st| {
                    st.heartbeats += 1;
                    st.last_poll_at = Some(now);
                    st.last_ok_poll_at = Some(now);
                    st.last_poll_error = None;
                    st.consecutive_failures = 0;
                });
                // An answer byte-for-byte the one planned from is that one again: its
                // deliveries were offered when it came (an offer of the same one is a
                // no-op), and the planner keeps it.
                if let Polled::Changed { mut answer, digest } = polled {
                    // What it delivers is installed beside the loop, never in it.
                    self.beside.deliver(&mut answer);
                    // Stored before the plan, so a status published while it is recorded
                    // is the status of this poll.
                    self.planner
                        .polled(Desired::from(answer), digest, membership);
                }
                if !self.view.up.is_up() {
                    // The poll was the heartbeat; joins and leaves wait for merod.
                    self.publish();
                    return CycleOutcome::WaitingForMerod;
                }
                self.on_held_read();
                self.find_orphans();
                let outcome = self.reconcile();
                self.publish();
                outcome
            }
        }
    }

    /// Finds the orphans by merod's list and this poll ([`reconcile::orphans`]): reported,
    /// and with `leave_orphans` recorded as admitted (persisted) so this cycle's plan
    /// leaves them through the stability wait, the guard and the rate limit.
    fn find_orphans(&mut self) {
        for id in self
            .planner
            .take_orphans(self.record.state(), self.record.membership())
        {
            info!(namespace_id = %id, "orphan taken as admitted (leave_orphans)");
            self.record(Outcome::Admitted(id));
        }
    }

    fn reconcile(&mut self) -> CycleOutcome {
        let now = Instant::now();
        let desired = &self.planner.desired;
        let (join_backoff, leave_backoff) = self.work.backoffs(desired, now);
        // The joins and leaves waiting for a write count as in flight: not planned again.
        let mut in_flight = self.work.in_flight();
        in_flight.extend(self.record.awaiting());
        let plan = self.planner.plan(
            self.record.state(),
            self.record.membership(),
            &in_flight,
            (&join_backoff, &leave_backoff),
            now,
        );
        let policy = &self.planner.policy;
        match plan.mass_drop_event {
            Some(MassDropEvent::HoldStarted { withdrawn, held }) => error!(
                withdrawn,
                held,
                "MASS WITHDRAWAL: MDMA withdrew {withdrawn} of {held} held namespaces in one poll; holding every leave for {:?} (it goes ahead only if the withdrawal persists)",
                policy.mass_drop_hold
            ),
            Some(MassDropEvent::Released { withdrawn }) => warn!(
                withdrawn,
                "mass withdrawal persisted for {:?}: leaving, at most {} a minute",
                policy.mass_drop_hold,
                policy.max_leaves_per_minute
            ),
            Some(MassDropEvent::Cleared) => {
                info!("mass withdrawal reverted before the hold ended: nothing left")
            }
            None => {}
        }
        for (id, wait) in &plan.waiting {
            if self.planner.waiting.get(id) != Some(wait) {
                debug!(namespace_id = %id, ?wait, "withdrawn, not left yet");
            }
        }
        self.planner.waiting = plan.waiting;
        if !self.planner.dry_run() {
            // A leave planned now starts only once the write recording it ends; until
            // then the status shows it as under way (as later plans do, which count it in
            // flight), never as neither pending nor leaving.
            for id in &plan.leaves {
                self.planner.waiting.insert(*id, LeaveWait::InFlight);
            }
        }
        let outcome = CycleOutcome::Planned {
            joins: plan.joins.len(),
            leaves: plan.leaves.len(),
        };
        self.planner.guard = plan.guard;
        // The plan (absence counts and joins included) is recorded before anything starts:
        // no join or leave starts before the write recording it ended (it then starts in
        // `on_written`), and a leave (irreversible) only while its outcome can be recorded
        // too (the write's probe).
        let ready = self
            .record
            .record_plan(plan.state, &plan.joins, &plan.leaves, |state| {
                publish(&self.deps, &self.planner, &self.work, state, None)
            });
        if self.planner.dry_run() {
            for id in &plan.joins {
                info!(namespace_id = %id, "dry run: would join (fleet-join, then confirm)");
            }
            for id in &plan.leaves {
                warn!(namespace_id = %id, "dry run: would leave (withdrawn by MDMA)");
            }
            return outcome;
        }
        self.after_write(ready, true);
        outcome
    }

    /// Takes in a state write that ended (see `Record::on_written`) and does what waited
    /// for it; `start`: the joins and leaves that waited start (not at shutdown).
    fn on_written(&mut self, written: Written, start: bool) {
        let ready = self.record.on_written(written, |state| {
            publish(&self.deps, &self.planner, &self.work, state, None)
        });
        self.after_write(ready, start);
        self.publish();
    }

    /// Does what waited for a write that succeeded: acknowledges admissions (the join task
    /// confirms only while the latest poll assigns the namespace), and with `start` sends
    /// the joins and starts the leaves. A leave whose namespace the latest poll assigns or
    /// retains again meanwhile is not started (its stamp stays: a leave budget errs on the
    /// side of fewer leaves).
    fn after_write(&mut self, ready: Vec<AfterWrite>, start: bool) {
        if ready.is_empty() {
            return;
        }
        let calls = self.calls();
        for after in ready {
            match after {
                AfterWrite::Ack { id, ack } => {
                    // Confirmed to MDMA only while the latest poll assigns it: one withdrawn
                    // (or moved to retain) meanwhile stays admitted, unconfirmed, and goes
                    // through the grace like any withdrawn namespace.
                    let _ = ack.send(self.planner.desired.assigned.contains(&id));
                }
                AfterWrite::Join(id) if start => {
                    let addrs = self
                        .planner
                        .desired
                        .admitter_addrs
                        .get(&id)
                        .cloned()
                        .unwrap_or_default();
                    let recorded_held = self.record.state().admitted.contains(&id);
                    self.work
                        .spawn_join(id, &calls, &self.identity.peer_id, addrs, recorded_held);
                }
                AfterWrite::Leave(id) if start => {
                    let desired = &self.planner.desired;
                    if desired.assigned.contains(&id) || desired.retain.contains(&id) {
                        info!(namespace_id = %id, "leave not started: the latest poll assigns or retains the namespace again");
                        continue;
                    }
                    let maybe_held = !self.record.state().admitted.contains(&id);
                    self.work.spawn_leave(id, &calls, maybe_held);
                }
                AfterWrite::Join(_) | AfterWrite::Leave(_) => {}
            }
        }
    }

    /// After a new read of what merod holds (see `MerodView::after_read`): takes it as
    /// merod's holdings for the orphans (see `find_orphans`), asks merod about
    /// the namespaces recorded as held that two reads in a row missed (a namespace is
    /// dropped only when merod answers it does not hold it, `Event::DriftChecked`, never on
    /// the list alone: it may lag an admission), and re-reads the role of a few confirmed
    /// ones (`Event::RoleChecked`).
    fn on_held_read(&mut self) {
        let state = self.record.state();
        let work = &self.work;
        let busy = |id: &GroupId| work.busy(id);
        let Some(checks) =
            self.view
                .after_read(&state.admitted, &state.confirmed, busy, Instant::now())
        else {
            return;
        };
        // merod's holdings for the orphans: this read, unless the loop saw an admission or
        // a leave after it started (that outcome asked for a newer read).
        self.planner.held_read(checks.read, checks.read_started);
        let calls = self.calls();
        for id in checks.drift {
            self.work.spawn_drift_check(id, &calls);
        }
        for (id, told) in checks.roles {
            self.work
                .spawn_role_check(id, &calls, &self.identity.peer_id, told);
        }
    }

    /// What a task needs for its calls (and only that: never the record).
    fn calls(&self) -> Calls {
        Calls {
            merod: self.deps.merod.clone(),
            mdma: self.deps.mdma.clone(),
            telemetry: self.deps.telemetry.clone(),
            latest_poll: self.planner.latest_poll(),
            account: self.view.account.clone(),
        }
    }

    /// Writes the state if it changed in anything, time included, after the write running
    /// (see `Record::flush`, bounded by `SHUTDOWN_WRITE_WAIT`): at shutdown.
    async fn persist_all(&mut self) -> bool {
        let (deps, planner, work) = (&self.deps, &self.planner, &self.work);
        self.record
            .flush(SHUTDOWN_WRITE_WAIT, |state| {
                publish(deps, planner, work, state, None)
            })
            .await
    }

    /// Folds `outcome` into the state and persists it (see `Record::record`).
    fn record(&mut self, outcome: Outcome) {
        self.record.record(outcome, |state| {
            publish(&self.deps, &self.planner, &self.work, state, None)
        });
    }

    /// Folds in what a task sent, or accounts for a task that ended.
    fn on_next(&mut self, next: Next) {
        match next {
            Next::Event(event) => self.on_event(event),
            Next::Ended(done) => {
                if self.work.on_task_done(done) {
                    self.publish();
                }
            }
        }
    }

    /// Folds one task event into the state: each end gives its own metric label, back-off
    /// decision and log line.
    pub(super) fn on_event(&mut self, event: Event) {
        match event {
            Event::Admitted { id, ack } => self.on_admitted(id, ack),
            Event::DriftChecked { id, held } => self.on_drift_checked(id, held),
            Event::RoleChecked { id, confirmed } => self.on_role_checked(id, confirmed),
            Event::JoinEnded {
                id,
                end,
                took,
                attempt,
                role,
            } => self.on_join_ended(id, end, took, attempt, role),
            Event::LeaveEnded { id, end, took } => self.on_leave_ended(id, end, took),
        }
        self.publish();
    }

    /// merod admitted `id` and lists it: recorded, and acknowledged to the join task once the
    /// admission is on disk (`after_write`).
    fn on_admitted(&mut self, id: GroupId, ack: oneshot::Sender<bool>) {
        Telemetry::count(&self.deps.telemetry.joins, "admitted");
        info!(namespace_id = %id, "admitted by merod and listed by it");
        self.planner.admitted(id);
        let ready = self.record.record_then(
            Outcome::Admitted(id),
            AfterWrite::Ack { id, ack },
            |state| publish(&self.deps, &self.planner, &self.work, state, None),
        );
        self.after_write(ready.into_iter().collect(), true);
    }

    /// merod was asked about `id`, recorded as held but missing from its list: dropped from
    /// the state only on merod's own "not held" (and while no join or leave of it runs).
    fn on_drift_checked(&mut self, id: GroupId, held: Result<bool, CheckFailed>) {
        self.work.check_ended(id);
        let recorded = self.record.state().admitted.contains(&id);
        match held {
            Ok(false) if recorded && !self.work.joins_or_leaves(&id) => {
                self.deps.telemetry.held_drift.inc();
                let assigned = self.planner.desired.assigned.contains(&id);
                let next = if assigned {
                    "joining it again (MDMA assigns it)"
                } else {
                    "nothing to leave"
                };
                warn!(namespace_id = %id, outcome = "drift", assigned, "merod no longer holds a namespace the state records as held (a restored snapshot, an operator's leave, a reset): dropped from the state; {next}");
                self.work.not_held(id);
                self.record(Outcome::Left(id));
            }
            Ok(_) => {}
            Err(why) => {
                debug!(namespace_id = %id, "missing from merod's list, but {why}: kept, asked again after the next read");
            }
        }
    }

    /// A role check of `id` ended; `confirmed`: the role a confirm with it was accepted.
    fn on_role_checked(&mut self, id: GroupId, confirmed: Option<Option<TeeRole>>) {
        self.work.check_ended(id);
        let Some(role) = confirmed else {
            return;
        };
        if !self.record.state().confirmed.contains(&id) {
            return;
        }
        let spelled = role.map_or("null", TeeRole::as_str);
        // A change is news; the first confirm with the role after a restart (nothing told
        // yet by this process) is not.
        if self.view.roles.told(id).is_some() {
            info!(namespace_id = %id, tee_role = spelled, "the node's role changed: confirmed again with it");
        } else {
            debug!(namespace_id = %id, tee_role = spelled, "confirmed again with the node's role (not told by this process yet)");
        }
        self.view.roles.confirmed_with(id, role);
    }

    /// The join of `id` ended: counted, logged, its fleet-join outcome kept for join-status,
    /// and a confirm recorded while MDMA still assigns it.
    fn on_join_ended(
        &mut self,
        id: GroupId,
        end: JoinEnd,
        took: Duration,
        attempt: Option<Box<Attempt>>,
        role: Option<Option<TeeRole>>,
    ) {
        let t = &self.deps.telemetry;
        if let Some(attempt) = attempt {
            self.view.join_status.record(id, *attempt);
            self.view.held.refresh_soon();
        }
        if let (true, Some(role)) = (end.succeeded(), role) {
            self.view.roles.confirmed_with(id, role);
        }
        if let Some(label) = end.metric_label() {
            Telemetry::count(&t.joins, label);
        }
        // Logged before it is recorded: whoever sees the state file change also finds the
        // line (a log-rotating test relies on it).
        let retry = self.work.join_ended(id, &end);
        end.log(id, took.as_secs_f64(), retry);
        // `confirmed` follows what MDMA assigns: a poll that withdrew it while the confirm
        // ran has pruned it, and it stays pruned.
        if matches!(end, JoinEnd::Confirmed | JoinEnd::ConfirmedHeld)
            && self.planner.desired.assigned.contains(&id)
        {
            self.record(Outcome::Confirmed(id));
        }
    }

    /// The leave of `id` ended: once merod no longer holds it (left, or never held) it is
    /// dropped from the state and from merod's holdings; else it backs off.
    fn on_leave_ended(&mut self, id: GroupId, end: LeaveEnd, took: Duration) {
        self.view.held.refresh_soon();
        Telemetry::count(&self.deps.telemetry.leaves, end.metric_label());
        let retry = self.work.leave_ended(id, &end);
        end.log(id, took.as_secs_f64(), retry);
        if end.succeeded() {
            self.planner.left(id);
            self.record(Outcome::Left(id));
        }
    }
}

/// Shows the loop's sets in the live status and the namespace gauges, `state` being the
/// record's (borrowed apart from the rest so the record can publish before it writes).
/// Shows the loop's sets in the live status; `sets`: their version, when known (see
/// [`SetsVersion`]; the closures the record calls with a state it just changed give none).
fn publish(
    deps: &Deps,
    planner: &Planner,
    work: &InFlight,
    state: &State,
    sets: Option<SetsVersion>,
) {
    deps.telemetry.publish(&Projection {
        desired: &planner.desired,
        state,
        joining: work.joining(),
        leaving: work.leaving(),
        waiting: &planner.waiting,
        orphans: planner.orphans(),
        mass_drop: planner.guard.mass_drop,
        mass_drop_hold: planner.policy.mass_drop_hold,
        sets,
    });
}
