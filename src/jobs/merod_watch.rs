//! Whether merod answers, watched in the background after start-up: the loop polls MDMA
//! (the node's heartbeat) from the moment the PeerId is read, whether or not merod
//! answers; only joins and leaves wait for merod. Until the first answer `/readyz` is not
//! ready and `STATUS=` says merod is not answering. The watch is a job on the crate's job
//! harness (`jobs`): one run is one readiness probe, and it ends with merod's first answer.

use std::sync::Arc;

use tracing::info;

use crate::jobs::{self, Job, JobHandle, Latest, Schedule};
use crate::merod::{MerodError, Node, PROBE_TIMEOUT};
use crate::telemetry::Telemetry;
use tokio_util::sync::CancellationToken;

use super::held::HeldView;
use super::readiness::PROBE_BACKOFF;

/// Whether merod has answered a readiness probe since start-up.
#[derive(Clone, Debug)]
pub(crate) struct MerodUp(Option<JobHandle<()>>);

impl MerodUp {
    /// merod answered before the loop started (or is never called: a dry run).
    pub(crate) fn known() -> Self {
        Self(None)
    }

    /// Whether merod has answered.
    pub(crate) fn is_up(&self) -> bool {
        self.0
            .as_ref()
            .is_none_or(|watch| watch.with_latest(|l| matches!(l, Latest::Good(_))))
    }
}

/// Starts probing merod (`GET /admin-api/peers`, each bounded by [`PROBE_TIMEOUT`], backing
/// off from 1 s to 5 s) until it answers; then asks `held` for a read and ends. Each change
/// of what the probe sees is logged once and shown in the live status (start-up sets
/// `merod_not_answering` before this starts, with the phase, so no `READY=1` slips out).
pub(crate) fn spawn(
    merod: Arc<dyn Node>,
    telemetry: Arc<Telemetry>,
    held: HeldView,
    shutdown: CancellationToken,
) -> MerodUp {
    let job = ReadinessWatch {
        merod,
        telemetry: Arc::clone(&telemetry),
        held,
        shown: None,
        up: false,
    };
    MerodUp(Some(jobs::spawn(job, telemetry, shutdown)))
}

/// The readiness watch, a job: one run is one probe of merod.
struct ReadinessWatch {
    merod: Arc<dyn Node>,
    telemetry: Arc<Telemetry>,
    /// Asked for a read once merod answers.
    held: HeldView,
    /// The failure shown in the live status (shown again only when it changes).
    shown: Option<String>,
    /// merod answered: the job is done.
    up: bool,
}

impl Job for ReadinessWatch {
    type Output = ();
    type Error = MerodError;
    const NAME: &'static str = "merod_readiness";
    const FAILING: &'static str = "merod not answering";
    const EFFECT: &'static str = "polling MDMA meanwhile; joins and leaves wait for merod";
    const RECOVERED: &'static str = "merod answers";

    fn schedule(&self) -> Schedule {
        Schedule::when_asked(PROBE_TIMEOUT).backoff(PROBE_BACKOFF)
    }

    async fn run(&mut self) -> Result<(), MerodError> {
        self.merod.probe().await?;
        info!("merod admin API answers: joins and leaves may start");
        self.telemetry.update(|st| st.merod_not_answering = None);
        self.up = true;
        self.held.refresh_soon();
        Ok(())
    }

    fn failed(&mut self, why: &str) {
        if self.shown.as_deref() != Some(why) {
            let why = why.to_owned();
            self.shown = Some(why.clone());
            self.telemetry
                .update(|st| st.merod_not_answering = Some(why));
        }
    }

    fn finished(&self) -> bool {
        self.up
    }
}
