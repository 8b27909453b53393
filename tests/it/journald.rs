//! `log_target = "journald"`: the daemon binary logs in journald's native protocol, one
//! datagram per event, with PRIORITY and the structured fields NAMESPACE_ID, OUTCOME,
//! DURATION and ERROR_KIND. The journal socket path is fixed (/run/systemd/journal/socket),
//! so the binary runs in a private mount namespace (`unshare`) where a fake journal socket
//! of this test is bind-mounted there; the host's /run is untouched. Skips with a message
//! when mount namespaces are not available.

use std::collections::HashMap;
use std::os::unix::net::UnixDatagram;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use fleet_sidecar::testing::mdma::PollReply;
use fleet_sidecar::testing::merod::JoinBehaviour;
use fleet_sidecar::testing::sandbox::Sandbox;

use crate::common::*;

const BIN: &str = env!("CARGO_BIN_EXE_fleet-sidecar");
const SETUP: &str = "mount -t tmpfs tmpfs /run && mkdir -p /run/systemd/journal \
    && : >/run/systemd/journal/socket && mount --bind \"$0\" /run/systemd/journal/socket";

/// `unshare` arguments for a private mount namespace (a user namespace too when not root).
fn unshare() -> Command {
    let mut cmd = Command::new("unshare");
    if !nix::unistd::geteuid().is_root() {
        cmd.args(["--user", "--map-root-user"]);
    }
    cmd.args(["--mount", "--propagation", "private", "sh", "-c"]);
    cmd
}

