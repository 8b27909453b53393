//! A certificate MDMA delivers, installed under the shipped unit and followed by a restart
//! of the TLS terminator through systemd's D-Bus API: the private systemd runs the machine's
//! own `dbus.socket` and `dbus.service` (its system bus) and a stand-in `traefik.service`,
//! and the restart is what systemd reports (a new invocation of that unit).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rcgen::{CertificateParams, KeyPair};

use crate::harness::{base_dir, exec_start, skipped, Boot, Node, UNIT};
use crate::{active, SOON};

/// The system bus's units as the distribution ships them.
const DBUS_UNITS: [&str; 2] = [
    "/lib/systemd/system/dbus.socket",
    "/lib/systemd/system/dbus.service",
];
/// The stand-in for the TLS terminator the shipped config restarts.
const TRAEFIK: &str = "traefik.service";
/// The shipped config's TLS directory (inside the private systemd's `/mnt` overlay, made
/// writable by the unit's `ReadWritePaths=-/mnt/data/tls`).
const TLS_DIR: &str = "/mnt/data/tls";

/// A unit's current invocation (a new one per start).
pub async fn invocation(sysd: &Boot, unit: &str) -> String {
    sysd.run(&["systemctl", "show", "-p", "InvocationID", "--value", unit])
        .await
        .trim()
        .to_owned()
}

/// Waits until `unit` runs another invocation than `before` and returns it; panics after
/// [`SOON`] with the daemon's journal.
pub async fn until_restarted(sysd: &Boot, unit: &str, before: &str) -> String {
    let start = Instant::now();
    loop {
        let now = invocation(sysd, unit).await;
        if now != before {
            return now;
        }
        assert!(
            start.elapsed() < SOON,
            "{unit} was not restarted; the daemon said:\n{}",
            sysd.daemon_journal().await
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Boots with the machine's system bus and a stand-in `unit` (a process that sleeps) both
/// started, the shipped unit installed but not; `None` (said) when the suite or the bus
/// cannot run here. The directory holds the stand-in's file while the boot lives.
pub async fn boot_with_bus(test: &str, unit: &str) -> Option<(Boot, tempfile::TempDir)> {
    if skipped(test) {
        return None;
    }
    if let Some(missing) = DBUS_UNITS
        .iter()
        .chain(&["/usr/bin/dbus-daemon"])
        .find(|p| !Path::new(p).exists())
    {
        eprintln!("SKIPPED systemd test {test}: {missing} is missing (no system bus to run)");
        return None;
    }
    std::fs::create_dir_all(base_dir()).expect("base dir");
    let units = tempfile::tempdir_in(base_dir()).expect("unit dir");
    let stand_in = units.path().join(unit);
    std::fs::write(
        &stand_in,
        format!("[Unit]\nDescription=stand-in {unit}\n[Service]\nExecStart=/bin/sleep infinity\n"),
    )
    .expect("stand-in unit");
    let mut extra: Vec<PathBuf> = DBUS_UNITS.iter().map(PathBuf::from).collect();
    extra.push(stand_in);
    let sysd = match Boot::up_with(&extra).await {
        Ok(b) => b,
        Err(e) => {
            eprintln!("SKIPPED systemd test {test}: {e}");
            return None;
        }
    };
    sysd.run(&["systemctl", "start", "dbus.socket", "dbus.service", unit])
        .await;
    Some((sysd, units))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivered_certificate_is_installed_and_traefik_restarted_over_d_bus() {
    const TEST: &str = "a_delivered_certificate_is_installed_and_traefik_restarted_over_d_bus";
    let Some((sysd, _units)) = boot_with_bus(TEST, TRAEFIK).await else {
        return;
    };
    let before = invocation(&sysd, TRAEFIK).await;
    assert!(!before.is_empty(), "the stand-in traefik runs");

    // The node's key on the data disk, and a certificate over it that MDMA delivers in
    // every answer.
    let node = Node::start(None).await;
    let key = KeyPair::generate().expect("key");
    let cert = CertificateParams::new(vec!["node.test".to_owned()])
        .expect("params")
        .self_signed(&key)
        .expect("certificate")
        .pem();
    let key_file = node.path("key.pem");
    std::fs::write(&key_file, key.serialize_pem()).expect("key file");
    sysd.run(&[
        "sh",
        "-c",
        &format!(
            "mkdir -p {TLS_DIR} && cp {} {TLS_DIR}/key.pem",
            key_file.display()
        ),
    ])
    .await;
    node.mdma
        .set_delivery("tls_certificate", Some(serde_json::json!(cert)));
    let config = node.config("");
    sysd.drop_in(&exec_start(&config)).await;
    sysd.run(&["systemctl", "start", "--no-block", UNIT]).await;
    sysd.until("the daemon active", SOON, active).await;

    let installed = sysd
        .until_file(&format!("{TLS_DIR}/cert.pem"), SOON, |t| !t.is_empty())
        .await;
    assert_eq!(installed.trim_end(), cert.trim_end());
    let after = until_restarted(&sysd, TRAEFIK, &before).await;
    // The same certificate, delivered again by every poll, restarts nothing more.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        invocation(&sysd, TRAEFIK).await,
        after,
        "restarted more than once"
    );
    let said = sysd.daemon_journal().await;
    assert!(
        said.contains("restarted for the new TLS certificate"),
        "{said}"
    );
}
