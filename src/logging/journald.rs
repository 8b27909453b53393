//! Native journal logging (`log_target`): each event is one datagram in journald's native
//! protocol on `/run/systemd/journal/socket`, with `PRIORITY` from the level (error 3,
//! warn 4, info 5, debug 6, trace 7), `MESSAGE`, `SYSLOG_IDENTIFIER=fleet-sidecar`,
//! `TARGET`, `CODE_FILE`, `CODE_LINE`, and every event and span field as its own
//! upper-case journal field — `NAMESPACE_ID`, `OUTCOME`, `DURATION` (seconds),
//! `ERROR_KIND` — so `journalctl -u fleet-sidecar NAMESPACE_ID=<64 hex>` works.
//!
//! The datagram is queued to a writer thread of its own ([`Sink`]), which sends it and waits
//! while the journal's socket queue is full: a journal busy for a moment (a start-up burst,
//! a queue of only `net.unix.max_dgram_qlen` datagrams) loses nothing, and the loop never
//! waits. A journal that stops reading fills that queue; further events are dropped,
//! counted in `fleet_sidecar_log_lines_dropped_total{sink="journal"}`, and once it reads
//! again one event says how many were lost. (Sent without waiting, as before, an error
//! logged at start-up next to systemd's own burst of lines was lost.) Every
//! value has its control characters escaped (outside text cannot make a field span lines),
//! and is cut at [`MAX_VALUE`] bytes. (tracing-journald, used before, sends with a blocking
//! socket and drops its errors unseen, so neither could be had through it.)

use std::ffi::OsStr;
use std::fmt;
use std::os::fd::AsFd;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::layer::Context;
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::Layer;

use super::escape::escape;
use super::sink::Sink;

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

/// journald's native socket.
const JOURNALD_PATH: &str = "/run/systemd/journal/socket";

/// Longest value sent in one field, in bytes (escaped); a longer one is cut, marked `…`.
pub(crate) const MAX_VALUE: usize = 16 * 1024;

/// The journal layer: formats each event as one datagram and queues it to the journal's
/// [`Sink`], whose writer thread sends it.
pub(crate) struct Journal {
    sink: Sink,
}

/// The journal layer on journald's socket, and its sink (to flush at exit).
///
/// Errors: the journal socket cannot be reached (no journald), or the writer thread
/// could not be started.
pub(crate) fn layer() -> std::io::Result<(Journal, Sink)> {
    layer_at(Path::new(JOURNALD_PATH))
}

/// [`layer`] on the socket at `path`.
fn layer_at(path: &Path) -> std::io::Result<(Journal, Sink)> {
    let sink = Sink::journal(path)?;
    Ok((Journal { sink: sink.clone() }, sink))
}

/// A span's fields, kept as journal lines (`NAME=value\n`).
struct SpanFields(Vec<u8>);

/// Writes `NAME=value\n` for each field, the name journal-shaped, the value escaped.
struct Fields<'a>(&'a mut Vec<u8>);

impl Visit for Fields<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        put(self.0, &name(field.name()), value);
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        put(self.0, &name(field.name()), &format!("{value:?}"));
    }
}

/// A field name as the journal takes it: `message` is `MESSAGE`; others upper-case, `.`
/// as `_`, only `A-Z0-9_`, no leading `_` (those are the journal's own trusted fields).
fn name(field: &str) -> String {
    field
        .chars()
        .map(|c| if c == '.' { '_' } else { c })
        .skip_while(|c| *c == '_')
        .filter(|c| *c == '_' || c.is_ascii_alphanumeric())
        .map(|c| c.to_ascii_uppercase())
        .collect()
}

/// Appends `NAME=value\n`, the value escaped (so it holds no newline) and cut at
/// [`MAX_VALUE`] bytes.
fn put(buf: &mut Vec<u8>, name: &str, value: &str) {
    if name.is_empty() {
        return;
    }
    let mut escaped = escape(value);
    if escaped.len() > MAX_VALUE {
        let mut cut = MAX_VALUE;
        while !escaped.is_char_boundary(cut) {
            cut -= 1;
        }
        escaped.truncate(cut);
        escaped.push('…');
    }
    buf.extend_from_slice(name.as_bytes());
    buf.push(b'=');
    buf.extend_from_slice(escaped.as_bytes());
    buf.push(b'\n');
}

