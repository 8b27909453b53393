//! The reconcile loop: poll, plan, execute, persist — every `poll_interval`.
//!
//! **Not part of the library's promise.** This module exists only with the `daemon` feature
//! and is the daemon's own (its entry points, its telemetry, its test hooks): it changes in
//! any version without a note. A tool uses the modules in the API snapshot (`api/`).
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
//! Layout, top-down: this file holds the entry points ([`run`], [`once`]) and re-exports;
//! each module below imports only from modules on lower floors (`tests/layering.rs`):
//! - `sidecar`: the [`Sidecar`] and its one `impl` — start-up, the loop, one cycle, the
//!   fold of task events — holding the owners below, each guarding its own rule;
//! - `startup` (reading the identity), `merod_view` (the jobs watching merod and what the
//!   loop keeps of their reads), `beside` (the jobs the poll feeds and reads: the node's
//!   files, the relay URL, what polls deliver, the inventory and the envelopes);
//! - `tasks` (the joins, leaves and checks in flight, their retry tables, and the one
//!   confirm gate), `deps` (what the loop is given, why it stops);
//! - `planner` (the latest poll, the guard, merod's holdings and the orphans);
//! - `record` (the state, changed only by recording an outcome, which persists it), `poll`
//!   (the poll's cadence), `roles` (the roles MDMA was told).
//!
//! The jobs beside the loop are in their own room, `crate::jobs` (one file each, under the
//! harness they run on). [`TreeJobs`] runs the inventory and the recovery envelopes one run
//! at a time, for the instruction-count check.
//!
//! What the live status shows of the loop's sets is projected in `telemetry`.

mod beside;
mod deps;
mod merod_view;
mod planner;
mod poll;
mod record;
mod roles;
mod sidecar;
mod startup;
mod tasks;

pub use crate::jobs::readiness::{wait_for_merod, ProbeFailed, Readiness};
pub use crate::jobs::units::{SystemdUnits, UnitControl, UnitError, RESTART_TIMEOUT};
pub use crate::telemetry::serve as serve_status;
pub use crate::telemetry::{unix_now, LiveStatus, NotReady, Phase, Telemetry};
pub use deps::{DaemonError, Deps, NotPersisted};
pub use sidecar::{CycleOutcome, Sidecar};

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::ids::{GroupId, PeerId};
use crate::jobs::{inventory, recovery, trees, Job};

/// How long `once` waits for merod's admin API before giving up.
pub const ONCE_MEROD_WAIT: Duration = Duration::from_secs(60);

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
    sidecar.once_cycle().await
}

/// The context inventory and the recovery envelopes as the daemon runs them (one walk of a
/// tree for both, through the same handoff), one run at a time, without the harness: for
/// the instruction-count check, which counts one scan or one pass (`examples/cycle-cost.rs`).
pub struct TreeJobs {
    scan: inventory::ScanJob,
    pass: recovery::PassJob,
    /// The confirmed set handed to each, and the admitted one to the envelopes.
    _offers: [inventory::NamespacesOffer; 3],
}

/// Why a run of a [`TreeJobs`] job did not do all it had to (the job's own typed error).
pub type TreeJobError = Box<dyn std::error::Error + Send + Sync>;

impl TreeJobs {
    /// The two jobs over `deps`'s clients, for the node `peer_id` whose account is
    /// `account` (lowercase hex), handed `confirmed`, their records beside `cfg`'s state
    /// file. `None` when `deps` has not their clients (a test's own merod and MDMA).
    pub fn new(
        cfg: &Config,
        deps: &Deps,
        peer_id: PeerId,
        account: String,
        confirmed: &BTreeSet<GroupId>,
    ) -> Option<Self> {
        let offers = [(); 3].map(|()| inventory::NamespacesOffer::channel());
        let [(inv, inv_feed), (rec, rec_feed), (adm, adm_feed)] = offers;
        for offer in [&inv, &rec, &adm] {
            offer.offer(confirmed);
        }
        let account: inventory::AccountSource = Arc::new(move || Some(account.clone()));
        let walks = Arc::new(trees::Handoff::default());
        let dir = crate::durable::parent_dir(&cfg.state_file);
        let scan = inventory::ScanJob::new(
            deps.inventory.clone()?,
            peer_id.clone(),
            Arc::clone(&account),
            inv_feed,
            dir.join(inventory::RECORD_FILE),
            Some(Arc::clone(&walks)),
        );
        let pass = recovery::PassJob::new(
            deps.recovery.clone()?,
            peer_id,
            account,
            (rec_feed, adm_feed),
            &dir.join(recovery::RECORD_FILE),
            Some(walks),
        );
        Some(Self {
            scan,
            pass,
            _offers: [inv, rec, adm],
        })
    }

    /// One scan: merod's usage, the walks it picks, handed on, the report if any. The
    /// namespaces reported.
    ///
    /// Errors: the post did not land.
    pub async fn scan(&mut self) -> Result<usize, TreeJobError> {
        Ok(self.scan.run().await?)
    }

    /// Makes the next scan walk every namespace, as every 15 minutes.
    pub fn walk_whole_next(&mut self) {
        self.scan.walk_whole_next();
    }

    /// One pass of the envelopes over the walks handed over. The envelopes written.
    ///
    /// Errors: some envelopes were not written or removed.
    pub async fn pass(&mut self) -> Result<usize, TreeJobError> {
        Ok(self.pass.run().await?.written)
    }
}
