//! The systemd watchdog against a fake notify socket and the real binary: pings follow
//! `WATCHDOG_USEC` (every half of it, whatever `poll_interval` is), none without a watchdog
//! or for another `WATCHDOG_PID`; `@abstract` sockets work; an unreachable socket is warned
//! about once.

use std::ffi::OsStr;
use std::io::Read;
use std::os::linux::net::SocketAddrExt;
use std::time::{Duration, Instant};

use fleet_sidecar::testing::mdma::PollReply;
use fleet_sidecar::testing::sandbox::Sandbox;

use crate::common::*;

/// Collects notify lines from `socket` for `window`.
async fn collect(socket: &tokio::net::UnixDatagram, window: Duration) -> Vec<(Instant, String)> {
    let end = Instant::now() + window;
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while Instant::now() < end {
        if let Ok(Ok(n)) =
            tokio::time::timeout(Duration::from_millis(100), socket.recv(&mut buf)).await
        {
            let at = Instant::now();
            got.extend(
                String::from_utf8_lossy(&buf[..n])
                    .lines()
                    .map(|l| (at, l.to_owned())),
            );
        }
    }
    got
}

fn pings(got: &[(Instant, String)]) -> Vec<Instant> {
    got.iter()
        .filter(|(_, m)| m == "WATCHDOG=1")
        .map(|(t, _)| *t)
        .collect()
}

async fn sandbox() -> Sandbox {
    let sb = Sandbox::start(None).await.unwrap();
    sb.mdma.set_reply(PollReply::assign([A]));
    sb
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pings_follow_watchdog_usec_not_the_poll_interval_on_an_abstract_socket() {
    let sb = sandbox().await;
    // Polls 10 minutes apart; the watchdog (2 s) must still be fed every second.
    let cfg = sb.dir().join("slow-polls.toml");
    let text = sb
        .config_text("")
        .replace("poll_interval = \"1s\"", "poll_interval = \"10m\"");
    assert!(text.contains("\"10m\""));
    std::fs::write(&cfg, text).unwrap();
    let name = format!("fleet-sidecar-test-{}", std::process::id());
    let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
    let std_sock = std::os::unix::net::UnixDatagram::bind_addr(&addr).unwrap();
    std_sock.set_nonblocking(true).unwrap();
    let socket = tokio::net::UnixDatagram::from_std(std_sock).unwrap();
    let value = format!("@{name}");
    let mut child = spawn_daemon(
        &cfg,
        false,
        &[
            ("NOTIFY_SOCKET", OsStr::new(&value)),
            ("WATCHDOG_USEC", OsStr::new("2000000")),
        ],
    );
    let got = collect(&socket, Duration::from_secs(7)).await;
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(got.iter().any(|(_, m)| m == "READY=1"), "{got:?}");
    let p = pings(&got);
    assert!(p.len() >= 5, "about one ping a second: {got:?}");
    let worst = p.windows(2).map(|w| w[1] - w[0]).max().unwrap();
    assert!(worst < Duration::from_millis(1900), "worst gap {worst:?}");
    // The first poll waits a random part of at most 5 s; then nothing for 10 min.
    assert_eq!(
        sb.mdma.polls().len(),
        1,
        "one poll in 7 s at a 10 min interval"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_pings_without_a_watchdog_or_for_another_pid() {
    let sb = sandbox().await;
    let cfg = sb.write_config("").unwrap();
    for extra in [None, Some(("WATCHDOG_PID", "1"))] {
        let path = sb.dir().join(format!("notify-{}.sock", extra.is_some()));
        let socket = tokio::net::UnixDatagram::bind(&path).unwrap();
        let mut env = vec![("NOTIFY_SOCKET", path.as_os_str())];
        if let Some((k, v)) = extra {
            env.push(("WATCHDOG_USEC", OsStr::new("2000000")));
            env.push((k, OsStr::new(v)));
        }
        let mut child = spawn_daemon(&cfg, false, &env);
        let got = collect(&socket, Duration::from_secs(4)).await;
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(
            got.iter().any(|(_, m)| m.starts_with("STATUS=")),
            "{extra:?}: {got:?}"
        );
        assert!(pings(&got).is_empty(), "{extra:?}: {got:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_notify_socket_is_warned_about_once() {
    let sb = sandbox().await;
    let cfg = sb.write_config("").unwrap();
    let missing = sb.dir().join("no-such-dir/notify.sock");
    let mut child = spawn_daemon(
        &cfg,
        true,
        &[
            ("NOTIFY_SOCKET", missing.as_os_str()),
            ("WATCHDOG_USEC", OsStr::new("1000000")),
        ],
    );
    eventually("a few polls", Duration::from_secs(30), || {
        sb.mdma.polls().len() >= 4
    })
    .await;
    child.kill().unwrap();
    child.wait().unwrap();
    let mut err = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    assert_eq!(
        err.matches("cannot notify systemd").count(),
        1,
        "warned once: {err}"
    );
}
