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
//! Layout: the loop's state is held by owners, each guarding its own rule, and the
//! [`Sidecar`] holds them: `record` (the state, its file and a failing write; the only way
//! to change the state is to record an outcome, which persists it), `work` (the join and
//! leave tasks in flight, their permits and retry tables; a task gets its calls, never the
//! record), `poll` (the poll's cadence and failure streak), `startup` (start-up and the
//! node's identity), `merod_view` (the background jobs watching merod — `merod_watch`
//! its readiness, `held` what it holds, `join_status` the join outcomes told to MDMA —
//! and what the loop keeps of their reads: drift suspects, `roles`). `cycle` is the loop,
//! one cycle and the fold of task events.
//! What the live status shows of the loop's sets is projected in `telemetry`.

mod cycle;
mod held;
mod join_status;
mod merod_view;
mod merod_watch;
mod poll;
mod record;
mod roles;
mod startup;
mod tasks;

pub use crate::telemetry::serve as serve_status;
pub use crate::telemetry::{unix_now, LiveStatus, NotReady, Phase, Telemetry};
pub use startup::{wait_for_merod, Readiness};
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::identity::IdentityError;
use crate::ids::PeerId;
use crate::mdma::{ControlPlane, MdmaClient, PollError, MDMA_TIMEOUT};
use crate::merod::{ListenCandidates, Node, CHECK_TIMEOUT, MEMBERS_TIMEOUT};
use crate::registration::TokenJob;
use crate::state::{State, StateError};
use crate::telemetry::Projection;
use cycle::Planner;
use merod_view::MerodView;
use poll::Cadence;
use record::Record;
use startup::Identity;
use tasks::InFlight;

/// How much longer the loop waits for a call than the client's own timeout, so the client's
/// deadline, whose error names the URL, normally fires first.
pub(crate) const DEADLINE_SLACK: Duration = Duration::from_secs(1);

/// The loop's bound on a call whose client gives up after `client_timeout`:
/// `client_timeout` plus [`DEADLINE_SLACK`], saturating.
pub(crate) const fn outer_deadline(client_timeout: Duration) -> Duration {
    client_timeout.saturating_add(DEADLINE_SLACK)
}

/// The loop's bound on one MDMA call (a poll, a confirm, a join-status report): the
/// outer deadline of [`MDMA_TIMEOUT`].
pub(crate) const MDMA_DEADLINE: Duration = outer_deadline(MDMA_TIMEOUT);
/// The loop's bound on reading merod's identity: the outer deadline of [`CHECK_TIMEOUT`].
pub(crate) const IDENTITY_DEADLINE: Duration = outer_deadline(CHECK_TIMEOUT);
/// The loop's bound on reading a namespace's member list: the outer deadline of
/// [`MEMBERS_TIMEOUT`].
pub(crate) const MEMBERS_DEADLINE: Duration = outer_deadline(MEMBERS_TIMEOUT);
/// On shutdown, how long running joins and leaves may take to finish before they are cut.
pub(crate) const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);
/// At shutdown, how long the loop waits for the state writes (the one running, then the
/// final one) before it exits without them.
pub(crate) const SHUTDOWN_WRITE_WAIT: Duration = Duration::from_secs(10);
/// The longest time between two turns of the loop (the systemd watchdog's sign of life).
pub(crate) const ALIVE_TURN: Duration = Duration::from_secs(1);

/// The outside world the loop drives, and where it reports.
#[derive(Clone)]
pub struct Deps {
    /// MDMA.
    pub mdma: Arc<dyn ControlPlane>,
    /// merod.
    pub merod: Arc<dyn Node>,
    /// Metrics and live status (read by the status listener and the systemd notifier).
    pub telemetry: Arc<Telemetry>,
    /// The fleet token's job (a `fleet_token_file` to re-read, or `[registration]`), when
    /// the config has one; started once the PeerId is known.
    pub(crate) token_job: Option<Arc<TokenJob>>,
}

impl Deps {
    /// MDMA and merod with a fresh [`Telemetry`].
    pub fn new(mdma: Arc<dyn ControlPlane>, merod: Arc<dyn Node>) -> Self {
        Self {
            mdma,
            merod,
            telemetry: Arc::new(Telemetry::new()),
            token_job: None,
        }
    }

    /// The real clients for `cfg`, with the fleet token's job when `cfg` needs one
    /// (`fleet_token_file` read again on a refused poll and SIGHUP; `[registration]`).
    /// `merod` takes the loop's calls; `registration_merod` the token job's (identity,
    /// attest), sent to the address of its [`ListenCandidates::current`], which is the
    /// loop's choice when `merod` is the same candidates.
    pub(crate) fn real(
        cfg: &Config,
        mdma: MdmaClient,
        merod: Arc<dyn Node>,
        registration_merod: Arc<ListenCandidates>,
        telemetry: Arc<Telemetry>,
    ) -> Result<Self, crate::registration::JobError> {
        let token_job = TokenJob::for_config(cfg, &mdma, &registration_merod)?;
        Ok(Self {
            mdma: Arc::new(mdma),
            merod,
            telemetry,
            token_job,
        })
    }

