//! Jobs beside the reconcile loop, one harness for all. A job is one type implementing
//! [`Job`]: what one run does, and the words its failure is told in. [`spawn`] owns
//! everything around the runs, the same for every job:
//! - the cadence ([`Schedule`]): the first run at once, then every `every` after a good run
//!   (or only when asked), a run soon when anyone holding its [`JobHandle`] asks, never two
//!   starts closer than `min_gap` (a burst of requests is one run); a job fed by requests
//!   that has nothing to do ([`Job::idle`]) skips a run then due; a job can wait for
//!   events of its own ([`Job::wake`]), taken as requests;
//! - after a failed run, the crate's one [`Backoff`] from its end to the next run; a deadline on every
//!   run (past it the run is cut and counts as a timeout); at shutdown the run in progress
//!   is dropped at once, so a job never holds up the shutdown grace;
//! - one log line per change of its failure (the first failure, a different one, the
//!   recovery), never one per run;
//! - its latest outcome published on a `watch` channel with when it was had ([`Latest`]):
//!   a reader (the poll) takes what was last published and never waits for a run;
//! - its metrics: `fleet_sidecar_job_runs_total{job,outcome}`,
//!   `fleet_sidecar_job_run_seconds{job}` and
//!   `fleet_sidecar_job_last_success_timestamp_seconds{job}`; and its entry in the live
//!   status (`/status` `jobs`, `fleet-sidecar status`): runs, the latest run, the latest
//!   good result, why it fails.
//!
//! A job never decides a join or a leave: what it publishes is read by the loop as one more
//! input, and a job that fails or hangs changes nothing the loop does but what that input
//! says.
//!
//! **The jobs' room.** This file is the harness; the jobs sit below it, one file each, and
//! a new job is one more file here and one line of wiring in the loop's room: in
//! `daemon/beside.rs` when the poll feeds or reads it, in `daemon/merod_view.rs` when it
//! watches merod.
//! Each file imports only from files on lower floors (`tests/layering.rs`):
//! - what several jobs and the loop share: `limits` (the bounds of every call beyond its
//!   client's timeout), `units` (the systemd units an install restarts, on D-Bus), `trees`
//!   (the walk of a namespace the inventory and the envelopes share, and which to walk
//!   again), `node_files` (the TLS certificate's expiry and the logs token's fingerprint,
//!   read again on change);
//! - what merod holds and whether it answers: `held` (the `held_namespaces` refresh),
//!   `readiness` (the one readiness probe), `merod_watch` (the probe until merod answers);
//! - the node's report beside `held_namespaces`: `account` (`executor_account`), `swarm`
//!   (`swarm_addrs`), `relay` (`relay_url`), and `join_status` (join outcomes told to MDMA);
//! - what is delivered, installed: `install` (what the three share: the delivery, the file
//!   work within its bound, the restarts, the error), `tls_install` (the certificate),
//!   `logs_token` (the log shippers' token and their configure scripts), `device_login`
//!   (merod's node key);
//! - what the node tells MDMA of its namespaces: `inventory` (the context inventory, which
//!   walks), `recovery` (the recovery envelopes, from the inventory's walks), each keeping
//!   its record beside the state file through `record_file`.
//!
//! `canary` is the test-only job that keeps "one file and one line of wiring" true.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{watch, Notify};
use tokio::time::{timeout, Instant};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::backoff::{asked_wait, Backoff, RETRY};
use crate::outcome::{CallOutcome, Timed};
use crate::telemetry::{unix_now, JobLabel, JobOutcomeLabel, Telemetry};

/// When a job runs.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Schedule {
    /// Between the starts of a good run and the next; `None`: only when asked.
    pub(crate) every: Option<Duration>,
    /// Shortest gap between the starts of two runs: a request that comes sooner waits for
    /// it, and the requests meanwhile make one run.
    pub(crate) min_gap: Duration,
    /// The bound of one run: past it the run is dropped and counts as a timeout.
    pub(crate) deadline: Duration,
    /// After the `n`-th failed run in a row, the wait from its end to the next run (a
    /// request brings it forward, `min_gap` still applies).
    pub(crate) backoff: Backoff,
}

impl Schedule {
    /// A run every `every` after a good one, each bounded by `deadline`; by default no gap
    /// beyond that between runs asked for, and the crate's [`RETRY`] back-off after a
    /// failure.
    pub(crate) const fn every(every: Duration, deadline: Duration) -> Self {
        Self {
            every: Some(every),
            min_gap: Duration::ZERO,
            deadline,
            backoff: RETRY,
        }
    }

    /// A run only when asked (or woken), each bounded by `deadline`; defaults as
    /// [`Schedule::every`].
    pub(crate) const fn when_asked(deadline: Duration) -> Self {
        Self {
            every: None,
            min_gap: Duration::ZERO,
            deadline,
            backoff: RETRY,
        }
    }

