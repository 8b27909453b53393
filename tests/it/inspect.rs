//! The example admin tool (`examples/fleet-inspect.rs`), built only on the public API, run
//! in-process against the merod emulator.

use std::os::unix::fs::PermissionsExt;

use fleet_sidecar::testing::sandbox::Sandbox;

use crate::common::{set, A, B, C, D};

#[allow(dead_code)] // its `main` is the example's, not the test's
#[path = "../../examples/fleet-inspect.rs"]
mod fleet_inspect;

#[allow(dead_code)] // its `main` is the example's, not the test's
#[path = "../../examples/fleet-membership.rs"]
mod fleet_membership;

/// A tool's config in the sandbox: the state file and merod's home, nothing of MDMA
/// (`extra`: more top-level keys).
fn tool_config(sb: &Sandbox, state_file: &std::path::Path, extra: &str) -> std::path::PathBuf {
    let config = sb.dir().join("tool.toml");
    std::fs::write(
        &config,
        format!(
            "state_file = \"{}\"\n{extra}[merod]\nhome = \"{}\"\n",
            state_file.display(),
            sb.dir().join("calimero").display()
        ),
    )
    .unwrap();
    config
}

/// A sandbox whose merod holds `held`, with a state file `state.json` holding `state`.
async fn sandbox_with(held: &[&str], state: String) -> (Sandbox, std::path::PathBuf) {
    let sb = Sandbox::start(None).await.unwrap();
    for id in held {
        sb.merod.hold(id);
    }
    let state_file = sb.dir().join("state.json");
    std::fs::write(&state_file, state).unwrap();
    (sb, state_file)
}

/// A daemon's status listener serving `telemetry` on a free loopback port, until the token
/// is cancelled.
async fn status_listener(
    telemetry: &std::sync::Arc<fleet_sidecar::daemon::Telemetry>,
) -> (std::net::SocketAddr, tokio_util::sync::CancellationToken) {
    let stop = tokio_util::sync::CancellationToken::new();
    let addr = fleet_sidecar::daemon::serve_status(
        "127.0.0.1:0".parse().unwrap(),
        std::sync::Arc::clone(telemetry),
        std::time::Duration::from_secs(30),
        stop.clone(),
    )
    .await
    .unwrap();
    (addr, stop)
}

#[tokio::test]
async fn drift_between_state_and_merod_with_a_tool_only_config() {
    // As written: C admitted but gone from merod; D confirmed but never admitted (the one
    // drift that must never happen); B held by merod but unknown to the state.
    let (sb, state_file) = sandbox_with(
        &[A, B],
        format!("{{\"version\":2,\"admitted\":[\"{A}\",\"{C}\"],\"confirmed\":[\"{A}\",\"{D}\"]}}"),
    )
    .await;
    // A token file the daemon would refuse (readable by all): the tool never opens it.
    let token = sb.dir().join("token");
    std::fs::write(&token, "NEVER-LOGGED-TOKEN-inspect\n").unwrap();
    std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o644)).unwrap();
    let config = tool_config(
        &sb,
        &state_file,
        &format!("fleet_token_file = \"{}\"\n", token.display()),
    );

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

    use fleet_sidecar::daemon::Telemetry;
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
    let config = tool_config(&sb, &state_file, "");
    // The daemon's latest poll assigns C; D is in no set: the one orphan.
    let telemetry = Arc::new(Telemetry::new());
    let c: GroupId = C.parse().unwrap();
    telemetry.update(|st| st.desired = vec![c]);
    let (addr, stop) = status_listener(&telemetry).await;
    // Before the daemon's first good poll its empty assignments say nothing: no orphans
    // are named, the tool says why.
    let err = fleet_inspect::inspect(&config, Some(&addr.to_string()))
        .await
        .expect_err("no good poll yet");
    assert!(err.to_string().contains("no successful poll yet"), "{err}");
    telemetry.update(|st| st.last_ok_poll_at = Some(fleet_sidecar::daemon::unix_now()));

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

#[tokio::test]
async fn membership_side_by_side_says_unknown_for_a_side_it_could_not_read() {
    use std::sync::Arc;

    use fleet_sidecar::daemon::{unix_now, Telemetry};
    use fleet_sidecar::GroupId;

    let (sb, state_file) = sandbox_with(
        &[A, B],
        format!("{{\"version\":2,\"admitted\":[\"{A}\",\"{C}\"],\"confirmed\":[\"{A}\"]}}"),
    )
    .await;
    let config = tool_config(&sb, &state_file, "");
    let row = |id: &str, merod, state, mdma| fleet_membership::Row {
        id: id.parse().unwrap(),
        merod,
        state,
        mdma,
    };

    // Without --status MDMA's side is unknown, never "not assigned".
    let m = fleet_membership::membership(&config, None).await.unwrap();
    assert!(m.mdma.says.is_none() && m.mdma.unknown.is_some());
    assert_eq!(
        m.namespaces,
        vec![
            row(A, "held", "confirmed", "unknown"),
            row(B, "held", "none", "unknown"),
            row(C, "not held", "admitted", "unknown"),
        ]
    );

    // The daemon's latest good poll assigns A and D and retains B.
    let telemetry = Arc::new(Telemetry::new());
    let (addr, stop) = status_listener(&telemetry).await;
    let ids = |xs: &[&str]| {
        xs.iter()
            .map(|x| x.parse().unwrap())
            .collect::<Vec<GroupId>>()
    };
    telemetry.update(|st| {
        st.desired = ids(&[A, D]);
        st.retain = ids(&[B]);
    });
    let before_poll = fleet_membership::membership(&config, Some(addr))
        .await
        .unwrap();
    assert!(
        before_poll.mdma.says.is_none(),
        "no good poll yet: its empty sets say nothing"
    );
    telemetry.update(|st| st.last_ok_poll_at = Some(unix_now()));
    let m = fleet_membership::membership(&config, Some(addr))
        .await
        .unwrap();
    stop.cancel();
    assert_eq!(
        m.namespaces,
        vec![
            row(A, "held", "confirmed", "assigned"),
            row(B, "held", "none", "retained"),
            row(C, "not held", "admitted", "not assigned"),
            row(D, "not held", "none", "assigned"),
        ]
    );
    let json = serde_json::to_value(&m).unwrap();
    assert_eq!(json["namespaces"][3]["mdma"], "assigned");
    assert_eq!(json["state"]["says"]["present"], true);

    // merod unreachable: its side is unknown, the others still read.
    sb.merod.shutdown();
    let m = fleet_membership::membership(&config, None).await.unwrap();
    assert!(m.merod.says.is_none() && m.merod.unknown.is_some());
    assert_eq!(m.namespaces[0], row(A, "unknown", "confirmed", "unknown"));
}
