//! The record: the state, the file it is persisted to, the write running off the loop
//! thread, and a failing write.
//!
//! The state changes only through [`Record::record`] (an outcome), [`Record::record_then`]
//! (an outcome something waits on) and [`Record::record_plan`] (a cycle's plan), and each
//! change is persisted from here. A write (render, write, fsync, rename, fsync of the
//! directory) never runs on the loop thread: it runs on a blocking thread, one at a time,
//! and the changes made meanwhile are coalesced into the next write. What may only happen
//! once a change is on disk (confirming an admission, sending a join recorded as started,
//! starting a leave) waits here as an [`AfterWrite`], tagged with the change's sequence
//! number, and is handed back to the loop only when a write covering that change
//! succeeded ([`Record::on_written`]); a failed write drops what waited on it. So a slow
//! fsync delays only what waits for that write, never the poll or `/healthz`, and
//! "nothing is confirmed, and no leave starts, before its record is on disk" is kept here.

use std::collections::{BTreeSet, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::oneshot;
use tokio::task::{JoinError, JoinHandle};
use tokio::time::Instant;
use tracing::{debug, error, info};

use crate::backoff::{self, RETRY_MAX, RETRY_MIN};
use crate::ids::GroupId;
use crate::reconcile::{self, Outcome, StateChange};
use crate::state::{State, StateError, StateStore, WriteOutcome};
use crate::telemetry::{unix_now, Telemetry};

/// How long a state write may run before it counts as stalled (a hung disk): then
/// `/readyz` is not ready, one line is logged, and the status, `STATUS=` and
/// `fleet_sidecar_state_write_stalled` say so until it ends. A write takes milliseconds on a
/// healthy disk and a few seconds on a slow one (as long as shutdown waits for one,
/// [`SHUTDOWN_WRITE_WAIT`](crate::jobs::limits::SHUTDOWN_WRITE_WAIT)); the joins, confirms and
/// leaves waiting for it wait meanwhile, the heartbeat does not.
pub(crate) const WRITE_STALLED_AFTER: Duration = Duration::from_secs(10);

/// The state, its store, the write in flight and a failing write.
pub(super) struct Record {
    /// The state as of now (the file holds it once the writes in flight and due are done,
    /// unless a write failed).
    state: State,
    /// The state file, as of the last write that succeeded.
    store: StateStore,
    /// A dry run: nothing is written.
    dry_run: bool,
    /// The failing state write, while writes fail.
    failure: Option<WriteFailure>,
    /// Where writes are counted and a failing one is shown.
    telemetry: Arc<Telemetry>,
    /// The sequence number of the latest change to `state` (one per recorded change).
    changed: u64,
    /// Advanced by every change that may touch the sets (`admitted`, `confirmed`,
    /// `joining`); a cycle that changes only the clock leaves it (see
    /// [`Record::membership`]).
    membership: u64,
    /// The write running on a blocking thread (at most one).
    writing: Option<Writing>,
    /// What waits for its change to be on disk, in the order of the changes: the
    /// sequence number of the change, and what to do then.
    waiting: VecDeque<(u64, AfterWrite)>,
}

/// What may happen only once the change it follows is on disk.
#[derive(Debug)]
pub(super) enum AfterWrite {
    /// Acknowledge an admission to its join task, which then confirms it to MDMA.
    Ack {
        /// The namespace admitted.
        id: GroupId,
        /// The join task's acknowledgement.
        ack: oneshot::Sender<bool>,
    },
    /// Send a join recorded as started.
    Join(GroupId),
    /// Start a leave (its stamp is recorded, and a file could be created beside the state
    /// file after the write: its outcome can be recorded).
    Leave(GroupId),
}

/// The write on its blocking thread.
struct Writing {
    /// The sequence number of the latest change it writes.
    seq: u64,
    /// The [`Record::membership`] of the state it writes.
    membership: u64,
    /// When it started.
    started: Instant,
    /// When it started (Unix s), once it ran past [`WRITE_STALLED_AFTER`] and was told.
    stalled_since: Option<f64>,
    /// It gives back the state written and how the write went.
    handle: JoinHandle<WriteOutcome>,
}

/// A write that ended (from [`Record::written`]), to give to [`Record::on_written`].
pub(super) struct Written {
    /// The sequence number of the latest change it wrote.
    seq: u64,
    /// The [`Record::membership`] of the state it wrote.
    membership: u64,
    /// How it went (`Err`: its thread panicked).
    outcome: Result<WriteOutcome, JoinError>,
}

/// A state write failing: which fault (to log it once), and when the loop tries again.
struct WriteFailure {
    /// [`StateError::stable_key`] of the last failure.
    key: String,
    /// The failure (its message is also in the live status, so `/readyz` is not ready).
    error: Arc<StateError>,
    /// Failed attempts in a row.
    failures: u32,
    /// Before this, a cycle does not try to write again (an outcome to record still does).
    retry_at: Instant,
}

impl Record {
    /// The state loaded from `store`, written to it from now on (never in a dry run).
    pub(super) fn new(
        state: State,
        mut store: StateStore,
        dry_run: bool,
        telemetry: Arc<Telemetry>,
    ) -> Self {
        // Loaded as the file holds it: its sets are version 0, not walked until they move.
        store.adopt_sets_version(&state, 0);
        Self {
            state,
            store,
            dry_run,
            failure: None,
            telemetry,
            changed: 0,
            membership: 0,
            writing: None,
            waiting: VecDeque::new(),
        }
    }

    /// The state as of now.
    pub(super) fn state(&self) -> &State {
        &self.state
    }

    /// Which version of the sets (`admitted`, `confirmed`, `joining`) the state holds: it
    /// moves with every outcome recorded and every plan that prunes or starts a join, so
    /// one seen before means the sets are those seen then, without walking them (at
    /// 10,000 namespaces that walk, every poll, is what an idle cycle costs most).
    pub(super) fn membership(&self) -> u64 {
        self.membership
    }

    /// The failing state write, while writes fail.
    pub(super) fn write_error(&self) -> Option<Arc<StateError>> {
        self.failure.as_ref().map(|f| Arc::clone(&f.error))
    }

    /// Whether a write runs.
    pub(super) fn writing(&self) -> bool {
        self.writing.is_some()
    }

    /// The namespaces whose join or leave waits for a write (planning counts them as in
    /// flight, so a later cycle does not plan them again).
    pub(super) fn awaiting(&self) -> BTreeSet<GroupId> {
        self.waiting
            .iter()
            .filter_map(|(_, after)| match after {
                AfterWrite::Join(id) | AfterWrite::Leave(id) => Some(*id),
                AfterWrite::Ack { .. } => None,
            })
            .collect()
    }

    /// Folds `outcome` into the state and persists it (`publish` is called with the new
    /// state before the write starts): a write starts now, or, while one runs, follows it.
    pub(super) fn record(&mut self, outcome: Outcome, publish: impl FnOnce(&State)) {
        reconcile::apply(&mut self.state, outcome);
        self.changed += 1;
        self.membership += 1;
        self.persist(publish);
    }

    /// [`Record::record`], with `after` to do once the change is on disk: given back now
    /// when it already is (nothing to write), else by the [`Record::on_written`] of the
    /// write that puts it there; dropped in a dry run or when that write fails.
    pub(super) fn record_then(
        &mut self,
        outcome: Outcome,
        after: AfterWrite,
        publish: impl FnOnce(&State),
    ) -> Option<AfterWrite> {
        self.record(outcome, publish);
        if self.dry_run {
            return None;
        }
        self.wait_for_change(after)
    }

    /// Makes a cycle's `change` and, outside a dry run, records every join of `joins` as
    /// started (a join is recorded before it is sent: merod may hold the namespace from
    /// then on, whatever happens to this process); then persists, but while writes fail
    /// only once the back-off of the last failure has ended. The joins and the `leaves`
    /// (whose stamps `change` holds) wait for that write: the joins already on disk are
    /// given back now; the rest come from [`Record::on_written`]. Held (not started, the
    /// leaves' stamps dropped so they use none of the rate limits) while the state cannot
    /// be written; nothing in a dry run.
    pub(super) fn record_plan(
        &mut self,
        change: StateChange,
        joins: &[GroupId],
        leaves: &[GroupId],
        publish: impl FnOnce(&State),
    ) -> Vec<AfterWrite> {
        if change.changes_membership() || !joins.is_empty() {
            self.membership += 1;
        }
        change.apply_to(&mut self.state);
        self.changed += 1;
        if self.dry_run {
            return Vec::new();
        }
        for id in joins {
            reconcile::apply(&mut self.state, Outcome::JoinStarted(*id));
        }
        let backing_off = self.writing.is_none()
            && self
                .failure
                .as_ref()
                .is_some_and(|f| Instant::now() < f.retry_at);
        if backing_off {
            self.hold(joins.len(), leaves.len());
            return Vec::new();
        }
        if !leaves.is_empty() {
            // A leave starts only after a write that recorded its stamp and the probe
            // after it, even if nothing else changed.
            self.store.forget_written();
        }
        self.persist(publish);
        let afters = joins
            .iter()
            .map(|id| AfterWrite::Join(*id))
            .chain(leaves.iter().map(|id| AfterWrite::Leave(*id)));
        afters
            .filter_map(|after| self.wait_for_change(after))
            .collect()
    }

    /// `after` waits for the latest change, or is given back if no write is due for it.
    fn wait_for_change(&mut self, after: AfterWrite) -> Option<AfterWrite> {
        if self.writing.is_none() {
            // Nothing runs: the change was on disk already, or its write could not start.
            return self.failure.is_none().then_some(after);
        }
        self.waiting.push_back((self.changed, after));
        None
    }

    /// Joins and leaves of a plan not started because the state cannot be written now.
    fn hold(&mut self, joins: usize, leaves: usize) {
        if joins > 0 {
            debug!(
                held = joins,
                "joins held: the state file cannot be written, so the join could not be recorded first"
            );
        }
        if leaves > 0 {
            self.unstamp_leaves(leaves);
            debug!(
                held = leaves,
                "leaves held: the state file cannot be written, so their outcome could not be recorded"
            );
        }
    }

    /// Drops the last `n` leave stamps: those leaves were held (not started), so they use
    /// none of the rate limits. (Stamps are appended in the order of the changes, and the
    /// held leaves are always the latest ones.)
    fn unstamp_leaves(&mut self, n: usize) {
        let kept = self.state.recent_leaves_ms.len().saturating_sub(n);
        self.state.recent_leaves_ms.truncate(kept);
    }

    /// Persists the state if it changed (atomically, off the loop thread; never in a dry
    /// run). A change of time alone (the observed clock, poll counts) is written at most
    /// once a minute ([`StateStore::is_recorded`]): a pending leave costs no write per
    /// poll. While a write runs, the change follows it (coalesced). Before a write
    /// `publish` brings the live status up to date, so it never lags the file: whoever sees
    /// the file change and then asks `/status` finds the change there. Nothing to write (an
    /// idle cycle): neither is done.
    pub(super) fn persist(&mut self, publish: impl FnOnce(&State)) {
        self.start_write(publish, false);
    }

    /// Starts the write of the state if one is due and none runs (`time_too`: time-only
    /// changes too). `false`: nothing to write.
    fn start_write(&mut self, publish: impl FnOnce(&State), time_too: bool) -> bool {
        if self.dry_run {
            return false;
        }
        if self.writing.is_some() {
            // Checked again when it ends.
            return true;
        }
        // While writes fail, the document is written again at each try (not only on
        // change), so recovery is noticed.
        if self.failure.is_some() {
            self.store.forget_written();
        }
        let recorded = if time_too {
            self.store.is_saved(&self.state)
        } else {
            self.store
                .is_recorded_at(&self.state, Some(self.membership), Instant::now())
        };
        if recorded {
            return false;
        }
        publish(&self.state);
        let job = self.store.prepare_write(self.state.clone());
        let probe = self
            .waiting
            .iter()
            .any(|(_, after)| matches!(after, AfterWrite::Leave(_)));
        self.writing = Some(Writing {
            seq: self.changed,
            membership: self.membership,
            started: Instant::now(),
            stalled_since: None,
            handle: tokio::task::spawn_blocking(move || job.run(probe)),
        });
        true
    }

    /// The write running, once it ends (pending while none runs). Cancel-safe: a write not
    /// ended yet stays where it is. A write that was told as stalled is told as ended.
    pub(super) async fn written(&mut self) -> Written {
        let Some(writing) = &mut self.writing else {
            return std::future::pending().await;
        };
        let outcome = (&mut writing.handle).await;
        let (seq, membership) = (writing.seq, writing.membership);
        if writing.stalled_since.is_some() {
            info!(
                path = %self.store.path().display(),
                after_secs = writing.started.elapsed().as_secs(),
                "the stalled state write ended; joins, confirms and leaves go on"
            );
            self.telemetry.state_write_stalled.set(0);
            self.telemetry
                .update(|st| st.state_write_stalled_since = None);
        }
        self.writing = None;
        Written {
            seq,
            membership,
            outcome,
        }
    }

    /// When the write running counts as stalled ([`WRITE_STALLED_AFTER`] after it
    /// started); `None` while none runs, or once it was told.
    pub(super) fn stalls_at(&self) -> Option<Instant> {
        self.writing
            .as_ref()
            .filter(|w| w.stalled_since.is_none())
            .map(|w| w.started + WRITE_STALLED_AFTER)
    }

    /// Tells the write running as stalled, once (at [`Record::stalls_at`]): one error line,
    /// `/readyz` not ready, the status and `STATUS=` say since when, the gauge
    /// `fleet_sidecar_state_write_stalled` is 1. [`Record::written`] undoes it all.
    pub(super) fn on_stalled(&mut self) {
        let path = self.store.path().display().to_string();
        let Some(w) = self.writing.as_mut().filter(|w| w.stalled_since.is_none()) else {
            return;
        };
        let ran = w.started.elapsed();
        let since = unix_now() - ran.as_secs_f64();
        w.stalled_since = Some(since);
        error!(path, "a state write has not returned for {} s (a hung disk?): joins, confirms and leaves wait for it; polls go on", ran.as_secs());
        self.telemetry.state_write_stalled.set(1);
        self.telemetry
            .update(|st| st.state_write_stalled_since = Some(since));
    }

    /// Takes in a write that ended: what waited for the changes it wrote is given back
    /// (when it succeeded: confirm, send those joins, start those leaves); a failed write
    /// drops what waited (an admission is then not confirmed, a join not sent, a leave not
    /// started) and backs off. Then the changes made meanwhile are written.
    pub(super) fn on_written(
        &mut self,
        written: Written,
        publish: impl FnOnce(&State),
    ) -> Vec<AfterWrite> {
        let mut ready = Vec::new();
        let outcome = written.outcome.unwrap_or_else(|e| WriteOutcome {
            state: self.state.clone(),
            written: Err(StateError::Write {
                path: self.store.path().to_owned(),
                step: "write thread",
                source: std::io::Error::other(e.to_string()),
            }),
            probed: None,
        });
        match outcome.written {
            Ok(()) => {
                Telemetry::count(&self.telemetry.state_writes, "ok");
                self.store
                    .mark_written(outcome.state, Some(written.membership), Instant::now());
                if self.failure.take().is_some() {
                    info!(path = %self.store.path().display(), "state file written again");
                    self.telemetry.update(|st| st.state_write_error = None);
                }
                while self
                    .waiting
                    .front()
                    .is_some_and(|(seq, _)| *seq <= written.seq)
                {
                    ready.extend(self.waiting.pop_front().map(|(_, after)| after));
                }
                if let Some(Err(e)) = outcome.probed {
                    self.fail(e);
                    // No leave starts, neither of this write nor of a later one.
                    let released = ready
                        .iter()
                        .filter(|after| matches!(after, AfterWrite::Leave(_)))
                        .count();
                    ready.retain(|after| !matches!(after, AfterWrite::Leave(_)));
                    let later = self.drop_waiting(|after| matches!(after, AfterWrite::Leave(_)));
                    self.hold(0, released + later);
                }
            }
            Err(e) => {
                self.fail(e);
                let joins = self.drop_waiting(|after| matches!(after, AfterWrite::Join(_)));
                let leaves = self.drop_waiting(|after| matches!(after, AfterWrite::Leave(_)));
                // Acknowledgements dropped: their joins end as not persisted.
                self.drop_waiting(|_| true);
                self.hold(joins, leaves);
            }
        }
        if self.failure.is_none() && self.changed > written.seq {
            self.persist(publish);
        }
        if self.writing.is_none() {
            if self.failure.is_none() {
                // The changes since needed no write: on disk already.
                ready.extend(self.waiting.drain(..).map(|(_, after)| after));
            } else {
                // Not written (the probe failed): held like the rest.
                let joins = self.drop_waiting(|after| matches!(after, AfterWrite::Join(_)));
                self.drop_waiting(|_| true);
                self.hold(joins, 0);
            }
        }
        ready
    }

    /// Drops what waits and matches `which`; how many.
    fn drop_waiting(&mut self, which: impl Fn(&AfterWrite) -> bool) -> usize {
        let before = self.waiting.len();
        self.waiting.retain(|(_, after)| !which(after));
        before - self.waiting.len()
    }

    /// At shutdown: waits for the write running, then writes the state if it changed in
    /// anything, time included (so the observed clock is kept up to the last poll), and
    /// waits for that write; at most `bound` in all. What waited on a write is dropped (the
    /// joins and leaves start at the next run). `true`: the state is on disk (or, in a
    /// dry run, nothing is to be written).
    pub(super) async fn flush(&mut self, bound: Duration, publish: impl Fn(&State)) -> bool {
        if self.dry_run {
            return true;
        }
        let deadline = Instant::now() + bound;
        // The write running, the changes coalesced after it, the final write (time included),
        // and one retry of it if it fails.
        for _ in 0..4 {
            if self.writing.is_none() && !self.start_write(&publish, true) {
                break;
            }
            match tokio::time::timeout_at(deadline, self.written()).await {
                Ok(written) => drop(self.on_written(written, &publish)),
                Err(_) => {
                    error!(path = %self.store.path().display(), "the state write did not end within {bound:?} at shutdown; the file holds the last write that ended (writes are atomic), without the changes since");
                    return false;
                }
            }
        }
        self.waiting.clear();
        self.writing.is_none() && self.failure.is_none() && self.store.is_saved(&self.state)
    }

    /// Counts a failed state write (or write check), logs it once per kind (step and OS
    /// error, not the message, which names a random temp file), shows it in the live status
    /// (`/readyz` not ready) and sets when the loop tries again: [`RETRY_MIN`] doubling to
    /// [`RETRY_MAX`], jittered.
    fn fail(&mut self, e: StateError) {
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
            error: Arc::new(e),
            failures,
            retry_at: Instant::now() + backoff::RETRY.wait(failures, fastrand::f64()),
        });
        self.telemetry
            .update(|st| st.state_write_error = Some(text));
    }
}
