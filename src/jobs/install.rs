//! What the jobs installing a delivered file share, written once: a delivery handed from
//! the loop to its job ([`deliveries`]: the job wakes once per new value, however often the
//! polls repeat it), the file work off the runtime within [`FILES_DEADLINE`]
//! ([`file_work`]), the restart of the units that read the file ([`restart_each`]), and the
//! one error of all three ([`InstallError`]). `tls_install` (the TLS certificate),
//! `logs_token` (the log shippers' token) and `device_login` (merod's node key) are
//! configured on it; each keeps only what it checks of its file.

use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::sync::watch;
use tracing::info;

use super::units::{UnitControl, UnitError};
use crate::durable::WriteError;
use crate::outcome::Timed;
use crate::telemetry::Telemetry;

/// Bound of one install's file work (reading what is held, writing the new file): a hung
/// disk fails the run instead of holding the job.
pub(crate) const FILES_DEADLINE: Duration = Duration::from_secs(10);

/// Why an install, or the restarts after it, failed (retried with the back-off).
#[derive(Debug, thiserror::Error)]
pub(crate) enum InstallError {
    /// A file could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The new file could not be written.
    #[error(transparent)]
    Write(#[from] WriteError),
    /// The file work did not end within [`FILES_DEADLINE`] (a hung disk): which files.
    #[error("{0} did not answer within {FILES_DEADLINE:?}")]
    Stalled(&'static str),
    /// A unit could not be restarted.
    #[error("restart of {unit}: {source}")]
    Restart {
        /// The unit.
        unit: String,
        /// Why.
        #[source]
        source: UnitError,
    },
}

impl InstallError {
    /// A failed read of `path`.
    pub(crate) fn read(path: &Path) -> impl FnOnce(std::io::Error) -> Self + '_ {
        move |source| InstallError::Read {
            path: path.to_owned(),
            source,
        }
    }
}

impl Timed for InstallError {
    fn is_timeout(&self) -> bool {
        match self {
            InstallError::Stalled(_) => true,
            InstallError::Restart { source, .. } => source.is_timeout(),
            _ => false,
        }
    }
}

/// Runs `work` off the runtime, bounded by [`FILES_DEADLINE`]; past it (or if it panicked)
/// the error is [`InstallError::Stalled`] naming `files`.
pub(crate) async fn file_work<T, E>(
    files: &'static str,
    work: impl FnOnce() -> Result<T, E> + Send + 'static,
) -> Result<T, E>
where
    T: Send + 'static,
    E: From<InstallError> + Send + 'static,
{
    match tokio::time::timeout(FILES_DEADLINE, tokio::task::spawn_blocking(work)).await {
        Ok(Ok(done)) => done,
        Ok(Err(_)) | Err(_) => Err(InstallError::Stalled(files).into()),
    }
}

/// Restarts the units in `pending` in order, each counted in `unit_restarts` and said
/// (`"restarted {after}"`); the first failure ends it, `pending` keeping that unit and the
/// ones after it for the next run.
///
/// Errors: [`InstallError::Restart`] for the unit that could not be restarted.
pub(crate) async fn restart_each(
    units: &dyn UnitControl,
    pending: &mut Vec<String>,
    telemetry: &Telemetry,
    after: &str,
) -> Result<(), InstallError> {
    while let Some(unit) = pending.first() {
        match units.restart(unit).await {
            Ok(()) => {
                Telemetry::count(&telemetry.unit_restarts, "ok");
                info!(unit = %unit, "restarted {after}");
                pending.remove(0);
            }
            Err(source) => {
                let label = if source.is_timeout() {
                    "timeout"
                } else {
                    "error"
                };
                Telemetry::count(&telemetry.unit_restarts, label);
                return Err(InstallError::Restart {
                    unit: unit.clone(),
                    source,
                });
            }
        }
    }
    Ok(())
}

/// A new delivery channel: the loop's end and the job's.
pub(crate) fn deliveries<T>() -> (Deliveries<T>, Delivered<T>) {
    let (tx, rx) = watch::channel(None);
    (
        Deliveries(tx),
        Delivered {
            latest: rx,
            handled: None,
        },
    )
}

/// The loop's end of an install job: hands it what the polls deliver.
#[derive(Debug)]
pub(crate) struct Deliveries<T>(watch::Sender<Option<T>>);

impl<T: PartialEq> Deliveries<T> {
    /// Hands over `value`; the job wakes only when it differs from the one handed over
    /// before (MDMA repeats a delivery every poll).
    pub(crate) fn offer(&self, value: T) {
        self.0.send_if_modified(|current| {
            if current.as_ref() == Some(&value) {
                return false;
            }
            *current = Some(value);
            true
        });
    }
}

/// The job's end: the latest delivery, and the one dealt with last.
pub(crate) struct Delivered<T> {
    latest: watch::Receiver<Option<T>>,
    handled: Option<T>,
}

impl<T: Clone + PartialEq> Delivered<T> {
    /// The latest delivery (`None` inside: nothing delivered yet) when it is not the one
    /// dealt with last; `None` when it is.
    pub(crate) fn new_one(&mut self) -> Option<Option<T>> {
        let current = self.latest.borrow_and_update().clone();
        (current != self.handled).then_some(current)
    }

    /// Records `delivery` as dealt with (installed, unchanged or refused).
    pub(crate) fn dealt_with(&mut self, delivery: Option<T>) {
        self.handled = delivery;
    }

    /// Whether the latest delivery is the one dealt with last: a run would do nothing.
    pub(crate) fn all_dealt_with(&self) -> bool {
        *self.latest.borrow() == self.handled
    }

    /// Waits for a new delivery; forever once the loop is gone (shutdown: nothing will be
    /// delivered again).
    pub(crate) async fn changed(&mut self) {
        if self.latest.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}
