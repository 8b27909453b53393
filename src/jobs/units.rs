//! The systemd units the daemon restarts (the TLS terminator after a new certificate,
//! `mero-auth` after a new node key), through systemd's D-Bus API on the system bus:
//! `org.freedesktop.systemd1.Manager` `RestartUnit(name, "replace")`, never a `systemctl`
//! subprocess. A restart counts as done once systemd accepted the job; how the unit then
//! starts is systemd's to report. When a unit last became active is its
//! `ActiveEnterTimestamp` property (`LoadUnit(name)`, then `org.freedesktop.DBus.Properties`
//! `Get` on the unit's object).

use std::time::{Duration, SystemTime};

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
/// own through [`Deps`](crate::daemon::Deps).
#[async_trait]
pub trait UnitControl: Send + Sync {
    /// Restarts `unit` (a unit name such as `traefik.service`), starting it if it is
    /// stopped; returns once the restart is queued.
    ///
    /// Errors: [`UnitError`].
    async fn restart(&self, unit: &str) -> Result<(), UnitError>;

    /// When `unit` last entered the active state (systemd's `ActiveEnterTimestamp`, wall
    /// clock); `Ok(None)` when it has not since systemd started (or is unknown to it).
    ///
    /// Errors: [`UnitError`]; the default implementation always fails
    /// ([`UnitError::Other`]), which a caller takes as "unknown", never as a time.
    async fn active_since(&self, unit: &str) -> Result<Option<SystemTime>, UnitError> {
        Err(UnitError::Other(format!(
            "this unit control cannot tell when {unit} became active"
        )))
    }
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

    async fn active_since(&self, unit: &str) -> Result<Option<SystemTime>, UnitError> {
        let refused = |source: zbus::Error| UnitError::Refused {
            unit: unit.to_owned(),
            source: Box::new(source),
        };
        let call = async {
            let bus = zbus::Connection::system()
                .await
                .map_err(|e| UnitError::Bus(Box::new(e)))?;
            let loaded = bus
                .call_method(
                    Some("org.freedesktop.systemd1"),
                    "/org/freedesktop/systemd1",
                    Some("org.freedesktop.systemd1.Manager"),
                    "LoadUnit",
                    &(unit,),
                )
                .await
                .map_err(refused)?;
            let path: zbus::zvariant::OwnedObjectPath =
                loaded.body().deserialize().map_err(refused)?;
            let got = bus
                .call_method(
                    Some("org.freedesktop.systemd1"),
                    &path,
                    Some("org.freedesktop.DBus.Properties"),
                    "Get",
                    &("org.freedesktop.systemd1.Unit", "ActiveEnterTimestamp"),
                )
                .await
                .map_err(refused)?;
            let value: zbus::zvariant::OwnedValue = got.body().deserialize().map_err(refused)?;
            let micros = u64::try_from(value).map_err(|e| refused(e.into()))?;
            Ok(since_epoch_micros(micros))
        };
        tokio::time::timeout(RESTART_TIMEOUT, call)
            .await
            .unwrap_or(Err(UnitError::Timeout(RESTART_TIMEOUT)))
    }
}

/// systemd's timestamp (microseconds since the Unix epoch; 0: never) as a time.
fn since_epoch_micros(micros: u64) -> Option<SystemTime> {
    (micros != 0).then(|| SystemTime::UNIX_EPOCH + Duration::from_micros(micros))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_zero_timestamp_is_never_and_others_count_from_the_epoch() {
        assert_eq!(since_epoch_micros(0), None);
        assert_eq!(
            since_epoch_micros(1_733_400_000_123_456),
            Some(SystemTime::UNIX_EPOCH + Duration::new(1_733_400_000, 123_456_000))
        );
    }
}
