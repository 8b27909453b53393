//! The jobs the poll feeds and reads, beside the loop: what the node's report carries
//! besides what merod holds (the node's files, the relay URL), what the polls deliver
//! (the TLS certificate and the logs token, handed to their install jobs), and the
//! confirmed and admitted sets handed to the inventory and the recovery envelopes (with
//! both on, the inventory's walks go on to the envelopes). The loop never waits for one of
//! them: it reads what they last published and hands over what changed.

use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use super::deps::Deps;
use crate::config::Config;
use crate::ids::PeerId;
use crate::jobs::account::AccountCache;
use crate::jobs::device_login;
use crate::jobs::inventory::InventoryView;
use crate::jobs::logs_token::TokenInstaller;
use crate::jobs::node_files::{NodeFiles, NodeFilesView};
use crate::jobs::recovery::RecoveryView;
use crate::jobs::relay::RelayView;
use crate::jobs::tls_install::CertInstaller;
use crate::jobs::trees::Handoff;
use crate::mdma::ShouldJoin;
use crate::state::State;

/// The loop's ends of the jobs beside it that the poll feeds or reads.
pub(crate) struct Beside {
    /// What the node's files say (the TLS certificate's expiry, the logs token's
    /// fingerprint), as a job last looked.
    files: NodeFilesView,
    /// The relay URL polls report (fixed, or as a job last read it from the metadata).
    relay: RelayView,
    /// Installs the TLS certificates polls deliver (none in a dry run or with `[tls]
    /// install = false`).
    tls: Option<CertInstaller>,
    /// Installs the log shippers' tokens polls deliver (none in a dry run or with
    /// `[logs_token] install = false`).
    logs_token: Option<TokenInstaller>,
    /// Reports the context inventory of the confirmed namespaces (none in a dry run, with
    /// `[inventory] enabled = false`, or with a test's own merod and MDMA).
    inventory: Option<InventoryView>,
    /// Writes the recovery envelopes of the confirmed namespaces' members (none in a dry
    /// run, with `[recovery] enabled = false`, or with a test's own merod and MDMA).
    recovery: Option<RecoveryView>,
    /// The membership version whose sets `inventory` and `recovery` were handed last.
    offered_membership: Option<u64>,
}

impl Beside {
    /// Starts the jobs beside the loop for `cfg` (each as its table says) for the node
    /// `peer_id`, the walking jobs reading its account from `account`; device-key login
    /// too, which the loop neither feeds nor reads.
    pub(crate) fn start(
        cfg: &Config,
        deps: &Deps,
        peer_id: &PeerId,
        account: &Arc<AccountCache>,
        shutdown: &CancellationToken,
    ) -> Self {
        let telemetry = Arc::clone(&deps.telemetry);
        let files = NodeFilesView::start(cfg, Arc::clone(&telemetry), shutdown.clone());
        let relay = RelayView::start(
            cfg,
            deps.metadata.as_ref(),
            Arc::clone(&telemetry),
            shutdown.clone(),
        );
        let tls = CertInstaller::start(
            cfg,
            Arc::clone(&deps.units),
            files.clone(),
            Arc::clone(&telemetry),
            shutdown.clone(),
        );
        let logs_token = TokenInstaller::start(
            cfg,
            Arc::clone(&deps.units),
            deps.metadata.clone(),
            files.clone(),
            Arc::clone(&telemetry),
            shutdown.clone(),
        );
        // With both jobs on, the inventory's walks go on to the envelopes: each tree is
        // read once for both.
        let walks = (InventoryView::starts(cfg, deps.inventory.as_ref())
            && RecoveryView::starts(cfg, deps.recovery.as_ref()))
        .then(|| Arc::new(Handoff::default()));
        let inventory = InventoryView::start(
            cfg,
            deps.inventory.clone(),
            peer_id.clone(),
            {
                let account = Arc::clone(account);
                Arc::new(move || account.get())
            },
            walks.clone(),
            Arc::clone(&telemetry),
            shutdown.clone(),
        );
        device_login::start(
            cfg,
            deps.node_key.clone(),
            Arc::clone(&deps.units),
            Arc::clone(&telemetry),
            shutdown.clone(),
        );
        let recovery = RecoveryView::start(
            cfg,
            deps.recovery.clone(),
            peer_id.clone(),
            {
                let account = Arc::clone(account);
                Arc::new(move || account.get())
            },
            walks,
            Arc::clone(&telemetry),
            shutdown.clone(),
        );
        Self {
            files,
            relay,
            tls,
            logs_token,
            inventory,
            recovery,
            offered_membership: None,
        }
    }

    /// What the next poll reports of them: the node's files and the relay URL, as last
    /// read (never waited for).
    pub(crate) fn report(&self) -> (Arc<NodeFiles>, Arc<str>) {
        (self.files.poll_fields(), self.relay.poll_field())
    }

    /// Hands what `answer` delivers (taken out of it) to the install jobs; each wakes only
    /// for a delivery that differs from the one before.
    pub(crate) fn deliver(&self, answer: &mut ShouldJoin) {
        if let (Some(tls), Some(pem)) = (&self.tls, answer.tls_certificate.take()) {
            tls.offer(pem);
        }
        if let (Some(installer), Some(token)) = (&self.logs_token, answer.logs_token.take()) {
            installer.offer(token);
        }
    }

    /// Hands `state`'s confirmed (and admitted) sets to the inventory and the envelopes
    /// when its `membership` version moved since they were handed last.
    pub(crate) fn offer_membership(&mut self, membership: u64, state: &State) {
        if self.offered_membership == Some(membership) {
            return;
        }
        self.offered_membership = Some(membership);
        if let Some(inventory) = &self.inventory {
            inventory.offer(&state.confirmed);
        }
        if let Some(recovery) = &self.recovery {
            recovery.offer(&state.confirmed, &state.admitted);
        }
    }
}