/// Whether this machine lets the test build the namespace; the reason when not.
fn namespaces_work(socket: &Path) -> Result<(), String> {
    let out = unshare()
        .arg(SETUP)
        .arg(socket)
        .output()
        .map_err(|e| format!("cannot run unshare: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).trim().to_owned())
    }
}

/// One native-protocol datagram: `NAME=value\n`, or `NAME\n<u64 LE length><value>\n` for
/// values with a newline.
fn parse(mut d: &[u8]) -> HashMap<String, String> {
    let mut fields = HashMap::new();
    while !d.is_empty() {
        let end = d
            .iter()
            .position(|&b| b == b'\n' || b == b'=')
            .expect("a field name");
        let name = String::from_utf8_lossy(&d[..end]).into_owned();
        if d[end] == b'=' {
            let rest = &d[end + 1..];
            let nl = rest.iter().position(|&b| b == b'\n').expect("a newline");
            fields.insert(name, String::from_utf8_lossy(&rest[..nl]).into_owned());
            d = &rest[nl + 1..];
        } else {
            let len = u64::from_le_bytes(d[end + 1..end + 9].try_into().unwrap()) as usize;
            let value = &d[end + 9..end + 9 + len];
            fields.insert(name, String::from_utf8_lossy(value).into_owned());
            d = &d[end + 9 + len + 1..];
        }
    }
    fields
}

/// Runs `fleet-sidecar once` with `config` in the namespace; the datagrams it sent and
/// its exit code.
async fn run_once(
    socket: &UnixDatagram,
    path: &Path,
    config: &Path,
) -> (Vec<HashMap<String, String>>, i32, String) {
    let mut child = unshare()
        .arg(format!("{SETUP} && exec \"$1\" --config \"$2\" once"))
        .arg(path)
        .arg(BIN)
        .arg(config)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("unshare runs");
    // Read while it runs, as journald does: the socket queues only
    // `net.unix.max_dgram_qlen` (10) datagrams, and the daemon's writer waits on a full
    // queue, so reading only after the exit would keep the lines past the tenth.
    let mut got = Vec::new();
    let mut buf = vec![0u8; 65536];
    let mut drain = |got: &mut Vec<HashMap<String, String>>| {
        while let Ok(n) = socket.recv(&mut buf) {
            if n > 0 {
                got.push(parse(&buf[..n]));
            }
        }
    };
    let started = std::time::Instant::now();
    let status = loop {
        drain(&mut got);
        if let Some(s) = child.try_wait().expect("child status") {
            break s;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the daemon did not stop within 60 s"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    drain(&mut got);
    let mut stderr = String::new();
    std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut stderr).unwrap();
    (got, status.code().unwrap_or(-1), stderr)
}

fn find<'a>(got: &'a [HashMap<String, String>], message: &str) -> &'a HashMap<String, String> {
    got.iter()
        .find(|f| f.get("MESSAGE").is_some_and(|m| m.contains(message)))
        .unwrap_or_else(|| panic!("no event {message:?} in {got:#?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn journald_gets_native_datagrams_with_structured_fields_and_priorities() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("journal.socket");
    let socket = UnixDatagram::bind(&path).unwrap();
    socket.set_nonblocking(true).unwrap();
    if let Err(why) = namespaces_work(&path) {
        eprintln!("SKIP journald test: no private mount namespace here ({why})");
        return;
    }
    let sb = Sandbox::start(None).await.unwrap();
    sb.mdma.set_reply(PollReply::assign([A]));
    let config = sb
        .write_config("log_target = \"journald\"\nlog_to_file = false")
        .unwrap();
    let (got, code, stderr) = run_once(&socket, &path, &config).await;
    assert_eq!(code, 0, "{stderr}");
    let confirmed = find(&got, "confirmed to MDMA");
    assert_eq!(confirmed["NAMESPACE_ID"], A);
    assert_eq!(confirmed["OUTCOME"], "confirmed");
    assert_eq!(confirmed["PRIORITY"], "5", "info is notice");
    assert_eq!(confirmed["SYSLOG_IDENTIFIER"], "fleet-sidecar");
    let took: f64 = confirmed["DURATION"].parse().expect("DURATION in seconds");
    assert!((0.0..60.0).contains(&took), "{took}");
    assert_eq!(find(&got, "joining")["NAMESPACE_ID"], A);
    // The journal replaces stderr, and log_to_file = false leaves no file.
    assert!(!stderr.contains("confirmed to MDMA"), "{stderr}");
    assert!(!sb.log_file().exists());

    sb.mdma.set_reply(PollReply::Status(503));
    let (got, code, stderr) = run_once(&socket, &path, &config).await;
    assert_eq!(code, 3, "{stderr}");
    let failed = find(&got, "poll failed");
    assert_eq!(failed["ERROR_KIND"], "status");
    assert_eq!(failed["OUTCOME"], "failed");
    assert_eq!(failed["PRIORITY"], "4", "warn is warning");
}

#[test]
fn by_default_the_log_file_stays_and_an_unknown_target_is_refused() {
    let cfg =
        fleet_sidecar::Config::from_toml("mdma_url = \"https://m\"", Path::new("t.toml")).unwrap();
    assert!(cfg.log_to_file);
    assert_eq!(cfg.log_target, fleet_sidecar::config::LogTarget::Auto);
    let err = fleet_sidecar::Config::from_toml(
        "mdma_url = \"https://m\"\nlog_target = \"syslog\"",
        Path::new("t.toml"),
    )
    .unwrap_err();
    assert!(err.to_string().contains("log_target"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn merods_words_cannot_forge_a_journal_field() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("journal.socket");
    let socket = UnixDatagram::bind(&path).unwrap();
    socket.set_nonblocking(true).unwrap();
    if let Err(why) = namespaces_work(&path) {
        eprintln!("SKIP journald test: no private mount namespace here ({why})");
        return;
    }
    let sb = Sandbox::start(None).await.unwrap();
    sb.merod.set_default_join(JoinBehaviour::Error {
        status: 500,
        message: "attestation failed\nPRIORITY=0\nMESSAGE=FORGED\r\u{1b}[2K".to_owned(),
    });
    sb.mdma.set_reply(PollReply::assign([A]));
    let config = sb
        .write_config("log_target = \"journald\"\nlog_to_file = false")
        .unwrap();
    let (got, code, stderr) = run_once(&socket, &path, &config).await;
    assert_eq!(code, 0, "{stderr}");
    let failed = find(&got, "join failed");
    assert!(
        failed["MESSAGE"].contains("attestation failed\\nPRIORITY=0\\nMESSAGE=FORGED\\r\\"),
        "{failed:?}"
    );
    assert_eq!(failed["PRIORITY"], "4");
    for fields in &got {
        for (name, value) in fields {
            assert!(
                !value.contains(['\n', '\r', '\u{1b}']),
                "{name} holds a control character: {value:?}"
            );
        }
        assert_ne!(fields.get("MESSAGE").map(String::as_str), Some("FORGED"));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_journal_socket_nobody_reads_stalls_neither_the_poll_nor_healthz() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("journal.socket");
    let socket = UnixDatagram::bind(&path).unwrap();
    socket.set_nonblocking(true).unwrap();
    if let Err(why) = namespaces_work(&path) {
        eprintln!("SKIP journald test: no private mount namespace here ({why})");
        return;
    }
    let sb = Sandbox::start(None).await.unwrap();
    sb.mdma
        .set_reply(PollReply::assign((0..600u32).map(|n| format!("{n:064x}"))));
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let config = sb
        .write_config(&format!(
            "log_target = \"journald\"\nlog_to_file = false\nstatus_listen = \"127.0.0.1:{port}\""
        ))
        .unwrap();
    // Nobody reads the socket until the end: its queue (net.unix.max_dgram_qlen datagrams)
    // fills at once, then the journal writer's own queue (QUEUE_LINES, 1024 lines) within
    // two polls (a dry run logs one line per namespace it would join, every poll), and the
    // lines after that are dropped.
    let child = unshare()
        .arg(format!(
            "{SETUP} && exec \"$1\" --config \"$2\" --dry-run run"
        ))
        .arg(&path)
        .arg(BIN)
        .arg(&config)
        .env("RUST_LOG", "debug")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("unshare runs");
    let _child = DaemonProcess::new(child);
    let get = |what: &'static str| async move {
        reqwest::Client::new()
            .get(format!("http://127.0.0.1:{port}/{what}"))
            .timeout(Duration::from_secs(2))
            .send()
            .await
            .expect("the listener answers at once")
            .text()
            .await
            .unwrap()
    };
    eventually("a second poll", Duration::from_secs(30), || {
        sb.mdma.polls().len() >= 2
    })
    .await;
    let started = std::time::Instant::now();
    let dropped = || async {
        metric(
            &get("metrics").await,
            "fleet_sidecar_log_lines_dropped_total{sink=\"journal\"}",
        )
    };
    while dropped().await == 0.0 {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "no journal line dropped within 60 s: the queue never filled"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // With the journal's queue full, the polls go on at their pace and /healthz answers.
    let full_from = sb.mdma.polls().len();
    eventually("six polls more", Duration::from_secs(30), || {
        sb.mdma.polls().len() >= full_from + 6
    })
    .await;
    let polls = sb.mdma.polls();
    let worst = polls[full_from..]
        .windows(2)
        .map(|p| p[1].at - p[0].at)
        .max()
        .unwrap();
    assert!(worst < Duration::from_millis(2500), "worst gap {worst:?}");
    assert_eq!(get("healthz").await.trim(), "ok");
    assert!(dropped().await > 0.0);
    // Read again: the first event taken is followed by one saying how many were lost.
    let mut buf = vec![0u8; 65536];
    let started = std::time::Instant::now();
    loop {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "no notice of the lost lines"
        );
        match socket.recv(&mut buf) {
            Ok(n) => {
                let fields = parse(&buf[..n]);
                if fields.get("SINK").map(String::as_str) == Some("journal") {
                    assert!(fields["DROPPED"].parse::<u64>().unwrap() > 0, "{fields:?}");
                    assert!(fields["MESSAGE"]
                        .contains("were dropped while the journal was not being read"));
                    assert_eq!(fields["PRIORITY"], "4");
                    break;
                }
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
}
