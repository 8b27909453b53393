//! Switching a node from the fleet's Bash sidecar (its files in place) and the namespaces
//! merod holds that nothing explains (orphans), under tokio's paused clock with in-memory
//! MDMA and merod.

use std::time::Duration;

use fleet_sidecar::StateStore;

use crate::common::*;
use crate::fakes::Fake;

/// Sleeps until `fake` has been polled `n` times in all, then 10 ms more (every fake
/// answers at once, so that cycle is persisted by then).
async fn until_polls(fake: &Fake, n: usize) {
    while fake.with(|w| w.polls.len()) < n {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(10)).await;
}

/// Lays the Bash sidecar's files out where `node`'s state file is: the confirmed set as
/// the state file (a bare array) and `fleet-admitted.json` beside it.
fn bash_files(node: &NodeDir, confirmed: &[&str], admitted: &[&str]) {
    let array = |ids: &[&str]| serde_json::to_vec(ids).unwrap();
    std::fs::write(node.state_file(), array(confirmed)).unwrap();
    std::fs::write(node.dir.path().join("fleet-admitted.json"), array(admitted)).unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_node_switched_from_the_bash_files_leaves_what_mdma_withdrew_and_joins_nothing_it_held() {
    let node = NodeDir::new();
    // The Bash sidecar confirmed A and admitted B without confirming it; MDMA withdrew B
    // since. merod holds both.
    bash_files(&node, &[A], &[A, B]);
    let admitted_file = std::fs::read(node.dir.path().join("fleet-admitted.json")).unwrap();
    let fake = Fake::default();
    fake.with(|w| {
        w.held = set(&[A, B]);
        w.assignments = set(&[A]);
    });
    // No timer in the Bash files: a grace would start at the switch (none here, for brevity).
    let running = fake.run(node.config("leave_grace = \"0s\""));
    until_polls(&fake, 5).await;
    running.stop().await;
    fake.with(|w| {
        assert!(
            w.joins.is_empty(),
            "nothing it held is joined: {:?}",
            w.joins
        );
        let left: Vec<_> = w.leaves.iter().map(|(id, _)| *id).collect();
        assert_eq!(
            left,
            vec![gid(B)],
            "the withdrawn admitted-unconfirmed one is left"
        );
        assert!(w.violations.is_empty(), "{:?}", w.violations);
        assert_eq!(w.held, set(&[A]));
    });
    // Written in this sidecar's format; the Bash sidecar's own file is left as it was.
    let text = std::fs::read_to_string(node.state_file()).unwrap();
    assert!(text.contains("\"version\": 4"), "{text}");
    let state = node.state();
    assert_eq!(state.admitted, set(&[A]));
    assert_eq!(state.confirmed, set(&[A]));
    assert_eq!(
        std::fs::read(node.dir.path().join("fleet-admitted.json")).unwrap(),
        admitted_file
    );
}

#[tokio::test(start_paused = true)]
async fn without_its_admitted_file_the_bash_state_is_the_confirmed_set() {
    // Without the import B would be forgotten; without fleet-admitted.json there is
    // nothing to import, and only the confirmed set is known (as the Bash sidecar seeds it).
    let node = NodeDir::new();
    std::fs::write(node.state_file(), serde_json::to_vec(&[A]).unwrap()).unwrap();
    let fake = Fake::default();
    fake.with(|w| {
        w.held = set(&[A, B]);
        w.assignments = set(&[A]);
    });
    let running = fake.run(node.config(""));
    until_polls(&fake, 5).await;
    running.stop().await;
    fake.with(|w| {
        assert!(
            w.joins.is_empty() && w.leaves.is_empty(),
            "{w:?}",
            w = (&w.joins, &w.leaves)
        );
    });
    // B is an orphan now: merod holds it and nothing explains it.
    assert_eq!(running_orphans(&node, &fake, "").await, vec![gid(B)]);
}

#[tokio::test(start_paused = true)]
async fn a_corrupt_bash_file_stops_the_daemon_naming_it() {
    let node = NodeDir::new();
    bash_files(&node, &[A], &[A]);
    std::fs::write(node.dir.path().join("fleet-leave-pending.json"), b"").unwrap();
    let fake = Fake::default();
    let deps = fleet_sidecar::daemon::Deps::new(
        std::sync::Arc::new(fake.clone()),
        std::sync::Arc::new(fake.clone()),
    );
    let err = tokio::time::timeout(
        Duration::from_secs(5),
        fleet_sidecar::daemon::run(node.config(""), deps, Default::default()),
    )
    .await
    .expect("stops at once")
    .expect_err("a corrupt side file is an error");
    let text = err.to_string();
    assert!(
        text.contains("fleet-leave-pending.json") && text.contains("corrupt"),
        "{text}"
    );
    assert!(fake.with(|w| w.polls.is_empty()), "nothing polled");
}

/// Runs the daemon on `node` and `fake` with `extra` keys for 3 polls and returns the
/// orphans its live status lists (checking the gauge counts as many).
async fn running_orphans(node: &NodeDir, fake: &Fake, extra: &str) -> Vec<fleet_sidecar::GroupId> {
    let before = fake.with(|w| w.polls.len());
    let running = fake.run(node.config(extra));
    until_polls(fake, before + 3).await;
    let status = running.telemetry.snapshot();
    let gauge = metric(
        &running.telemetry.encode_metrics(),
        "fleet_sidecar_orphan_namespaces",
    );
    running.stop().await;
    assert_eq!(gauge, status.orphans.len() as f64);
    status.orphans
}

#[tokio::test(start_paused = true)]
async fn an_orphan_is_reported_and_left_alone_by_default() {
    let node = NodeDir::new();
    node.seed(&set(&[A]), &set(&[A]));
    let fake = Fake::default();
    // C: held by merod, in no set. D: retained. B: assigned (and so joined).
    fake.with(|w| {
        w.held = set(&[A, B, C, D]);
        w.assignments = set(&[A, B]);
        w.retain = set(&[D]);
    });
    assert_eq!(running_orphans(&node, &fake, "").await, vec![gid(C)]);
    fake.with(|w| {
        assert!(w.leaves.is_empty(), "never touched: {:?}", w.leaves);
        assert_eq!(w.held, set(&[A, B, C, D]));
    });
    assert_eq!(
        node.state().admitted,
        set(&[A, B]),
        "not taken into the state"
    );
}

#[tokio::test(start_paused = true)]
async fn with_leave_orphans_an_orphan_is_left_after_the_stability_wait() {
    let node = NodeDir::new();
    node.seed(&set(&[A]), &set(&[A]));
    let fake = Fake::default();
    fake.with(|w| {
        w.held = set(&[A, C]);
        w.assignments = set(&[A]);
    });
    let running =
        fake.run(node.config("leave_orphans = true\nleave_after_polls = 3\nleave_grace = \"0s\""));
    until_polls(&fake, 2).await;
    assert!(
        fake.with(|w| w.leaves.is_empty()),
        "absent from 2 of 3 polls: not yet"
    );
    let state = node.state();
    assert_eq!(state.admitted, set(&[A, C]), "taken as admitted");
    assert!(!state.confirmed.contains(&gid(C)), "never confirmed");
    until_polls(&fake, 4).await;
    assert!(running.telemetry.snapshot().orphans.is_empty());
    running.stop().await;
    fake.with(|w| {
        let left: Vec<_> = w.leaves.iter().map(|(id, _)| *id).collect();
        assert_eq!(left, vec![gid(C)]);
        assert!(w.joins.is_empty());
        assert!(w.violations.is_empty(), "{:?}", w.violations);
    });
    assert_eq!(node.state().admitted, set(&[A]));
}

#[tokio::test(start_paused = true)]
async fn with_leave_orphans_many_orphans_at_once_meet_the_mass_withdrawal_guard() {
    let node = NodeDir::new();
    node.seed(&set(&[A]), &set(&[A]));
    let fake = Fake::default();
    fake.with(|w| {
        w.held = set(&[A, B, C, D]);
        w.assignments = set(&[A]);
    });
    let running =
        fake.run(node.config("leave_orphans = true\nleave_after_polls = 1\nmass_drop_min = 3"));
    until_polls(&fake, 5).await;
    let status = running.telemetry.snapshot();
    running.stop().await;
    assert!(fake.with(|w| w.leaves.is_empty()), "held by the guard");
    assert!(
        status.mass_drop.starts_with("holding"),
        "{}",
        status.mass_drop
    );
    assert_eq!(
        StateStore::new(node.state_file())
            .load()
            .unwrap()
            .unwrap()
            .admitted,
        set(&[A, B, C, D])
    );
}

#[tokio::test(start_paused = true)]
async fn a_state_file_on_tmpfs_is_reported_and_the_daemon_still_runs() {
    if !std::path::Path::new("/dev/shm").is_dir() {
        println!("SKIPPED: no /dev/shm");
        return;
    }
    let node = NodeDir::new();
    let shm = tempfile::tempdir_in("/dev/shm").unwrap();
    let state_file = shm.path().join("fleet-confirmed.json");
    let fake = Fake::default();
    fake.with(|w| w.assignments = set(&[A]));
    let cfg = fleet_sidecar::Config {
        state_file: state_file.clone(),
        ..node.config("")
    };
    let running = fake.run(cfg);
    until_polls(&fake, 3).await;
    let status = running.telemetry.snapshot();
    let metrics = running.telemetry.encode_metrics();
    running.stop().await;
    assert_eq!(
        status.state_ram_filesystem.as_deref(),
        Some("tmpfs at /dev/shm")
    );
    assert_eq!(
        metric(&metrics, "fleet_sidecar_state_on_ram_filesystem"),
        1.0
    );
    assert_eq!(
        load_state(&state_file).confirmed,
        set(&[A]),
        "still runs and records"
    );

    // On disk (the checkout's directory): 0.
    let disk = tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap();
    let fake = Fake::default();
    let running = fake.run(fleet_sidecar::Config {
        state_file: disk.path().join("fleet-confirmed.json"),
        ..node.config("")
    });
    until_polls(&fake, 1).await;
    let metrics = running.telemetry.encode_metrics();
    running.stop().await;
    assert_eq!(
        metric(&metrics, "fleet_sidecar_state_on_ram_filesystem"),
        0.0
    );
}

/// An absence the Bash sidecar saw counts at most an hour here: B, absent for 30 h there, is
/// left after one more minute observed under a 61 min grace; C, absent for a minute there,
/// still has an hour to go.
#[tokio::test(start_paused = true)]
async fn a_bash_timer_30_h_old_counts_one_hour_toward_the_grace_and_a_new_one_waits() {
    let node = NodeDir::new();
    bash_files(&node, &[A], &[A, B, C]);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    std::fs::write(
        node.dir.path().join("fleet-leave-pending.json"),
        format!(
            r#"{{"absent_since":{{"{B}":{},"{C}":{}}},"recent_leaves":[],"suspicious":false,"deferred":[]}}"#,
            now - 30 * 3600,
            now - 60
        ),
    )
    .unwrap();
    let fake = Fake::default();
    fake.with(|w| {
        w.held = set(&[A, B, C]);
        w.assignments = set(&[A]);
    });
    let running = fake.run(node.config("leave_grace = \"61m\"\nmass_drop_min = 1000"));
    until_polls(&fake, 50).await;
    assert!(
        fake.with(|w| w.leaves.is_empty()),
        "30 h there count one hour: B waits one more minute"
    );
    until_polls(&fake, 70).await;
    running.stop().await;
    fake.with(|w| {
        let left: Vec<_> = w.leaves.iter().map(|(id, _)| *id).collect();
        assert_eq!(
            left,
            vec![gid(B)],
            "B is past the grace; C has an hour to go"
        );
        assert!(w.joins.is_empty());
    });
    let state = node.state();
    assert_eq!(state.admitted, set(&[A, C]));
    assert!(state.absence_observed(&gid(C)).unwrap() < Duration::from_secs(180));
}
