//! systemd integration for `Type=notify` units (`sd_notify(3)`), driven by the loop's own
//! status changes: `READY=1` once the identity is read and merod answered; `STATUS=` with
//! a one-line summary on every poll attempt (and every second of the wait for merod before
//! that); `STOPPING=1` on shutdown.
//!
//! `WATCHDOG=1` follows the unit's watchdog, not the poll cadence: only when `WATCHDOG_USEC`
//! is set (and `WATCHDOG_PID`, if set, is this process), and only while the loop is alive
//! ([`Telemetry::loop_turns`] moved since the last ping) — a stalled loop is killed and
//! restarted by systemd, whatever `poll_interval` is. The loop turns at least every second
//! on a clock of its own; the pinger looks every quarter of `WATCHDOG_USEC`, so a live loop
//! is pinged for at least once per half of it (second included) whatever the two clocks'
//! phase, and a stalled one is not.
//!
//! `NOTIFY_SOCKET` may be an absolute path or `@name` (an abstract socket), the forms
//! `sd_notify(3)` documents for `AF_UNIX`. Does nothing when it is unset (not started by
//! systemd). A socket that cannot be reached, or a form not understood, is warned about
//! once (and its recovery logged once). A message is sent without waiting: one the socket
//! does not take (a manager not reading, or busy for a moment: its queue holds only
//! `net.unix.max_dgram_qlen` datagrams) is dropped and counted in
//! `fleet_sidecar_log_lines_dropped_total{sink="notify"}`. `STATUS=` and `WATCHDOG=1` are
//! superseded by the next ones; `READY=1` and `STOPPING=1` change what systemd does (a
//! lost `READY=1` gets the unit killed at `TimeoutStartSec`), so one not taken is owed and
//! sent again with the next message, which comes within a second (the status of the next
//! poll or the next watchdog ping).

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::UnixDatagram;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tracing::{info, warn};

use crate::dropped::{self, count_dropped};
use crate::telemetry::{unix_now, LiveStatus, Phase, StatusMark, Telemetry};

/// One notification, as [`messages`] decides it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Message {
    /// `READY=1`.
    Ready,
    /// `WATCHDOG=1`.
    Watchdog,
    /// `STATUS=<line>`.
    Status(String),
    /// `STOPPING=1`.
    Stopping,
}

impl Message {
    fn line(&self) -> String {
        match self {
            Message::Ready => "READY=1".to_owned(),
            Message::Watchdog => "WATCHDOG=1".to_owned(),
            Message::Status(s) => format!("STATUS={}", s.replace('\n', " ")),
            Message::Stopping => "STOPPING=1".to_owned(),
        }
    }
}

/// What to tell systemd about the change `before` → `after` at `now` (Unix s). Pure.
/// (Watchdog pings are not status changes: see [`watchdog_interval`].)
pub(crate) fn messages(before: StatusMark, after: &LiveStatus, now: f64) -> Vec<Message> {
    let mut out = Vec::new();
    let entered = |p: Phase| after.phase == p && before.phase != p;
    let was_serving = before.phase == Phase::Running && before.merod_answering;
    if after.serving() && !was_serving {
        out.push(Message::Ready);
    }
    if after.heartbeats != before.heartbeats
        || after.phase != before.phase
        || after.merod_not_answering.is_none() != before.merod_answering
    {
        out.push(Message::Status(after.summary(now)));
    }
    if entered(Phase::Stopping) {
        out.push(Message::Stopping);
    }
    out
}

/// Where `NOTIFY_SOCKET` points.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum NotifySocket {
    /// An absolute path of a datagram socket.
    Path(PathBuf),
    /// `@name`: a Linux abstract socket (`name` without the `@`).
    Abstract(Vec<u8>),
}

/// A `NOTIFY_SOCKET` value in a form this build does not speak.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("NOTIFY_SOCKET={0} is neither an absolute path nor @abstract-name")]
pub(crate) struct UnsupportedNotifySocket(pub String);

/// Reads a `NOTIFY_SOCKET` value. Errors: [`UnsupportedNotifySocket`] for a form this build
/// does not speak (for example `vsock:` addresses, a relative path, an empty value).
pub(crate) fn parse_notify_socket(value: &OsStr) -> Result<NotifySocket, UnsupportedNotifySocket> {
    let bytes = value.as_bytes();
    match bytes.first() {
        Some(b'/') => Ok(NotifySocket::Path(PathBuf::from(value))),
        Some(b'@') if bytes.len() > 1 => Ok(NotifySocket::Abstract(bytes[1..].to_vec())),
        _ => Err(UnsupportedNotifySocket(
            value.to_string_lossy().into_owned(),
        )),
    }
}

