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
//!
//! Opening the log file never blocks the start or a writer: only a regular file or a
//! character device (`/dev/null`) is taken, opened with `O_NONBLOCK` (a FIFO nobody reads
//! would otherwise block the open for ever), on a thread of its own that the opener waits
//! for at most [`OPEN_DEADLINE`] (an open on a hung filesystem blocks in the kernel
//! whatever the flags). An open cut at its deadline is abandoned: the start goes on without
//! the file, a reopen keeps writing to the old one, and one open at most is left hanging.

use std::fs::{File, FileType, OpenOptions};
use std::io::{self, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender, TryRecvError, TrySendError};
use std::sync::Arc;
use std::time::Duration;

use tracing_subscriber::fmt::MakeWriter;

use super::escape::escape_line;
use crate::dropped::{self, count_dropped};

/// Lines a sink holds for its writer before it drops new ones (a few hundred KiB at most).
pub(crate) const QUEUE_LINES: usize = 1024;

/// The longest the start or a reopen waits for the log file to open (a local open takes
/// microseconds; past this the filesystem hangs).
pub(crate) const OPEN_DEADLINE: Duration = Duration::from_secs(2);

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
        /// Set while an open of `path` runs (it may outlive its deadline on a hung
        /// filesystem): no second one starts meanwhile.
        opening: Arc<AtomicBool>,
    },
    /// journald's native socket at `path`: one datagram per line, sent blocking.
    Journal {
        socket: UnixDatagram,
        path: PathBuf,
    },
}

/// Opens `path` to append (created if needed), on a thread of its own, waiting at most
/// `limit`; `opening` is set while that thread runs.
///
/// Errors: [`io::ErrorKind::TimedOut`] past `limit`, or when an earlier open of the file
/// still hangs; [`io::ErrorKind::InvalidInput`] for anything but a regular file or a
/// character device (a FIFO, a socket, a directory); the open's own error.
fn open_append(path: &Path, limit: Duration, opening: &Arc<AtomicBool>) -> io::Result<File> {
    if opening.swap(true, Ordering::AcqRel) {
        return Err(io::Error::new(
            io::ErrorKind::TimedOut,
            "an earlier open of it has not returned yet (a hung filesystem?)",
        ));
    }
    let (tx, rx) = mpsc::channel();
    let owned = path.to_owned();
    let flag = Arc::clone(opening);
    let spawned = std::thread::Builder::new()
        .name("log-open".to_owned())
        .spawn(move || {
            let opened = open_append_now(&owned);
            flag.store(false, Ordering::Release);
            // The opener is gone once the deadline passed: the file is closed here.
            let _ = tx.send(opened);
        });
    if let Err(e) = spawned {
        opening.store(false, Ordering::Release);
        return Err(e);
    }
    match rx.recv_timeout(limit) {
        Ok(opened) => opened,
        Err(RecvTimeoutError::Timeout) => Err(io::Error::new(
            io::ErrorKind::TimedOut,
            format!("the open did not return within {limit:?} (a hung filesystem?)"),
        )),
        Err(RecvTimeoutError::Disconnected) => {
            Err(io::Error::other("the thread opening it stopped"))
        }
    }
}

/// The open itself: refuses what is not a regular file or a character device before
/// opening it and again after (the path may be replaced between the two), never waiting
/// for a reader.
fn open_append_now(path: &Path) -> io::Result<File> {
    let refuse = |kind: FileType| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "a {} is not a log file (a regular file or a character device is)",
                describe(kind)
            ),
        )
    };
    match std::fs::metadata(path) {
        Ok(m) if !takes_lines(m.file_type()) => return Err(refuse(m.file_type())),
        _ => {}
    }
    let file = OpenOptions::new()
        .create(true)
        .append(true)
        .custom_flags(nix::libc::O_NONBLOCK)
        .open(path)?;
    let kind = file.metadata()?.file_type();
    if !takes_lines(kind) {
        return Err(refuse(kind));
    }
    // Writes wait for the device like any write (a terminal's flow control): only the open
    // had to be non-blocking. Regular files ignore the flag either way.
    let flags = nix::fcntl::fcntl(file.as_raw_fd(), nix::fcntl::FcntlArg::F_GETFL)?;
    let flags = nix::fcntl::OFlag::from_bits_truncate(flags) - nix::fcntl::OFlag::O_NONBLOCK;
    nix::fcntl::fcntl(file.as_raw_fd(), nix::fcntl::FcntlArg::F_SETFL(flags))?;
    Ok(file)
}

