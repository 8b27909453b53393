//! The poll's cadence (first-poll spread, backoff while polls fail) and how failed polls
//! are counted and logged.

use std::time::Duration;

use tokio::time::Instant;
use tracing::{info, warn};

use crate::backoff::{asked_wait, Backoff, Jitter};
use crate::mdma::PollError;

/// A poll failing the same way is logged again after this many repeats.
const REPEAT_LOG_EVERY: u64 = 60;

/// When polls are due: every `poll_interval` while they succeed, backing off while they
/// fail (see [`next_poll_delay`]).
pub(super) struct Cadence {
    /// `poll_interval`.
    interval: Duration,
    /// `max_backoff`.
    max_backoff: Duration,
    /// The failed polls in a row, and what the last one said.
    streak: FailureStreak,
    /// No poll before this: the last failed poll's answer asked for a wait (`Retry-After`,
    /// at most `backoff::RETRY_AFTER_MAX` from when it came).
    not_before: Option<Instant>,
}

impl Cadence {
    /// A cadence of `interval`, backing off to `max_backoff`.
    pub(super) fn new(interval: Duration, max_backoff: Duration) -> Self {
        Self {
            interval,
            max_backoff,
            streak: FailureStreak::default(),
            not_before: None,
        }
    }

    /// When the first poll after a start is due (see [`first_poll_delay`]).
    pub(super) fn first_poll(&self, now: Instant) -> Instant {
        now + first_poll_delay(self.interval, fastrand::f64())
    }

    /// When the poll after one that started at `started` is due: the cadence's time, or
    /// later if the last failed poll's answer asked for a longer wait.
    pub(super) fn next_poll(&self, started: Instant) -> Instant {
        let due = started
            + next_poll_delay(
                self.interval,
                self.max_backoff,
                self.streak.count,
                fastrand::f64(),
            );
        self.not_before.map_or(due, |at| due.max(at))
    }

    /// Records a failed poll (logged once per new reason, then every [`REPEAT_LOG_EVERY`])
    /// and the wait its answer asked for; returns the failures in a row.
    pub(super) fn fail(&mut self, e: &PollError) -> u64 {
        self.streak.fail(e);
        self.not_before = e
            .retry_after()
            .map(|asked| Instant::now() + asked_wait(Some(asked)));
        self.streak.count
    }

    /// Records a successful poll (the recovery is logged once).
    pub(super) fn succeed(&mut self) {
        self.streak.succeed();
        self.not_before = None;
    }
}

/// The longest wait before the first poll: a node on a long `poll_interval` still sends its
/// first heartbeat within seconds of a (re)start.
const FIRST_POLL_SPREAD_MAX: Duration = Duration::from_secs(5);

/// The wait before the first poll after start: `min(interval, 5 s) · jitter` for `jitter`
/// in `[0, 1)`, so a fleet started at the same instant (a rollout, a power cut) spreads its
/// polls over one interval instead of hitting MDMA in lock-step, and keeps them spread.
fn first_poll_delay(interval: Duration, jitter: f64) -> Duration {
    interval
        .min(FIRST_POLL_SPREAD_MAX)
        .mul_f64(jitter.clamp(0.0, 1.0))
}

/// The wait before the next poll. After a successful poll: `interval`. After `failures`
/// failed polls in a row: a jittered exponential backoff, so a fleet recovering from an
/// MDMA outage does not poll in lockstep: `base = min(max_backoff, interval · 2^failures)`,
/// wait `base · (1 + jitter) / 2` for `jitter` in `[0, 1)` — never below `interval`.
fn next_poll_delay(
    interval: Duration,
    max_backoff: Duration,
    failures: u64,
    jitter: f64,
) -> Duration {
    if failures == 0 {
        return interval;
    }
    // The first failure already doubles: base `interval · 2^failures`.
    let n = u32::try_from(failures)
        .unwrap_or(u32::MAX)
        .saturating_add(1);
    Backoff::new(interval, max_backoff, Jitter::Down).wait(n, jitter)
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
                error_kind = e.metric_label(),
                outcome = "failed",
                "poll failed, cycle skipped (nothing joined or left): {reason}"
            );
            self.last = Some(reason);
        } else if self.count % REPEAT_LOG_EVERY == 0 {
            warn!(
                error_kind = e.metric_label(),
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mdma::{RequestError, RequestMethod};

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
            method: RequestMethod::Post,
            url: url.clone(),
            timeout: Duration::from_secs(10),
        });
        assert_eq!(timeout.metric_label(), "timeout");
        let deadline = PollError::Deadline {
            timeout: Duration::from_secs(11),
        };
        assert_eq!(deadline.metric_label(), "timeout");
        let status = PollError::Request(RequestError::Status {
            method: RequestMethod::Post,
            url,
            status: 503,
            retry_after_secs: None,
            body: Box::default(),
        });
        assert_eq!(status.metric_label(), "status");
    }

    #[tokio::test(start_paused = true)]
    async fn a_refused_poll_s_retry_after_is_waited_out_up_to_60_s() {
        let refused = |asked: Option<u32>| {
            PollError::Request(RequestError::Status {
                method: RequestMethod::Post,
                url: "https://mdma.test/api/fleet/should-join".parse().unwrap(),
                status: 429,
                retry_after_secs: asked,
                body: Box::default(),
            })
        };
        let mut cadence = Cadence::new(S, Duration::from_secs(10));
        let now = Instant::now();
        cadence.fail(&refused(Some(30)));
        assert_eq!(cadence.next_poll(now), now + Duration::from_secs(30));
        // Never silent for longer than 60 s, whatever MDMA asks.
        cadence.fail(&refused(Some(3600)));
        assert_eq!(cadence.next_poll(now), now + Duration::from_secs(60));
        // An answer without it: the back-off alone (at most `max_backoff`).
        cadence.fail(&refused(None));
        assert!(cadence.next_poll(now) <= now + Duration::from_secs(10));
        // A good poll ends it.
        cadence.fail(&refused(Some(30)));
        cadence.succeed();
        assert_eq!(cadence.next_poll(now), now + S);
    }
}
