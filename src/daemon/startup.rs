//! Start-up: the state loaded, the PeerId and the MRTD read, merod waited for only by
//! `once` (or when the PeerId cannot be read before merod answers).

use std::sync::Arc;
use std::time::Duration;

use tokio::time::{timeout, Instant};
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

use crate::backoff::{Backoff, Jitter};
use crate::config::Config;
use crate::identity::read_peer_id;
use crate::ids::PeerId;
use crate::merod::{Node, PROBE_TIMEOUT};
use crate::mrtd::{
    read_mrtd_bounded, Mrtd, MrtdReading, MrtdUnavailable, TdxConfig, MRTD_READ_TIMEOUT,
};
use crate::state::volatile::check_state_dir;
use crate::state::{State, StateStore};
use crate::telemetry::{Phase, Telemetry};

use super::cycle::Planner;
use super::merod_view::MerodView;
use super::poll::Cadence;
use super::record::Record;
use super::tasks::InFlight;
use super::{DaemonError, Deps, Sidecar, ALIVE_TURN};

/// Wait after the first failed readiness probe of merod (doubles per failure, up to
/// [`PROBE_INTERVAL_MAX`]).
const PROBE_INTERVAL: Duration = Duration::from_secs(1);
/// Longest wait between two readiness probes: how late, at most, a merod that comes up is
/// noticed.
const PROBE_INTERVAL_MAX: Duration = Duration::from_secs(5);
/// Wait before the one retry of reading the PeerId (merod may still be writing its config).
const PEER_ID_RETRY_DELAY: Duration = Duration::from_secs(2);
/// How often an unreadable MRTD is tried again (a later module load can make it appear).
const MRTD_RETRY_INTERVAL: Duration = Duration::from_secs(300);

/// Who the node is: what every poll and confirm carries.
pub(super) struct Identity {
    /// The node's PeerId, read from merod's config at start.
    pub(super) peer_id: PeerId,
    /// The TD's MRTD; `None` while unreadable (polls then carry the PeerId only).
    pub(super) mrtd: Option<Mrtd>,
    /// While the MRTD is unreadable: when it is tried again.
    next_try: Option<Instant>,
    /// Where the MRTD is read from (`[tdx]`).
    tdx: TdxConfig,
}

/// How waiting for merod ended.
#[derive(Debug, PartialEq, Eq)]
pub enum Readiness {
    /// merod answered.
    Ready,
    /// Shut down first.
    ShutDown,
    /// `limit` passed; the last probe saw this.
    GaveUp(String),
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
    /// What the last failed probe saw.
    last: Option<String>,
}

/// What one [`ReadinessProbe::probe`] saw.
pub(super) enum Probed {
    /// merod answered.
    Ready,
    /// It did not; `changed` when the reason differs from the last probe's (to be told).
    Failed { reason: String, changed: bool },
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
            Ok(Err(e)) => e.to_string(),
            Err(_) => format!("no answer within {PROBE_TIMEOUT:?}"),
        };
        self.failures = self.failures.saturating_add(1);
        let changed = self.last.as_deref() != Some(reason.as_str());
        self.last = Some(reason.clone());
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
            st.waiting_for = Some(reason.clone());
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

