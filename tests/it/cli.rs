//! The binary as an operator runs it: exit codes, messages, signals, secrets in output.

use std::time::Duration;

use fleet_sidecar::testing::mdma::PollReply;
use fleet_sidecar::testing::sandbox::{Sandbox, MRTD_HEX};

use crate::common::*;

fn run(args: &[&str]) -> std::process::Output {
    run_once(args, &[])
}

#[test]
fn version_and_help() {
    let out = run(&["--version"]);
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains(env!("CARGO_PKG_VERSION")));
    let out = run(&["--help"]);
    let help = String::from_utf8_lossy(&out.stdout);
    for word in ["run", "once", "mrtd", "--config"] {
        assert!(help.contains(word), "{help}");
    }
}

#[test]
fn a_missing_mdma_url_exits_78_with_a_clear_message() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("c.toml");
    std::fs::write(&cfg, "poll_interval = \"1s\"\n").unwrap();
    let out = run(&["--config", cfg.to_str().unwrap(), "run"]);
    assert_eq!(out.status.code(), Some(78));
    assert!(String::from_utf8_lossy(&out.stderr).contains("mdma_url is not set"));
    std::fs::write(&cfg, "mdma_url = \"http://mdma.example\"\n").unwrap();
    let out = run(&["--config", cfg.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(78));
    assert!(String::from_utf8_lossy(&out.stderr).contains("https"));
    let out = run(&["--config", "/nonexistent/fleet-sidecar.toml", "once"]);
    assert_eq!(out.status.code(), Some(78));
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent/fleet-sidecar.toml"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn once_exits_0_on_success_and_3_on_a_failed_poll() {
    let sb = Sandbox::start(None).await.unwrap();
    let cfg = sb.write_config("").unwrap();
    sb.mdma.set_reply(PollReply::assign([A]));
    let out =
        tokio::task::spawn_blocking(move || run(&["--config", cfg.to_str().unwrap(), "once"]))
            .await
            .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        load(&sb).confirmed.contains(&gid(A)),
        "once ran the join to its end"
    );

    sb.mdma.set_reply(PollReply::Status(503));
    let cfg = sb.write_config("").unwrap();
    let out =
        tokio::task::spawn_blocking(move || run(&["--config", cfg.to_str().unwrap(), "once"]))
            .await
            .unwrap();
    assert_eq!(out.status.code(), Some(3));
    assert!(String::from_utf8_lossy(&out.stderr).contains("HTTP 503"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_and_sigint_stop_cleanly_with_state_persisted() {
    use nix::sys::signal::Signal;

    for signal in [Signal::SIGTERM, Signal::SIGINT] {
        let sb = Sandbox::start(Some("NEVER-LOGGED-TOKEN-42")).await.unwrap();
        let cfg = sb.write_config("").unwrap();
        sb.mdma.set_reply(PollReply::assign([A]));
        let child = spawn_daemon(&cfg, true, &[]);
        eventually("A confirmed", Duration::from_secs(20), || {
            load(&sb).confirmed.contains(&gid(A))
        })
        .await;
        let out = child.stop_with(signal).await;
        assert_eq!(out.status.code(), Some(0), "{signal}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains("stopping"), "{stderr}");
        assert!(load(&sb).confirmed.contains(&gid(A)));
        // The token went to MDMA, and nowhere else.
        assert!(sb
            .mdma
            .polls()
            .iter()
            .all(|p| p.token.as_deref() == Some("NEVER-LOGGED-TOKEN-42")));
        let log = std::fs::read_to_string(sb.log_file()).unwrap();
        assert!(log.contains("confirmed to MDMA"), "{log}");
        for text in [
            &stderr[..],
            &log[..],
            &String::from_utf8_lossy(&out.stdout)[..],
        ] {
            assert!(
                !text.contains("NEVER-LOGGED-TOKEN-42"),
                "token leaked: {text}"
            );
        }
    }
}

fn tdreport_with(mrtd: &[u8; 48]) -> Vec<u8> {
    let mut r = vec![0u8; 1024];
    r[0] = 0x81;
    r[528..576].copy_from_slice(mrtd);
    r
}

#[test]
fn mrtd_subcommand_reads_and_parses_offline() {
    let dir = tempfile::tempdir().unwrap();
    let mrtd: [u8; 48] = core::array::from_fn(|i| i as u8);
    let report = dir.path().join("tdreport.bin");
    std::fs::write(&report, tdreport_with(&mrtd)).unwrap();
    let out = run(&["mrtd", "--tdreport", report.to_str().unwrap()]);
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).starts_with(MRTD_HEX));

    let out = run(&["mrtd", "--quote", report.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1), "a TDREPORT is not a quote");

    // The source chain from a config: sysfs attribute present.
    let attr = dir.path().join("mrtd");
    std::fs::write(&attr, mrtd).unwrap();
    let cfg = dir.path().join("c.toml");
    std::fs::write(
        &cfg,
        format!(
            "mdma_url = \"https://m\"\n[tdx]\nmrtd_path = \"{}\"\nlegacy_mrtd_path = \"{}/no\"\ndevice = \"{}/no\"\ntsm_report_dir = \"{}/no\"\n",
            attr.display(),
            dir.path().display(),
            dir.path().display(),
            dir.path().display()
        ),
    )
    .unwrap();
    let out = run(&["--config", cfg.to_str().unwrap(), "mrtd"]);
    assert!(out.status.success());
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains(MRTD_HEX) && stdout.contains("sysfs"),
        "{stdout}"
    );

    // No source works: each failure is listed, exit 1.
    std::fs::remove_file(&attr).unwrap();
    let out = run(&["--config", cfg.to_str().unwrap(), "mrtd"]);
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    for source in ["sysfs:", "sysfs-legacy:", "tdreport:", "quote:"] {
        assert!(stderr.contains(source), "{stderr}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failure_repeated_every_poll_is_logged_once_and_its_recovery_once() {
    let sb = Sandbox::start(None).await.unwrap();
    sb.mdma.set_reply(PollReply::Status(503));
    // max_backoff = poll_interval: failed polls keep the 1 s cadence.
    let cfg = sb.write_config("max_backoff = \"1s\"").unwrap();
    let child = spawn_daemon(&cfg, false, &[]);
    assert!(sb.mdma.wait_for_polls(6, Duration::from_secs(20)).await);
    sb.mdma.set_reply(PollReply::assign([A]));
    eventually("A confirmed", Duration::from_secs(20), || {
        load(&sb).confirmed.contains(&gid(A))
    })
    .await;
    child.stop().await;
    let log = std::fs::read_to_string(sb.log_file()).unwrap();
    let failures = sb.mdma.polls().iter().filter(|p| p.status == 503).count();
    assert!(failures >= 6, "{failures}");
    assert_eq!(log.matches("poll failed").count(), 1, "{log}");
    assert_eq!(log.matches("poll succeeded again").count(), 1, "{log}");
    assert!(log.contains(&format!("failures={failures}")), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unwritable_state_directory_stops_before_any_merod_call() {
    let sb = Sandbox::start(None).await.unwrap();
    sb.mdma.set_reply(PollReply::assign([A]));
    let blocker = sb.dir().join("blocker");
    std::fs::write(&blocker, "a file, not a directory").unwrap();
    let text = sb.config_text("").replace(
        &format!("state_file = \"{}\"", sb.state_file().display()),
        &format!(
            "state_file = \"{}/fleet-confirmed.json\"",
            blocker.display()
        ),
    );
    let cfg = sb.dir().join("blocked.toml");
    std::fs::write(&cfg, text).unwrap();
    let out =
        tokio::task::spawn_blocking(move || run(&["--config", cfg.to_str().unwrap(), "once"]))
            .await
            .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("blocker/fleet-confirmed.json"), "{stderr}");
    assert!(
        sb.merod.joins(A) == 0 && sb.mdma.polls().is_empty(),
        "acted before checking"
    );
}

#[test]
fn command_line_misuse_is_refused() {
    let out = run(&["--dry-run", "status"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--dry-run goes with run or once"));
    let out = run(&["--config", "/nonexistent/fleet-sidecar.toml", "mrtd"]);
    assert_eq!(
        out.status.code(),
        Some(78),
        "an explicit config path must exist"
    );
    let dir = tempfile::tempdir().unwrap();
    let long = dir.path().join("long.bin");
    let mut report = tdreport_with(&[9u8; 48]);
    report.push(0);
    std::fs::write(&long, &report).unwrap();
    let out = run(&["mrtd", "--tdreport", long.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr)
        .contains("saved tdreport is 1025 bytes, expected exactly 1024"));
    let out = run(&["mrtd", "--quote", "/dev/zero"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("more than 1048576 bytes"));
}