    /// The same, with `min_gap` between the starts of two runs.
    pub(crate) const fn min_gap(self, min_gap: Duration) -> Self {
        Self { min_gap, ..self }
    }

    /// The same, with `backoff` after a failed run.
    pub(crate) const fn backoff(self, backoff: Backoff) -> Self {
        Self { backoff, ..self }
    }
}

/// One job beside the loop: what one run does. Everything around the runs is the
/// harness's ([`spawn`]).
pub(crate) trait Job: Send + 'static {
    /// What a good run gives (published to the job's readers; cheap to clone: share big
    /// values behind an `Arc`).
    type Output: Clone + Send + Sync + 'static;
    /// Why a run failed; whether it ran out of time decides its metric label.
    type Error: std::error::Error + Timed + Send + Sync + 'static;

    /// The job's name, in its metrics (`job` label) and log lines (`job` field).
    const NAME: &'static str;
    /// What a failing run means, said once per change: `"{FAILING} ({why}); {EFFECT}"`.
    const FAILING: &'static str;
    /// What the loop does meanwhile (the second half of the failure's line). The default:
    /// the job's own work is retried with the back-off, and nothing else changes.
    const EFFECT: &'static str = "retried with the back-off";
    /// Said once when a run works again after a failure.
    const RECOVERED: &'static str;

    /// Whether a run walks every namespace the node holds: it then allocates and frees
    /// megabytes of small blocks among the loop's long-lived ones, and the heap's free
    /// pages are handed back to the system after it (see [`give_back_free_heap`]). The
    /// default: no.
    const WALKS_EVERY_NAMESPACE: bool = false;

    /// When it runs (read once, at [`spawn`]).
    fn schedule(&self) -> Schedule;

    /// One run. The harness bounds it by [`Schedule::deadline`] and drops it at shutdown,
    /// so it must leave nothing half-done that the next run cannot take up.
    ///
    /// Errors: [`Job::Error`], why this run failed.
    fn run(&mut self) -> impl Future<Output = Result<Self::Output, Self::Error>> + Send;

    /// After a failed run (an error or the deadline), with why (the message the log line
    /// carries): what the job withdraws of its earlier results, or shows of the failure
    /// (the default: nothing).
    fn failed(&mut self, _why: &str) {}

    /// The wait the failure's answer asked for (a `Retry-After`), if any: the next run waits
    /// at least that long (at most `backoff::RETRY_AFTER_MAX`), a request included. The
    /// default: none.
    fn retry_after(_error: &Self::Error) -> Option<Duration> {
        None
    }

    /// After a good run: whether the job is done (it then ends; the default: never).
    fn finished(&self) -> bool {
        false
    }

    /// Whether the job has nothing to do now (a job fed by requests, with its queue empty):
    /// a run then due is skipped (not run, not counted, nothing said), and the next waits
    /// for a request or the interval. So a back-off never ends in an empty run that would
    /// pass for a recovery. The default: never idle.
    fn idle(&self) -> bool {
        false
    }

    /// Waits for something of the job's own that calls for a run (a signal, a watched
    /// value, a time only the job knows); the harness awaits it beside its own cadence and
    /// treats its end as a request. It is dropped when the harness stops waiting (a run
    /// due, shutdown), so it must be cancel-safe: lose nothing when dropped at an await.
    /// The default: never.
    fn wake(&mut self) -> impl Future<Output = ()> + Send {
        std::future::pending()
    }
}

/// A job's latest outcome, as its readers see it.
#[derive(Debug)]
pub(crate) enum Latest<T> {
    /// No run ended yet.
    NotYet,
    /// The latest run was good.
    Good(Published<T>),
    /// The latest run failed or timed out: nothing is known (an older result is not used).
    /// Why is logged (each change once) and counted where it happened.
    Failed,
}

impl<T: Clone> Clone for Latest<T> {
    fn clone(&self) -> Self {
        match self {
            Latest::NotYet => Latest::NotYet,
            Latest::Good(p) => Latest::Good(p.clone()),
            Latest::Failed => Latest::Failed,
        }
    }
}

impl<T> Latest<T> {
    /// The latest good result if it is at most `max_age` old at `now`.
    pub(crate) fn fresh(&self, now: Instant, max_age: Duration) -> Option<&Published<T>> {
        match self {
            Latest::Good(p) if now.saturating_duration_since(p.started) <= max_age => Some(p),
            _ => None,
        }
    }
}

/// A good result and when it was had.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Published<T> {
    /// What the run gave.
    pub(crate) value: T,
    /// When the run that gave it started (what its age counts from: the result is at
    /// least as old as that).
    pub(crate) started: Instant,
    /// 1 for the first good run, then +1 per good run.
    pub(crate) generation: u64,
}

