//! systemd integration for `Type=notify` units (`sd_notify(3)`), driven by the loop's own
//! status changes: `READY=1` once the identity is read and merod answered; `STATUS=` with
//! a one-line summary and `WATCHDOG=1` on every poll attempt (and every readiness probe
//! before that) — so the watchdog is fed only while the loop really runs on its cadence,
//! and a stalled loop is killed and restarted by systemd; `STOPPING=1` on shutdown.
//!
//! Does nothing when `NOTIFY_SOCKET` is unset (not started by systemd).

use std::sync::Arc;

use sd_notify::NotifyState;
use tracing::warn;

use crate::telemetry::{unix_now, LiveStatus, Phase, Telemetry};

/// One notification, as [`messages`] decides it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Message {
    /// `READY=1`.
    Ready,
    /// `WATCHDOG=1`.
    Watchdog,
    /// `STATUS=<line>`.
    Status(String),
    /// `STOPPING=1`.
    Stopping,
}

/// What to tell systemd about the change `before` → `after` at `now` (Unix s). Pure.
pub fn messages(before: &LiveStatus, after: &LiveStatus, now: f64) -> Vec<Message> {
    let mut out = Vec::new();
    let entered = |p: Phase| after.phase == p && before.phase != p;
    if entered(Phase::Running) {
        out.push(Message::Ready);
    }
    if after.heartbeats != before.heartbeats {
        out.push(Message::Watchdog);
    }
    if after.heartbeats != before.heartbeats || after.phase != before.phase {
        out.push(Message::Status(after.summary(now)));
    }
    if entered(Phase::Stopping) {
        out.push(Message::Stopping);
    }
    out
}

fn send(messages: &[Message]) {
    let states: Vec<NotifyState<'_>> = messages
        .iter()
        .map(|m| match m {
            Message::Ready => NotifyState::Ready,
            Message::Watchdog => NotifyState::Watchdog,
            Message::Status(s) => NotifyState::Status(s),
            Message::Stopping => NotifyState::Stopping,
        })
        .collect();
    if let Err(e) = sd_notify::notify(&states) {
        warn!("cannot notify systemd: {e}");
    }
}

/// Sends the daemon's status changes to systemd when started by it (`NOTIFY_SOCKET` set).
/// Returns whether it is on.
pub fn install(telemetry: &Arc<Telemetry>) -> bool {
    if std::env::var_os("NOTIFY_SOCKET").is_none() {
        return false;
    }
    telemetry.add_observer(Box::new(|before, after| {
        let msgs = messages(before, after, unix_now());
        if !msgs.is_empty() {
            send(&msgs);
        }
    }));
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_once_then_watchdog_per_heartbeat_then_stopping() {
        let start = LiveStatus::default();
        let waiting = LiveStatus {
            phase: Phase::WaitingForMerod,
            heartbeats: 1,
            waiting_for: Some("connection refused".into()),
            ..LiveStatus::default()
        };
        assert_eq!(
            messages(&start, &waiting, 0.0),
            vec![
                Message::Watchdog,
                Message::Status("waiting for merod: connection refused".into())
            ]
        );
        let running = LiveStatus {
            phase: Phase::Running,
            peer_id: Some("p".into()),
            ..waiting.clone()
        };
        let m = messages(&waiting, &running, 0.0);
        assert_eq!(m[0], Message::Ready);
        let polled = LiveStatus {
            heartbeats: 2,
            last_poll_at: Some(10.0),
            last_ok_poll_at: Some(10.0),
            ..running.clone()
        };
        assert_eq!(
            messages(&running, &polled, 10.4),
            vec![
                Message::Watchdog,
                Message::Status("0 confirmed, last poll ok 0.4 s ago".into())
            ]
        );
        // A change that is not a heartbeat (a join finished) feeds no watchdog.
        let joined = LiveStatus {
            confirmed: vec![crate::ids::GroupId::from_bytes([1; 32])],
            ..polled.clone()
        };
        assert!(messages(&polled, &joined, 11.0).is_empty());
        let stopping = LiveStatus {
            phase: Phase::Stopping,
            ..joined.clone()
        };
        assert_eq!(
            messages(&joined, &stopping, 12.0),
            vec![Message::Status("stopping".into()), Message::Stopping]
        );
    }
}
