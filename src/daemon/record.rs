//! The record: the state, the file it is persisted to, and a failing write.
//!
//! The state changes only through [`Record::record`] (an outcome, persisted at once) and
//! [`Record::record_plan`] (a cycle's plan, persisted when a failing write is due again), so
//! "nothing is confirmed, and no leave starts, before its record is on disk" is kept here:
//! each returns whether the state is on disk, and the loop acts only on `true`.

use std::sync::Arc;

use tokio::time::Instant;
use tracing::{error, info};

use crate::backoff::{self, RETRY_MAX, RETRY_MIN};
use crate::ids::GroupId;
use crate::reconcile::{self, Outcome, StateChange};
use crate::state::{State, StateError, StateStore};
use crate::telemetry::Telemetry;

/// The state, its store and a failing write.
pub(super) struct Record {
    /// The state as of now (the file holds it unless a write failed).
    state: State,
    /// The state file.
    store: StateStore,
    /// A dry run: nothing is written.
    dry_run: bool,
    /// The failing state write, while writes fail.
    failure: Option<WriteFailure>,
    /// Where writes are counted and a failing one is shown.
    telemetry: Arc<Telemetry>,
}

/// A state write failing: which fault (to log it once), and when the loop tries again.
struct WriteFailure {
    /// [`StateError::stable_key`] of the last failure.
    key: String,
    /// Its message (also in the live status, so `/readyz` is not ready).
    text: String,
    /// Failed attempts in a row.
    failures: u32,
    /// Before this, a cycle does not try to write again (an outcome to record still does).
    retry_at: Instant,
}

impl Record {
    /// The state loaded from `store`, written to it from now on (never in a dry run).
    pub(super) fn new(
        state: State,
        store: StateStore,
        dry_run: bool,
        telemetry: Arc<Telemetry>,
    ) -> Self {
        Self {
            state,
            store,
            dry_run,
            failure: None,
            telemetry,
        }
    }

    /// The state as of now.
    pub(super) fn state(&self) -> &State {
        &self.state
    }

    /// The message of the failing state write, while writes fail.
    pub(super) fn write_error(&self) -> Option<&str> {
        self.failure.as_ref().map(|f| f.text.as_str())
    }

    /// Folds `outcome` into the state and persists it now (`publish` is called with the
    /// new state before the write). `true`: it is on disk.
    pub(super) fn record(&mut self, outcome: Outcome, publish: impl FnOnce(&State)) -> bool {
        reconcile::apply(&mut self.state, outcome);
        self.persist(publish)
    }

    /// Makes a cycle's `change` and, outside a dry run, records every join of `joins` as
    /// started (a join is recorded before it is sent: merod may hold the namespace from
    /// then on, whatever happens to this process); then persists, but while writes fail
    /// only once the back-off of the last failure has ended. `true`: it is on disk (and
    /// the joins may be sent).
    pub(super) fn record_plan(
        &mut self,
        change: StateChange,
        joins: &[GroupId],
        publish: impl FnOnce(&State),
    ) -> bool {
        change.apply_to(&mut self.state);
        if self.dry_run {
            return false;
        }
        for id in joins {
            reconcile::apply(&mut self.state, Outcome::JoinStarted(*id));
        }
        match &self.failure {
            Some(f) if Instant::now() < f.retry_at => false,
            _ => self.persist(publish),
        }
    }

    /// Whether a file can be created next to the state file now (checked before leaves);
    /// a failure is recorded as a state write error.
    pub(super) fn check_writable(&mut self) -> bool {
        match self.store.check_writable() {
            Ok(()) => true,
            Err(e) => {
                self.fail(&e);
                false
            }
        }
    }

    /// Drops the last `n` leave stamps of the plan just recorded: those leaves were held
    /// (not started), so they use none of the rate limits.
    pub(super) fn unstamp_leaves(&mut self, n: usize) {
        let kept = self.state.recent_leaves_ms.len().saturating_sub(n);
        self.state.recent_leaves_ms.truncate(kept);
    }

    /// Writes the state if it changed (atomically; `false` when it could not be written or
    /// in a dry run). A change of time alone (the observed clock, poll counts) is written at
    /// most once a minute ([`StateStore::is_recorded`]): a pending leave costs no write per
    /// poll. Before a write `publish` brings the live status up to date, so it never lags
    /// the file: whoever sees the file change and then asks `/status` finds the change
    /// there. Nothing to write (an idle cycle): neither is done.
    pub(super) fn persist(&mut self, publish: impl FnOnce(&State)) -> bool {
        self.write(publish, false)
    }

    /// [`Record::persist`], time-only changes included (at shutdown, so the observed clock
    /// is kept up to the last poll).
    pub(super) fn persist_all(&mut self, publish: impl FnOnce(&State)) -> bool {
        self.write(publish, true)
    }

    fn write(&mut self, publish: impl FnOnce(&State), time_too: bool) -> bool {
        if self.dry_run {
            return false;
        }
        // While writes fail, the document is written again at each try (not only on
        // change), so recovery is noticed.
        if self.failure.is_some() {
            self.store.forget_written();
        }
        let recorded = if time_too {
            self.store.is_saved(&self.state)
        } else {
            self.store.is_recorded(&self.state, Instant::now())
        };
        if recorded {
            return true;
        }
        publish(&self.state);
        match self.store.save(&self.state) {
            Ok(_) => {
                Telemetry::count(&self.telemetry.state_writes, "ok");
                if self.failure.take().is_some() {
                    info!(path = %self.store.path().display(), "state file written again");
                    self.telemetry.update(|st| st.state_write_error = None);
                }
                true
            }
            Err(e) => {
                self.fail(&e);
                false
            }
        }
    }

    /// Counts a failed state write (or write check), logs it once per kind (step and OS
    /// error, not the message, which names a random temp file), shows it in the live status
    /// (`/readyz` not ready) and sets when the loop tries again: [`RETRY_MIN`] doubling to
    /// [`RETRY_MAX`], jittered.
    fn fail(&mut self, e: &StateError) {
        Telemetry::count(&self.telemetry.state_writes, "error");
        let key = e.stable_key();
        let text = e.to_string();
        let failures = self
            .failure
            .as_ref()
            .map_or(1, |f| f.failures.saturating_add(1));
        if self.failure.as_ref().map(|f| &f.key) != Some(&key) {
            error!("{text}; admissions are not confirmed and no leave starts until the state can be written (retried {RETRY_MIN:?} later, backing off to {RETRY_MAX:?})");
        }
        self.failure = Some(WriteFailure {
            key,
            text: text.clone(),
            failures,
            retry_at: Instant::now() + backoff::retry_delay(failures, fastrand::f64()),
        });
        self.telemetry
            .update(|st| st.state_write_error = Some(text));
    }
}
