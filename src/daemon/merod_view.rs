//! What the loop knows of merod beside its own record, and what it tells MDMA of it: the
//! owner of the background jobs that watch merod (its readiness, what it holds, the join
//! outcomes reported to MDMA) and of what the loop remembers between their reads (drift
//! suspects, the roles MDMA was told, the node's account). Each job runs on its own and is
//! read without waiting; this owner only decides, after each new held read, which
//! namespaces to ask merod about ([`MerodView::after_read`]).

use std::collections::BTreeSet;
use std::sync::Arc;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::ids::{GroupId, PeerId};
use crate::merod::TeeRole;

use super::deps::Deps;
use super::roles::Roles;
use crate::jobs::account::{self, AccountCache};
use crate::jobs::held::{self, HeldView};
use crate::jobs::join_status::{self, JoinStatusHandle};
use crate::jobs::merod_watch::{self, MerodUp};
use crate::jobs::swarm::SwarmView;

/// The jobs watching merod and what the loop keeps of their reads.
pub(super) struct MerodView {
    /// Whether merod has answered since start-up (joins and leaves wait until it has).
    pub(super) up: MerodUp,
    /// What merod holds: the held refresh's latest read (also for other consumers).
    pub(super) held: HeldView,
    /// Join outcomes go to MDMA's join-status through this.
    pub(super) join_status: JoinStatusHandle,
    /// merod's external addresses, as its job last read them.
    pub(super) swarm: SwarmView,
    /// The roles MDMA was told per confirmed namespace, and the round robin of re-reads.
    pub(super) roles: Roles,
    /// The node's account, asked for by its job until known, read for the role in each
    /// confirm and reported in every poll.
    pub(super) account: Arc<AccountCache>,
    /// The generation of the latest held read looked at.
    seen: u64,
    /// Recorded as held but missing from that read (asked about when missing again).
    missing: BTreeSet<GroupId>,
}

/// What to ask merod after a new held read.
#[derive(Debug)]
pub(super) struct Checks {
    /// Recorded as held, missing from this read and the one before: does merod hold it?
    pub(super) drift: Vec<GroupId>,
    /// Confirmed namespaces whose role is read again, with the role MDMA was told.
    pub(super) roles: Vec<(GroupId, Option<Option<TeeRole>>)>,
    /// Everything the read listed (merod's holdings, where orphans are found).
    pub(super) read: Arc<[GroupId]>,
    /// When the read started.
    pub(super) read_started: Instant,
}

impl MerodView {
    /// No job runs (a dry run calls no merod): merod counts as up, nothing is reported.
    pub(super) fn idle() -> Self {
        Self::with(
            MerodUp::known(),
            HeldView::idle(),
            JoinStatusHandle::idle(),
            Arc::default(),
            SwarmView::idle(),
        )
    }

    /// Starts the held refresh and the join-status job (its file beside `state_file`),
    /// and, unless merod already answered, the readiness watch.
    pub(super) fn start(
        deps: &Deps,
        state_file: &std::path::Path,
        peer_id: &PeerId,
        merod_answered: bool,
        shutdown: &CancellationToken,
    ) -> Self {
        let telemetry = &deps.telemetry;
        let held = held::spawn(
            Arc::clone(&deps.merod),
            Arc::clone(telemetry),
            shutdown.clone(),
        );
        let join_status = join_status::spawn(
            join_status::JobDeps {
                path: join_status::file_beside(state_file),
                mdma: Arc::clone(&deps.mdma),
                peer_id: peer_id.clone(),
                telemetry: Arc::clone(telemetry),
            },
            shutdown.clone(),
        );
        #[cfg(test)]
        crate::jobs::spawn(
            crate::jobs::canary::Canary::default(),
            Arc::clone(telemetry),
            shutdown.clone(),
        );
        let up = if merod_answered {
            MerodUp::known()
        } else {
            merod_watch::spawn(
                Arc::clone(&deps.merod),
                Arc::clone(telemetry),
                held.clone(),
                shutdown.clone(),
            )
        };
        let account = Arc::new(AccountCache::shown_in(Arc::clone(telemetry)));
        account::spawn(
            Arc::clone(&deps.merod),
            Arc::clone(&account),
            Arc::clone(telemetry),
            shutdown.clone(),
        );
        let swarm = SwarmView::start(
            Arc::clone(&deps.merod),
            Arc::clone(telemetry),
            shutdown.clone(),
        );
        Self::with(up, held, join_status, account, swarm)
    }

    fn with(
        up: MerodUp,
        held: HeldView,
        join_status: JoinStatusHandle,
        account: Arc<AccountCache>,
        swarm: SwarmView,
    ) -> Self {
        Self {
            up,
            held,
            join_status,
            swarm,
            roles: Roles::default(),
            account,
            seen: 0,
            missing: BTreeSet::new(),
        }
    }

    /// After a held read newer than the last one looked at (fresh at `now`): the
    /// namespaces recorded as held (`admitted`) that it and the read before both miss
    /// (at most [`held::MAX_DRIFT_CHECKS`]), and a round of role checks of `confirmed`;
    /// `busy` namespaces (a task of theirs runs) are left out. `None`: no new read.
    pub(super) fn after_read(
        &mut self,
        admitted: &BTreeSet<GroupId>,
        confirmed: &BTreeSet<GroupId>,
        busy: impl Fn(&GroupId) -> bool,
        now: Instant,
    ) -> Option<Checks> {
        let latest = self.held.latest();
        let read = latest.fresh(now, held::HELD_MAX_AGE)?;
        if read.generation == self.seen {
            return None;
        }
        self.seen = read.generation;
        let missing = held::missing(admitted, &read.value);
        let drift = missing
            .intersection(&self.missing)
            .filter(|id| !busy(id))
            .take(held::MAX_DRIFT_CHECKS)
            .copied()
            .collect();
        self.missing = missing;
        let roles = self
            .roles
            .next_round(confirmed, &busy)
            .into_iter()
            .map(|id| (id, self.roles.told(id)))
            .collect();
        Some(Checks {
            drift,
            roles,
            read: Arc::clone(&read.value),
            read_started: read.started,
        })
    }
}
