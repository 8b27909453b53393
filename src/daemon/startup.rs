//! Start-up: the state loaded, the PeerId and the MRTD read, merod waited for only by
//! `once` (or when the PeerId cannot be read before merod answers).

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

use crate::config::Config;
use crate::identity::read_peer_id;
use crate::ids::PeerId;
use crate::mrtd::{
    read_mrtd_bounded, Mrtd, MrtdReading, MrtdUnavailable, TdxConfig, MRTD_READ_TIMEOUT,
};
use crate::state::volatile::check_state_dir;
use crate::state::{State, StateStore};
use crate::telemetry::{Phase, Telemetry};

use super::deps::{DaemonError, Deps};
use crate::jobs::readiness::{wait_for_merod, Readiness};

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
    /// Where the MRTD was read from at start (`None`: unreadable then).
    mrtd_source: Option<String>,
    /// While the MRTD is unreadable: when it is tried again.
    next_try: Option<Instant>,
    /// Where the MRTD is read from (`[tdx]`).
    tdx: TdxConfig,
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

/// The state in `store`'s file, or an empty one when there is none yet (each logged).
///
/// Errors: [`DaemonError::State`] for an unreadable or corrupt file.
pub(super) fn load_state(store: &mut StateStore) -> Result<State, DaemonError> {
    Ok(match store.load()? {
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
    })
}

/// Calls out a state file on a RAM filesystem (an ERROR, and in the live status): a reboot
/// loses what the node admitted. The daemon runs all the same.
pub(super) fn warn_if_on_ram(state_file: &Path, telemetry: &Telemetry) {
    match check_state_dir(state_file) {
        Ok(Some(fs)) => {
            error!(
                path = %state_file.display(),
                filesystem = %fs,
                "the state file's directory is on a RAM filesystem ({fs}): a reboot loses what this node admitted, and a namespace withdrawn while it was down is never left; set state_file on persistent storage (e.g. /mnt/data/fleet/fleet-confirmed.json)"
            );
            telemetry.update(|st| st.state_ram_filesystem = Some(fs.to_string()));
        }
        Ok(None) => {}
        Err(e) => warn!("cannot tell whether the state file is on a RAM filesystem: {e}"),
    }
}

/// Before the identity: outside a dry run, removes the temp files an interrupted write left
/// beside the state file, checks the file can be written, and with `merod_wait` waits for
/// merod (at most that long). `Some(answered)`: whether merod has answered (a dry run never
/// calls it, so it counts as answered); `None`: shut down while waiting.
///
/// Errors: [`DaemonError`]: the state file cannot be written, or merod did not answer.
pub(super) async fn prepare(
    cfg: &Config,
    deps: &Deps,
    shutdown: &CancellationToken,
    store: &mut StateStore,
    merod_wait: Option<Duration>,
) -> Result<Option<bool>, DaemonError> {
    if cfg.dry_run {
        warn!("dry run: polling and logging plans only; merod is not called, nothing is confirmed, the state file is not written");
        return Ok(Some(true));
    }
    let removed = store.remove_stale_temp_files();
    if removed > 0 {
        info!(
            removed,
            "removed temp files an interrupted state write left behind"
        );
    }
    store.check_writable()?;
    if merod_wait.is_none() {
        return Ok(Some(false));
    }
    Ok(await_merod(deps, shutdown, merod_wait)
        .await?
        .then_some(true))
}

/// Reads the PeerId from merod's `config.toml`. If that fails before merod answered
/// (`merod_answered` false), merod may not have written it yet: merod is waited for, then
/// it is read again (with one retry); otherwise it is read once more after
/// [`PEER_ID_RETRY_DELAY`]. `Some((peer_id, merod_answered))`; `None`: shut down while
/// waiting.
///
/// Errors: [`DaemonError`]: the PeerId stayed unreadable.
pub(super) async fn read_peer_id_at_start(
    cfg: &Config,
    deps: &Deps,
    shutdown: &CancellationToken,
    merod_answered: bool,
) -> Result<Option<(PeerId, bool)>, DaemonError> {
    let peer_config = cfg.merod.config_toml();
    match read_peer_id(&peer_config) {
        Ok(p) => Ok(Some((p, merod_answered))),
        Err(first) if !merod_answered => {
            warn!("{first}; waiting for merod before reading it again");
            if !await_merod(deps, shutdown, None).await? {
                return Ok(None);
            }
            Ok(Some((read_peer_id_with_retry(&peer_config).await?, true)))
        }
        Err(first) => {
            warn!("{first}; trying again in {PEER_ID_RETRY_DELAY:?}");
            tokio::time::sleep(PEER_ID_RETRY_DELAY).await;
            Ok(Some((read_peer_id(&peer_config)?, merod_answered)))
        }
    }
}

/// Starts the fleet token's own job, when there is one: a stored token is in place before
/// the first poll; registration then runs beside the loop, never in it. Without one, the
/// live status says whether a token is configured.
pub(super) async fn start_token_job(
    cfg: &Config,
    deps: &Deps,
    peer_id: &PeerId,
    shutdown: &CancellationToken,
) {
    let telemetry = Arc::clone(&deps.telemetry);
    match deps.token_job.clone() {
        Some(job) => {
            job.start(peer_id.clone(), telemetry, shutdown.clone(), cfg.dry_run)
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
    /// The identity of the node `peer_id`, its MRTD read from `tdx` (logged once if
    /// unreadable: polls then carry the PeerId only, and it is tried again every
    /// [`MRTD_RETRY_INTERVAL`]).
    pub(super) async fn read(peer_id: PeerId, tdx: &TdxConfig, telemetry: &Telemetry) -> Self {
        let mut identity = Identity {
            peer_id,
            mrtd: None,
            mrtd_source: None,
            next_try: None,
            tdx: tdx.clone(),
        };
        match read_mrtd_blocking(&identity.tdx).await {
            Ok(r) => {
                info!(mrtd = %r.mrtd, source = %r.source, "MRTD read");
                telemetry.set_mrtd_source(Some(r.source.as_str()));
                identity.mrtd_source = Some(r.source.to_string());
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
        identity
    }

    /// Shows the running phase and the identity in the live status, in one change: with
    /// `merod_answered` false, merod shows as not answering in the same change, so no
    /// `READY=1` goes out before it answers.
    pub(super) fn show_running(&self, telemetry: &Telemetry, merod_answered: bool) {
        telemetry.update(|st| {
            st.phase = Phase::Running;
            if !merod_answered {
                st.merod_not_answering = Some("no answer yet".to_owned());
            }
            st.peer_id = Some(self.peer_id.to_string());
            st.mrtd = self.mrtd.map(|m| m.to_hex());
            st.mrtd_source = self.mrtd_source.clone();
            st.waiting_for = None;
        });
    }

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
                self.mrtd_source = Some(r.source.to_string());
                self.next_try = None;
            }
            Err(e) => {
                debug!("MRTD still unreadable: {e}");
                self.next_try = Some(Instant::now() + MRTD_RETRY_INTERVAL);
            }
        }
    }
}