    /// SIGHUP: the token job reads its token file again (nothing without one).
    pub(crate) fn reload_token(&self) -> bool {
        self.token_job.as_ref().map(|j| j.reload()).is_some()
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
    NotPersisted(#[source] NotPersisted),
}

/// Why `once`'s outcome is not on disk.
#[derive(Debug, thiserror::Error)]
pub enum NotPersisted {
    /// The state write failed (the latest failure; shared with the loop that keeps it).
    #[error(transparent)]
    Failed(Arc<StateError>),
    /// The state write did not end within the wait allowed at the end (10 s).
    #[error("the state write did not end within {0:?}")]
    Unfinished(Duration),
}

/// How long `once` waits for merod's admin API before giving up.
pub const ONCE_MEROD_WAIT: Duration = Duration::from_secs(60);

/// How one cycle went.
#[derive(Debug)]
pub enum CycleOutcome {
    /// The poll failed: nothing was planned.
    PollFailed(PollError),
    /// The poll succeeded, but merod has not answered since start-up: nothing was planned
    /// (joins and leaves wait for merod; the poll is the heartbeat).
    WaitingForMerod,
    /// The poll succeeded and this was started.
    Planned {
        /// Joins started.
        joins: usize,
        /// Leaves started.
        leaves: usize,
    },
}

/// The running sidecar: identity known, merod ready, state loaded. Each field is an owner
/// of one part of the loop's state; only the loop (this struct's methods) holds them all.
///
/// Not an API: public for the benches and `examples/cycle-profile` only, which time one
/// cycle; embed the loop with [`run`] or [`once`].
#[doc(hidden)]
pub struct Sidecar {
    /// MDMA, merod and the telemetry the loop reports to.
    deps: Deps,
    /// Cancelled to stop the loop.
    shutdown: CancellationToken,
    /// Who the node is: its PeerId and MRTD (retried while unreadable).
    identity: Identity,
    /// The state and its file: changed only by recording an outcome, which persists it.
    record: Record,
    /// The joins and leaves in flight, their join permits and both retry tables.
    work: InFlight,
    /// When the next poll is due, and the streak of failed polls.
    cadence: Cadence,
    /// What the last successful poll asked for and what planning remembers between polls
    /// (the mass-withdrawal guard, the withdrawn namespaces not left yet).
    planner: Planner,
    /// The background jobs watching merod (readiness, what it holds, join-status) and
    /// what the loop keeps of their reads.
    view: MerodView,
}

/// Runs the daemon until `shutdown` is cancelled: load the state, read the identity, then
/// poll every `poll_interval` (the heartbeat does not wait for merod) and reconcile once
/// merod has answered.
///
/// Errors: [`DaemonError`] for an unusable state file or an unreadable PeerId. A shutdown
/// while waiting for merod (only when the PeerId could not be read before it answered)
/// returns `Ok`.
pub async fn run(cfg: Config, deps: Deps, shutdown: CancellationToken) -> Result<(), DaemonError> {
    let Some(mut sidecar) = Sidecar::start(cfg, deps, shutdown, None).await? else {
        return Ok(());
    };
    sidecar.run_loop().await;
    Ok(())
}

/// One full cycle (`fleet-sidecar once`): start as [`run`] does (but wait at most
/// [`ONCE_MEROD_WAIT`] for merod), with `[registration]` and no stored token wait for the
/// first registration attempt to end (registered or not), poll once, run the planned joins
/// and leaves to their end, persist.
///
/// Errors: as [`run`], [`DaemonError::MerodNotReady`], and [`DaemonError::NotPersisted`]
/// when the state could not be written. `Ok(None)` when shut down before the cycle.
pub async fn once(
    cfg: Config,
    deps: Deps,
    shutdown: CancellationToken,
) -> Result<Option<CycleOutcome>, DaemonError> {
    let Some(mut sidecar) =
        Sidecar::start(cfg, deps, shutdown.clone(), Some(ONCE_MEROD_WAIT)).await?
    else {
        return Ok(None);
    };
    // With `[registration]` and no stored token, the first attempt ends before the poll.
    if let Some(job) = sidecar.deps.token_job.clone() {
        tokio::select! {
            () = shutdown.cancelled() => return Ok(None),
            () = job.settled() => {}
        }
    }
    let mut held = sidecar.view.held.clone();
    held.first_read(held::HELD_READ_TIMEOUT).await;
    let outcome = sidecar.cycle().await;
    let persisted = sidecar.drain(None).await;
    match sidecar.record.write_error() {
        Some(e) => Err(DaemonError::NotPersisted(NotPersisted::Failed(e))),
        None if !persisted => Err(DaemonError::NotPersisted(NotPersisted::Unfinished(
            SHUTDOWN_WRITE_WAIT,
        ))),
        None => Ok(Some(outcome)),
    }
}

impl Sidecar {
    /// The node's PeerId.
    pub fn peer_id(&self) -> &PeerId {
        &self.identity.peer_id
    }

    /// The state as of now (in memory; persisted after every change).
    pub fn state(&self) -> &State {
        self.record.state()
    }

    /// Shows the loop's sets in the live status and the namespace gauges.
    fn publish(&self) {
        publish(&self.deps, &self.planner, &self.work, self.record.state());
    }
}

/// Shows the loop's sets in the live status and the namespace gauges, `state` being the
/// record's (borrowed apart from the rest so the record can publish before it writes).
fn publish(deps: &Deps, planner: &Planner, work: &InFlight, state: &State) {
    deps.telemetry.publish(&Projection {
        desired: &planner.desired,
        state,
        joining: work.joining(),
        leaving: work.leaving(),
        waiting: &planner.waiting,
        orphans: &planner.orphans,
        mass_drop: planner.guard.mass_drop,
        mass_drop_hold: planner.policy.mass_drop_hold,
    });
}
