//! Log output: human-readable lines to stderr — or natively to the journal
//! ([`journald`], `log_target`) — and appended to the log file
//! (`/var/log/fleet-sidecar.log` by default, `log_to_file`), via `tracing`.
//!
//! No sink can make the loop wait: the journal (or stderr) and the log file are written by
//! a thread of their own each, through a bounded queue ([`sink`]). A sink that stops
//! reading loses lines — counted in
//! `fleet_sidecar_log_lines_dropped_total{sink}` and said once when it reads again — and
//! the poll and `/healthz` go on. Control characters in a line (outside text: merod's and
//! MDMA's words) are escaped in text lines and journal fields ([`escape`]); JSON escapes
//! its own.
//!
//! The log file can be reopened ([`Logs::reopen`]) after logrotate moved it. Secrets never
//! reach a log line: the token has no `Display` and its `Debug` is `[redacted]`
//! ([`crate::mdma::FleetToken`]).

use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

use tracing_subscriber::fmt::MakeWriter;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

use crate::config::{LogFormat, LogTarget};

mod escape;
mod journald;
mod sink;

use sink::Sink;

/// The process's log sinks, for the signal handler (reopen) and the exit (flush).
#[derive(Debug, Default)]
pub(crate) struct Logs {
    /// The log file's sink and path, when one is open.
    file: Option<(Sink, PathBuf)>,
    /// Every queued sink (the journal or stderr, the log file).
    queued: Vec<Sink>,
}

impl Logs {
    /// Has the log file reopened at its path (after logrotate renamed the old one), after
    /// the lines already logged, which go to the old file. Never waits. `None` without a
    /// log file; `Some(false)` when the file's queue is full (nothing asked: try again).
    pub(crate) fn reopen(&self) -> Option<bool> {
        self.file.as_ref().map(|(sink, _)| sink.reopen())
    }

    /// The log file's path, when one is open.
    pub(crate) fn file_path(&self) -> Option<&Path> {
        self.file.as_ref().map(|(_, p)| p.as_path())
    }

    /// Waits at most `limit` in all for the lines logged so far to be written (at exit; a
    /// sink that does not read is not waited for longer).
    pub(crate) fn flush(&self, limit: Duration) {
        let deadline = std::time::Instant::now() + limit;
        for sink in &self.queued {
            sink.flush(deadline.saturating_duration_since(std::time::Instant::now()));
        }
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
    /// A log writer thread could not be started.
    #[error("cannot start the log writer: {0}")]
    Writer(#[source] io::Error),
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
/// Returns the sinks (to reopen the log file on SIGHUP, and flush at exit), and
/// [`LogInitError::LogFile`] when `log_file` could not be opened: logging is set up all the
/// same and goes to the journal or stderr only.
///
/// Errors: [`LogInitError::Subscriber`] when a global subscriber is already set (nothing is
/// logged through this one); [`LogInitError::Writer`] when a writer thread cannot start.
pub(crate) fn init(
    log_file: Option<&Path>,
    format: LogFormat,
    target: LogTarget,
) -> Result<(Logs, Option<LogInitError>), LogInitError> {
    let escape = format == LogFormat::Text;
    let want_journal = match target {
        LogTarget::Journald => true,
        LogTarget::Stderr => false,
        LogTarget::Auto => journald::stderr_is_journal(),
    };
    let mut logs = Logs::default();
    let (journal, journal_problem) = match want_journal.then(journald::layer) {
        None => (None, None),
        Some(Ok((l, sink))) => {
            logs.queued.push(sink);
            (Some(l.with_filter(filter())), None)
        }
        Some(Err(e)) => (None, Some(e)),
    };
    let stderr = match journal {
        Some(_) => None,
        None => {
            let sink = Sink::stderr(escape).map_err(LogInitError::Writer)?;
            logs.queued.push(sink.clone());
            Some(layer(sink, format))
        }
    };
    let mut problem = None;
    let file_layer = match log_file.map(|p| (p, Sink::file(p, escape))) {
        None => None,
        Some((path, Ok(sink))) => {
            logs.queued.push(sink.clone());
            logs.file = Some((sink.clone(), path.to_owned()));
            Some(layer(sink, format))
        }
        Some((path, Err(source))) => {
            problem = Some(LogInitError::LogFile {
                path: path.to_owned(),
                source,
            });
            None
        }
    };
    tracing_subscriber::registry()
        .with(journal)
        .with(stderr)
        .with(file_layer)
        .try_init()?;
    if let Some(e) = journal_problem {
        tracing::warn!("cannot log to the journal ({e}): logging to stderr instead");
    }
    Ok((logs, problem))
}