/// Whether a file of `kind` can take log lines without waiting for a reader.
fn takes_lines(kind: FileType) -> bool {
    kind.is_file() || kind.is_char_device()
}

/// `kind` in a sentence.
fn describe(kind: FileType) -> &'static str {
    if kind.is_fifo() {
        "FIFO (named pipe)"
    } else if kind.is_socket() {
        "socket"
    } else if kind.is_dir() {
        "directory"
    } else if kind.is_block_device() {
        "block device"
    } else {
        "special file"
    }
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
        if let Target::File {
            path,
            file,
            opening,
        } = self
        {
            match open_append(path, OPEN_DEADLINE, opening) {
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

    /// A sink appending to the file at `path` (created if needed), opened within
    /// [`OPEN_DEADLINE`].
    ///
    /// Errors: as [`open_append`] (past the deadline, not a regular file or a character
    /// device, the open's I/O error), or the writer thread could not be started.
    pub(crate) fn file(path: &Path, escape: bool) -> io::Result<Self> {
        let opening = Arc::new(AtomicBool::new(false));
        let file = open_append(path, OPEN_DEADLINE, &opening)?;
        let target = Target::File {
            path: path.to_owned(),
            file,
            opening,
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

    /// `Sink::file` on another thread, so a test of an open that blocks fails instead of
    /// hanging.
    fn open_within_10_s(path: &Path) -> io::Result<Sink> {
        let (tx, rx) = mpsc::channel();
        let path = path.to_owned();
        std::thread::spawn(move || {
            let _ = tx.send(Sink::file(&path, true));
        });
        rx.recv_timeout(Duration::from_secs(10))
            .expect("the open returned")
    }

    fn mkfifo(path: &Path) {
        nix::unistd::mkfifo(path, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
    }

    #[test]
    fn only_a_regular_file_or_a_character_device_is_opened_and_a_fifo_never_blocks_the_open() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo");
        mkfifo(&fifo);
        let refused = |path: &Path, what: &str| {
            let err = open_within_10_s(path).unwrap_err();
            assert_eq!(err.kind(), io::ErrorKind::InvalidInput, "{err}");
            assert!(err.to_string().contains(what), "{err}");
        };
        // Nobody reads it (a plain open would wait for a reader for ever).
        refused(&fifo, "FIFO");
        // Somebody reads it: still not a file; lines would stall on the reader.
        let _reader = OpenOptions::new()
            .read(true)
            .custom_flags(nix::libc::O_NONBLOCK)
            .open(&fifo)
            .unwrap();
        refused(&fifo, "FIFO");
        refused(dir.path(), "directory");
        assert!(open_within_10_s(Path::new("/dev/null")).is_ok());
        let file = dir.path().join("sidecar.log");
        let sink = open_within_10_s(&file).unwrap();
        sink.push(b"a line\n".to_vec());
        sink.flush(Duration::from_secs(5));
        assert_eq!(std::fs::read_to_string(&file).unwrap(), "a line\n");
    }

    #[test]
    fn a_reopen_that_would_block_is_abandoned_and_a_later_one_works() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("sidecar.log");
        let rotated = dir.path().join("sidecar.log.1");
        let sink = Sink::file(&file, true).unwrap();
        sink.push(b"before\n".to_vec());
        // logrotate moved the file, and something put a FIFO nobody reads at its path.
        std::fs::rename(&file, &rotated).unwrap();
        mkfifo(&file);
        assert!(sink.reopen());
        sink.push(b"still the old file\n".to_vec());
        sink.flush(Duration::from_secs(5));
        assert_eq!(
            std::fs::read_to_string(&rotated).unwrap(),
            "before\nstill the old file\n",
            "the writer is not stuck in the open"
        );
        std::fs::remove_file(&file).unwrap();
        assert!(sink.reopen());
        sink.push(b"the new file\n".to_vec());
        sink.flush(Duration::from_secs(5));
        assert_eq!(std::fs::read_to_string(&file).unwrap(), "the new file\n");
    }

    #[test]
    fn while_an_open_hangs_no_second_one_starts() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("sidecar.log");
        let opening = Arc::new(AtomicBool::new(true));
        let err = open_append(&file, OPEN_DEADLINE, &opening).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert!(!file.exists(), "no open was started");
        opening.store(false, Ordering::Release);
        open_append(&file, OPEN_DEADLINE, &opening).unwrap();
        assert!(file.exists() && !opening.load(Ordering::Acquire));
    }

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
