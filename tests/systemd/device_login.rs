//! Device-key login under the shipped unit: merod's node key written to the data disk and a
//! stand-in `mero-auth.service` restarted through systemd's D-Bus API; after a restart of
//! the daemon, that unit's `ActiveEnterTimestamp` (read over D-Bus) shows it already read
//! the key, so it is not restarted again. Every assertion is on what systemd reports.

use std::time::{Duration, Instant};

use crate::deliveries::{boot_with_bus, invocation, until_restarted};
use crate::harness::{exec_start, Boot, Node, UNIT};
use crate::{active, SOON};

/// The stand-in for the login service the shipped config restarts.
const AUTH: &str = "mero-auth.service";
/// The shipped config's key file (inside the private systemd's `/mnt` overlay, made
/// writable by the unit's `ReadWritePaths=-/mnt/data/fleet`).
const KEY_FILE: &str = "/mnt/data/fleet/login-node-key";
/// The recorded rc.25 identity's base58 `publicKey`, as its 32 bytes in hex.
const RC25_KEY: &str = "6f74442edba9238bfaf0a993ccf53b117e36e350614a1b7ba7c8a8ecf7422c5f";
/// What the daemon says each time login is on.
const ON: &str = "device-key login is on for node key";

/// The lines of the daemon's journal saying login is on.
async fn said_on(sysd: &Boot) -> Vec<String> {
    sysd.daemon_journal()
        .await
        .lines()
        .filter(|l| l.contains(ON))
        .map(str::to_owned)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_node_key_is_handed_to_mero_auth_and_a_restart_reads_its_active_enter_timestamp() {
    const TEST: &str =
        "the_node_key_is_handed_to_mero_auth_and_a_restart_reads_its_active_enter_timestamp";
    let Some((sysd, _units)) = boot_with_bus(TEST, AUTH).await else {
        return;
    };
    let before = invocation(&sysd, AUTH).await;
    assert!(!before.is_empty(), "the stand-in mero-auth runs");

    // A node built with delegated access (the marker), merod answering rc.25's identity.
    let node = Node::start(None).await;
    node.merod.set_minted(true);
    let marker = node.path("device-key-login");
    std::fs::write(&marker, "").expect("marker");
    let config = node.config(&format!(
        "[device_login]\nmarker = \"{}\"\n",
        marker.display()
    ));
    sysd.drop_in(&exec_start(&config)).await;
    sysd.run(&["systemctl", "start", "--no-block", UNIT]).await;
    sysd.until("the daemon active", SOON, active).await;

    let written = sysd.until_file(KEY_FILE, SOON, |t| !t.is_empty()).await;
    assert_eq!(written, format!("{RC25_KEY}\n"));
    let mode = sysd.run(&["stat", "-c", "%a", KEY_FILE]).await;
    assert_eq!(mode.trim(), "600");
    let after = until_restarted(&sysd, AUTH, &before).await;
    let on = said_on(&sysd).await;
    assert!(
        on.len() == 1 && on[0].contains("mero-auth.service restarted"),
        "{on:?}"
    );

    // The daemon restarts: the file holds the key and mero-auth became active after it was
    // written (systemd says so over D-Bus), so login is on without a restart.
    sysd.run(&["systemctl", "restart", UNIT]).await;
    let start = Instant::now();
    while said_on(&sysd).await.len() < 2 {
        assert!(
            start.elapsed() < SOON,
            "login not on again; the daemon said:\n{}",
            sysd.daemon_journal().await
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let on = said_on(&sysd).await;
    assert!(!on[1].contains("restarted"), "{on:?}");
    assert_eq!(invocation(&sysd, AUTH).await, after, "restarted again");
}
