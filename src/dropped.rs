//! The process's count of output dropped because its sink was not reading: log lines to
//! stderr, the log file or the journal, and systemd notify messages. The sinks are set up
//! before any `Telemetry` exists and are the process's, so the count is too; `telemetry`
//! exports it as `fleet_sidecar_log_lines_dropped_total{sink}`.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;

/// Where the daemon's output goes: the `sink` label's values.
pub(crate) const SINKS: [&str; 4] = [STDERR, LOG_FILE, JOURNAL, NOTIFY];
/// `stderr`.
pub(crate) const STDERR: &str = "stderr";
/// `log_file`: the log file.
pub(crate) const LOG_FILE: &str = "log_file";
/// `journal`: journald's native socket.
pub(crate) const JOURNAL: &str = "journal";
/// `notify`: systemd's `NOTIFY_SOCKET`.
pub(crate) const NOTIFY: &str = "notify";

/// Label set `{sink="stderr|log_file|journal|notify"}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct SinkLabel {
    /// Which sink (one of [`SINKS`]).
    pub(crate) sink: &'static str,
}

/// The counts, one series per sink.
pub(crate) fn dropped_lines() -> &'static Family<SinkLabel, Counter> {
    static DROPPED: std::sync::OnceLock<Family<SinkLabel, Counter>> = std::sync::OnceLock::new();
    DROPPED.get_or_init(Family::default)
}

/// Counts `n` lines (or messages) `sink` dropped.
pub(crate) fn count_dropped(sink: &'static str, n: u64) {
    dropped_lines().get_or_create(&SinkLabel { sink }).inc_by(n);
}
