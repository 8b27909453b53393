//! Whether merod answers: one readiness probe (`GET /admin-api/peers`, bounded, backing off
//! from 1 s to 5 s) for start-up's wait and the later watch alike.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::{timeout, Instant};
use tokio_util::sync::CancellationToken;
use tracing::info;

use crate::backoff::{Backoff, Jitter};
use crate::merod::{MerodError, Node, PROBE_TIMEOUT};
use crate::telemetry::{Phase, Telemetry};

use super::limits::ALIVE_TURN;

/// Wait after the first failed readiness probe of merod (doubles per failure, up to
/// [`PROBE_INTERVAL_MAX`]).
const PROBE_INTERVAL: Duration = Duration::from_secs(1);
/// Longest wait between two readiness probes: how late, at most, a merod that comes up is
/// noticed.
const PROBE_INTERVAL_MAX: Duration = Duration::from_secs(5);
/// Why merod did not answer a readiness probe.
#[derive(Clone, Debug, thiserror::Error)]
pub enum ProbeFailed {
    /// It answered with an error, or could not be reached (shared: the last failure is
    /// kept while the next probe runs).
    #[error(transparent)]
    Error(Arc<MerodError>),
    /// No answer within the probe's bound ([`PROBE_TIMEOUT`], 5 s).
    #[error("no answer within {0:?}")]
    NoAnswer(Duration),
}

/// How waiting for merod ended.
#[derive(Debug)]
pub enum Readiness {
    /// merod answered.
    Ready,
    /// Shut down first.
    ShutDown,
    /// `limit` passed; the last probe saw this.
    GaveUp(ProbeFailed),
}

/// The readiness probe's back-off: [`PROBE_INTERVAL`] doubling to [`PROBE_INTERVAL_MAX`]
/// after each failed probe. Not jittered: merod is on this machine, no fleet shares it.
pub(super) const PROBE_BACKOFF: Backoff =
    Backoff::new(PROBE_INTERVAL, PROBE_INTERVAL_MAX, Jitter::None);

/// The wait after the `failures`-th failed readiness probe in a row (1-based).
pub(super) fn probe_delay(failures: u32) -> Duration {
    PROBE_BACKOFF.wait(failures, 0.0)
}

/// The one readiness probe of merod, for start-up's wait and the later watch alike
/// (`merod_watch`): each probe bounded by [`PROBE_TIMEOUT`], the next one due after
/// [`PROBE_BACKOFF`], and what the last one saw kept so each change is told once.
#[derive(Debug, Default)]
pub(super) struct ReadinessProbe {
    /// Failed probes in a row.
    failures: u32,
    /// The message of what the last failed probe saw (to tell each change once).
    last: Option<String>,
}

/// What one [`ReadinessProbe::probe`] saw.
pub(super) enum Probed {
    /// merod answered.
    Ready,
    /// It did not; `changed` when the reason differs from the last probe's (to be told).
    Failed { reason: ProbeFailed, changed: bool },
}

impl ReadinessProbe {
    /// Probes merod once (`GET /admin-api/peers` at each listen address, within
    /// [`PROBE_TIMEOUT`] in all).
    pub(super) async fn probe(&mut self, merod: &dyn Node) -> Probed {
        let reason = match timeout(PROBE_TIMEOUT, merod.probe()).await {
            Ok(Ok(())) => {
                self.failures = 0;
                self.last = None;
                return Probed::Ready;
            }
            Ok(Err(e)) => ProbeFailed::Error(Arc::new(e)),
            Err(_) => ProbeFailed::NoAnswer(PROBE_TIMEOUT),
        };
        self.failures = self.failures.saturating_add(1);
        let text = reason.to_string();
        let changed = self.last.as_deref() != Some(text.as_str());
        self.last = Some(text);
        Probed::Failed { reason, changed }
    }

    /// When the next probe is due, after a failed one at `now`.
    pub(super) fn next_probe(&self, now: Instant) -> Instant {
        now + probe_delay(self.failures)
    }
}

/// Probes merod until it answers (or `limit`, if any, passes), backing off from 1 s to 5 s
/// between probes (`ReadinessProbe`); logs one line per change of what it sees. While it
/// waits it reports a heartbeat every second (`ALIVE_TURN`), probe or not, so the systemd
/// watchdog sees it alive.
pub async fn wait_for_merod(
    merod: &dyn Node,
    telemetry: &Telemetry,
    shutdown: &CancellationToken,
    limit: Option<Duration>,
) -> Readiness {
    let deadline = limit.map(|l| Instant::now() + l);
    let mut probe = ReadinessProbe::default();
    loop {
        let reason = match probe.probe(merod).await {
            Probed::Ready => {
                info!("merod admin API answers");
                return Readiness::Ready;
            }
            Probed::Failed { reason, changed } => {
                if changed {
                    info!("waiting for merod: {reason}");
                }
                reason
            }
        };
        telemetry.update(|st| {
            st.phase = Phase::WaitingForMerod;
            st.waiting_for = Some(reason.to_string());
        });
        let next_probe = probe.next_probe(Instant::now());
        // A heartbeat now and every second until the next probe.
        loop {
            telemetry.mark_alive();
            telemetry.update(|st| st.heartbeats += 1);
            let now = Instant::now();
            if deadline.is_some_and(|d| now >= d) {
                return Readiness::GaveUp(reason);
            }
            if now >= next_probe {
                break;
            }
            let mut wake = next_probe.min(now + ALIVE_TURN);
            if let Some(d) = deadline {
                wake = wake.min(d);
            }
            tokio::select! {
                () = tokio::time::sleep_until(wake) => {}
                () = shutdown.cancelled() => return Readiness::ShutDown,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readiness_probes_back_off_from_1_s_to_5_s() {
        let waits: Vec<u64> = (1..=6).map(|n| probe_delay(n).as_secs()).collect();
        assert_eq!(waits, [1, 2, 4, 5, 5, 5]);
        assert_eq!(probe_delay(u32::MAX), PROBE_INTERVAL_MAX);
    }
}
