//! Log output: human-readable lines to stderr — or natively to the journal
//! ([`journald`], `log_target`) — and appended to the log file
//! (`/var/log/fleet-sidecar.log` by default, `log_to_file`), via `tracing`.
//!
//! The file is opened in append mode and can be reopened ([`LogFile::reopen`]) after
//! logrotate moved it. Secrets never reach a log line: the token has no `Display` and its
//! `Debug` is `[redacted]` ([`crate::mdma::FleetToken`]).

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use tracing_subscriber::fmt::MakeWriter;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

use crate::config::{LogFormat, LogTarget};

mod journald;

/// An append-only log file that can be reopened at the same path.
#[derive(Debug)]
pub(crate) struct LogFile {
    path: PathBuf,
    file: Mutex<File>,
}

fn open_append(path: &Path) -> io::Result<File> {
    OpenOptions::new().create(true).append(true).open(path)
}

impl LogFile {
    /// Opens (creating it if needed) `path` for appending.
    ///
    /// Errors: the I/O error of the open.
    pub(crate) fn open(path: &Path) -> io::Result<Arc<Self>> {
        Ok(Arc::new(Self {
            path: path.to_owned(),
            file: Mutex::new(open_append(path)?),
        }))
    }

    /// Reopens the file at its path (after logrotate renamed the old one).
    ///
    /// Errors: the I/O error of the open; the old file stays in use.
    pub(crate) fn reopen(&self) -> io::Result<()> {
        let fresh = open_append(&self.path)?;
        let mut file = self.file.lock().unwrap_or_else(|p| p.into_inner());
        *file = fresh;
        Ok(())
    }

    /// The file's path.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }
}

/// Why [`init`] could not set logging up as configured.
#[derive(Debug, thiserror::Error)]
pub(crate) enum LogInitError {
    /// The log file could not be opened; logging goes to the journal or stderr only.
    #[error("cannot open log file {}: {source}; logging to the journal or stderr only", path.display())]
    LogFile {
        /// The configured `log_file`.
        path: PathBuf,
        /// The open's I/O error.
        #[source]
        source: io::Error,
    },
    /// A global `tracing` subscriber was already installed.
    #[error("cannot install the log subscriber: {0}")]
    Subscriber(#[from] tracing_subscriber::util::TryInitError),
}

/// One event's writer into a [`LogFile`].
#[derive(Debug)]
pub(crate) struct LogFileWriter<'a>(&'a LogFile);

impl Write for LogFileWriter<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let mut file = self.0.file.lock().unwrap_or_else(|p| p.into_inner());
        file.write_all(buf)?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// The [`MakeWriter`] that `tracing` holds: a shared handle on the [`LogFile`].
#[derive(Debug, Clone)]
pub(crate) struct SharedLogFile(pub Arc<LogFile>);

impl<'a> MakeWriter<'a> for SharedLogFile {
    type Writer = LogFileWriter<'a>;

    fn make_writer(&'a self) -> Self::Writer {
        LogFileWriter(&self.0)
    }
}

/// `RUST_LOG`, default `info`.
fn filter() -> EnvFilter {
    EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"))
}

/// A fmt layer writing to `writer` in `format`, filtered by `RUST_LOG` (default `info`).
fn layer<S, W>(writer: W, format: LogFormat) -> Box<dyn Layer<S> + Send + Sync>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
    W: for<'w> MakeWriter<'w> + Send + Sync + 'static,
{
    let filter = filter();
    let base = tracing_subscriber::fmt::layer()
        .with_writer(writer)
        .with_ansi(false)
        .with_target(false);
    match format {
        LogFormat::Text => base.with_filter(filter).boxed(),
        LogFormat::Json => base.json().with_filter(filter).boxed(),
    }
}

/// Sets up the global subscriber: the journal or stderr (`target`; `Auto` is the journal
/// when systemd connected stderr to it), plus `log_file` when given and openable, each
/// line in `format`. Verbosity comes from `RUST_LOG` (default `info`). When the journal
/// cannot be reached, stderr is used and a warning says why.
///
/// Returns the open log file (to reopen on SIGHUP).
///
/// Errors: [`LogInitError::Subscriber`] when a global subscriber is already set (nothing is
/// logged through this one); [`LogInitError::LogFile`] when `log_file` cannot be opened —
/// logging is set up all the same and goes to the journal or stderr only.
pub(crate) fn init(
    log_file: Option<&Path>,
    format: LogFormat,
    target: LogTarget,
) -> Result<Option<Arc<LogFile>>, LogInitError> {
    let want_journal = match target {
        LogTarget::Journald => true,
        LogTarget::Stderr => false,
        LogTarget::Auto => journald::stderr_is_journal(),
    };
    let (journal, journal_problem) = match want_journal.then(journald::layer) {
        None => (None, None),
        Some(Ok(l)) => (Some(l.with_filter(filter())), None),
        Some(Err(e)) => (None, Some(e)),
    };
    let stderr = journal.is_none().then(|| layer(io::stderr, format));
    let (file, problem) = match log_file.map(|p| (p, LogFile::open(p))) {
        None => (None, None),
        Some((_, Ok(f))) => (Some(f), None),
        Some((path, Err(source))) => (
            None,
            Some(LogInitError::LogFile {
                path: path.to_owned(),
                source,
            }),
        ),
    };
    let file_layer = file
        .as_ref()
        .map(|f| layer(SharedLogFile(Arc::clone(f)), format));
    tracing_subscriber::registry()
        .with(journal)
        .with(stderr)
        .with(file_layer)
        .try_init()?;
    if let Some(e) = journal_problem {
        tracing::warn!("cannot log to the journal ({e}): logging to stderr instead");
    }
    match problem {
        Some(p) => Err(p),
        None => Ok(file),
    }
}