/// A reader of a job's latest outcome, and the way to ask it to run soon. Cheap to clone;
/// reading copies only what [`Job::Output`]'s clone copies.
#[derive(Debug)]
pub(crate) struct JobHandle<T> {
    latest: watch::Receiver<Latest<T>>,
    soon: Arc<Notify>,
}

impl<T> Clone for JobHandle<T> {
    fn clone(&self) -> Self {
        Self {
            latest: self.latest.clone(),
            soon: Arc::clone(&self.soon),
        }
    }
}

impl<T: Clone> JobHandle<T> {
    /// The latest outcome.
    pub(crate) fn latest(&self) -> Latest<T> {
        self.latest.borrow().clone()
    }

    /// Reads the latest outcome in place (no copy); hold the borrow briefly.
    pub(crate) fn with_latest<R>(&self, f: impl FnOnce(&Latest<T>) -> R) -> R {
        f(&self.latest.borrow())
    }

    /// The latest good run's value (a cheap clone, such as an `Arc`), `None` before the
    /// first and after a failed one: what a poll field reads.
    pub(crate) fn latest_good(&self) -> Option<T> {
        self.with_latest(|l| match l {
            Latest::Good(p) => Some(p.value.clone()),
            Latest::NotYet | Latest::Failed => None,
        })
    }

    /// Asks for a run soon (once `min_gap` after the last start has passed); returns at once.
    pub(crate) fn run_soon(&self) {
        self.soon.notify_one();
    }

    /// A handle on no job: nothing is ever published (what a dry run, which calls no
    /// merod, reads).
    pub(crate) fn idle() -> Self {
        let (_tx, latest) = watch::channel(Latest::NotYet);
        Self {
            latest,
            soon: Arc::new(Notify::new()),
        }
    }

    /// Waits until a run ends (good or not), at most `limit`.
    pub(crate) async fn first_outcome(&mut self, limit: Duration) {
        let _ = timeout(
            limit,
            self.latest.wait_for(|l| !matches!(l, Latest::NotYet)),
        )
        .await;
    }
}

/// Starts `job` on its [`Schedule`] until `shutdown` (or until it is
/// [`Job::finished`]); returns its readers' handle at once.
pub(crate) fn spawn<J: Job>(
    job: J,
    telemetry: Arc<Telemetry>,
    shutdown: CancellationToken,
) -> JobHandle<J::Output> {
    let (tx, latest) = watch::channel(Latest::NotYet);
    let soon = Arc::new(Notify::new());
    let asked = Arc::clone(&soon);
    // Every outcome is exported from the start (at 0), so dashboards and alerts see the
    // series before the first run ends.
    for outcome in [CallOutcome::Ok, CallOutcome::Error, CallOutcome::Timeout] {
        drop(telemetry.job_runs.get_or_create(&JobOutcomeLabel {
            job: J::NAME,
            outcome: outcome.label(),
        }));
    }
    tokio::spawn(drive(job, tx, asked, telemetry, shutdown));
    JobHandle { latest, soon }
}

/// Hands the heap's free pages back to the system (glibc's `malloc_trim`). glibc gives back
/// only the free space at the top of its heap; the holes a walk of 10,000 namespaces leaves
/// between longer-lived blocks stay resident otherwise (at 10,000 × 8 with every job on,
/// the RSS after a scan is 17.2 MiB with it and 19.8 MiB without). It runs once per walk,
/// so at most once a minute per job. A no-op outside glibc.
fn give_back_free_heap() {
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim only releases memory the allocator holds free; it takes the
    // allocator's own locks and may be called from any thread at any time.
    unsafe {
        nix::libc::malloc_trim(0);
    }
}

