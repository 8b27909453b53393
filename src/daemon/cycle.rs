//! The loop and the fold: the cadence of cycles, one cycle (poll, plan, start tasks,
//! persist), and the events of the tasks folded into the state.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::{timeout, Instant};
use tracing::{debug, debug_span, error, info, warn, Instrument};

use crate::ids::GroupId;
use crate::mdma::{PollError, MDMA_TIMEOUT};
use crate::reconcile::{self, Desired, MassDropEvent, Outcome, PlanInput};
use crate::state::StateError;
use crate::telemetry::{unix_now, Outcome as Metric, Phase, Telemetry};

use super::poll::{first_poll_delay, next_poll_delay, poll_outcome};
use super::tasks::{Event, JoinEnd, LeaveEnd};
use super::{
    CycleOutcome, Sidecar, WriteFailure, ALIVE_TURN, RETRY_MAX, RETRY_MIN, SHUTDOWN_GRACE,
};
use crate::backoff;

impl Sidecar {
    /// Reconciles every `poll_interval` (backing off while polls fail, see
    /// `next_poll_delay`) until shutdown, then lets running tasks finish for up to
    /// `SHUTDOWN_GRACE` (10 s) and persists.
    pub async fn run_loop(&mut self) {
        let shutdown = self.shutdown.clone();
        let mut next_poll =
            Instant::now() + first_poll_delay(self.cfg.poll_interval, fastrand::f64());
        // A turn at least every second, so the watchdog sees the loop alive between polls;
        // one timer for both, so polls a second apart are those turns (no wake-up of its own).
        let mut alive_at = Instant::now() + ALIVE_TURN;
        loop {
            self.deps.telemetry.mark_alive();
            tokio::select! {
                biased;
                () = shutdown.cancelled() => break,
                Some(event) = self.events_rx.recv() => self.on_event(event),
                Some(done) = self.tasks.join_next_with_id(), if !self.tasks.is_empty() => {
                    self.on_task_done(done);
                }
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
    pub(super) async fn drain(&mut self, grace: Option<Duration>) {
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
        .instrument(debug_span!("poll"))
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
                // Stored before the plan, so a status published while it is recorded is
                // the status of this poll.
                self.desired = Desired::from(answer);
                let outcome = self.reconcile();
                self.publish();
                outcome
            }
        }
    }

    fn reconcile(&mut self) -> CycleOutcome {
        let now = Instant::now();
        let desired = &self.desired;
        self.join_retry
            .keep_only(|id| desired.assigned.contains(id));
        self.leave_retry
            .keep_only(|id| !desired.assigned.contains(id) && !desired.retain.contains(id));
        let join_backoff = self.join_retry.waiting(now);
        let leave_backoff = self.leave_retry.waiting(now);
        let in_flight: BTreeSet<GroupId> = self.joining.union(&self.leaving).copied().collect();
        let plan = reconcile::plan_change(PlanInput {
            policy: &self.cfg.leave_policy,
            desired: &self.desired,
            state: &self.state,
            in_flight: &in_flight,
            join_backoff: &join_backoff,
            leave_backoff: &leave_backoff,
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
            // A join is recorded (joining) before it is sent: merod may hold the namespace
            // from then on, whatever happens to this process.
            for id in &plan.joins {
                reconcile::apply(&mut self.state, Outcome::JoinStarted(*id));
            }
            let started_before = std::mem::replace(&mut self.guard, plan.guard).recent_leaves;
            // The plan (absence counts and joins included) is recorded before anything
            // starts: no join or leave starts while it could not be recorded, and a leave
            // (irreversible) only while its outcome can be recorded too.
            let recorded = self.persist_when_due();
            if recorded {
                for id in plan.joins {
                    self.spawn_join(id);
                }
            } else if !plan.joins.is_empty() {
                debug!(
                    held = plan.joins.len(),
                    "joins held: the state file cannot be written, so the join could not be recorded first"
                );
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

    /// Counts a failed state write (or write check), logs it once per kind (step and OS
    /// error, not the message, which names a random temp file), shows it in the live status
    /// (`/readyz` not ready) and sets when the loop tries again: [`RETRY_MIN`] doubling to
    /// [`RETRY_MAX`], jittered.
    pub(super) fn record_persist_error(&mut self, e: &StateError) {
        Telemetry::count(&self.deps.telemetry.state_writes, Metric::Error);
        let key = e.stable_key();
        let text = e.to_string();
        let failures = self
            .persist_error
            .as_ref()
            .map_or(1, |f| f.failures.saturating_add(1));
        if self.persist_error.as_ref().map(|f| &f.key) != Some(&key) {
            error!("{text}; admissions are not confirmed and no leave starts until the state can be written (retried {RETRY_MIN:?} later, backing off to {RETRY_MAX:?})");
        }
        self.persist_error = Some(WriteFailure {
            key,
            text: text.clone(),
            failures,
            retry_at: Instant::now() + backoff::retry_delay(failures, fastrand::f64()),
        });
        self.deps
            .telemetry
            .update(|st| st.state_write_error = Some(text));
    }

    /// [`Sidecar::persist`] for the loop's own cycle: while writes fail, only once the
    /// back-off set by the last failure has ended (`false` before that: not written). An
    /// outcome to record (an admission, a confirm, a leave) calls `persist` and tries at once;
    /// those are already paced by their own back-off.
    fn persist_when_due(&mut self) -> bool {
        match &self.persist_error {
            Some(f) if Instant::now() < f.retry_at => false,
            _ => self.persist(),
        }
    }

    /// Writes the state if it changed (atomically; `false` when it could not be written or
    /// in a dry run). Before a write the live status is brought up to date, so it never
    /// lags the file: whoever sees the file change and then asks `/status` finds the change
    /// there. Nothing to write (an idle cycle): neither is done.
    pub(super) fn persist(&mut self) -> bool {
        if self.cfg.dry_run {
            return false;
        }
        // While writes fail, the document is written again at each try (not only on
        // change), so recovery is noticed.
        if self.persist_error.is_some() {
            self.store.forget_written();
        }
        if self.store.is_saved(&self.state) {
            return true;
        }
        self.publish();
        match self.store.save(&self.state) {
            Ok(_) => {
                Telemetry::count(&self.deps.telemetry.state_writes, Metric::Ok);
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

    /// Records a failed join; returns the failures in a row and the wait before the next.
    pub(super) fn back_off_join(&mut self, id: GroupId) -> (u32, Duration) {
        self.join_retry.fail(id, Instant::now(), fastrand::f64())
    }

    /// Records a failed leave; returns the failures in a row and the wait before the next.
    pub(super) fn back_off_leave(&mut self, id: GroupId) -> (u32, Duration) {
        self.leave_retry.fail(id, Instant::now(), fastrand::f64())
    }

    /// merod no longer holds `id` (left, or never held): drop it from the state, end its
    /// leave back-off, persist.
    fn record_gone(&mut self, id: GroupId) {
        reconcile::apply(&mut self.state, Outcome::Left(id));
        self.leave_retry.succeed(id);
        self.persist();
    }

    pub(super) fn on_event(&mut self, event: Event) {
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
                            warn!(namespace_id = %id, outcome = "not_admitted", duration, status, "not admitted (admitted: false): {reasons}; retrying in {wait:?}, backing off to {RETRY_MAX:?}");
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
                        self.record_gone(id);
                    }
                    LeaveEnd::NeverHeld => {
                        Telemetry::count(&self.deps.telemetry.leaves, Metric::NotHeld);
                        info!(namespace_id = %id, outcome = "not_held", duration, "dropped, no leave sent: merod does not hold it (its fleet-join never went through)");
                        self.record_gone(id);
                    }
                    LeaveEnd::StillHeld { reason, timed_out } => {
                        let outcome = if timed_out {
                            Metric::Timeout
                        } else {
                            Metric::Failed
                        };
                        Telemetry::count(&self.deps.telemetry.leaves, outcome);
                        let (failures, wait) = self.back_off_leave(id);
                        warn!(namespace_id = %id, outcome = "failed", error_kind = "leave", duration, failures, "leave not done ({reason}); stays a leave candidate, retrying in {wait:?}, backing off to {RETRY_MAX:?}");
                    }
                }
            }
        }
        self.publish();
    }
}
