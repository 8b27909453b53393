//! The harness under tokio's paused clock, with a scripted job.

use std::collections::VecDeque;
use std::sync::Mutex;

use super::*;
use crate::backoff::Jitter;

/// What one run of [`Scripted`] does.
#[derive(Clone, Copy, Debug)]
enum Step {
    Ok(u32),
    Fail(&'static str),
    /// A failure whose answer asked for a wait (`Retry-After`), in seconds.
    FailAsking(u64),
    Hang,
}

/// Why a scripted run failed, and the wait its answer asked for.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct Failed(&'static str, Option<Duration>);

impl Timed for Failed {
    fn is_timeout(&self) -> bool {
        false
    }
}

/// Runs as its script says (then `Ok(0)`), recording when each run started.
#[derive(Clone, Default)]
struct Scripted {
    script: Arc<Mutex<VecDeque<Step>>>,
    starts: Arc<Mutex<Vec<Instant>>>,
    failed: Arc<Mutex<u32>>,
    once: bool,
    /// Idle while the script is empty (a job fed by requests).
    fed: bool,
    /// Its own event ([`Job::wake`]).
    woken: Arc<Notify>,
}

const EVERY: Duration = Duration::from_secs(60);
const GAP: Duration = Duration::from_secs(5);
const DEADLINE: Duration = Duration::from_secs(10);

impl Job for Scripted {
    type Output = u32;
    type Error = Failed;
    const NAME: &'static str = "scripted";
    const FAILING: &'static str = "scripted job failing";
    const EFFECT: &'static str = "nothing changes";
    const RECOVERED: &'static str = "scripted job works again";

    fn schedule(&self) -> Schedule {
        Schedule::every(EVERY, DEADLINE)
            .min_gap(GAP)
            .backoff(Backoff::new(
                Duration::from_secs(2),
                Duration::from_secs(8),
                Jitter::None,
            ))
    }

    async fn run(&mut self) -> Result<u32, Failed> {
        self.starts.lock().unwrap().push(Instant::now());
        let step = self
            .script
            .lock()
            .unwrap()
            .pop_front()
            .unwrap_or(Step::Ok(0));
        match step {
            Step::Ok(n) => Ok(n),
            Step::Fail(why) => Err(Failed(why, None)),
            Step::FailAsking(secs) => Err(Failed("busy", Some(Duration::from_secs(secs)))),
            Step::Hang => std::future::pending().await,
        }
    }

    fn retry_after(error: &Failed) -> Option<Duration> {
        error.1
    }

    fn failed(&mut self, _why: &str) {
        *self.failed.lock().unwrap() += 1;
    }

    fn finished(&self) -> bool {
        self.once
    }

    fn idle(&self) -> bool {
        self.fed && self.script.lock().unwrap().is_empty()
    }

