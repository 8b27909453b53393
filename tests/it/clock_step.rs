//! A forward step of the wall clock by days under the real binary (Debian's `faketime`
//! package: libfaketime, preloaded, steps `CLOCK_REALTIME` when its control file changes
//! and leaves the monotonic clock alone, as NTP correcting a wrong clock does). The
//! `leave_grace` must still wait for the absence the daemon observed. SKIPPED (and passes)
//! where libfaketime is not installed; `.ci/run` installs it.

use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime};

use fleet_sidecar::testing::mdma::PollReply;
use fleet_sidecar::testing::sandbox::Sandbox;

use crate::common::*;

/// libfaketime's preload library, where Debian and Ubuntu install it.
fn libfaketime() -> Option<PathBuf> {
    let multiarch = format!("/usr/lib/{}-linux-gnu", std::env::consts::ARCH);
    [
        format!("{multiarch}/faketime/libfaketimeMT.so.1"),
        format!("{multiarch}/faketime/libfaketime.so.1"),
        "/usr/lib/faketime/libfaketime.so.1".to_owned(),
    ]
    .into_iter()
    .map(PathBuf::from)
    .find(|p| p.exists())
}

/// The daemon under libfaketime (`lib`) with its wall clock at `offset` from the real one
/// (libfaketime's syntax: `+0`, `+2d`), the monotonic clock left alone; returns once it
/// polled, with the control file that steps the clock when rewritten.
async fn spawn_stepped(
    sb: &Sandbox,
    cfg: &std::path::Path,
    lib: &std::path::Path,
    offset: &str,
) -> (DaemonProcess, PathBuf) {
    let control = sb.dir().join("faketime.rc");
    std::fs::write(&control, format!("{offset}\n")).unwrap();
    let daemon = spawn_daemon(
        cfg,
        false,
        &[
            ("LD_PRELOAD", lib.as_os_str()),
            ("FAKETIME_TIMESTAMP_FILE", control.as_os_str()),
            ("FAKETIME_NO_CACHE", "1".as_ref()),
            ("FAKETIME_DONT_FAKE_MONOTONIC", "1".as_ref()),
        ],
    );
    eventually("the first poll", Duration::from_secs(20), || {
        !sb.mdma.polls().is_empty()
    })
    .await;
    (daemon, control)
}

/// The `YYYY-MM-DD` of `t` (UTC).
fn day(t: SystemTime) -> String {
    humantime_serde::re::humantime::format_rfc3339_seconds(t).to_string()[..10].to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forward_wall_clock_step_of_two_days_does_not_shorten_leave_grace() {
    let Some(lib) = libfaketime() else {
        println!("SKIPPED: libfaketime not installed (apt-get install faketime)");
        return;
    };
    let sb = Sandbox::start(None).await.unwrap();
    seed(&sb, &[A, B, C], &[A, B, C]);
    for id in [A, B, C] {
        sb.merod.hold(id);
    }
    sb.mdma.set_reply(PollReply::assign([A, B]));
    let cfg = sb
        .write_config("leave_grace = \"8s\"\nleave_after_polls = 1")
        .unwrap();
    let (_daemon, control) = spawn_stepped(&sb, &cfg, &lib, "+0").await;
    let first_poll = Instant::now();
    tokio::time::sleep(Duration::from_secs(2)).await;
    // NTP, or a VM resumed: the wall clock jumps two days ahead.
    std::fs::write(&control, "+2d\n").unwrap();
    let polls = sb.mdma.polls().len();
    eventually("polls after the step", Duration::from_secs(10), || {
        sb.mdma.polls().len() >= polls + 2
    })
    .await;
    assert_eq!(sb.merod.leaves(C), 0, "left right after the step");
    eventually("C left", Duration::from_secs(30), || sb.merod.leaves(C) > 0).await;
    let waited = first_poll.elapsed();
    assert!(
        waited >= Duration::from_secs(7),
        "left {waited:?} after the first poll that withdrew it: before its 8 s grace"
    );
    // The leave's own log line carries the stepped wall clock: the step did happen.
    let stepped = day(SystemTime::now() + Duration::from_secs(2 * 86_400));
    eventually("the leave logged", Duration::from_secs(10), || {
        std::fs::read_to_string(sb.log_file()).is_ok_and(|l| l.contains("left: merod"))
    })
    .await;
    let log = std::fs::read_to_string(sb.log_file()).unwrap();
    let line = log.lines().find(|l| l.contains("left: merod")).unwrap();
    assert!(
        line.starts_with(&stepped),
        "the daemon's wall clock stepped to {stepped}: {line}"
    );
    eventually("C recorded as left", Duration::from_secs(10), || {
        load(&sb).admitted.len() == 2
    })
    .await;
}

/// A node switched from the Bash sidecar starts with its wall clock two days ahead (a
/// wrong RTC, NTP not synced yet): the Bash sidecar's timer says B has been absent for
/// 60 s. Read against the wall clock alone, that was two days of absence and B was left
/// on the first poll; read against the file's last write, it is the 60 s it was, and a
/// 5 min grace still has 4 min to go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wall_clock_two_days_ahead_at_the_first_start_does_not_age_the_bash_timers() {
    let Some(lib) = libfaketime() else {
        println!("SKIPPED: libfaketime not installed (apt-get install faketime)");
        return;
    };
    let sb = Sandbox::start(None).await.unwrap();
    for id in [A, B] {
        sb.merod.hold(id);
    }
    let dir = sb.state_file().parent().unwrap().to_owned();
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(sb.state_file(), serde_json::to_vec(&[A, B]).unwrap()).unwrap();
    std::fs::write(
        dir.join("fleet-admitted.json"),
        serde_json::to_vec(&[A, B]).unwrap(),
    )
    .unwrap();
    let now = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    std::fs::write(
        dir.join("fleet-leave-pending.json"),
        format!(
            r#"{{"absent_since":{{"{B}":{}}},"recent_leaves":[],"suspicious":false,"deferred":[]}}"#,
            now - 60
        ),
    )
    .unwrap();
    sb.mdma.set_reply(PollReply::assign([A]));
    let cfg = sb
        .write_config("leave_grace = \"5m\"\nleave_after_polls = 1")
        .unwrap();
    let (_daemon, _) = spawn_stepped(&sb, &cfg, &lib, "+2d").await;
    let polls = sb.mdma.polls().len();
    eventually("five polls more", Duration::from_secs(20), || {
        sb.mdma.polls().len() >= polls + 5
    })
    .await;
    assert_eq!(
        sb.merod.leaves(B),
        0,
        "left with 60 s of its 5 min grace observed"
    );
    // The daemon's wall clock was two days ahead all along.
    let stepped = day(SystemTime::now() + Duration::from_secs(2 * 86_400));
    let log = std::fs::read_to_string(sb.log_file()).unwrap_or_default();
    assert!(
        log.lines().next().is_some_and(|l| l.starts_with(&stepped)),
        "the daemon's wall clock is at {stepped}: {log}"
    );
}
