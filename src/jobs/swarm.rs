//! The node's swarm addresses: merod's `GET /admin-api/network/status` `externalAddrs`, each
//! ending in the node's own `/p2p/<PeerId>` ([`NetworkStatus::swarm_addrs`]). Every poll
//! reports them as `swarm_addrs`, and MDMA hands them to other joiners as `admitter_addrs`
//! (direct admission), so a fleet of these nodes keeps admitting each other directly. A job
//! reads them every [`READ_EVERY`]; the poll sends what it last read and never waits for
//! merod. `[]` means "not reported" to MDMA (it keeps what it had): it is sent before the
//! first read and after a failed one.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::limits::IDENTITY_DEADLINE;
use crate::jobs::{self, Job, JobHandle, Schedule};
use crate::merod::{MerodError, NetworkStatus, Node};
use crate::telemetry::Telemetry;

/// How often the addresses are read.
pub(crate) const READ_EVERY: Duration = Duration::from_secs(60);

struct SwarmJob {
    merod: Arc<dyn Node>,
    telemetry: Arc<Telemetry>,
}

impl Job for SwarmJob {
    type Output = Arc<Vec<String>>;
    type Error = MerodError;
    const NAME: &'static str = "swarm_addrs";
    const FAILING: &'static str = "merod's network status cannot be read";
    const EFFECT: &'static str =
        "polls report swarm_addrs as [] (not reported: MDMA keeps what it had)";
    const RECOVERED: &'static str = "merod's network status can be read again";

    fn schedule(&self) -> Schedule {
        Schedule::every(READ_EVERY, IDENTITY_DEADLINE)
    }

    async fn run(&mut self) -> Result<Arc<Vec<String>>, MerodError> {
        let status: NetworkStatus = self.merod.network_status().await?;
        let addrs = status.swarm_addrs();
        self.telemetry
            .update(|st| st.swarm_addrs = Some(addrs.clone()));
        Ok(Arc::new(addrs))
    }

    fn failed(&mut self, _why: &str) {
        self.telemetry.update(|st| st.swarm_addrs = None);
    }
}

/// What the poll reads of the swarm addresses.
#[derive(Clone, Debug)]
pub(crate) struct SwarmView(Option<JobHandle<Arc<Vec<String>>>>);

impl SwarmView {
    /// Starts reading them from `merod`.
    pub(crate) fn start(
        merod: Arc<dyn Node>,
        telemetry: Arc<Telemetry>,
        shutdown: CancellationToken,
    ) -> Self {
        let job = SwarmJob {
            merod,
            telemetry: Arc::clone(&telemetry),
        };
        Self(Some(jobs::spawn(job, telemetry, shutdown)))
    }

    /// No job (a dry run, which calls no merod): `[]` always.
    pub(crate) fn idle() -> Self {
        Self(None)
    }

    /// What the next poll reports: the latest good read, else `[]` (not reported).
    pub(crate) fn poll_field(&self) -> Arc<Vec<String>> {
        self.0
            .as_ref()
            .and_then(JobHandle::latest_good)
            .unwrap_or_default()
    }
}
