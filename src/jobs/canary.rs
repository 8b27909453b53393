//! A job that exists only in this crate's tests, to keep true what the harness promises:
//! a job beside the loop is one file (this one) and one line of wiring (in
//! `daemon/merod_view.rs`), and from that alone the running daemon gives it its cadence,
//! its back-off, its log lines (one per change of failure), its metrics and its entry in
//! `/status`. It fails its first [`FAILING_RUNS`] runs, then works.

use std::time::Duration;

use super::{Job, Schedule};
use crate::backoff::{Backoff, Jitter};
use crate::outcome::Timed;

/// Runs that fail before the first good one.
pub(crate) const FAILING_RUNS: u32 = 3;
/// Between runs, good or failed.
const EVERY: Duration = Duration::from_millis(100);

/// The test-only job; its output is the number of the run.
#[derive(Default)]
pub(crate) struct Canary {
    runs: u32,
}

/// Why a canary run failed (always the same, so it is told once).
#[derive(Debug, thiserror::Error)]
#[error("canary down")]
pub(crate) struct Down;

impl Timed for Down {
    fn is_timeout(&self) -> bool {
        false
    }
}

impl Job for Canary {
    type Output = u32;
    type Error = Down;
    const NAME: &'static str = "canary";
    const FAILING: &'static str = "canary failing";
    const EFFECT: &'static str = "nothing else changes";
    const RECOVERED: &'static str = "canary works again";

    fn schedule(&self) -> Schedule {
        Schedule::every(EVERY, Duration::from_secs(1)).backoff(Backoff::new(
            EVERY,
            EVERY,
            Jitter::None,
        ))
    }

    async fn run(&mut self) -> Result<u32, Down> {
        self.runs += 1;
        if self.runs <= FAILING_RUNS {
            Err(Down)
        } else {
            Ok(self.runs)
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::sync::{Arc, Mutex};

    use tokio::time::Instant;
    use tokio_util::sync::CancellationToken;

    use super::*;
    use crate::testing::sandbox::Sandbox;

    /// Log lines written by this thread's subscriber.
    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);

    impl Write for Captured {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl Captured {
        fn count(&self, needle: &str) -> usize {
            String::from_utf8_lossy(&self.0.lock().unwrap())
                .matches(needle)
                .count()
        }
    }

    async fn get(url: &str) -> String {
        let client = reqwest::Client::builder().no_proxy().build().unwrap();
        let answer = client.get(url).send().await.unwrap();
        assert_eq!(answer.status(), 200, "{url}");
        answer.text().await.unwrap()
    }

    // A current-thread runtime: every task of the daemon logs through this thread's
    // subscriber.
    #[tokio::test]
    async fn a_job_of_one_file_and_one_line_runs_in_the_daemon_told_counted_and_shown() {
        // Were this test's subscriber the only live dispatcher, tracing-core would compute a
        // callsite's interest from the asking thread's default alone: another test's thread
        // meeting one of the harness's callsites first (its "failing" line) would cache it
        // as "never" for every thread, and this test would miss the line. With a second live
        // dispatcher it asks every registered one, whichever thread asks.
        let _second = tracing::Dispatch::new(tracing_subscriber::registry());
        let logs = Captured::default();
        let writer = logs.clone();
        let _subscriber = tracing::subscriber::set_default(
            tracing_subscriber::fmt()
                .with_ansi(false)
                .with_writer(move || writer.clone())
                .finish(),
        );
        let sb = Sandbox::start(None).await.unwrap();
        // Another test's thread that first met a callsite while no subscriber but the
        // global none existed may have cached it as "never", racing this subscriber's
        // arrival (tracing-core computes and stores that outside its dispatcher lock).
        // Computed again now, well after that race and before the daemon logs a line.
        tracing::callsite::rebuild_interest_cache();
        let cfg = sb.config("").unwrap();
        let deps = sb.deps(&cfg).unwrap();
        let telemetry = Arc::clone(&deps.telemetry);
        let shutdown = CancellationToken::new();
        let daemon = tokio::spawn(crate::daemon::run(cfg, deps, shutdown.clone()));
        let addr = crate::daemon::serve_status(
            "127.0.0.1:0".parse().unwrap(),
            Arc::clone(&telemetry),
            Duration::from_secs(60),
            shutdown.clone(),
        )
        .await
        .unwrap();
        let limit = Instant::now() + Duration::from_secs(20);
        let good_runs = || {
            telemetry
                .snapshot()
                .jobs
                .get("canary")
                .map_or(0, |j| j.runs.saturating_sub(u64::from(FAILING_RUNS)))
        };
        while good_runs() < 3 {
            assert!(Instant::now() < limit, "three good canary runs within 20 s");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }

        // In /status: its runs, its latest good result, not failing.
        let status: serde_json::Value =
            serde_json::from_str(&get(&format!("http://{addr}/status")).await).unwrap();
        let canary = &status["jobs"]["canary"];
        assert!(canary["runs"].as_u64().unwrap() >= 6, "{canary}");
        assert!(canary["last_good_at"].as_f64().unwrap() > 0.0, "{canary}");
        assert!(canary["failing"].is_null(), "{canary}");
        // In the metrics: the failed runs and the good ones, by the harness's names.
        let metrics = get(&format!("http://{addr}/metrics")).await;
        assert!(
            metrics.contains("fleet_sidecar_job_runs_total{job=\"canary\",outcome=\"error\"} 3"),
            "{metrics}"
        );
        assert!(
            metrics.contains("fleet_sidecar_job_last_success_timestamp_seconds{job=\"canary\"}"),
            "{metrics}"
        );
        // Three failures in a row are told once, and the recovery once.
        assert_eq!(logs.count("canary failing (canary down)"), 1);
        assert_eq!(logs.count("canary works again"), 1);

        shutdown.cancel();
        tokio::time::timeout(Duration::from_secs(15), daemon)
            .await
            .expect("the daemon stops within the shutdown grace")
            .unwrap()
            .unwrap();
    }
}
