//! What the loop is given (MDMA, merod, telemetry, the fleet token's job) and why it stops
//! with an error.

use std::sync::Arc;
use std::time::Duration;

use crate::config::Config;
use crate::identity::IdentityError;
use crate::mdma::{ControlPlane, MdmaClient};
use crate::merod::{ListenCandidates, Node};
use crate::metadata::MetadataClient;
use crate::registration::TokenJob;
use crate::state::StateError;
use crate::telemetry::Telemetry;

use crate::jobs::device_login::NodeKeySource;
use crate::jobs::inventory::InventoryDeps;
use crate::jobs::readiness::ProbeFailed;
use crate::jobs::recovery::RecoveryDeps;
use crate::jobs::units::{SystemdUnits, UnitControl};

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
    /// systemd: the units a new TLS certificate restarts ([`SystemdUnits`] on the system
    /// bus, unless replaced).
    pub units: Arc<dyn UnitControl>,
    /// The instance metadata at `[registration] metadata_url` (else GCE's), shared by
    /// registration, the poll's `relay_url` (with `[registration]` only) and the log
    /// shippers' endpoints; read only when one of them needs it.
    pub(crate) metadata: Option<MetadataClient>,
    /// merod's group reads and MDMA's inventory route for the context inventory (the real
    /// clients only: a test's own merod and MDMA have none, and no inventory runs).
    pub(crate) inventory: Option<InventoryDeps>,
    /// merod's reads and seal route and MDMA's recovery route for the recovery envelopes
    /// (the real clients only, as `inventory`).
    pub(crate) recovery: Option<RecoveryDeps>,
    /// merod's node key for device-key login (the real client only, as `inventory`).
    pub(crate) node_key: Option<Arc<dyn NodeKeySource>>,
}

impl Deps {
    /// MDMA and merod with a fresh [`Telemetry`].
    pub fn new(mdma: Arc<dyn ControlPlane>, merod: Arc<dyn Node>) -> Self {
        Self {
            mdma,
            merod,
            telemetry: Arc::new(Telemetry::new()),
            token_job: None,
            metadata: None,
            units: Arc::new(SystemdUnits),
            inventory: None,
            recovery: None,
            node_key: None,
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
        let url = match &cfg.registration {
            Some(reg) => reg.metadata_url.clone(),
            None => url::Url::parse(crate::config::DEFAULT_METADATA_URL)
                .expect("the default metadata URL parses"),
        };
        let metadata = Some(MetadataClient::new(url)?);
        let token_job = TokenJob::for_config(cfg, &mdma, &registration_merod, metadata.as_ref())?;
        let inventory = Some(InventoryDeps {
            merod: Arc::clone(&registration_merod) as _,
            mdma: Arc::new(mdma.clone()),
        });
        let node_key = Some(Arc::clone(&registration_merod) as Arc<dyn NodeKeySource>);
        let recovery = Some(RecoveryDeps {
            merod: registration_merod,
            mdma: Arc::new(mdma.clone()),
        });
        Ok(Self {
            mdma: Arc::new(mdma),
            merod,
            telemetry,
            token_job,
            metadata,
            units: Arc::new(SystemdUnits),
            inventory,
            recovery,
            node_key,
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
        last: ProbeFailed,
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