/// The time between watchdog pings: half of `WATCHDOG_USEC`, when it is set to a positive
/// number and `WATCHDOG_PID` is unset or `my_pid`. `None`: no watchdog, no pings.
pub(crate) fn watchdog_interval(
    usec: Option<&str>,
    pid: Option<&str>,
    my_pid: u32,
) -> Option<Duration> {
    let usec: u64 = usec?.trim().parse().ok().filter(|u| *u > 0)?;
    if let Some(pid) = pid {
        if pid.trim().parse::<u32>().ok() != Some(my_pid) {
            return None;
        }
    }
    Some(Duration::from_micros(usec) / 2)
}

/// Sends datagrams to the notify socket; failures are warned about once.
struct Notifier {
    socket: NotifySocket,
    failing: AtomicBool,
    /// `READY=1` was not taken: sent again with the next message.
    ready_owed: AtomicBool,
    /// `STOPPING=1` was not taken: sent again with the next message.
    stopping_owed: AtomicBool,
}

impl Notifier {
    fn try_send(&self, payload: &[u8]) -> std::io::Result<()> {
        let sock = UnixDatagram::unbound()?;
        // Never waits: a manager that does not read its socket (the queue full) loses
        // this message, not the loop.
        sock.set_nonblocking(true)?;
        match &self.socket {
            NotifySocket::Path(p) => sock.connect(p)?,
            NotifySocket::Abstract(name) => {
                use std::os::linux::net::SocketAddrExt;
                let addr = std::os::unix::net::SocketAddr::from_abstract_name(name)?;
                sock.connect_addr(&addr)?;
            }
        }
        sock.send(payload).map(drop)
    }

    fn new(socket: NotifySocket) -> Self {
        Notifier {
            socket,
            failing: AtomicBool::new(false),
            ready_owed: AtomicBool::new(false),
            stopping_owed: AtomicBool::new(false),
        }
    }

    /// Sends `messages` in one datagram, after the owed `READY=1` and `STOPPING=1`.
    fn send(&self, messages: &[Message]) {
        let ready =
            self.ready_owed.swap(false, Ordering::Relaxed) || messages.contains(&Message::Ready);
        let stopping = self.stopping_owed.swap(false, Ordering::Relaxed)
            || messages.contains(&Message::Stopping);
        let mut payload = String::new();
        let owed = ready
            .then_some(Message::Ready)
            .into_iter()
            .chain(
                messages
                    .iter()
                    .filter(|m| !matches!(m, Message::Ready | Message::Stopping))
                    .cloned(),
            )
            .chain(stopping.then_some(Message::Stopping));
        for m in owed {
            payload.push_str(&m.line());
            payload.push('\n');
        }
        let sent = self.try_send(payload.as_bytes());
        if sent.is_err() {
            self.ready_owed.fetch_or(ready, Ordering::Relaxed);
            self.stopping_owed.fetch_or(stopping, Ordering::Relaxed);
        }
        match sent {
            Ok(()) => {
                if self.failing.swap(false, Ordering::Relaxed) {
                    info!("systemd notify socket reachable again");
                }
            }
            Err(e) => {
                // Not delivered: dropped, counted like a log line no sink took.
                count_dropped(dropped::NOTIFY, 1);
                if !self.failing.swap(true, Ordering::Relaxed) {
                    if e.kind() == std::io::ErrorKind::WouldBlock {
                        warn!(socket = ?self.socket, "systemd's notify socket is not reading: messages dropped (warned once until it reads again)");
                    } else {
                        warn!(socket = ?self.socket, "cannot notify systemd: {e} (warned once until it works again)");
                    }
                }
            }
        }
    }
}

