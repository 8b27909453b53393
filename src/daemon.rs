//! The reconcile loop: poll, plan, execute, persist — every `poll_interval`.
//!
//! Level-triggered: each cycle recomputes from the latest poll and the persisted state, so
//! a crash at any point leaves a state the next cycle repairs. The poll is the node's
//! heartbeat and runs on its cadence whatever merod does: joins and leaves run as
//! background tasks (at most one per namespace, at most `max_concurrent_joins` joins), each
//! merod and MDMA call bounded by its deadline, and their outcomes come back as events
//! that are folded into the state and persisted.
//!
//! Safety order inside a join task: `fleet-join` → `admitted: true` → merod lists the
//! namespace → the admission is persisted (the loop acknowledges) → confirm to MDMA → the
//! confirmation is persisted. A failed poll plans nothing at all.
//!
//! Layout: this file holds the [`Sidecar`] and the entry points ([`run`], [`once`]);
//! `startup` loads the state, waits for merod ([`wait_for_merod`]) and reads the identity;
//! `cycle` is the loop, one cycle and the fold of task events into the state; `tasks` the
//! join and leave tasks and their events; `poll` the poll's cadence and failure streaks.
//! What the live status shows of the loop's sets is projected in `telemetry`.

mod cycle;
mod poll;
mod startup;
mod tasks;

pub use crate::status::serve as serve_status;
pub use crate::telemetry::{unix_now, LiveStatus, NotReady, Phase, StatusMark, Telemetry};
pub use startup::{wait_for_merod, Readiness};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, Semaphore};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::identity::IdentityError;
use crate::ids::{GroupId, PeerId};
use crate::mdma::{ControlPlane, PollError};
use crate::merod::Node;
use crate::reconcile::{Desired, Guard, LeaveWait};
use crate::state::{State, StateError, StateStore};
use crate::telemetry::Projection;
use poll::FailureStreak;
use startup::MrtdSlot;
use tasks::Event;

/// Wait after the first failed readiness probe of merod (doubles per failure, up to
/// [`PROBE_INTERVAL_MAX`]).
pub(crate) const PROBE_INTERVAL: Duration = Duration::from_secs(1);
/// Longest wait between two readiness probes: how late, at most, a merod that comes up is
/// noticed.
pub(crate) const PROBE_INTERVAL_MAX: Duration = Duration::from_secs(5);
/// Wait before the one retry of reading the PeerId (merod may still be writing its config).
pub(crate) const PEER_ID_RETRY_DELAY: Duration = Duration::from_secs(2);
/// How often an unreadable MRTD is tried again (a later module load can make it appear).
pub(crate) const MRTD_RETRY_INTERVAL: Duration = Duration::from_secs(300);
/// Bound of one MRTD read (sysfs, ioctl with its short retries, configfs-tsm quote).
pub(crate) const MRTD_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// First wait before retrying a failed join or leave of a namespace (doubles, up to the cap).
pub(crate) const RETRY_MIN: Duration = Duration::from_secs(2);
/// Longest wait before retrying a failing join or leave.
pub(crate) const RETRY_MAX: Duration = Duration::from_secs(60);
/// On shutdown, how long running joins and leaves may take to finish before they are cut.
pub(crate) const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);
/// The longest time between two turns of the loop (the systemd watchdog's sign of life).
pub(crate) const ALIVE_TURN: Duration = Duration::from_secs(1);
/// A poll failing the same way is logged again after this many repeats.
pub(crate) const REPEAT_LOG_EVERY: u64 = 60;

/// The outside world the loop drives, and where it reports.
#[derive(Clone)]
pub struct Deps {
    /// MDMA.
    pub mdma: Arc<dyn ControlPlane>,
    /// merod.
    pub merod: Arc<dyn Node>,
    /// Metrics and live status (read by the status listener and the systemd notifier).
    pub telemetry: Arc<Telemetry>,
}

impl Deps {
    /// MDMA and merod with a fresh [`Telemetry`].
    pub fn new(mdma: Arc<dyn ControlPlane>, merod: Arc<dyn Node>) -> Self {
        Self {
            mdma,
            merod,
            telemetry: Arc::new(Telemetry::new()),
        }
    }
}

