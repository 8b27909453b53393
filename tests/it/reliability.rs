//! Faults found by trying public bug reports of similar agents, each as a kind — a sink
//! that stops reading, a slow disk, outside text shaped like a log line, a fleet-sized poll
//! answer, merod behind its second listen address, a kept-alive connection closed as it is
//! reused.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use fleet_sidecar::testing::mdma::PollReply;
use fleet_sidecar::testing::merod::JoinBehaviour;
use fleet_sidecar::testing::sandbox::Sandbox;
use fleet_sidecar::{ControlPlane, MdmaClient, PeerId};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::common::*;

const LIMIT: Duration = Duration::from_secs(30);
const BIN: &str = env!("CARGO_BIN_EXE_fleet-sidecar");

fn peer() -> PeerId {
    fleet_sidecar::testing::sandbox::PEER_ID.parse().unwrap()
}

/// A free loopback TCP port (bound, then let go).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// `GET url` with a 5 s bound: status and body.
async fn get(url: &str) -> Result<(u16, String), reqwest::Error> {
    let resp = reqwest::Client::new()
        .get(url)
        .timeout(Duration::from_secs(5))
        .send()
        .await?;
    Ok((resp.status().as_u16(), resp.text().await?))
}

/// Reads one HTTP/1.1 request (head, then a `content-length` body); `false` at EOF.
async fn read_request(tcp: &mut TcpStream) -> bool {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        if let Some(end) = got.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&got[..end]).to_ascii_lowercase();
            let len: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0);
            if got.len() >= end + 4 + len {
                return true;
            }
        }
        match tcp.read(&mut buf).await {
            Ok(0) | Err(_) => return false,
            Ok(n) => got.extend_from_slice(&buf[..n]),
        }
    }
}

