//! Operating the daemon: systemd notify, health/readiness/metrics, status, dry run, JSON
//! logs, SIGHUP, and the token never in any output.

use std::time::{Duration, Instant};

use fleet_sidecar::testing::mdma::PollReply;
use fleet_sidecar::testing::sandbox::Sandbox;
use nix::sys::signal::Signal;

use crate::common::*;

const LIMIT: Duration = Duration::from_secs(20);
/// Every token the tests use contains this, so a run's whole output can be grepped for it
/// (`.ci/run` does).
const TOKEN: &str = "NEVER-LOGGED-TOKEN-7f3a";

async fn get(url: &str) -> (u16, String) {
    let resp = reqwest::Client::new()
        .get(url)
        .timeout(Duration::from_secs(5))
        .send()
        .await
        .unwrap();
    (resp.status().as_u16(), resp.text().await.unwrap())
}

/// Receives notify datagrams (one message per line) into `got` until `done` holds.
async fn read_until(
    socket: &tokio::net::UnixDatagram,
    got: &mut Vec<String>,
    what: &str,
    done: impl Fn(&[String]) -> bool,
) {
    let t = Instant::now();
    let mut buf = [0u8; 4096];
    while !done(got) {
        assert!(t.elapsed() < LIMIT, "no {what} in {got:?}");
        if let Ok(Ok(n)) =
            tokio::time::timeout(Duration::from_millis(200), socket.recv(&mut buf)).await
        {
            got.extend(
                String::from_utf8_lossy(&buf[..n])
                    .lines()
                    .map(str::to_owned),
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn systemd_gets_ready_status_watchdog_and_stopping() {
    let sb = Sandbox::start(None).await.unwrap();
    sb.merod.set_ready(false);
    sb.mdma.set_reply(PollReply::assign([A]));
    let cfg = sb.write_config("").unwrap();
    let socket_path = sb.dir().join("notify.sock");
    let socket = tokio::net::UnixDatagram::bind(&socket_path).unwrap();
    let mut child = spawn_daemon(
        &cfg,
        false,
        &[
            ("NOTIFY_SOCKET", socket_path.as_os_str()),
            ("WATCHDOG_USEC", std::ffi::OsStr::new("2000000")),
        ],
    );
    let mut got: Vec<String> = Vec::new();
    // The status and the pinger's datagrams come from two tasks, in no fixed order: wait
    // for each on its own. Two pings (a second apart) prove the wait keeps feeding the
    // watchdog, not only the pinger's first look.
    read_until(&socket, &mut got, "waiting status", |g| {
        g.iter().any(|m| m.starts_with("STATUS=waiting for merod"))
    })
    .await;
    read_until(&socket, &mut got, "pings during the readiness wait", |g| {
        g.iter().filter(|m| *m == "WATCHDOG=1").count() >= 2
    })
    .await;
    assert!(
        !got.iter().any(|m| m == "READY=1"),
        "not ready before merod answers: {got:?}"
    );
    // ...but the heartbeat does not wait for merod: MDMA is polled meanwhile.
    eventually("polls while merod is down", LIMIT, || {
        !sb.mdma.polls().is_empty()
    })
    .await;
    sb.merod.set_ready(true);
    read_until(&socket, &mut got, "READY=1", |g| {
        g.iter().any(|m| m == "READY=1")
    })
    .await;
    read_until(&socket, &mut got, "a status after the confirm", |g| {
        g.iter()
            .any(|m| m.starts_with("STATUS=1 confirmed, last poll ok"))
    })
    .await;
    let watchdogs = got.iter().filter(|m| *m == "WATCHDOG=1").count();
    read_until(&socket, &mut got, "watchdog pings every second", |g| {
        g.iter().filter(|m| *m == "WATCHDOG=1").count() >= watchdogs + 2
    })
    .await;
    child.signal(Signal::SIGTERM);
    read_until(&socket, &mut got, "STOPPING=1", |g| {
        g.iter().any(|m| m == "STOPPING=1")
    })
    .await;
    assert_eq!(wait_exit(&mut child, LIMIT).await.code(), Some(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_goes_unready_during_an_mdma_outage_and_back() {
    let sb = Sandbox::start(None).await.unwrap();
    sb.mdma.set_reply(PollReply::assign([A]));
    let d = start(&sb, "ready_max_poll_age = \"2s\"\nmax_backoff = \"1s\"");
    let (addr, stop) = d.serve_status(Duration::from_secs(2)).await;
    let base = format!("http://{addr}");
    assert_eq!(get(&format!("{base}/healthz")).await.0, 200);
    let t = Instant::now();
    loop {
        if get(&format!("{base}/readyz")).await.0 == 200 {
            break;
        }
        assert!(t.elapsed() < LIMIT, "never ready");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    sb.mdma.set_reply(PollReply::Status(503));
    let t = Instant::now();
    let body = loop {
        let (code, body) = get(&format!("{base}/readyz")).await;
        if code == 503 {
            break body;
        }
        assert!(t.elapsed() < LIMIT, "still ready during the outage");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(body.contains("HTTP 503"), "{body}");
    assert_eq!(
        get(&format!("{base}/healthz")).await.0,
        200,
        "alive all along"
    );
    sb.mdma.set_reply(PollReply::assign([A]));
    let t = Instant::now();
    while get(&format!("{base}/readyz")).await.0 != 200 {
        assert!(t.elapsed() < LIMIT, "not ready again after the outage");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    stop.cancel();
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_after_a_scripted_scenario() {
    let sb = Sandbox::start(None).await.unwrap();
    sb.mdma.fail_next_confirms(B, 1);
    sb.mdma.set_reply(PollReply::assign([A, B]));
    let d = start(&sb, REFERENCE);
    let (addr, stop) = d.serve_status(Duration::from_secs(30)).await;
    eventually("A, B confirmed", LIMIT, || {
        load(&sb).confirmed == set(&[A, B])
    })
    .await;
    let polls = sb.mdma.polls().len();
    sb.mdma
        .queue_replies([PollReply::Status(500), PollReply::RawBody("x".into())]);
    sb.mdma.set_reply(PollReply::assign([A]));
    assert!(sb.mdma.wait_for_polls(polls + 2, LIMIT).await);
    eventually("B left", LIMIT, || load(&sb).admitted == set(&[A])).await;
    let (code, text) = get(&format!("http://{addr}/metrics")).await;
    assert_eq!(code, 200);
    let ok_polls = sb.mdma.polls().iter().filter(|p| p.status == 200).count() as f64;
    assert!(
        metric(&text, "fleet_sidecar_polls_total{outcome=\"ok\"}") >= ok_polls - 1.0,
        "{text}"
    );
    assert_eq!(
        metric(&text, "fleet_sidecar_polls_total{outcome=\"status\"}"),
        1.0,
        "{text}"
    );
    assert_eq!(
        metric(&text, "fleet_sidecar_polls_total{outcome=\"malformed\"}"),
        1.0,
        "{text}"
    );
    // B's confirm failed once: it is retried as a confirm alone, merod holding B (no new
    // attested fleet-join).
    assert_eq!(
        metric(&text, "fleet_sidecar_joins_total{outcome=\"admitted\"}"),
        2.0,
        "{text}"
    );
    assert_eq!(
        metric(&text, "fleet_sidecar_confirms_total{outcome=\"error\"}"),
        1.0,
        "{text}"
    );
    assert_eq!(
        metric(&text, "fleet_sidecar_confirms_total{outcome=\"ok\"}"),
        2.0,
        "{text}"
    );
    assert_eq!(
        metric(&text, "fleet_sidecar_leaves_total{outcome=\"left\"}"),
        1.0,
        "{text}"
    );
    assert_eq!(
        metric(&text, "fleet_sidecar_namespaces{set=\"confirmed\"}"),
        1.0,
        "{text}"
    );
    assert_eq!(
        metric(&text, "fleet_sidecar_namespaces{set=\"admitted\"}"),
        1.0,
        "{text}"
    );
    assert_eq!(
        metric(&text, "fleet_sidecar_namespaces{set=\"desired\"}"),
        1.0,
        "{text}"
    );
    assert_eq!(
        metric(&text, "fleet_sidecar_mrtd_source{source=\"sysfs\"}"),
        1.0,
        "{text}"
    );
    assert_eq!(
        metric(
            &text,
            "fleet_sidecar_call_duration_seconds_count{call=\"leave\"}"
        ),
        1.0
    );
    assert!(
        metric(
            &text,
            "fleet_sidecar_call_duration_seconds_count{call=\"fleet_join\"}"
        ) >= 2.0
    );
    assert!(
        metric(
            &text,
            "fleet_sidecar_last_successful_poll_timestamp_seconds"
        ) > 1.7e9
    );
    let (_, live) = get(&format!("http://{addr}/status")).await;
    let live: serde_json::Value = serde_json::from_str(&live).unwrap();
    assert_eq!(live["phase"], "running");
    assert_eq!(live["confirmed"], serde_json::json!([A]));
    stop.cancel();
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_status_command_shows_state_and_live_status() {
    let sb = Sandbox::start(None).await.unwrap();
    sb.merod.hold(B);
    seed(&sb, &[B], &[]);
    sb.mdma.set_reply(PollReply::assign([A]));
    // A listener on a free port, then the daemon on it (the binary, as operators run it).
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let cfg = sb
        .write_config(&format!(
            "status_listen = \"127.0.0.1:{port}\"\nleave_after_polls = 1000\nleave_grace = \"0s\""
        ))
        .unwrap();
    let child = spawn_daemon(&cfg, false, &[]);
    eventually("A confirmed", LIMIT, || {
        load(&sb).confirmed.contains(&gid(A))
    })
    .await;
    let c = cfg.clone();
    let out = tokio::task::spawn_blocking(move || {
        run_once(&["--config", c.to_str().unwrap(), "status"], &[])
    })
    .await
    .unwrap();
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains(&format!("{A}  confirmed")), "{text}");
    assert!(
        text.contains(&format!("{B}  admitted, not confirmed")),
        "{text}"
    );
    assert!(text.contains("pending leave (live):"), "{text}");
    assert!(
        text.contains("of the 1000 successful polls needed"),
        "{text}"
    );
    assert!(text.contains(&format!("{B}  absent ")), "{text}");
    assert!(text.contains("live: running: 1 confirmed"), "{text}");
    let c = cfg.clone();
    let out = tokio::task::spawn_blocking(move || {
        run_once(&["--config", c.to_str().unwrap(), "status", "--json"], &[])
    })
    .await
    .unwrap();
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["state"]["confirmed"], serde_json::json!([A]));
    assert_eq!(report["live"]["phase"], "running");
    assert!(report["live"]["pending_leaves"][B].is_string(), "{report}");
    child.stop().await;
    // Daemon stopped: the state file alone, and a clear word about the live part.
    let out = run_once(&["--config", cfg.to_str().unwrap(), "status"], &[]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success());
    assert!(
        text.contains("pending leave (from the state file)"),
        "{text}"
    );
    assert!(
        text.contains(&format!("live: GET http://127.0.0.1:{port}/status")),
        "{text}"
    );
    assert!(text.contains("is the daemon running?"), "{text}");
    // A corrupt state file: exit 1, the error shown.
    std::fs::write(sb.state_file(), "{").unwrap();
    let out = run_once(&["--config", cfg.to_str().unwrap(), "status"], &[]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stdout).contains("corrupt"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dry_run_polls_and_logs_the_plan_without_touching_merod() {
    let sb = Sandbox::start(None).await.unwrap();
    sb.merod.hold(B);
    sb.merod.hold(C);
    // C stays: withdrawing everything held would be a mass withdrawal, held.
    let before = seed(&sb, &[B, C], &[B, C]);
    sb.mdma.set_reply(PollReply::assign([A, C]));
    let cfg = sb.write_config(REFERENCE).unwrap();
    let out = tokio::task::spawn_blocking(move || {
        run_once(
            &["--config", cfg.to_str().unwrap(), "--dry-run", "once"],
            &[],
        )
    })
    .await
    .unwrap();
    assert!(out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("dry run: would join") && stderr.contains(A),
        "{stderr}"
    );
    assert!(
        stderr.contains("dry run: would leave") && stderr.contains(B),
        "{stderr}"
    );
    assert!(
        sb.merod.calls().is_empty(),
        "merod was called: {:?}",
        sb.merod.calls()
    );
    assert!(sb.mdma.confirms().is_empty());
    assert_eq!(sb.mdma.polls().len(), 1);
    assert_eq!(
        std::fs::read(sb.state_file()).unwrap(),
        before,
        "state untouched"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_logs_sighup_reopen_and_no_token_anywhere() {
    let sb = Sandbox::start(Some(TOKEN)).await.unwrap();
    sb.mdma.fail_next_confirms(A, 1);
    sb.mdma.set_reply(PollReply::assign([A]));
    let cfg = sb.write_config("log_format = \"json\"").unwrap();
    let child = spawn_daemon(&cfg, true, &[("RUST_LOG", std::ffi::OsStr::new("debug"))]);
    eventually("A confirmed", LIMIT, || {
        load(&sb).confirmed.contains(&gid(A))
    })
    .await;
    // logrotate: move the file away, SIGHUP, the daemon writes a new one.
    let rotated = sb.dir().join("fleet-sidecar.log.1");
    std::fs::rename(sb.log_file(), &rotated).unwrap();
    child.signal(Signal::SIGHUP);
    eventually("a new log file", LIMIT, || sb.log_file().exists()).await;
    sb.mdma.set_reply(PollReply::Status(500));
    eventually("a line in the new file", LIMIT, || {
        std::fs::read_to_string(sb.log_file()).is_ok_and(|t| t.contains("poll failed"))
    })
    .await;
    let out = child.stop().await;
    assert_eq!(out.status.code(), Some(0));
    let old = std::fs::read_to_string(&rotated).unwrap();
    let new = std::fs::read_to_string(sb.log_file()).unwrap();
    for line in old.lines().chain(new.lines()) {
        let v: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"));
        assert!(v["fields"]["message"].is_string(), "{line}");
    }
    assert!(
        old.contains("confirm failed") && old.contains("confirmed to MDMA"),
        "{old}"
    );
    assert!(new.contains("log file reopened") || old.contains("log file reopened"));
    let stderr = String::from_utf8_lossy(&out.stderr);
    for text in [
        &old[..],
        &new[..],
        &stderr[..],
        &String::from_utf8_lossy(&out.stdout)[..],
    ] {
        assert!(!text.contains(TOKEN), "the token leaked");
        assert!(!text.contains("sandbox-keypair"), "merod's keypair leaked");
    }
    assert!(sb
        .mdma
        .polls()
        .iter()
        .all(|p| p.token.as_deref() == Some(TOKEN)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_file_must_be_private() {
    use std::os::unix::fs::PermissionsExt;
    let sb = Sandbox::start(None).await.unwrap();
    let file = sb.dir().join("token");
    std::fs::write(&file, format!("{TOKEN}\n")).unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
    let cfg = sb
        .write_config(&format!("fleet_token_file = \"{}\"", file.display()))
        .unwrap();
    let out = run_once(&["--config", cfg.to_str().unwrap(), "once"], &[]);
    assert_eq!(out.status.code(), Some(78));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("group or others") && stderr.contains("chmod 600"),
        "{stderr}"
    );
    assert!(!stderr.contains(TOKEN));
}
