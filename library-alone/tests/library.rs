//! The library with default features off, as an admin tool depends on it: the pieces a tool
//! uses work without the daemon's dependencies.

use std::time::{Duration, Instant};

use fleet_sidecar::{
    merod::MerodOp, mrtd::parse_sysfs, MerodClient, Repair, StateFile, StateStore, ToolConfig,
};

const A: &str = "38069a4cc4285c4245c84587ac60084ba53502a8b91c9b108bca40f10ec4d3df";
const D: &str = "d00dd00dd00dd00dd00dd00dd00dd00dd00dd00dd00dd00dd00dd00dd00dd00d";

#[test]
fn tool_config_and_state_report() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state.json");
    let config = dir.path().join("tool.toml");
    std::fs::write(
        &config,
        format!(
            "state_file = \"{}\"\n[merod]\nnode = \"n1\"\n",
            state.display()
        ),
    )
    .unwrap();
    let cfg = ToolConfig::load(&config).unwrap();
    assert_eq!(cfg.state_file, state);

    let store = StateStore::new(&cfg.state_file);
    assert_eq!(store.inspect().unwrap(), StateFile::Missing);
    std::fs::write(
        &state,
        format!("{{\"version\":2,\"admitted\":[\"{A}\"],\"confirmed\":[\"{D}\"]}}"),
    )
    .unwrap();
    let StateFile::Present(report) = store.inspect().unwrap() else {
        panic!("present")
    };
    assert_eq!(
        report.repairs,
        vec![Repair::ConfirmedNotAdmitted(D.parse().unwrap())]
    );
}

#[test]
fn mrtd_parsers() {
    let mrtd = parse_sysfs(&[7u8; 48]).unwrap();
    assert_eq!(mrtd.to_hex(), "07".repeat(48));
}

/// A merod that accepts connections and never answers: the client's own deadline ends it.
#[tokio::test]
async fn merod_client_deadline_without_the_daemon() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let _server = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((conn, _)) = listener.accept().await {
            held.push(conn);
        }
    });
    let merod = MerodClient::builder(format!("http://{addr}/").parse().unwrap())
        .check_timeout(Duration::from_millis(200))
        .build()
        .unwrap();
    let started = Instant::now();
    let err = merod.list_namespaces().await.unwrap_err();
    assert!(err.is_timeout(), "{err}");
    assert_eq!(err.op(), MerodOp::ListNamespaces);
    assert!(started.elapsed() < Duration::from_secs(10));
}
