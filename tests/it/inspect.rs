//! The example admin tool (`examples/fleet-inspect.rs`), built only on the public API, run
//! in-process against the merod emulator.

use std::os::unix::fs::PermissionsExt;

use fleet_sidecar::testing::sandbox::Sandbox;

use crate::common::{set, A, B, C, D};

#[allow(dead_code)] // its `main` is the example's, not the test's
#[path = "../../examples/fleet-inspect.rs"]
mod fleet_inspect;

#[tokio::test]
async fn drift_between_state_and_merod_with_a_tool_only_config() {
    let sb = Sandbox::start(None).await.unwrap();
    sb.merod.hold(A);
    sb.merod.hold(B);
    // As written: C admitted but gone from merod; D confirmed but never admitted (the one
    // drift that must never happen); B held by merod but unknown to the state.
    let state_file = sb.dir().join("state.json");
    std::fs::write(
        &state_file,
        format!("{{\"version\":2,\"admitted\":[\"{A}\",\"{C}\"],\"confirmed\":[\"{A}\",\"{D}\"]}}"),
    )
    .unwrap();
    // A token file the daemon would refuse (readable by all): the tool never opens it.
    let token = sb.dir().join("token");
    std::fs::write(&token, "NEVER-LOGGED-TOKEN-inspect\n").unwrap();
    std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o644)).unwrap();
    let config = sb.dir().join("tool.toml");
    std::fs::write(
        &config,
        format!(
            "state_file = \"{}\"\nfleet_token_file = \"{}\"\n[merod]\nhome = \"{}\"\n",
            state_file.display(),
            token.display(),
            sb.dir().join("calimero").display()
        ),
    )
    .unwrap();

    let drift = fleet_inspect::inspect(&config, None)
        .await
        .expect("the tool runs");
    assert!(drift.state_file_present);
    assert_eq!(drift.in_sync, set(&[A]));
    assert_eq!(drift.held_not_in_state, set(&[B]));
    assert_eq!(
        drift.admitted_not_held,
        set(&[C, D]),
        "D is admitted once repaired"
    );
    assert_eq!(drift.confirmed_not_admitted, set(&[D]));
    assert_eq!(drift.repairs.len(), 1, "{:?}", drift.repairs);
    assert!(drift.found());

    let text = fleet_inspect::render_text(&drift);
    assert!(
        text.contains(&format!("IMPOSSIBLE: confirmed, not admitted  {D}")),
        "{text}"
    );
    assert!(
        text.contains(&format!("held by merod, not in state          {B}")),
        "{text}"
    );
    assert!(text.contains("repaired on load"), "{text}");
    let json: serde_json::Value = serde_json::to_value(&drift).unwrap();
    assert_eq!(json["confirmed_not_admitted"], serde_json::json!([D]));

    // MDMA is never asked: a should-join from a tool would count as the node's heartbeat.
    assert!(sb.mdma.polls().is_empty() && sb.mdma.confirms().is_empty());

    // Version 3: B and C joining (fleet-join sent, admission not recorded). B, which merod
    // holds, is no longer drift of the "held, not in state" kind; neither is shown as drift.
    std::fs::write(
        &state_file,
        format!("{{\"version\":3,\"admitted\":[\"{A}\"],\"confirmed\":[\"{A}\"],\"joining\":[\"{B}\",\"{C}\"]}}"),
    )
    .unwrap();
    let drift = fleet_inspect::inspect(&config, None).await.unwrap();
    assert!(drift.held_not_in_state.is_empty(), "{drift:?}");
    assert_eq!(drift.joining_held, set(&[B]));
    assert_eq!(drift.joining_not_held, set(&[C]));
    assert!(!drift.found(), "{drift:?}");
    let text = fleet_inspect::render_text(&drift);
    assert!(
        text.contains(&format!("joining, held by merod               {B}")),
        "{text}"
    );

    // A missing state file is said, not read silently as "nothing held".
    std::fs::remove_file(&state_file).unwrap();
    let drift = fleet_inspect::inspect(&config, None).await.unwrap();
    assert!(!drift.state_file_present);
    assert_eq!(drift.held_not_in_state, set(&[A, B]));
    assert!(fleet_inspect::render_text(&drift).contains("(missing"));
}

#[tokio::test]
async fn orphans_by_the_daemons_latest_poll_and_the_bash_sidecars_files() {
    use std::sync::Arc;
    use std::time::Duration;

    use fleet_sidecar::daemon::{serve_status, Telemetry};
    use fleet_sidecar::GroupId;

    let sb = Sandbox::start(None).await.unwrap();
    for id in [A, B, C, D] {
        sb.merod.hold(id);
    }
    // The Bash sidecar's files: A confirmed, B admitted (unconfirmed).
    let state_file = sb.dir().join("fleet-confirmed.json");
    std::fs::write(&state_file, format!("[\"{A}\"]")).unwrap();
    std::fs::write(
        sb.dir().join("fleet-admitted.json"),
        format!("[\"{A}\",\"{B}\"]"),
    )
    .unwrap();
    let config = sb.dir().join("tool.toml");
    std::fs::write(
        &config,
        format!(
            "state_file = \"{}\"\n[merod]\nhome = \"{}\"\n",
            state_file.display(),
            sb.dir().join("calimero").display()
        ),
    )
    .unwrap();
    // The daemon's latest poll assigns C; D is in no set: the one orphan.
    let telemetry = Arc::new(Telemetry::new());
    let c: GroupId = C.parse().unwrap();
    telemetry.update(|st| st.desired = vec![c]);
    let stop = tokio_util::sync::CancellationToken::new();
    let addr = serve_status(
        "127.0.0.1:0".parse().unwrap(),
        Arc::clone(&telemetry),
        Duration::from_secs(30),
        stop.clone(),
    )
    .await
    .unwrap();

    let drift = fleet_inspect::inspect(&config, Some(&addr.to_string()))
        .await
        .expect("the tool runs");
    stop.cancel();
    assert_eq!(
        drift.in_sync,
        set(&[A, B]),
        "B imported from fleet-admitted.json"
    );
    assert_eq!(drift.held_not_in_state, set(&[C, D]));
    assert_eq!(drift.orphans, Some(set(&[D])));
    let imported = drift
        .bash_import
        .as_ref()
        .expect("the Bash files are reported");
    assert_eq!((imported.admitted, imported.timers), (2, 0));
    assert!(drift.found());
    let text = fleet_inspect::render_text(&drift);
    assert!(
        text.contains(&format!("ORPHAN: held, not assigned/retained  {D}")),
        "{text}"
    );
    assert!(
        text.contains("Bash sidecar's files imported: 2 admitted"),
        "{text}"
    );

    // Without --status nothing is called an orphan: assignments are unknown to a tool.
    let drift = fleet_inspect::inspect(&config, None).await.unwrap();
    assert_eq!(drift.orphans, None);
    // The state file was not written: the Bash format stays until the daemon writes.
    assert_eq!(
        std::fs::read_to_string(&state_file).unwrap(),
        format!("[\"{A}\"]")
    );
}
