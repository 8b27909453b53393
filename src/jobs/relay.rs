//! The node's relay URL, which every poll reports as `relay_url`: `[registration]
//! relay_url` when set, else the instance metadata's `relay-url`, read by a job every
//! [`READ_EVERY`] through the metadata client registration uses, so both send the same value
//! (the last one read: a metadata server's blip keeps it). `""` while unknown, and always
//! without `[registration]` (a node with a configured token reads no metadata). The poll
//! takes the latest value and never waits for the metadata server.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::jobs::{self, Job, JobHandle, Schedule};
use crate::metadata::{MetadataAttribute, MetadataClient, MetadataError, METADATA_TIMEOUT};
use crate::outcome::Timed;
use crate::telemetry::Telemetry;

/// How often the metadata's `relay-url` is read (as often as registration checks the
/// identity it registered with).
pub(crate) const READ_EVERY: Duration = crate::metadata::REREAD_EVERY;

impl Timed for MetadataError {
    fn is_timeout(&self) -> bool {
        MetadataError::is_timeout(self)
    }
}

struct RelayJob {
    metadata: MetadataClient,
    telemetry: Arc<Telemetry>,
}

impl Job for RelayJob {
    type Output = Arc<str>;
    type Error = MetadataError;
    const NAME: &'static str = "relay_url";
    const FAILING: &'static str = "the instance metadata's relay-url cannot be read";
    const EFFECT: &'static str = "polls report relay_url as \"\" until it is read";
    const RECOVERED: &'static str = "the instance metadata's relay-url can be read again";

    fn schedule(&self) -> Schedule {
        Schedule::every(
            READ_EVERY,
            METADATA_TIMEOUT.saturating_add(Duration::from_secs(1)),
        )
    }

    async fn run(&mut self) -> Result<Arc<str>, MetadataError> {
        let url = self.metadata.value(MetadataAttribute::RelayUrl).await?;
        self.telemetry.update(|st| st.relay_url = Some(url.clone()));
        Ok(url.into())
    }
}

/// What the poll reads of the relay URL.
#[derive(Clone, Debug)]
pub(crate) enum RelayView {
    /// Known without reading: `[registration] relay_url`, or `""` without `[registration]`.
    Fixed(Arc<str>),
    /// Read from the metadata by a job.
    Read(JobHandle<Arc<str>>),
}

impl RelayView {
    /// The view for `cfg`: a job reading `metadata` when `[registration]` leaves
    /// `relay_url` unset (and `metadata` is given), else the fixed value.
    pub(crate) fn start(
        cfg: &Config,
        metadata: Option<&MetadataClient>,
        telemetry: Arc<Telemetry>,
        shutdown: CancellationToken,
    ) -> Self {
        let fixed = match (&cfg.registration, metadata) {
            (Some(reg), _) if reg.relay_url.is_some() => reg.relay_url.clone(),
            (Some(_), Some(metadata)) => {
                let job = RelayJob {
                    metadata: metadata.clone(),
                    telemetry: Arc::clone(&telemetry),
                };
                return Self::Read(jobs::spawn(job, telemetry, shutdown));
            }
            _ => None,
        };
        let fixed = fixed.unwrap_or_default();
        telemetry.update(|st| st.relay_url = Some(fixed.clone()));
        Self::Fixed(fixed.into())
    }

    /// What the next poll reports: the fixed value, or the job's latest read (`""` before
    /// the first and while nothing could be read).
    pub(crate) fn poll_field(&self) -> Arc<str> {
        match self {
            RelayView::Fixed(url) => Arc::clone(url),
            RelayView::Read(job) => job.latest_good().unwrap_or_else(|| Arc::from("")),
        }
    }
}