    async fn wake(&mut self) {
        self.woken.notified().await;
    }
}

fn scripted(steps: &[Step]) -> Scripted {
    Scripted {
        script: Arc::new(Mutex::new(steps.iter().copied().collect())),
        ..Scripted::default()
    }
}

/// The starts of the runs, in seconds after `t0`.
fn starts(job: &Scripted, t0: Instant) -> Vec<u64> {
    job.starts
        .lock()
        .unwrap()
        .iter()
        .map(|t| (*t - t0).as_secs())
        .collect()
}

/// Spawns `job` on a fresh telemetry: the telemetry, the shutdown, when it started, the
/// handle.
fn start(job: &Scripted) -> (Arc<Telemetry>, CancellationToken, Instant, JobHandle<u32>) {
    let t = Arc::new(Telemetry::new());
    let stop = CancellationToken::new();
    let t0 = Instant::now();
    let handle = spawn(job.clone(), Arc::clone(&t), stop.clone());
    (t, stop, t0, handle)
}

fn runs(t: &Telemetry, outcome: &'static str) -> u64 {
    t.job_runs
        .get_or_create(&JobOutcomeLabel {
            job: "scripted",
            outcome,
        })
        .get()
}

#[tokio::test(start_paused = true)]
async fn runs_at_once_then_every_interval_and_soon_when_asked_never_closer_than_the_gap() {
    let job = scripted(&[Step::Ok(1), Step::Ok(2), Step::Ok(3)]);
    let (t, stop, t0, handle) = start(&job);
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(matches!(
        handle.latest(),
        Latest::Good(Published {
            value: 1,
            generation: 1,
            ..
        })
    ));
    // Asked three times at 1 s: one run, at the 5 s gap.
    handle.run_soon();
    handle.run_soon();
    handle.run_soon();
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert_eq!(starts(&job, t0), [0, 5]);
    // Then the interval, from the last start.
    tokio::time::sleep(Duration::from_secs(60)).await;
    assert_eq!(starts(&job, t0), [0, 5, 65]);
    assert!(matches!(
        handle.latest(),
        Latest::Good(Published {
            value: 3,
            generation: 3,
            ..
        })
    ));
    assert_eq!(runs(&t, "ok"), 3);
    stop.cancel();
}

#[tokio::test(start_paused = true)]
async fn a_failure_s_retry_after_is_waited_out_even_when_a_run_is_asked_for_up_to_60_s() {
    let job = scripted(&[Step::FailAsking(30), Step::FailAsking(3600), Step::Ok(1)]);
    let (_t, stop, t0, handle) = start(&job);
    // Asked to run soon all along: the back-off (2 s) and the gap (5 s) would allow it.
    for _ in 0..100 {
        handle.run_soon();
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    // 30 s as asked, then 60 s for an hour asked.
    assert_eq!(starts(&job, t0)[..3], [0, 30, 90]);
    stop.cancel();
}

#[tokio::test(start_paused = true)]
async fn a_failing_job_backs_off_publishes_failed_and_is_told_once_per_change() {
    let job = scripted(&[
        Step::Fail("refused"),
        Step::Fail("refused"),
        Step::Fail("refused"),
        Step::Fail("reset"),
        Step::Ok(7),
    ]);
    let (t, stop, t0, handle) = start(&job);
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert!(matches!(handle.latest(), Latest::Failed));
    // The live status shows it failing, and why.
    let status = t.snapshot().jobs["scripted"].clone();
    assert_eq!(
        (status.runs, status.failing.as_deref(), status.last_good_at),
        (1, Some("refused"), None)
    );
    tokio::time::sleep(Duration::from_secs(30)).await;
    // 2, 4, 8, 8 s after each failed start.
    assert_eq!(starts(&job, t0), [0, 2, 6, 14, 22]);
    assert!(matches!(
        handle.latest(),
        Latest::Good(Published { value: 7, .. })
    ));
    assert_eq!(*job.failed.lock().unwrap(), 4);
    assert_eq!((runs(&t, "error"), runs(&t, "ok")), (4, 1));
    let success = t
        .job_last_success
        .get_or_create(&JobLabel { job: "scripted" })
        .get();
    assert!(success > 0.0, "{success}");
    let status = t.snapshot().jobs["scripted"].clone();
    assert_eq!((status.runs, status.failing), (5, None));
    assert_eq!(status.last_good_at, Some(success));
    // The metrics are declared by the harness, named by the job.
    let metrics = t.encode_metrics();
    for series in [
        "fleet_sidecar_job_runs_total{job=\"scripted\",outcome=\"error\"} 4",
        "fleet_sidecar_job_runs_total{job=\"scripted\",outcome=\"ok\"} 1",
        "fleet_sidecar_job_runs_total{job=\"scripted\",outcome=\"timeout\"} 0",
        "fleet_sidecar_job_run_seconds_count{job=\"scripted\"} 5",
        "fleet_sidecar_job_last_success_timestamp_seconds{job=\"scripted\"}",
    ] {
        assert!(metrics.contains(series), "{series} not in:\n{metrics}");
    }
    stop.cancel();

    // What is said: the first failure, a different one, the recovery; never a repeat.
    let mut told = Told::default();
    let said: Vec<bool> = ["a", "a", "a", "b"]
        .iter()
        .map(|why| told.failed::<Scripted>((*why).to_owned()))
        .collect();
    assert_eq!(said, [true, false, false, true]);
    assert_eq!(told.failures, 4);
    assert!(told.good::<Scripted>());
    assert!(!told.good::<Scripted>());
    assert_eq!(told.failures, 0);
}

#[tokio::test(start_paused = true)]
async fn a_run_that_hangs_is_cut_at_its_deadline_and_shutdown_does_not_wait_for_one() {
    let job = scripted(&[Step::Hang, Step::Hang]);
    let (t, stop, t0, handle) = start(&job);
    tokio::time::sleep(Duration::from_secs(11)).await;
    assert!(matches!(handle.latest(), Latest::Failed));
    assert_eq!(runs(&t, "timeout"), 1);
    // The second run starts 2 s (the first back-off) after the first was cut.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(starts(&job, t0), [0, 12]);
    // Shut down in the middle of the hanging second run: the task ends at once.
    stop.cancel();
    tokio::time::sleep(Duration::from_millis(1)).await;
    assert!(
        handle.latest.has_changed().is_err(),
        "the job's sender is dropped"
    );
}

#[tokio::test(start_paused = true)]
async fn a_finished_job_ends_and_a_reader_never_waits_for_a_run() {
    let job = Scripted {
        once: true,
        ..scripted(&[Step::Fail("down"), Step::Ok(1)])
    };
    let (_t, _stop, _t0, mut handle) = start(&job);
    handle.first_outcome(Duration::from_secs(1)).await;
    assert!(matches!(handle.latest(), Latest::Failed));
    tokio::time::sleep(Duration::from_secs(120)).await;
    // It ran until its first good run, then ended.
    assert_eq!(job.starts.lock().unwrap().len(), 2);
    assert!(handle.latest.has_changed().is_err(), "ended");
    assert!(matches!(
        handle.latest(),
        Latest::Good(Published { value: 1, .. })
    ));
    // An idle handle never has anything and never blocks.
    let mut idle = JobHandle::<u32>::idle();
    idle.run_soon();
    idle.first_outcome(Duration::from_secs(1)).await;
    assert!(matches!(idle.latest(), Latest::NotYet));
}

#[tokio::test(start_paused = true)]
async fn an_idle_job_skips_its_back_off_run_and_runs_when_asked() {
    let job = Scripted {
        fed: true,
        ..scripted(&[Step::Fail("route absent")])
    };
    let (t, stop, t0, handle) = start(&job);
    // The failure's back-off (2 s) passes with nothing to do: no run, no recovery said,
    // the failure still shown; nor does the interval bring an empty run.
    tokio::time::sleep(Duration::from_secs(120)).await;
    assert_eq!(starts(&job, t0), [0]);
    assert!(matches!(handle.latest(), Latest::Failed));
    assert_eq!(
        t.snapshot().jobs["scripted"].failing.as_deref(),
        Some("route absent")
    );
    // Work comes with a request: it runs at once (the gap since the last start is long
    // past), and only then does it work again.
    job.script.lock().unwrap().push_back(Step::Ok(4));
    handle.run_soon();
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(starts(&job, t0), [0, 120]);
    assert!(matches!(
        handle.latest(),
        Latest::Good(Published { value: 4, .. })
    ));
    assert_eq!((runs(&t, "error"), runs(&t, "ok")), (1, 1));
    // A request while idle and inside the gap waits for the gap, then finds nothing to do.
    handle.run_soon();
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert_eq!(starts(&job, t0), [0, 120]);
    stop.cancel();
}

#[tokio::test(start_paused = true)]
async fn a_job_s_own_event_wakes_it_like_a_request() {
    let job = Scripted {
        fed: true,
        ..scripted(&[])
    };
    let (t, stop, t0, handle) = start(&job);
    // Idle from the start: no first run, and nothing published.
    tokio::time::sleep(Duration::from_secs(30)).await;
    assert_eq!(starts(&job, t0), Vec::<u64>::new());
    assert!(matches!(handle.latest(), Latest::NotYet));
    // Work arrives with the job's own event, not a request: it runs at once.
    job.script.lock().unwrap().push_back(Step::Ok(5));
    job.woken.notify_one();
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(starts(&job, t0), [30]);
    assert!(matches!(
        handle.latest(),
        Latest::Good(Published { value: 5, .. })
    ));
    assert_eq!(runs(&t, "ok"), 1);
    stop.cancel();
}