/// Why the daemon stopped with an error (exit non-zero).
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    /// The state file is unreadable or corrupt.
    #[error(transparent)]
    State(#[from] StateError),
    /// The PeerId could not be read (after one retry).
    #[error(transparent)]
    Identity(#[from] IdentityError),
    /// merod's admin API did not answer within the wait allowed (`once` only).
    #[error("merod's admin API did not answer within {waited:?}: {last}")]
    MerodNotReady {
        /// How long it was waited for.
        waited: Duration,
        /// What the last probe saw.
        last: String,
    },
    /// `once` ended with changes the state file could not record.
    #[error("the cycle ran but its outcome could not be persisted: {0}")]
    NotPersisted(String),
}

/// How long `once` waits for merod's admin API before giving up.
pub const ONCE_MEROD_WAIT: Duration = Duration::from_secs(60);

/// How one cycle went.
#[derive(Debug)]
pub enum CycleOutcome {
    /// The poll failed: nothing was planned.
    PollFailed(PollError),
    /// The poll succeeded and this was started.
    Planned {
        /// Joins started.
        joins: usize,
        /// Leaves started.
        leaves: usize,
    },
}

/// The running sidecar: identity known, merod ready, state loaded.
pub struct Sidecar {
    cfg: Config,
    deps: Deps,
    shutdown: CancellationToken,
    peer_id: PeerId,
    mrtd: MrtdSlot,
    store: StateStore,
    state: State,
    guard: Guard,
    joining: BTreeSet<GroupId>,
    leaving: BTreeSet<GroupId>,
    desired: Desired,
    join_retry: crate::backoff::Retries,
    leave_retry: crate::backoff::Retries,
    tasks: JoinSet<()>,
    task_ids: HashMap<tokio::task::Id, GroupId>,
    join_permits: Arc<Semaphore>,
    events_tx: mpsc::UnboundedSender<Event>,
    events_rx: mpsc::UnboundedReceiver<Event>,
    failures: FailureStreak,
    waiting: BTreeMap<GroupId, LeaveWait>,
    /// The failing state write, while writes fail.
    persist_error: Option<WriteFailure>,
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

/// Runs the daemon until `shutdown` is cancelled: load the state, wait for merod, read
/// the identity, then reconcile every `poll_interval`.
///
/// Errors: [`DaemonError`] for an unusable state file or an unreadable PeerId. A shutdown
/// before merod answered returns `Ok`.
pub async fn run(cfg: Config, deps: Deps, shutdown: CancellationToken) -> Result<(), DaemonError> {
    let Some(mut sidecar) = Sidecar::start(cfg, deps, shutdown, None).await? else {
        return Ok(());
    };
    sidecar.run_loop().await;
    Ok(())
}

/// One full cycle (`fleet-sidecar once`): start as [`run`] does (but wait at most
/// [`ONCE_MEROD_WAIT`] for merod), poll once, run the planned joins and leaves to their
/// end, persist.
///
/// Errors: as [`run`], [`DaemonError::MerodNotReady`], and [`DaemonError::NotPersisted`]
/// when the state could not be written. `Ok(None)` when shut down before the cycle.
pub async fn once(
    cfg: Config,
    deps: Deps,
    shutdown: CancellationToken,
) -> Result<Option<CycleOutcome>, DaemonError> {
    let Some(mut sidecar) = Sidecar::start(cfg, deps, shutdown, Some(ONCE_MEROD_WAIT)).await?
    else {
        return Ok(None);
    };
    let outcome = sidecar.cycle().await;
    sidecar.drain(None).await;
    match sidecar.persist_error.take() {
        Some(f) => Err(DaemonError::NotPersisted(f.text)),
        None => Ok(Some(outcome)),
    }
}

impl Sidecar {
    /// The node's PeerId.
    pub fn peer_id(&self) -> &PeerId {
        &self.peer_id
    }

    /// The state as of now (in memory; persisted after every change).
    pub fn state(&self) -> &State {
        &self.state
    }

    /// Shows the loop's sets in the live status and the namespace gauges.
    fn publish(&self) {
        self.deps.telemetry.publish(&Projection {
            desired: &self.desired,
            state: &self.state,
            joining: &self.joining,
            leaving: &self.leaving,
            waiting: &self.waiting,
            mass_drop: self.guard.mass_drop,
            mass_drop_hold: self.cfg.leave_policy.mass_drop_hold,
            now: Instant::now(),
        });
    }
}
