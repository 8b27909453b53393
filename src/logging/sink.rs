//! A log sink that never makes the loop wait: each line is queued (at most
//! [`QUEUE_LINES`]) to a writer thread of its own, which writes it to stderr or the log
//! file, or sends it as one datagram to journald's native socket. The writer waits for its
//! sink as long as it takes, so a short stall (a journal busy with a burst of systemd's
//! own lines at start-up, a socket queue of only `net.unix.max_dgram_qlen` datagrams) loses
//! nothing. A sink that stops reading (a pipe nobody drains, a full disk that blocks, a
//! journal that hangs) fills its queue; further lines are dropped and counted
//! (`fleet_sidecar_log_lines_dropped_total{sink}`), and once the queue has drained again
//! the writer thread says, once, how many were lost. The log file is reopened by the
//! writer thread too, in order with the lines: what was logged before a SIGHUP lands in
//! the old file.

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender, TryRecvError, TrySendError};
use std::sync::Arc;
use std::time::Duration;

use tracing_subscriber::fmt::MakeWriter;

use super::escape::escape_line;
use crate::dropped::{self, count_dropped};

/// Lines a sink holds for its writer before it drops new ones (a few hundred KiB at most).
pub(crate) const QUEUE_LINES: usize = 1024;

enum Msg {
    Line(Vec<u8>),
    /// Reopen the log file at its path (logrotate).
    Reopen,
    /// Everything queued before this is written: answer.
    Flush(mpsc::Sender<()>),
}

/// Where a writer thread writes.
enum Target {
    Stderr,
    File {
        path: PathBuf,
        file: File,
    },
    /// journald's native socket at `path`: one datagram per line, sent blocking.
    Journal {
        socket: UnixDatagram,
        path: PathBuf,
    },
}

fn open_append(path: &Path) -> io::Result<File> {
    OpenOptions::new().create(true).append(true).open(path)
}

impl Target {
    /// Writes `line`; `false` when the write failed (a full disk, a closed stderr, a
    /// journal socket gone with journald's restart): that line only is lost.
    fn write(&mut self, line: &[u8]) -> bool {
        match self {
            Target::Stderr => io::stderr().write_all(line),
            Target::File { file, .. } => file.write_all(line),
            Target::Journal { socket, path } => socket.send_to(line, path).map(drop),
        }
        .is_ok()
    }

    fn reopen(&mut self) {
        if let Target::File { path, file } = self {
            match open_append(path) {
                Ok(fresh) => {
                    *file = fresh;
                    tracing::info!(path = %path.display(), "log file reopened");
                }
                Err(e) => {
                    tracing::warn!(path = %path.display(), "cannot reopen log file: {e}; still writing to the old one")
                }
            }
        }
    }
}

/// A queue of lines to one writer thread. Clones share the queue.
#[derive(Clone, Debug)]
pub(crate) struct Sink {
    tx: SyncSender<Msg>,
    kind: &'static str,
    /// Text lines: control characters inside a line are escaped (`\n`, `\u{1b}`, …), so
    /// outside text cannot start a line of its own. JSON lines are escaped by JSON itself.
    escape: bool,
    dropped: Arc<AtomicU64>,
}

impl Sink {
    /// A sink writing to stderr.
    ///
    /// Errors: the writer thread could not be started.
    pub(crate) fn stderr(escape: bool) -> io::Result<Self> {
        Self::start(Target::Stderr, dropped::STDERR, escape)
    }

    /// A sink appending to the file at `path` (created if needed).
    ///
    /// Errors: the open's I/O error, or the writer thread could not be started.
    pub(crate) fn file(path: &Path, escape: bool) -> io::Result<Self> {
        let file = open_append(path)?;
        let target = Target::File {
            path: path.to_owned(),
            file,
        };
        Self::start(target, dropped::LOG_FILE, escape)
    }