fn priority(level: &Level) -> &'static str {
    match *level {
        Level::ERROR => "3",
        Level::WARN => "4",
        Level::INFO => "5",
        Level::DEBUG => "6",
        Level::TRACE => "7",
    }
}

impl<S> Layer<S> for Journal
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        let Some(span) = ctx.span(id) else { return };
        let mut buf = Vec::new();
        attrs.record(&mut Fields(&mut buf));
        span.extensions_mut().insert(SpanFields(buf));
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, ctx: Context<'_, S>) {
        let Some(span) = ctx.span(id) else { return };
        let mut ext = span.extensions_mut();
        if let Some(fields) = ext.get_mut::<SpanFields>() {
            values.record(&mut Fields(&mut fields.0));
        }
    }

    fn on_event(&self, event: &Event<'_>, ctx: Context<'_, S>) {
        let mut buf = Vec::with_capacity(256);
        if let Some(scope) = ctx.event_scope(event) {
            for span in scope.from_root() {
                if let Some(fields) = span.extensions().get::<SpanFields>() {
                    buf.extend_from_slice(&fields.0);
                }
            }
        }
        let meta = event.metadata();
        put(&mut buf, "PRIORITY", priority(meta.level()));
        put(&mut buf, "SYSLOG_IDENTIFIER", IDENTIFIER);
        put(&mut buf, "TARGET", meta.target());
        if let Some(file) = meta.file() {
            put(&mut buf, "CODE_FILE", file);
        }
        if let Some(line) = meta.line() {
            put(&mut buf, "CODE_LINE", &line.to_string());
        }
        event.record(&mut Fields(&mut buf));
        self.sink.push(buf);
    }
}

/// `SYSLOG_IDENTIFIER`.
const IDENTIFIER: &str = "fleet-sidecar";

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

    /// A journal that does not read for a moment (busy with systemd's own burst of lines at
    /// start-up) loses none of a burst longer than its socket's queue
    /// (`net.unix.max_dgram_qlen`: 10 by the kernel's default, 512 under systemd's sysctl),
    /// and gets it in order.
    #[test]
    fn a_burst_longer_than_the_socket_queue_is_not_lost_while_the_journal_is_busy() {
        use std::os::unix::net::UnixDatagram;
        use tracing_subscriber::layer::SubscriberExt;

        const BURST: usize = 1000;
        const _: () = assert!(BURST > 512 && BURST < super::super::sink::QUEUE_LINES);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("journal.socket");
        let journald = UnixDatagram::bind(&path).unwrap();
        let (layer, _sink) = layer_at(&path).unwrap();
        tracing::subscriber::with_default(tracing_subscriber::registry().with(layer), || {
            for n in 0..BURST {
                tracing::error!(n, "line of the burst");
            }
        });
        std::thread::sleep(std::time::Duration::from_millis(300));
        journald
            .set_read_timeout(Some(std::time::Duration::from_secs(10)))
            .unwrap();
        let mut buf = vec![0u8; 65536];
        let mut got = Vec::new();
        while got.len() < BURST {
            let len = journald
                .recv(&mut buf)
                .unwrap_or_else(|e| panic!("{} of {BURST} lines came, then: {e}", got.len()));
            let text = String::from_utf8_lossy(&buf[..len]).into_owned();
            if let Some(n) = text.lines().find_map(|l| l.strip_prefix("N=")) {
                got.push(n.parse::<usize>().unwrap());
            }
        }
        assert_eq!(got, (0..BURST).collect::<Vec<_>>());
    }

    #[test]
    fn fields_are_journal_shaped_and_one_line_each() {
        assert_eq!(name("namespace_id"), "NAMESPACE_ID");
        assert_eq!(name("message"), "MESSAGE");
        assert_eq!(name("_hidden.x-y"), "HIDDEN_XY");
        let mut buf = Vec::new();
        put(&mut buf, "MESSAGE", "bad\nPRIORITY=0\nMESSAGE=forged");
        assert_eq!(buf, b"MESSAGE=bad\\nPRIORITY=0\\nMESSAGE=forged\n".to_vec());
        let mut buf = Vec::new();
        put(&mut buf, "X", &"y".repeat(MAX_VALUE + 10));
        assert_eq!(buf.len(), "X=".len() + MAX_VALUE + '…'.len_utf8() + 1);
    }
}