/// A loopback MDMA that keeps connections alive but closes each one, unanswered, the
/// moment it is reused (what a load balancer with an idle timeout equal to the poll
/// interval does). Answers every first request of a connection with no assignments.
/// Counts requests and connections.
async fn closing_at_reuse() -> (url::Url, Arc<AtomicUsize>, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let (requests, connections) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let (r, c) = (Arc::clone(&requests), Arc::clone(&connections));
    tokio::spawn(async move {
        while let Ok((mut tcp, _)) = listener.accept().await {
            c.fetch_add(1, Ordering::SeqCst);
            let r = Arc::clone(&r);
            tokio::spawn(async move {
                let mut answered = false;
                while read_request(&mut tcp).await {
                    r.fetch_add(1, Ordering::SeqCst);
                    if answered {
                        return; // closed as it is reused, no answer
                    }
                    let body = r#"{"assignments":[]}"#;
                    let head = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: keep-alive\r\n\r\n",
                        body.len()
                    );
                    if tcp
                        .write_all(format!("{head}{body}").as_bytes())
                        .await
                        .is_err()
                    {
                        return;
                    }
                    answered = true;
                }
            });
        }
    });
    let url = format!("http://127.0.0.1:{port}/").parse().unwrap();
    (url, requests, connections)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kept_alive_connection_closed_as_it_is_reused_costs_no_failed_poll() {
    let (url, requests, connections) = closing_at_reuse().await;
    let resends = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&resends);
    let mdma = MdmaClient::builder(url)
        .on_resend(move || {
            counted.fetch_add(1, Ordering::SeqCst);
        })
        .build()
        .unwrap();
    for poll in 1..=4 {
        mdma.should_join(&peer(), None, fleet_sidecar::mdma::NodeReport::default())
            .await
            .unwrap_or_else(|e| panic!("poll {poll} failed: {e}"));
    }
    // Polls 2 and 4 found their kept-alive connection closed and were sent once more.
    assert_eq!(resends.load(Ordering::SeqCst), 2);
    assert_eq!(requests.load(Ordering::SeqCst), 6);
    // The server answers only the first request of a connection, so the two answered
    // resends went on fresh connections. Their count is at least 4, not exactly: the
    // pooled client may race a new connect against a pooled connection coming free (seen
    // under load as a fifth connection that carried no request).
    assert!(
        connections.load(Ordering::SeqCst) >= 4,
        "each resend on a fresh connection"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_daemon_counts_resends_in_a_metric_and_no_poll_fails() {
    let sb = Sandbox::start(None).await.unwrap();
    let (url, requests, _) = closing_at_reuse().await;
    let port = free_port();
    let text = sb
        .config_text(&format!("status_listen = \"127.0.0.1:{port}\""))
        .replace(&sb.mdma.url().to_string(), url.as_str());
    let cfg = sb.dir().join("closing.toml");
    std::fs::write(&cfg, text).unwrap();
    let _child = spawn_daemon(&cfg, false, &[]);
    eventually("five polls", LIMIT, || requests.load(Ordering::SeqCst) >= 7).await;
    let (_, metrics) = get(&format!("http://127.0.0.1:{port}/metrics"))
        .await
        .unwrap();
    assert!(
        metric(&metrics, "fleet_sidecar_poll_resends_total") >= 2.0,
        "{metrics}"
    );
    for outcome in ["transport", "timeout", "status", "malformed"] {
        let series = format!("fleet_sidecar_polls_total{{outcome=\"{outcome}\"}}");
        assert_eq!(metric(&metrics, &series), 0.0, "{series}: {metrics}");
    }
    assert!(metric(&metrics, "fleet_sidecar_polls_total{outcome=\"ok\"}") >= 4.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn merods_listen_addresses_are_tried_in_order_and_the_one_that_answered_is_logged() {
    let sb = Sandbox::start(None).await.unwrap();
    sb.mdma.set_reply(PollReply::assign([A]));
    // IPv6 first, where nothing listens (or IPv6 is off), then merod's real address.
    let v6 = std::net::TcpListener::bind("[::1]:0")
        .map(|l| l.local_addr().unwrap().port())
        .unwrap_or(9);
    let merod_port = sb.merod.addr().port();
    let toml = sb.dir().join("calimero/default/config.toml");
    let text = std::fs::read_to_string(&toml).unwrap().replace(
        &format!("listen = [\"/ip4/127.0.0.1/tcp/{merod_port}\"]"),
        &format!("listen = [\"/ip6/::1/tcp/{v6}\", \"/ip4/127.0.0.1/tcp/{merod_port}\"]"),
    );
    assert!(text.contains("/ip6/::1/"), "{text}");
    std::fs::write(&toml, text).unwrap();
    let cfg = sb.write_config("").unwrap();
    let out = tokio::task::spawn_blocking(move || {
        run_once(&["--config", cfg.to_str().unwrap(), "once"], &[])
    })
    .await
    .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(sb.mdma.confirmed().contains(A), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "merod's admin API answered at [server].listen[1] http://127.0.0.1:{merod_port}/"
        )),
        "{stderr}"
    );
}

/// Fills `stream`'s buffers so its next blocking write blocks (the reader never reads).
fn fill(stream: &std::os::unix::net::UnixStream) {
    use std::io::Write;
    stream.set_nonblocking(true).unwrap();
    let chunk = [b'#'; 4096];
    let mut w = stream;
    while w.write(&chunk).is_ok() {}
    stream.set_nonblocking(false).unwrap();
}

/// The daemon binary's `run` with `config`, stdout dropped, `stderr` as given.
fn spawn_with_stderr(
    config: &std::path::Path,
    stderr: std::process::Stdio,
    env: &[(&str, &str)],
) -> DaemonProcess {
    let mut cmd = std::process::Command::new(BIN);
    cmd.arg("--config").arg(config).arg("run");
    for (k, v) in env {
        cmd.env(k, v);
    }
    DaemonProcess::new(
        cmd.stdout(std::process::Stdio::null())
            .stderr(stderr)
            .spawn()
            .expect("the daemon starts"),
    )
}

/// `/healthz` answers 200 within 2 s.
async fn healthz_answers(port: u16) {
    let started = std::time::Instant::now();
    let (code, _) = get(&format!("http://127.0.0.1:{port}/healthz"))
        .await
        .expect("/healthz answers");
    assert_eq!(code, 200);
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
}

/// The biggest gap between two polls MDMA received from `from` on.
fn worst_poll_gap(sb: &Sandbox, from: usize) -> Duration {
    let polls = sb.mdma.polls();
    polls[from.min(polls.len())..]
        .windows(2)
        .map(|p| p[1].at - p[0].at)
        .max()
        .unwrap_or_default()
}

/// A `log_file` that would block its open (a FIFO nobody reads; a hung filesystem blocks
/// the same way) is named in one error line and the daemon runs without it: it polls, and
/// stops cleanly. Before, the open blocked before the first poll, for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_log_file_that_blocks_its_open_is_named_once_and_the_daemon_polls_without_it() {
    let sb = Sandbox::start(None).await.unwrap();
    nix::unistd::mkfifo(
        &sb.log_file(),
        nix::sys::stat::Mode::from_bits_truncate(0o600),
    )
    .unwrap();
    let cfg = sb.write_config("").unwrap();
    let child = spawn_daemon(&cfg, true, &[]);
    assert!(
        sb.mdma.wait_for_polls(2, LIMIT).await,
        "the daemon polls without its log file"
    );
    let out = child.stop().await;
    assert_eq!(out.status.code(), Some(0));
    let stderr = String::from_utf8_lossy(&out.stderr);
    let named: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains(&*sb.log_file().to_string_lossy()))
        .collect();
    assert_eq!(named.len(), 1, "{stderr}");
    assert!(
        named[0].contains("cannot open log file") && named[0].contains("FIFO"),
        "{}",
        named[0]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stderr_nobody_reads_stalls_neither_the_poll_nor_healthz() {
    let sb = Sandbox::start(None).await.unwrap();
    // 600 namespaces whose joins merod refuses: two lines each per try, more than the
    // stderr queue holds.
    let many: Vec<String> = (0..600u32).map(|i| format!("{i:064x}")).collect();
    sb.merod.set_default_join(JoinBehaviour::Error {
        status: 500,
        message: "Failed to generate attestation".to_owned(),
    });
    sb.mdma.set_reply(PollReply::assign(many));
    let port = free_port();
    let cfg = sb
        .write_config(&format!(
            "status_listen = \"127.0.0.1:{port}\"\nmax_concurrent_joins = 50"
        ))
        .unwrap();
    // stderr is a stream nobody reads (as the journal's stream is when journald hangs),
    // full before the daemon writes its first line.
    let (ours, theirs) = std::os::unix::net::UnixStream::pair().unwrap();
    fill(&theirs);
    let stderr = std::process::Stdio::from(std::os::fd::OwnedFd::from(theirs));
    let _child = spawn_with_stderr(&cfg, stderr, &[]);
    eventually("six polls", LIMIT, || sb.mdma.polls().len() >= 6).await;
    eventually("joins tried", LIMIT, || sb.merod.calls().len() >= 600).await;
    let polls = sb.mdma.polls().len();
    eventually("three more polls", LIMIT, || {
        sb.mdma.polls().len() >= polls + 3
    })
    .await;
    assert!(worst_poll_gap(&sb, 1) < Duration::from_millis(2500));
    healthz_answers(port).await;
    let (_, metrics) = get(&format!("http://127.0.0.1:{port}/metrics"))
        .await
        .unwrap();
    assert!(
        metric(
            &metrics,
            "fleet_sidecar_log_lines_dropped_total{sink=\"stderr\"}"
        ) > 0.0,
        "{metrics}"
    );
    assert_eq!(
        metric(
            &metrics,
            "fleet_sidecar_log_lines_dropped_total{sink=\"log_file\"}"
        ),
        0.0
    );
    // The log file lost nothing meanwhile.
    let log = std::fs::read_to_string(sb.log_file()).unwrap();
    assert!(log.matches("join failed").count() >= 600);
    // Read again, stderr says once how many lines it lost.
    let said = tokio::task::spawn_blocking(move || {
        use std::io::Read;
        ours.set_read_timeout(Some(Duration::from_secs(1))).unwrap();
        let mut seen = Vec::new();
        let started = std::time::Instant::now();
        let mut buf = [0u8; 65536];
        while started.elapsed() < LIMIT {
            if let Ok(n) = (&ours).read(&mut buf) {
                seen.extend_from_slice(&buf[..n]);
            }
            if String::from_utf8_lossy(&seen).contains("not being read; it reads again") {
                return String::from_utf8_lossy(&seen).into_owned();
            }
        }
        String::from_utf8_lossy(&seen).into_owned()
    })
    .await
    .unwrap();
    let notice = said
        .lines()
        .find(|l| l.contains("log lines were dropped while stderr was not being read"))
        .unwrap_or_else(|| panic!("no notice in {} bytes of stderr", said.len()));
    assert!(notice.contains("WARN"), "{notice}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_notify_socket_nobody_reads_stalls_neither_the_poll_nor_healthz() {
    let sb = Sandbox::start(None).await.unwrap();
    sb.mdma.set_reply(PollReply::assign([A]));
    let port = free_port();
    let cfg = sb
        .write_config(&format!("status_listen = \"127.0.0.1:{port}\""))
        .unwrap();
    // A datagram socket that never reads: its queue (net.unix.max_dgram_qlen) fills after
    // a few STATUS and WATCHDOG messages.
    let socket_path = sb.dir().join("notify.socket");
    let _socket = std::os::unix::net::UnixDatagram::bind(&socket_path).unwrap();
    let _child = spawn_with_stderr(
        &cfg,
        std::process::Stdio::null(),
        &[
            ("NOTIFY_SOCKET", socket_path.to_str().unwrap()),
            ("WATCHDOG_USEC", "400000"),
        ],
    );
    eventually("A confirmed", LIMIT, || sb.mdma.confirmed().contains(A)).await;
    eventually("sixteen polls", LIMIT, || sb.mdma.polls().len() >= 16).await;
    assert!(worst_poll_gap(&sb, 1) < Duration::from_millis(2500));
    healthz_answers(port).await;
    let (_, metrics) = get(&format!("http://127.0.0.1:{port}/metrics"))
        .await
        .unwrap();
    assert!(
        metric(
            &metrics,
            "fleet_sidecar_log_lines_dropped_total{sink=\"notify\"}"
        ) > 0.0,
        "{metrics}"
    );
    let log = std::fs::read_to_string(sb.log_file()).unwrap();
    assert_eq!(
        log.matches("systemd's notify socket is not reading")
            .count(),
        1,
        "warned once: {log}"
    );
}

/// merod's error text, shaped as a log line of its own after a newline, with a carriage
/// return and a terminal escape.
const FORGED: &str =
    "attestation failed\n2026-12-01T00:00:00.000000Z  INFO confirmed to MDMA FORGED\r\u{1b}[2K";

/// Runs `fleet-sidecar once` with merod answering every fleet-join with [`FORGED`]: its
/// stderr and the log file.
async fn once_with_forged_merod_error(extra: &str) -> (String, String) {
    let sb = Sandbox::start(None).await.unwrap();
    sb.merod.set_default_join(JoinBehaviour::Error {
        status: 500,
        message: FORGED.to_owned(),
    });
    sb.mdma.set_reply(PollReply::assign([A]));
    let cfg = sb.write_config(extra).unwrap();
    let out = tokio::task::spawn_blocking(move || {
        run_once(&["--config", cfg.to_str().unwrap(), "once"], &[])
    })
    .await
    .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    (stderr, std::fs::read_to_string(sb.log_file()).unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn merods_words_cannot_forge_a_text_log_line() {
    let (stderr, log) = once_with_forged_merod_error("").await;
    for (sink, text) in [("stderr", &stderr), ("log file", &log)] {
        let lines: Vec<&str> = text.lines().filter(|l| l.contains("FORGED")).collect();
        assert!(
            !lines.is_empty(),
            "{sink}: merod's words are logged: {text}"
        );
        for line in lines {
            assert!(
                line.contains("join failed"),
                "{sink}: a forged line: {line:?}"
            );
            assert!(
                line.contains("attestation failed\\n2026-12-01"),
                "{sink}: {line:?}"
            );
            // The escape character as `\u{1b}` (ours) or `\x1b` (tracing's own).
            assert!(line.contains("FORGED\\r\\"), "{sink}: {line:?}");
        }
        assert!(
            !text.contains('\r') && !text.contains('\u{1b}'),
            "{sink}: {text:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn merods_words_cannot_forge_a_json_log_line() {
    let (stderr, log) = once_with_forged_merod_error("log_format = \"json\"").await;
    for (sink, text) in [("stderr", &stderr), ("log file", &log)] {
        let mut found = false;
        for line in text.lines() {
            let v: serde_json::Value = serde_json::from_str(line)
                .unwrap_or_else(|e| panic!("{sink}: not one JSON object a line ({e}): {line:?}"));
            let message = v["fields"]["message"].as_str().unwrap_or_default();
            if message.contains("FORGED") {
                assert!(message.contains("join failed"), "{sink}: {line}");
                found = true;
            }
        }
        assert!(found, "{sink}: merod's words are logged: {text}");
    }
}

/// An `LD_PRELOAD` shim making `fsync`/`fdatasync` of files under `$SLOW_FSYNC_DIR` take
/// `$SLOW_FSYNC_MS` milliseconds (a slowed disk, without root), and, while the file
/// `$SLOW_FSYNC_GATE` exists, not return at all (a hung disk).
const SLOW_FSYNC_C: &str = r#"
#define _GNU_SOURCE
#include <dlfcn.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static void slow(int fd) {
    const char *dir = getenv("SLOW_FSYNC_DIR");
    const char *ms = getenv("SLOW_FSYNC_MS");
    char link[64], path[PATH_MAX];
    if (!dir || !ms) return;
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, path, sizeof path - 1);
    if (n < 0) return;
    path[n] = 0;
    if (strncmp(path, dir, strlen(dir)) != 0) return;
    long v = atol(ms);
    struct timespec ts = { v / 1000, (v % 1000) * 1000000L };
    nanosleep(&ts, NULL);
    const char *gate = getenv("SLOW_FSYNC_GATE");
    struct timespec tick = { 0, 20000000L };
    while (gate && access(gate, F_OK) == 0) nanosleep(&tick, NULL);
}

int fsync(int fd) {
    static int (*real)(int);
    if (!real) real = (int (*)(int))dlsym(RTLD_NEXT, "fsync");
    slow(fd);
    return real(fd);
}

int fdatasync(int fd) {
    static int (*real)(int);
    if (!real) real = (int (*)(int))dlsym(RTLD_NEXT, "fdatasync");
    slow(fd);
    return real(fd);
}
"#;

/// Builds the slow-fsync shim with gcc into `dir`; `None` (test skipped) without gcc.
fn slow_fsync_shim(dir: &std::path::Path) -> Option<std::path::PathBuf> {
    let src = dir.join("slow_fsync.c");
    let lib = dir.join("slow_fsync.so");
    std::fs::write(&src, SLOW_FSYNC_C).unwrap();
    let built = std::process::Command::new("gcc")
        .args(["-shared", "-fPIC", "-O2", "-o"])
        .arg(&lib)
        .arg(&src)
        .arg("-ldl")
        .status();
    match built {
        Ok(s) if s.success() => Some(lib),
        _ => None,
    }
}

/// The daemon on `sb`'s node with `extra` config and `/status` on a free port, every fsync
/// under the state directory taking 1.5 s (so each state write, two fsyncs, takes 3 s):
/// the daemon, the port and the shim's directory (kept while it runs). `None` (test
/// skipped) without gcc.
fn spawn_with_slow_fsync(
    sb: &Sandbox,
    extra: &str,
) -> Option<(DaemonProcess, u16, tempfile::TempDir)> {
    spawn_with_fsync_shim(sb, extra, "1500", None)
}

/// [`spawn_with_slow_fsync`] with each fsync taking `ms`, and hanging while `gate` exists.
fn spawn_with_fsync_shim(
    sb: &Sandbox,
    extra: &str,
    ms: &str,
    gate: Option<&std::path::Path>,
) -> Option<(DaemonProcess, u16, tempfile::TempDir)> {
    let shim_dir = tempfile::tempdir().unwrap();
    let Some(shim) = slow_fsync_shim(shim_dir.path()) else {
        println!("SKIPPED: no gcc to build the slow-fsync shim");
        return None;
    };
    let state_dir = sb.state_file().parent().unwrap().to_owned();
    std::fs::create_dir_all(&state_dir).unwrap();
    let state_dir = state_dir.canonicalize().unwrap();
    let port = free_port();
    let cfg = sb
        .write_config(&format!("status_listen = \"127.0.0.1:{port}\"\n{extra}"))
        .unwrap();
    let gate = gate
        .map(|g| g.to_str().unwrap().to_owned())
        .unwrap_or_default();
    let mut env = vec![
        ("LD_PRELOAD", shim.to_str().unwrap()),
        ("SLOW_FSYNC_DIR", state_dir.to_str().unwrap()),
        ("SLOW_FSYNC_MS", ms),
    ];
    if !gate.is_empty() {
        env.push(("SLOW_FSYNC_GATE", &gate));
    }
    let child = spawn_with_stderr(&cfg, std::process::Stdio::null(), &env);
    Some((child, port, shim_dir))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_fsync_stalls_neither_the_poll_nor_healthz_and_confirms_wait_for_it() {
    let sb = Sandbox::start(None).await.unwrap();
    sb.mdma.set_reply(PollReply::assign([A]));
    // Every write of the state file: two fsyncs (temp file, directory) of 1.5 s each.
    let Some((_child, port, _shim)) = spawn_with_slow_fsync(&sb, "") else {
        return;
    };
    eventually("two polls", LIMIT, || sb.mdma.polls().len() >= 2).await;
    let first = sb.mdma.polls().len() - 1;
    // The join is recorded (a 3 s write), sent, admitted, recorded (3 s), confirmed,
    // recorded (3 s): polls go on at 1 s meanwhile, and /healthz answers.
    let checking = async {
        while !sb.mdma.confirmed().contains(A) {
            healthz_answers(port).await;
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    };
    tokio::time::timeout(LIMIT, checking)
        .await
        .expect("A confirmed");
    eventually("four more polls", LIMIT, || {
        sb.mdma.polls().len() >= first + 4
    })
    .await;
    let gap = worst_poll_gap(&sb, first);
    assert!(gap < Duration::from_millis(1800), "worst poll gap {gap:?}");
    // The confirm waited for the writes: the join recorded before fleet-join was sent
    // (3 s), the admission recorded before the confirm (3 s more).
    let join_at = first_fleet_join(&sb).at;
    let confirm_at = sb.mdma.confirms()[0].at;
    let first_poll_at = sb.mdma.polls()[0].at;
    assert!(
        join_at - first_poll_at >= Duration::from_millis(2900),
        "fleet-join {:?} after the first poll",
        join_at - first_poll_at
    );
    assert!(
        confirm_at - join_at >= Duration::from_millis(2900),
        "confirm {:?} after fleet-join",
        confirm_at - join_at
    );
    assert!(load(&sb).admitted.contains(&gid(A)));
}

/// A state write that does not return (a hung disk) holds back the join recorded by it, and
/// past 10 s it shows: `/readyz` not ready, one line logged, `/status` (what `fleet-sidecar
/// status` and `STATUS=` show) and `fleet_sidecar_state_write_stalled`; polls go on. When it
/// returns, all of them recover and the join goes on. Before, nothing showed it at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_state_write_shows_in_readyz_status_log_and_metric_and_all_recover() {
    let sb = Sandbox::start(None).await.unwrap();
    let gate = sb.dir().join("disk-hangs");
    let Some((_child, port, _shim)) = spawn_with_fsync_shim(&sb, "", "0", Some(&gate)) else {
        return;
    };
    let base = format!("http://127.0.0.1:{port}");
    let ready = || async { get(&format!("{base}/readyz")).await.map(|r| r.0).ok() };
    let stalled = || async {
        let body = get(&format!("{base}/metrics")).await.unwrap().1;
        metric(&body, "fleet_sidecar_state_write_stalled")
    };
    eventually("two polls", LIMIT, || sb.mdma.polls().len() >= 2).await;
    let t0 = std::time::Instant::now();
    while ready().await != Some(200) {
        assert!(t0.elapsed() < LIMIT, "ready before the disk hangs");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    std::fs::write(&gate, "").unwrap();
    sb.mdma.set_reply(PollReply::assign([A]));
    let hung_at = std::time::Instant::now();
    let polls = sb.mdma.polls().len();
    while ready().await == Some(200) {
        assert!(
            hung_at.elapsed() < LIMIT,
            "/readyz never said the write hangs"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(
        hung_at.elapsed() >= Duration::from_secs(9),
        "not ready only past the bound ({:?})",
        hung_at.elapsed()
    );
    let (code, body) = get(&format!("{base}/readyz")).await.unwrap();
    assert_eq!(code, 503);
    assert!(body.contains("a state write has not returned"), "{body}");
    assert_eq!(stalled().await, 1.0);
    let status = get(&format!("{base}/status")).await.unwrap().1;
    let status: serde_json::Value = serde_json::from_str(&status).unwrap();
    assert!(status["state_write_stalled_since"].is_number(), "{status}");
    assert!(
        sb.mdma.polls().len() >= polls + 5,
        "polls go on while the write hangs"
    );
    assert!(sb
        .merod
        .calls()
        .iter()
        .all(|c| c.path != "/admin-api/tee/fleet-join"));
    std::fs::remove_file(&gate).unwrap();
    eventually("A confirmed once the write returned", LIMIT, || {
        sb.mdma.confirmed().contains(A)
    })
    .await;
    let t1 = std::time::Instant::now();
    while ready().await != Some(200) {
        assert!(t1.elapsed() < LIMIT, "/readyz ready again");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(stalled().await, 0.0);
    let status = get(&format!("{base}/status")).await.unwrap().1;
    assert!(!status.contains("state_write_stalled_since"), "{status}");
    let log = std::fs::read_to_string(sb.log_file()).unwrap();
    assert_eq!(
        log.matches("a state write has not returned").count(),
        1,
        "said once: {log}"
    );
    assert!(log.contains("the stalled state write ended"), "{log}");
}

/// A leave planned in a cycle starts only once the state write recording it ends (3 s here,
/// with every fsync taking 1.5 s). Meanwhile the status shows it under way (a pending leave
/// in flight, or leaving), never as nothing: a watcher of `/status` (an operator, a test)
/// sampling in that gap saw a withdrawn namespace that was neither pending nor leaving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leave_waiting_for_its_state_write_shows_in_the_status() {
    let sb = Sandbox::start(None).await.unwrap();
    for id in [A, B] {
        sb.merod.hold(id);
    }
    seed(&sb, &[A, B], &[A, B]);
    sb.mdma.set_reply(PollReply::assign([A, B]));
    let Some((_child, port, _shim)) = spawn_with_slow_fsync(&sb, REFERENCE) else {
        return;
    };
    eventually("two polls", LIMIT, || sb.mdma.polls().len() >= 2).await;
    sb.mdma.set_reply(PollReply::assign([B]));
    // Every sample from the first poll that withdrew A until merod saw the leave.
    let mut samples = 0;
    let sampling = async {
        while sb.merod.leaves(A) == 0 {
            let (_, body) = get(&format!("http://127.0.0.1:{port}/status"))
                .await
                .expect("/status answers");
            let live: serde_json::Value = serde_json::from_str(&body).unwrap();
            let has = |key: &str| {
                live[key]
                    .as_array()
                    .is_some_and(|l| l.iter().any(|v| v == A))
            };
            // The daemon has taken in a poll that withdrew A, and A is not left yet.
            if !has("desired") && has("admitted") && sb.merod.leaves(A) == 0 {
                samples += 1;
                assert!(
                    live["pending_leaves"].get(A).is_some() || has("leaving"),
                    "withdrawn, not left yet, and shown as neither pending nor leaving: {live}"
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    tokio::time::timeout(LIMIT, sampling).await.expect("A left");
    assert!(samples >= 10, "sampled the 3 s write {samples} times");
}
