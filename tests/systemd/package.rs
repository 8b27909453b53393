//! The Debian package under the private systemd: installed with `dpkg -i` (into overlays of
//! `/etc`, `/var` and `/usr`, so the host is never touched), the unit and binary **as the
//! package installs them** (`/usr/lib/systemd/system/fleet-sidecar.service`,
//! `/usr/bin/fleet-sidecar`), an upgrade from the previous version with the service running
//! and with it stopped, then remove and purge.
//!
//! The packages come from the environment, as `.ci/run` builds them with the README's
//! command (`scripts/build-deb.sh`): `FLEET_SIDECAR_DEB` (this version) and
//! `FLEET_SIDECAR_DEB_PREVIOUS` (the same build with a lower version, standing for the
//! previous release). Skipped with a `SKIPPED` line when they are not set.

use std::path::PathBuf;
use std::time::Duration;

use fleet_sidecar::testing::mdma::PollReply;

use crate::harness::{brief, prop, restarts, skipped, Boot, Node, STATE_FILE, UNIT};
use crate::{active, A, SOON};

const CONFIG: &str = "/etc/calimero/fleet-sidecar.toml";
const BIN: &str = "/usr/bin/fleet-sidecar";
const UNIT_FILE: &str = "/usr/lib/systemd/system/fleet-sidecar.service";
/// What `deb-systemd-helper enable` links for `WantedBy=multi-user.target`.
const ENABLED_LINK: &str = "/etc/systemd/system/multi-user.target.wants/fleet-sidecar.service";
/// systemd's line for each start of the unit that reached READY=1.
const STARTED: &str = "Started fleet-sidecar.service";
/// How long "nothing more happens" is watched after a package operation.
const SETTLE: Duration = Duration::from_secs(3);

/// The two packages, or why the test cannot run.
fn packages(test: &str) -> Option<(PathBuf, PathBuf)> {
    if skipped(test) {
        return None;
    }
    let var = |name: &str| std::env::var_os(name).map(PathBuf::from);
    match (var("FLEET_SIDECAR_DEB"), var("FLEET_SIDECAR_DEB_PREVIOUS")) {
        (Some(deb), Some(previous)) => {
            for p in [&deb, &previous] {
                assert!(p.is_file(), "no package at {}", p.display());
            }
            Some((deb, previous))
        }
        _ => {
            eprintln!(
                "SKIPPED systemd test {test}: FLEET_SIDECAR_DEB and FLEET_SIDECAR_DEB_PREVIOUS are not set (.ci/run builds both with scripts/build-deb.sh)"
            );
            None
        }
    }
}

/// `dpkg ARGS`; panics with dpkg's output if it fails.
async fn dpkg(sysd: &Boot, args: &[&str]) -> String {
    let mut all = vec!["dpkg", "--force-confold"];
    all.extend_from_slice(args);
    sysd.run(&all).await
}

/// The version dpkg records as installed.
async fn installed_version(sysd: &Boot) -> String {
    sysd.run(&["dpkg-query", "-W", "-f=${Version}", "fleet-sidecar"])
        .await
}

/// How many starts of the unit systemd logged.
async fn starts(sysd: &Boot) -> usize {
    sysd.journal_all()
        .await
        .lines()
        .filter(|l| l.contains(STARTED))
        .count()
}

async fn exists(sysd: &Boot, path: &str) -> bool {
    sysd.output(&["test", "-e", path]).await.status.success()
}