/// Why the MRTD could not be read in this attempt.
#[derive(Debug, thiserror::Error)]
enum MrtdReadError {
    #[error(transparent)]
    Unavailable(#[from] MrtdUnavailable),
    #[error("the MRTD reader stopped: {0}")]
    Stopped(#[source] tokio::task::JoinError),
}

/// Reads the MRTD on the blocking pool with the library's bounded read
/// ([`read_mrtd_bounded`], [`MRTD_READ_TIMEOUT`]): a source that never answers is reported
/// as timed out. Errors: [`MrtdReadError`], every source's failure.
async fn read_mrtd_blocking(tdx: &TdxConfig) -> Result<MrtdReading, MrtdReadError> {
    let tdx = tdx.clone();
    match tokio::task::spawn_blocking(move || read_mrtd_bounded(&tdx, MRTD_READ_TIMEOUT)).await {
        Ok(result) => Ok(result?),
        Err(e) => Err(MrtdReadError::Stopped(e)),
    }
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

        let telemetry = Arc::clone(&deps.telemetry);
        telemetry.update(|st| st.dry_run = cfg.dry_run);
        match check_state_dir(&cfg.state_file) {
            Ok(Some(fs)) => {
                error!(
                    path = %cfg.state_file.display(),
                    filesystem = %fs,
                    "the state file's directory is on a RAM filesystem ({fs}): a reboot loses what this node admitted, and a namespace withdrawn while it was down is never left; set state_file on persistent storage (e.g. /mnt/data/fleet/fleet-confirmed.json)"
                );
                telemetry.update(|st| st.state_ram_filesystem = Some(fs.to_string()));
            }
            Ok(None) => {}
            Err(e) => warn!("cannot tell whether the state file is on a RAM filesystem: {e}"),
        }
        // merod is never called in a dry run; otherwise, whether it has answered yet.
        let mut merod_answered = cfg.dry_run;
        if cfg.dry_run {
            warn!("dry run: polling and logging plans only; merod is not called, nothing is confirmed, the state file is not written");
        } else {
            let removed = store.remove_stale_temp_files();
            if removed > 0 {
                info!(
                    removed,
                    "removed temp files an interrupted state write left behind"
                );
            }
            store.check_writable()?;
            if merod_wait.is_some() {
                if !await_merod(&deps, &shutdown, merod_wait).await? {
                    return Ok(None);
                }
                merod_answered = true;
            }
        }

        let peer_config = cfg.merod.config_toml();
        let peer_id = match read_peer_id(&peer_config) {
            Ok(p) => p,
            Err(first) if !merod_answered => {
                // merod may not have written its config yet: wait for it, then read again.
                warn!("{first}; waiting for merod before reading it again");
                if !await_merod(&deps, &shutdown, None).await? {
                    return Ok(None);
                }
                merod_answered = true;
                read_peer_id_with_retry(&peer_config).await?
            }
            Err(first) => {
                warn!("{first}; trying again in {PEER_ID_RETRY_DELAY:?}");
                tokio::time::sleep(PEER_ID_RETRY_DELAY).await;
                read_peer_id(&peer_config)?
            }
        };
        info!(peer_id = %peer_id, "identity read");
        // The fleet token's own job: a stored token is in place before the first poll;
        // registration then runs beside the loop, never in it.
        match deps.token_job.clone() {
            Some(job) => {
                job.start(
                    peer_id.clone(),
                    Arc::clone(&telemetry),
                    shutdown.clone(),
                    cfg.dry_run,
                )
                .await
            }
            None => telemetry.update(|st| {
                st.fleet_token = if cfg.fleet_token.is_some() {
                    "configured"
                } else {
                    "none"
                }
                .to_owned()
            }),
        }

        let mut mrtd_source = None;
        let mut identity = Identity {
            peer_id,
            mrtd: None,
            next_try: None,
            tdx: cfg.tdx.clone(),
        };
        match read_mrtd_blocking(&identity.tdx).await {
            Ok(r) => {
                info!(mrtd = %r.mrtd, source = %r.source, "MRTD read");
                telemetry.set_mrtd_source(Some(r.source.as_str()));
                mrtd_source = Some(r.source.to_string());
                identity.mrtd = Some(r.mrtd);
            }
            Err(e) => {
                error!(
                    "cannot read the MRTD ({e}); polling with the PeerId only: MDMA assigns no MRTD-gated namespace; retrying every {MRTD_RETRY_INTERVAL:?}"
                );
                telemetry.set_mrtd_source(None);
                identity.next_try = Some(Instant::now() + MRTD_RETRY_INTERVAL);
            }
        }

        telemetry.update(|st| {
            st.phase = Phase::Running;
            // In the same change as the phase: no READY=1 before merod answers.
            if !merod_answered {
                st.merod_not_answering = Some("no answer yet".to_owned());
            }
            st.peer_id = Some(identity.peer_id.to_string());
            st.mrtd = identity.mrtd.map(|m| m.to_hex());
            st.mrtd_source = mrtd_source;
            st.waiting_for = None;
        });
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
        let sidecar = Self {
            view,
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
}

/// Waits for merod (at most `limit`, if set). `Ok(false)`: shut down first.
///
/// Errors: [`DaemonError::MerodNotReady`] when `limit` passed.
async fn await_merod(
    deps: &Deps,
    shutdown: &CancellationToken,
    limit: Option<Duration>,
) -> Result<bool, DaemonError> {
    match wait_for_merod(deps.merod.as_ref(), &deps.telemetry, shutdown, limit).await {
        Readiness::Ready => Ok(true),
        Readiness::ShutDown => Ok(false),
        Readiness::GaveUp(last) => Err(DaemonError::MerodNotReady {
            waited: limit.unwrap_or_default(),
            last,
        }),
    }
}

/// Reads the PeerId, once more after [`PEER_ID_RETRY_DELAY`] if the first read fails.
///
/// Errors: the second read's error.
async fn read_peer_id_with_retry(path: &std::path::Path) -> Result<PeerId, DaemonError> {
    match read_peer_id(path) {
        Ok(p) => Ok(p),
        Err(first) => {
            warn!("{first}; trying again in {PEER_ID_RETRY_DELAY:?}");
            tokio::time::sleep(PEER_ID_RETRY_DELAY).await;
            Ok(read_peer_id(path)?)
        }
    }
}

impl Identity {
    /// While the MRTD is unreadable and its next try is due, reads it again; once read,
    /// polls carry it from then on.
    pub(super) async fn retry_mrtd_if_due(&mut self, telemetry: &Telemetry) {
        let Some(due) = self.next_try else {
            return;
        };
        if Instant::now() < due {
            return;
        }
        match read_mrtd_blocking(&self.tdx).await {
            Ok(r) => {
                info!(mrtd = %r.mrtd, source = %r.source, "MRTD readable now: polls carry it from here on");
                telemetry.set_mrtd_source(Some(r.source.as_str()));
                telemetry.update(|st| {
                    st.mrtd = Some(r.mrtd.to_hex());
                    st.mrtd_source = Some(r.source.to_string());
                });
                self.mrtd = Some(r.mrtd);
                self.next_try = None;
            }
            Err(e) => {
                debug!("MRTD still unreadable: {e}");
                self.next_try = Some(Instant::now() + MRTD_RETRY_INTERVAL);
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
