//! packaging/monitoring/: every metric the alert rules and the dashboard use is one a
//! running daemon exports, and the rules pass `promtool check rules` when promtool is here.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::Duration;

use fleet_sidecar::testing::mdma::PollReply;
use fleet_sidecar::testing::sandbox::Sandbox;

use crate::common::*;

const RULES: &str = "packaging/monitoring/fleet-sidecar.rules.yml";
const DASHBOARD: &str = "packaging/monitoring/fleet-sidecar.dashboard.json";

fn file(path: &str) -> String {
    std::fs::read_to_string(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(path))
        .expect("monitoring file")
}

/// Every `fleet_sidecar_*` metric name in `text` (a PromQL-bearing file).
fn used_names(text: &str) -> BTreeSet<String> {
    let word = |c: char| c.is_ascii_alphanumeric() || c == '_';
    text.match_indices("fleet_sidecar_")
        .filter(|(i, _)| !text[..*i].ends_with(word))
        .map(|(i, _)| {
            text[i..]
                .split(|c| !word(c))
                .next()
                .unwrap_or("")
                .to_owned()
        })
        .collect()
}

/// The series names in an exposition-format `/metrics` body.
fn exported_names(metrics: &str) -> BTreeSet<String> {
    metrics
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| l.split(['{', ' ']).next())
        .map(str::to_owned)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_metric_the_rules_and_the_dashboard_use_is_exported() {
    let sb = Sandbox::start(None).await.unwrap();
    sb.mdma.set_reply(PollReply::assign([A]));
    let d = start(&sb, "");
    let (addr, stop) = d.serve_status(Duration::from_secs(30)).await;
    eventually("A confirmed", Duration::from_secs(20), || {
        load(&sb).confirmed.contains(&gid(A))
    })
    .await;
    let metrics = reqwest::get(format!("http://{addr}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    stop.cancel();
    d.stop().await;
    let exported = exported_names(&metrics);
    let dashboard: serde_json::Value =
        serde_json::from_str(&file(DASHBOARD)).expect("the dashboard is JSON");
    let panels = dashboard["panels"].as_array().expect("panels");
    assert!(panels.len() >= 6, "{} panels", panels.len());
    let mut checked = 0;
    for (path, text) in [(RULES, file(RULES)), (DASHBOARD, file(DASHBOARD))] {
        let used = used_names(&text);
        assert!(!used.is_empty(), "{path} uses no metric");
        for name in &used {
            assert!(
                exported.contains(name),
                "{path} uses {name}, which /metrics does not export:\n{metrics}"
            );
            checked += 1;
        }
    }
    assert!(checked >= 10);
}

#[test]
fn the_rules_cover_every_alert_the_operators_asked_for() {
    let rules = file(RULES);
    for alert in [
        "FleetSidecarPollsFailing",
        "FleetSidecarNotReady",
        "FleetSidecarMassWithdrawalHold",
        "FleetSidecarLeavesFailing",
        "FleetSidecarJoinsNotAdmitted",
        "FleetSidecarMrtdUnavailable",
        "FleetSidecarStateWriteFailing",
        "FleetSidecarStateWriteStalled",
        "FleetSidecarHeldUnknown",
        "FleetSidecarHeldDrift",
    ] {
        assert!(rules.contains(&format!("alert: {alert}\n")), "{alert}");
    }
}

#[test]
fn the_rules_pass_promtool() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(RULES);
    match std::process::Command::new("promtool")
        .args(["check", "rules"])
        .arg(&path)
        .output()
    {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            eprintln!("SKIP the_rules_pass_promtool: promtool is not installed (apt-get install prometheus)");
        }
        Err(e) => panic!("cannot run promtool: {e}"),
        Ok(out) => assert!(
            out.status.success(),
            "promtool check rules failed:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    }
}