/// Install, the shipped config's refusal, an edited config through two upgrades (running:
/// restarted once; stopped: left stopped), remove (stops it) and purge (the config goes,
/// the state directory stays).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_package_installs_upgrades_and_purges_under_systemd() {
    let Some((deb, previous)) = packages("package") else {
        return;
    };
    let sysd = match Boot::up_for_package().await {
        Ok(b) => b,
        Err(e) => {
            eprintln!("SKIPPED systemd test package: {e}");
            return;
        }
    };
    // A container image (this machine's among them) may carry a policy-rc.d that forbids
    // every service action to package scripts; a node has none. Removed from the /usr
    // overlay only, so deb-systemd-invoke acts as it does on a node.
    sysd.run(&["rm", "-f", "/usr/sbin/policy-rc.d"]).await;
    let deb = deb.to_str().expect("a UTF-8 path");
    let previous = previous.to_str().expect("a UTF-8 path");

    // Install the previous version: enabled, never started; the unit is the package's.
    dpkg(&sysd, &["-i", previous]).await;
    let old_version = installed_version(&sysd).await;
    for path in [BIN, UNIT_FILE, CONFIG, ENABLED_LINK, "/var/lib/calimero"] {
        assert!(exists(&sysd, path).await, "{path} after dpkg -i");
    }
    let p = sysd.show().await;
    assert_eq!(prop(&p, "LoadState"), "loaded", "{}", brief(&p));
    assert_eq!(prop(&p, "ActiveState"), "inactive", "{}", brief(&p));
    assert!(
        prop(&p, "ExecStart").contains(&format!("path={BIN} ")),
        "{}",
        prop(&p, "ExecStart")
    );
    assert_eq!(starts(&sysd).await, 0);

    // The shipped config is refused by the installed binary until mdma_url is filled in.
    let out = sysd
        .output(&[BIN, "--config", CONFIG, "check-config"])
        .await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(78), "{stderr}");
    assert!(stderr.contains("mdma_url is not set"), "{stderr}");

    // The operator fills it in and starts the service.
    let node = Node::start(None).await;
    node.mdma.set_reply(PollReply::assign([A]));
    let edited = std::fs::read_to_string(node.config("max_backoff = \"2s\"")).expect("config");
    sysd.run(&[
        "install",
        "-m",
        "0600",
        node.path("fleet-sidecar.toml").to_str().expect("UTF-8"),
        CONFIG,
    ])
    .await;
    sysd.run(&["systemctl", "start", "--no-block", UNIT]).await;
    let p = sysd
        .until("A confirmed by the installed unit", SOON, |p| {
            active(p) && prop(p, "StatusText").starts_with("1 confirmed")
        })
        .await;
    let pid = prop(&p, "MainPID").to_owned();
    sysd.until_file(STATE_FILE, SOON, |s| s.contains(A)).await;
    assert_eq!(starts(&sysd).await, 1);

    // Upgrade while running: the edited config kept, the service restarted exactly once
    // (a new process, not a crash restart), and it resumes from its state.
    dpkg(&sysd, &["-i", deb]).await;
    let new_version = installed_version(&sysd).await;
    assert_ne!(new_version, old_version, "the upgrade changed the version");
    assert_eq!(sysd.read(CONFIG).await.as_deref(), Some(edited.as_str()));
    let p = sysd
        .until("running again after the upgrade", SOON, |p| {
            active(p) && prop(p, "MainPID") != pid
        })
        .await;
    assert_eq!(restarts(&p), 0, "{}", brief(&p));
    tokio::time::sleep(SETTLE).await;
    assert_eq!(starts(&sysd).await, 2, "{}", sysd.journal_all().await);
    let p = sysd.show().await;
    assert!(active(&p), "{}", brief(&p));
    assert_eq!(
        node.merod.joins(A),
        1,
        "A was joined again after the upgrade"
    );

    // Upgrade while stopped: it stays stopped.
    sysd.run(&["systemctl", "stop", UNIT]).await;
    dpkg(&sysd, &["-i", previous]).await;
    assert_eq!(installed_version(&sysd).await, old_version);
    dpkg(&sysd, &["-i", deb]).await;
    assert_eq!(installed_version(&sysd).await, new_version);
    sysd.holds("stopped through the upgrades", SETTLE, |p| {
        prop(p, "ActiveState") == "inactive"
    })
    .await;
    assert_eq!(starts(&sysd).await, 2);
    assert_eq!(sysd.read(CONFIG).await.as_deref(), Some(edited.as_str()));

    // Remove stops a running service and keeps the config (a conffile).
    sysd.run(&["systemctl", "start", UNIT]).await;
    sysd.until("running before the removal", SOON, active).await;
    dpkg(&sysd, &["-r", "fleet-sidecar"]).await;
    let p = sysd.show().await;
    assert_ne!(prop(&p, "ActiveState"), "active", "{}", brief(&p));
    assert!(!exists(&sysd, BIN).await && !exists(&sysd, UNIT_FILE).await);
    assert!(exists(&sysd, CONFIG).await, "remove keeps the config");
    assert!(exists(&sysd, "/var/log/fleet-sidecar.log").await);

    // Purge: the config and the log go; the state directory and its file stay.
    dpkg(&sysd, &["-P", "fleet-sidecar"]).await;
    assert!(!exists(&sysd, CONFIG).await, "purge removes the config");
    assert!(!exists(&sysd, "/var/log/fleet-sidecar.log").await);
    let state = sysd
        .read(STATE_FILE)
        .await
        .expect("the state survives the purge");
    assert!(state.contains(A), "{state}");
    assert!(!exists(&sysd, ENABLED_LINK).await);
}
