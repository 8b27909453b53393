//! The systemd units the daemon restarts (the TLS terminator after a new certificate),
//! through systemd's D-Bus API on the system bus: `org.freedesktop.systemd1.Manager`
//! `RestartUnit(name, "replace")`, never a `systemctl` subprocess. A restart counts as done
//! once systemd accepted the job; how the unit then starts is systemd's to report.

use std::time::Duration;

use async_trait::async_trait;

/// Bound of one restart request: connecting to the system bus and systemd's answer.
pub const RESTART_TIMEOUT: Duration = Duration::from_secs(30);

/// Why a unit could not be restarted.
#[derive(Debug, thiserror::Error)]
pub enum UnitError {
    /// The system bus could not be reached.
    #[error("cannot reach the system bus: {0}")]
    Bus(#[source] Box<zbus::Error>),
    /// systemd refused or failed the request (no such unit, access denied, …).
    #[error("systemd refused to restart {unit}: {source}")]
    Refused {
        /// The unit.
        unit: String,
        /// systemd's D-Bus error.
        #[source]
        source: Box<zbus::Error>,
    },
    /// No answer within [`RESTART_TIMEOUT`].
    #[error("no answer from systemd within {0:?}")]
    Timeout(Duration),
    /// A stand-in's failure (tests, a tool's own implementation).
    #[error("{0}")]
    Other(String),
}

impl crate::outcome::Timed for UnitError {
    fn is_timeout(&self) -> bool {
        matches!(self, UnitError::Timeout(_))
    }
}

/// Restarts systemd units. [`SystemdUnits`] is the real one; a test or a tool passes its
/// own through [`Deps`](super::Deps).
#[async_trait]
pub trait UnitControl: Send + Sync {
    /// Restarts `unit` (a unit name such as `traefik.service`), starting it if it is
    /// stopped; returns once the restart is queued.
    ///
    /// Errors: [`UnitError`].
    async fn restart(&self, unit: &str) -> Result<(), UnitError>;
}

/// systemd on the system bus (a new connection per restart: restarts are rare).
#[derive(Clone, Copy, Debug, Default)]
pub struct SystemdUnits;

#[async_trait]
impl UnitControl for SystemdUnits {
    async fn restart(&self, unit: &str) -> Result<(), UnitError> {
        let call = async {
            let bus = zbus::Connection::system()
                .await
                .map_err(|e| UnitError::Bus(Box::new(e)))?;
            bus.call_method(
                Some("org.freedesktop.systemd1"),
                "/org/freedesktop/systemd1",
                Some("org.freedesktop.systemd1.Manager"),
                "RestartUnit",
                &(unit, "replace"),
            )
            .await
            .map_err(|source| UnitError::Refused {
                unit: unit.to_owned(),
                source: Box::new(source),
            })?;
            Ok(())
        };
        tokio::time::timeout(RESTART_TIMEOUT, call)
            .await
            .unwrap_or(Err(UnitError::Timeout(RESTART_TIMEOUT)))
    }
}