    /// A sink sending each line as one datagram to the journal socket at `path`, which is
    /// checked first with an empty datagram (journald ignores it).
    ///
    /// Errors: the socket cannot be reached (no journald there), or the writer thread
    /// could not be started.
    pub(crate) fn journal(path: &Path) -> io::Result<Self> {
        let socket = UnixDatagram::unbound()?;
        socket.set_nonblocking(true)?;
        match socket.send_to(&[], path) {
            Ok(_) => {}
            // There, but not reading just now: it counts as reachable.
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
        socket.set_nonblocking(false)?;
        let target = Target::Journal {
            socket,
            path: path.to_owned(),
        };
        Self::start(target, dropped::JOURNAL, false)
    }

    fn start(target: Target, kind: &'static str, escape: bool) -> io::Result<Self> {
        let (tx, rx) = mpsc::sync_channel(QUEUE_LINES);
        let dropped = Arc::new(AtomicU64::new(0));
        let seen = Arc::clone(&dropped);
        std::thread::Builder::new()
            .name(format!("log-{}", kind))
            .spawn(move || write_lines(rx, target, kind, &seen))?;
        Ok(Self {
            tx,
            kind,
            escape,
            dropped,
        })
    }

    /// Queues `line`, or drops and counts it when the queue is full. Never waits.
    pub(crate) fn push(&self, line: Vec<u8>) {
        match self.tx.try_send(Msg::Line(line)) {
            Ok(()) | Err(TrySendError::Disconnected(_)) => {}
            Err(TrySendError::Full(_)) => {
                self.dropped.fetch_add(1, Ordering::Relaxed);
                count_dropped(self.kind, 1);
            }
        }
    }

    /// Asks the writer to reopen the file (after the lines already queued). Never waits;
    /// `false` when the queue is full (try again later).
    pub(crate) fn reopen(&self) -> bool {
        self.tx.try_send(Msg::Reopen).is_ok()
    }

    /// Waits at most `limit` for the lines queued so far to be written (at exit).
    pub(crate) fn flush(&self, limit: Duration) {
        let (ack, done) = mpsc::channel();
        let deadline = std::time::Instant::now() + limit;
        let mut msg = Msg::Flush(ack);
        loop {
            match self.tx.try_send(msg) {
                Ok(()) => break,
                Err(TrySendError::Disconnected(_)) => return,
                Err(TrySendError::Full(m)) => {
                    if std::time::Instant::now() >= deadline {
                        return;
                    }
                    msg = m;
                    std::thread::sleep(Duration::from_millis(5));
                }
            }
        }
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        let _ = done.recv_timeout(left);
    }
}

/// The writer thread: writes each line; when the queue runs empty after lines were
/// dropped, says how many (once per episode).
fn write_lines(rx: Receiver<Msg>, mut target: Target, kind: &'static str, dropped: &AtomicU64) {
    let mut reported = 0;
    loop {
        let msg = match rx.try_recv() {
            Ok(m) => m,
            Err(TryRecvError::Disconnected) => return,
            Err(TryRecvError::Empty) => {
                let lost = dropped.load(Ordering::Relaxed);
                if lost > reported {
                    tracing::warn!(
                        sink = kind,
                        dropped = lost - reported,
                        "{} log lines were dropped while {} was not being read; it reads again",
                        lost - reported,
                        noun(kind)
                    );
                    reported = lost;
                }
                match rx.recv() {
                    Ok(m) => m,
                    Err(_) => return,
                }
            }
        };
        match msg {
            // Counted, but not said: the notice would go to the sink that fails.
            Msg::Line(line) => {
                if !target.write(&line) {
                    count_dropped(kind, 1);
                }
            }
            Msg::Reopen => target.reopen(),
            Msg::Flush(ack) => {
                let _ = ack.send(());
            }
        }
    }
}

/// The sink `kind` in a sentence.
fn noun(kind: &str) -> &str {
    match kind {
        dropped::LOG_FILE => "the log file",
        dropped::JOURNAL => "the journal",
        other => other,
    }
}

/// One event's bytes, queued when the event is formatted (on drop).
pub(crate) struct SinkWriter<'a> {
    sink: &'a Sink,
    buf: Vec<u8>,
}

impl Write for SinkWriter<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.buf.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Drop for SinkWriter<'_> {
    fn drop(&mut self) {
        if self.buf.is_empty() {
            return;
        }
        let buf = std::mem::take(&mut self.buf);
        let line = if self.sink.escape {
            escape_line(&buf)
        } else {
            buf
        };
        self.sink.push(line);
    }
}

impl<'a> MakeWriter<'a> for Sink {
    type Writer = SinkWriter<'a>;

    fn make_writer(&'a self) -> Self::Writer {
        SinkWriter {
            sink: self,
            buf: Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A line the journal socket refuses (journald gone) is counted as dropped, as it was
    /// when lines were sent from the loop.
    #[test]
    fn a_line_the_sink_refuses_is_counted_as_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("journal.socket");
        let journald = UnixDatagram::bind(&path).unwrap();
        let sink = Sink::journal(&path).unwrap();
        drop(journald);
        std::fs::remove_file(&path).unwrap();
        let count = || {
            dropped::dropped_lines()
                .get_or_create(&dropped::SinkLabel {
                    sink: dropped::JOURNAL,
                })
                .get()
        };
        let before = count();
        sink.push(b"MESSAGE=lost\n".to_vec());
        sink.flush(Duration::from_secs(5));
        assert!(count() > before);
    }
}