/// The harness's loop around one job (see the module docs).
async fn drive<J: Job>(
    mut job: J,
    tx: watch::Sender<Latest<J::Output>>,
    asked: Arc<Notify>,
    telemetry: Arc<Telemetry>,
    shutdown: CancellationToken,
) {
    let schedule = job.schedule();
    let mut told = Told::default();
    let mut generation = 0u64;
    let mut last_start: Option<Instant> = None;
    loop {
        // Requests made before this run starts are served by it: a stored one is dropped,
        // so a burst of requests is one run, not two.
        tokio::select! {
            biased;
            () = asked.notified() => {}
            () = std::future::ready(()) => {}
        }
        if job.idle() {
            let next = schedule.every.map(|every| Instant::now() + every);
            let earliest = last_start.map(|at| at + schedule.min_gap);
            if !wait_for_next(&mut job, next, earliest, &asked, &shutdown).await {
                return;
            }
            continue;
        }
        let started = Instant::now();
        last_start = Some(started);
        let ran = tokio::select! {
            () = shutdown.cancelled() => return,
            ran = timeout(schedule.deadline, job.run()) => ran,
        };
        if J::WALKS_EVERY_NAMESPACE {
            give_back_free_heap();
        }
        // What a failed run's answer asked for: no run, asked for or not, before it ends.
        let mut asked_for = Duration::ZERO;
        let outcome = match ran {
            Ok(Ok(value)) => {
                generation += 1;
                tx.send_replace(Latest::Good(Published {
                    value,
                    started,
                    generation,
                }));
                told.good::<J>();
                CallOutcome::Ok
            }
            Ok(Err(e)) => {
                asked_for = asked_wait(J::retry_after(&e));
                let outcome = CallOutcome::of_error(&e);
                told.failed::<J>(e.to_string());
                outcome
            }
            Err(_) => {
                told.failed::<J>(format!("no answer within {:?}", schedule.deadline));
                CallOutcome::Timeout
            }
        };
        telemetry
            .job_runs
            .get_or_create(&JobOutcomeLabel {
                job: J::NAME,
                outcome: outcome.label(),
            })
            .inc();
        let good_at =
            (outcome == CallOutcome::Ok).then(|| unix_now() - started.elapsed().as_secs_f64());
        if let Some(at) = good_at {
            telemetry
                .job_last_success
                .get_or_create(&JobLabel { job: J::NAME })
                .set(at);
        }
        telemetry.update(|st| {
            let status = st.jobs.entry(J::NAME.to_owned()).or_default();
            status.runs += 1;
            status.last_run_at = unix_now();
            status.last_good_at = good_at.or(status.last_good_at);
            status.failing = told.failing.clone();
        });
        telemetry
            .job_run_seconds
            .get_or_create(&JobLabel { job: J::NAME })
            .observe(started.elapsed().as_secs_f64());
        let next = if outcome == CallOutcome::Ok {
            if job.finished() {
                return;
            }
            schedule.every.map(|every| started + every)
        } else {
            job.failed(told.failing.as_deref().unwrap_or_default());
            tx.send_replace(Latest::Failed);
            // From the end of the failed run: a run cut at its deadline still backs off.
            let wait = schedule.backoff.wait(told.failures, fastrand::f64());
            Some(Instant::now() + wait.max(asked_for))
        };
        let earliest = Some((started + schedule.min_gap).max(Instant::now() + asked_for));
        if !wait_for_next(&mut job, next, earliest, &asked, &shutdown).await {
            return;
        }
    }
}

/// Waits until `next` (never without it), a request or the job's own [`Job::wake`], then
/// until `earliest` if one of the latter came first; `false` at shutdown.
async fn wait_for_next<J: Job>(
    job: &mut J,
    next: Option<Instant>,
    earliest: Option<Instant>,
    asked: &Notify,
    shutdown: &CancellationToken,
) -> bool {
    tokio::select! {
        () = shutdown.cancelled() => return false,
        () = sleep_until(next) => return true,
        () = asked.notified() => {}
        () = job.wake() => {}
    }
    let Some(earliest) = earliest else {
        return true;
    };
    tokio::select! {
        () = shutdown.cancelled() => false,
        () = tokio::time::sleep_until(earliest) => true,
    }
}

/// Sleeps until `at`; forever without it (a select branch that may have no deadline).
pub(crate) async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// What the harness has said of a job's failure, so each change is said once.
#[derive(Debug, Default)]
struct Told {
    /// Failed runs in a row.
    failures: u32,
    /// The message of the latest failure, while failing.
    failing: Option<String>,
}

impl Told {
    /// A failed run; `true`: it was said (the first failure, or a different one).
    fn failed<J: Job>(&mut self, why: String) -> bool {
        self.failures = self.failures.saturating_add(1);
        let say = self.failing.as_deref() != Some(why.as_str());
        if say {
            warn!(job = J::NAME, "{} ({why}); {}", J::FAILING, J::EFFECT);
        }
        self.failing = Some(why);
        say
    }

    /// A good run; `true`: the recovery was said.
    fn good<J: Job>(&mut self) -> bool {
        self.failures = 0;
        let say = self.failing.take().is_some();
        if say {
            info!(job = J::NAME, "{}", J::RECOVERED);
        }
        say
    }
}

pub(crate) mod account;
pub(crate) mod device_login;
pub(crate) mod held;
pub(crate) mod install;
pub(crate) mod inventory;
pub(crate) mod join_status;
pub(crate) mod limits;
pub(crate) mod logs_token;
pub(crate) mod merod_watch;
pub(crate) mod node_files;
pub(crate) mod readiness;
pub(crate) mod record_file;
pub(crate) mod recovery;
pub(crate) mod relay;
pub(crate) mod swarm;
pub(crate) mod tls_install;
pub(crate) mod trees;
pub(crate) mod units;

#[cfg(test)]
pub(crate) mod canary;
#[cfg(test)]
mod tests;
