//! Native journal logging (`log_target`): each event is one datagram in journald's native
//! protocol on `/run/systemd/journal/socket`, with `PRIORITY` from the level (error 3,
//! warn 4, info 5, debug 6, trace 7), `MESSAGE`, and every event and span field as its own
//! upper-case journal field — `NAMESPACE_ID`, `OUTCOME`, `DURATION` (seconds),
//! `ERROR_KIND` — so `journalctl -u fleet-sidecar NAMESPACE_ID=<64 hex>` works. Written
//! with the `tracing-journald` crate.

use std::ffi::OsStr;
use std::os::fd::AsFd;
use std::os::unix::fs::MetadataExt;

/// Whether systemd connected stderr to the journal: `JOURNAL_STREAM` (`<device>:<inode>`,
/// set by systemd for a unit with `StandardError=journal`, the default) names the file
/// stderr is. A `JOURNAL_STREAM` inherited by a process whose stderr was redirected does
/// not count (systemd.exec(5)).
pub(crate) fn stderr_is_journal() -> bool {
    let Ok(fd) = std::io::stderr().as_fd().try_clone_to_owned() else {
        return false;
    };
    names(
        std::env::var_os("JOURNAL_STREAM").as_deref(),
        &std::fs::File::from(fd),
    )
}

/// Whether `value` (`<device>:<inode>`, decimal) is `file`'s device and inode.
fn names(value: Option<&OsStr>, file: &std::fs::File) -> bool {
    let Some((dev, ino)) = value
        .and_then(OsStr::to_str)
        .and_then(|v| v.split_once(':'))
    else {
        return false;
    };
    let (Ok(dev), Ok(ino)) = (dev.parse::<u64>(), ino.parse::<u64>()) else {
        return false;
    };
    file.metadata()
        .is_ok_and(|m| m.dev() == dev && m.ino() == ino)
}

/// The journal layer: field names without prefix, identifier `fleet-sidecar`.
///
/// Errors: the journal socket cannot be reached (no journald).
pub(crate) fn layer() -> std::io::Result<tracing_journald::Layer> {
    Ok(tracing_journald::layer()?
        .with_field_prefix(None)
        .with_syslog_identifier("fleet-sidecar".to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn journal_stream_must_name_the_very_file() {
        let file = tempfile::tempfile().unwrap();
        let m = file.metadata().unwrap();
        let this = format!("{}:{}", m.dev(), m.ino());
        assert!(names(Some(OsStr::new(&this)), &file));
        let other = format!("{}:{}", m.dev(), m.ino() + 1);
        for value in [other.as_str(), "", "x", "1:", ":2", "1:2:3"] {
            assert!(!names(Some(OsStr::new(value)), &file), "{value:?}");
        }
        assert!(!names(None, &file));
    }
}