/// Sends the daemon's status changes to systemd when started by it (`NOTIFY_SOCKET` set),
/// and feeds its watchdog when one is set. Must run inside a tokio runtime (the watchdog is
/// a task). Returns whether notification is on.
pub(crate) fn install(telemetry: &Arc<Telemetry>) -> bool {
    let Some(value) = std::env::var_os("NOTIFY_SOCKET") else {
        return false;
    };
    let socket = match parse_notify_socket(&value) {
        Ok(s) => s,
        Err(e) => {
            warn!("{e}: systemd is not notified");
            return false;
        }
    };
    let notifier = Arc::new(Notifier::new(socket));
    let n = Arc::clone(&notifier);
    telemetry.add_observer(Box::new(move |before, after| {
        let msgs = messages(before, after, unix_now());
        if !msgs.is_empty() {
            n.send(&msgs);
        }
    }));
    let env = |k: &str| std::env::var(k).ok();
    if let Some(every) = watchdog_interval(
        env("WATCHDOG_USEC").as_deref(),
        env("WATCHDOG_PID").as_deref(),
        std::process::id(),
    ) {
        info!("systemd watchdog on: a ping at least every {every:?} while the loop is alive");
        let telemetry = Arc::clone(telemetry);
        tokio::spawn(async move {
            // Looking twice per ping interval: a turn just after one look is seen at the
            // next, half an interval later, not a whole one (the loop's 1 s and this
            // clock drift against each other).
            let mut tick = tokio::time::interval(every / 2);
            let mut seen = None;
            loop {
                tick.tick().await;
                let turns = telemetry.loop_turns.load(Ordering::Relaxed);
                if seen != Some(turns) {
                    seen = Some(turns);
                    notifier.send(&[Message::Watchdog]);
                }
            }
        });
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_watchdog_follows_watchdog_usec_and_pid() {
        let me = 4242;
        assert_eq!(
            watchdog_interval(Some("60000000"), None, me),
            Some(Duration::from_secs(30))
        );
        assert_eq!(
            watchdog_interval(Some("20000000"), Some("4242"), me),
            Some(Duration::from_secs(10))
        );
        for (usec, pid) in [
            (None, None),
            (Some("0"), None),
            (Some("abc"), None),
            (Some("60000000"), Some("1")),
            (Some("60000000"), Some("x")),
        ] {
            assert_eq!(watchdog_interval(usec, pid, me), None, "{usec:?} {pid:?}");
        }
    }

    /// `READY=1` and `STOPPING=1` that a full socket queue did not take (a manager busy
    /// for a moment) are sent again with the next message; a `STATUS=` is not.
    #[test]
    fn ready_and_stopping_not_taken_are_sent_again_with_the_next_message() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notify");
        let manager = UnixDatagram::bind(&path).unwrap();
        manager.set_nonblocking(true).unwrap();
        let filler = UnixDatagram::unbound().unwrap();
        filler.set_nonblocking(true).unwrap();
        let mut filled = 0;
        while filler.send_to(b"X=1", &path).is_ok() {
            filled += 1;
            assert!(filled < 100_000, "the queue never filled");
        }
        let n = Notifier::new(NotifySocket::Path(path.clone()));
        n.send(&[Message::Status("one".into()), Message::Ready]);
        n.send(&[Message::Status("two".into()), Message::Stopping]);
        let mut buf = [0u8; 4096];
        let mut got = Vec::new();
        while let Ok(len) = manager.recv(&mut buf) {
            got.push(String::from_utf8_lossy(&buf[..len]).into_owned());
        }
        assert_eq!(got.len(), filled, "nothing taken while the queue was full");
        assert!(got.iter().all(|d| d == "X=1"));
        n.send(&[Message::Status("three".into())]);
        let len = manager
            .recv(&mut buf)
            .expect("taken once the queue drained");
        assert_eq!(
            String::from_utf8_lossy(&buf[..len]),
            "READY=1\nSTATUS=three\nSTOPPING=1\n"
        );
        n.send(&[Message::Watchdog]);
        let len = manager.recv(&mut buf).unwrap();
        assert_eq!(String::from_utf8_lossy(&buf[..len]), "WATCHDOG=1\n");
    }

    #[test]
    fn notify_socket_forms() {
        assert_eq!(
            parse_notify_socket(OsStr::new("/run/systemd/notify")),
            Ok(NotifySocket::Path("/run/systemd/notify".into()))
        );
        assert_eq!(
            parse_notify_socket(OsStr::new("@sd-notify-1")),
            Ok(NotifySocket::Abstract(b"sd-notify-1".to_vec()))
        );
        for bad in ["", "@", "relative/sock", "vsock:2:9999"] {
            assert!(parse_notify_socket(OsStr::new(bad)).is_err(), "{bad}");
        }
    }

    #[test]
    fn ready_once_then_status_per_heartbeat_then_stopping() {
        let start = LiveStatus::default();
        let waiting = LiveStatus {
            phase: Phase::WaitingForMerod,
            heartbeats: 1,
            waiting_for: Some("connection refused".into()),
            ..LiveStatus::default()
        };
        assert_eq!(
            messages(start.mark(), &waiting, 0.0),
            vec![Message::Status(
                "waiting for merod: connection refused".into()
            )]
        );
        let running = LiveStatus {
            phase: Phase::Running,
            peer_id: Some("p".into()),
            ..waiting.clone()
        };
        let m = messages(waiting.mark(), &running, 0.0);
        assert_eq!(m[0], Message::Ready);
        let polled = LiveStatus {
            heartbeats: 2,
            last_poll_at: Some(10.0),
            last_ok_poll_at: Some(10.0),
            ..running.clone()
        };
        assert_eq!(
            messages(running.mark(), &polled, 10.4),
            vec![Message::Status(
                "0 confirmed, last poll ok 0.4 s ago".into()
            )]
        );
        // A change that is not a heartbeat (a join finished) sends nothing.
        let joined = LiveStatus {
            confirmed: vec![crate::ids::GroupId::from_bytes([1; 32])],
            ..polled.clone()
        };
        assert!(messages(polled.mark(), &joined, 11.0).is_empty());
        let stopping = LiveStatus {
            phase: Phase::Stopping,
            ..joined.clone()
        };
        assert_eq!(
            messages(joined.mark(), &stopping, 12.0),
            vec![Message::Status("stopping".into()), Message::Stopping]
        );
    }
}
