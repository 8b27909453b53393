//! Whether merod answers, watched in the background after start-up: the loop polls MDMA
//! (the node's heartbeat) from the moment the PeerId is read, whether or not merod
//! answers; only joins and leaves wait for merod. Until the first answer `/readyz` is not
//! ready and `STATUS=` says merod is not answering.

use std::sync::Arc;

use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::info;

use crate::merod::Node;
use crate::telemetry::Telemetry;

use super::held::HeldView;
use super::readiness::{Probed, ReadinessProbe};

/// Whether merod has answered a readiness probe since start-up.
#[derive(Clone, Debug)]
pub(crate) struct MerodUp(watch::Receiver<bool>);

impl MerodUp {
    /// merod answered before the loop started (or is never called: a dry run).
    pub(crate) fn known() -> Self {
        let (_tx, rx) = watch::channel(true);
        Self(rx)
    }

    /// Whether merod has answered.
    pub(crate) fn is_up(&self) -> bool {
        *self.0.borrow()
    }
}

/// Starts probing merod (`GET /admin-api/peers`, each bounded by [`crate::merod::PROBE_TIMEOUT`],
/// backing off from 1 s to 5 s) until it answers; then asks `held` for a read and ends.
/// Each change of what the probe sees is logged once and shown in the live status (start-up
/// sets `merod_not_answering` before this starts, with the phase, so no `READY=1` slips out).
pub(crate) fn spawn(
    merod: Arc<dyn Node>,
    telemetry: Arc<Telemetry>,
    held: HeldView,
    shutdown: CancellationToken,
) -> MerodUp {
    let (tx, rx) = watch::channel(false);
    tokio::spawn(async move {
        let mut probe = ReadinessProbe::default();
        loop {
            match probe.probe(merod.as_ref()).await {
                Probed::Ready => break,
                Probed::Failed { reason, changed } => {
                    if changed {
                        info!("merod not answering ({reason}): polling MDMA meanwhile; joins and leaves wait for merod");
                        telemetry.update(|st| st.merod_not_answering = Some(reason.to_string()));
                    }
                }
            }
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep_until(probe.next_probe(Instant::now())) => {}
            }
        }
        info!("merod admin API answers: joins and leaves may start");
        telemetry.update(|st| st.merod_not_answering = None);
        let _ = tx.send(true);
        held.refresh_soon();
    });
    MerodUp(rx)
}
