//! The Ansible role (`packaging/ansible/roles/fleet_sidecar`) applied with `ansible-playbook`
//! as an image build applies it, to a throwaway root: a mount namespace whose `/etc`, `/var`,
//! `/usr` and `/mnt` are overlays (their upper layers kept in a test directory between runs,
//! so the host's are never written) and whose `/run` is an empty tmpfs, so no systemd runs
//! there and `systemctl` works on the unit files alone, as in an image build's chroot. Over a
//! Bash sidecar's unit shadowing the package's: the package installed, the Bash unit gone, the
//! config written from the fleet's variables, the device-key-login marker, the ordering
//! drop-in, the unit enabled only for a read-only merod, `check-config` run; a second run
//! changes nothing.
//!
//! Needs root (mounts), `ansible-playbook` (`FLEET_SIDECAR_ANSIBLE_PLAYBOOK`, which `.ci/run`
//! sets after installing ansible-core with pip) and the package (`FLEET_SIDECAR_DEB`);
//! skipped with a `SKIPPED` line without them.

use std::path::{Path, PathBuf};

use crate::harness::{base_dir, skipped, succeeded, UNIT};

const CONFIG: &str = "/etc/calimero/fleet-sidecar.toml";
const MARKER: &str = "/etc/calimero/device-key-login";
const TOKEN_FILE: &str = "/etc/calimero/fleet-token";
const DROP_IN: &str = "/etc/systemd/system/fleet-sidecar.service.d/10-fleet-image.conf";
const MDMA: &str = "https://mdma.fleet.internal";
/// Where merotee bakes the Bash sidecar's unit (the same name as the package's).
const BASH_UNIT: &str = "/etc/systemd/system/fleet-sidecar.service";
/// The unit's enablement link.
const WANTS: &str = "/etc/systemd/system/multi-user.target.wants/fleet-sidecar.service";
/// A fleet-wide token: never in the config nor in ansible's output.
const TOKEN: &str = "NEVER-LOGGED-TOKEN-ansible";

/// `ansible-playbook` and the package, or why the test cannot run.
fn tools(test: &str) -> Option<(PathBuf, PathBuf)> {
    if skipped(test) {
        return None;
    }
    let var = |name: &str| std::env::var_os(name).map(PathBuf::from);
    match (
        var("FLEET_SIDECAR_ANSIBLE_PLAYBOOK"),
        var("FLEET_SIDECAR_DEB"),
    ) {
        (Some(playbook), Some(deb)) => {
            assert!(playbook.is_file(), "no {}", playbook.display());
            assert!(deb.is_file(), "no package at {}", deb.display());
            Some((playbook, deb))
        }
        _ => {
            eprintln!(
                "SKIPPED systemd test {test}: FLEET_SIDECAR_ANSIBLE_PLAYBOOK and FLEET_SIDECAR_DEB are not set (.ci/run installs ansible-core and builds the package)"
            );
            None
        }
    }
}

/// The throwaway root (see the module docs): each command runs in a new mount namespace over
/// the same upper layers, so what one run wrote the next one finds.
struct Root {
    dir: tempfile::TempDir,
}

/// Mounts the overlays and the empty `/run`, then runs the command given.
const ENTER: &str = r#"set -e
for d in /etc /var /usr /mnt; do
  n=$(echo "$d" | tr / _)
  mount -t overlay overlay -o "lowerdir=$d,upperdir=$ROOT/$n.upper,workdir=$ROOT/$n.work" "$d"
done
mount -t tmpfs -o mode=755 tmpfs /run
mkdir -p /run/lock
exec "$@"
"#;

impl Root {
    fn new() -> Self {
        std::fs::create_dir_all(base_dir()).expect("base dir");
        let dir = tempfile::tempdir_in(base_dir()).expect("root dir");
        for d in ["_etc", "_var", "_usr", "_mnt"] {
            for layer in ["upper", "work"] {
                std::fs::create_dir(dir.path().join(format!("{d}.{layer}"))).expect("layer");
            }
        }
        Self { dir }
    }

    /// Runs `args` in the root.
    async fn output(&self, args: &[&str]) -> std::process::Output {
        tokio::process::Command::new("unshare")
            .args([
                "--mount",
                "--propagation",
                "private",
                "--",
                "sh",
                "-c",
                ENTER,
                "sh",
            ])
            .args(args)
            .env("ROOT", self.dir.path())
            .env("SYSTEMD_OFFLINE", "1")
            .kill_on_drop(true)
            .output()
            .await
            .expect("unshare runs")
    }

    /// Runs `args` in the root; returns stdout, panics on failure.
    async fn run(&self, args: &[&str]) -> String {
        succeeded(args, &self.output(args).await)
    }

    /// A file of the root (`None` if it cannot be read).
    async fn read(&self, path: &str) -> Option<String> {
        let out = self.output(&["cat", path]).await;
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
    }
}

/// One `ansible-playbook` run of the role's example playbook on this machine (local
/// connection, no become: the test is root), with `vars` as extra variables (JSON).
struct Ansible {
    playbook: PathBuf,
    /// ansible's own temp and home directories, outside the private root's overlays.
    dir: tempfile::TempDir,
}

/// What a run printed and its recap for `localhost`.
struct Run {
    ok: bool,
    output: String,
    recap: String,
}

impl Run {
    /// `key=N` of the recap.
    fn count(&self, key: &str) -> u32 {
        self.recap
            .split_whitespace()
            .find_map(|w| w.strip_prefix(&format!("{key}=")))
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no {key}= in the recap: {}", self.recap))
    }
}

impl Ansible {
    fn new(playbook: PathBuf) -> Self {
        std::fs::create_dir_all(base_dir()).expect("base dir");
        let dir = tempfile::tempdir_in(base_dir()).expect("ansible dir");
        Self { playbook, dir }
    }

    async fn run(&self, root: &Root, vars: serde_json::Value) -> Run {
        let vars_file = self.dir.path().join("vars.json");
        std::fs::write(&vars_file, vars.to_string()).expect("vars");
        let home = self.dir.path().join("home");
        let play = Path::new(env!("CARGO_MANIFEST_DIR")).join("packaging/ansible/playbook.yml");
        let env = |k: &str, v: &Path| format!("{k}={}", v.display());
        let args = [
            "env".to_owned(),
            env("ANSIBLE_HOME", &home),
            env("ANSIBLE_LOCAL_TEMP", &home.join("tmp")),
            env("ANSIBLE_REMOTE_TEMP", &home.join("remote")),
            "ANSIBLE_NOCOLOR=1".to_owned(),
            "ANSIBLE_RETRY_FILES_ENABLED=0".to_owned(),
            self.playbook.display().to_string(),
            "-i".to_owned(),
            "localhost,".to_owned(),
            "-c".to_owned(),
            "local".to_owned(),
            "-e".to_owned(),
            "ansible_python_interpreter=/usr/bin/python3".to_owned(),
            "-e".to_owned(),
            "ansible_become=false".to_owned(),
            "-e".to_owned(),
            format!("@{}", vars_file.display()),
            play.display().to_string(),
        ];
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = root.output(&args).await;
        let output = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(!output.contains(TOKEN), "the token in ansible's output");
        let recap = output
            .lines()
            .skip_while(|l| !l.starts_with("PLAY RECAP"))
            .find(|l| l.starts_with("localhost"))
            .unwrap_or_default()
            .to_owned();
        println!("ansible-playbook recap: {recap}");
        Run {
            ok: out.status.success(),
            output,
            recap,
        }
    }
}

async fn exists(root: &Root, path: &str) -> bool {
    root.output(&["test", "-e", path]).await.status.success()
}

/// What the unit's enablement link points at (`""`: no link).
async fn wanted(root: &Root) -> String {
    let out = root.output(&["readlink", WANTS]).await;
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

async fn enabled(root: &Root) -> String {
    let out = root.output(&["systemctl", "is-enabled", UNIT]).await;
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_role_installs_configures_and_enables_the_unit_and_a_second_run_changes_nothing() {
    const TEST: &str =
        "the_role_installs_configures_and_enables_the_unit_and_a_second_run_changes_nothing";
    let Some((playbook, deb)) = tools(TEST) else {
        return;
    };
    let root = Root::new();
    // The Bash sidecar's unit, as merotee bakes it, enabled: the role removes both.
    root.run(&[
        "sh",
        "-c",
        &format!("mkdir -p /etc/systemd/system/multi-user.target.wants && printf '[Unit]\\nDescription=Fleet HA sidecar\\n[Service]\\nExecStart=/usr/local/lib/calimero/fleet-sidecar.sh\\n[Install]\\nWantedBy=multi-user.target\\n' > {BASH_UNIT} && ln -s {BASH_UNIT} {WANTS}"),
    ])
    .await;
    assert_eq!(enabled(&root).await, "enabled");
    assert_eq!(wanted(&root).await, BASH_UNIT);
    let ansible = Ansible::new(playbook);
    let image = serde_json::json!({
        "fleet_mdma_url": MDMA,
        "fleet_delegated_access": true,
        "merod_mode": "read-only",
        "fleet_sidecar_deb": deb,
    });

    // An image with delegated access and a read-only merod, no credential.
    let first = ansible.run(&root, image.clone()).await;
    assert!(first.ok && first.count("failed") == 0, "{}", first.output);
    assert!(first.count("changed") > 0, "{}", first.output);
    assert_eq!(enabled(&root).await, "enabled");
    // The package's unit (/lib is /usr/lib on a merged-/usr system), no longer the Bash one.
    let link = wanted(&root).await;
    assert!(
        ["/lib", "/usr/lib"]
            .map(|d| format!("{d}/systemd/system/{UNIT}"))
            .contains(&link),
        "{link}"
    );
    assert!(!exists(&root, BASH_UNIT).await, "the Bash unit is gone");
    assert!(exists(&root, "/usr/bin/fleet-sidecar").await);
    assert!(exists(&root, MARKER).await);
    assert!(!exists(&root, TOKEN_FILE).await);
    let config = root.read(CONFIG).await.expect("the config");
    assert!(
        config.contains(&format!("mdma_url = \"{MDMA}\"")),
        "{config}"
    );
    assert!(
        config.contains("state_file = \"/mnt/data/fleet/fleet-confirmed.json\""),
        "{config}"
    );
    assert!(config.contains("[registration]"), "{config}");
    let mode = root.run(&["stat", "-c", "%a", CONFIG]).await;
    assert_eq!(mode.trim(), "600");
    let drop_in = root.read(DROP_IN).await.expect("the drop-in");
    assert!(
        drop_in.contains("Requires=calimero-init.service"),
        "{drop_in}"
    );
    assert!(
        drop_in.contains("After=calimero-init.service merod.service"),
        "{drop_in}"
    );
    assert!(drop_in.contains("Wants=merod.service"), "{drop_in}");
    let check = root
        .output(&["/usr/bin/fleet-sidecar", "check-config", "--config", CONFIG])
        .await;
    assert!(check.status.success(), "{check:?}");

    // The same variables again: nothing changes.
    let second = ansible.run(&root, image.clone()).await;
    assert!(second.ok, "{}", second.output);
    assert_eq!(second.count("changed"), 0, "{}", second.output);

    // A fleet-wide token and no delegated access: the token in its own 0600 file, never in
    // the config; no registration; the marker gone.
    let mut token = image.clone();
    token["fleet_auth_token"] = TOKEN.into();
    token["fleet_delegated_access"] = false.into();
    let run = ansible.run(&root, token).await;
    assert!(run.ok, "{}", run.output);
    let config = root.read(CONFIG).await.expect("the config");
    assert!(!config.contains(TOKEN), "{config}");
    assert!(
        config.contains(&format!("fleet_token_file = \"{TOKEN_FILE}\"")),
        "{config}"
    );
    assert!(!config.contains("[registration]"), "{config}");
    assert_eq!(
        root.run(&["stat", "-c", "%a", TOKEN_FILE]).await.trim(),
        "600"
    );
    assert_eq!(
        root.read(TOKEN_FILE).await.as_deref(),
        Some(&format!("{TOKEN}\n")[..])
    );
    assert!(!exists(&root, MARKER).await);

    // Another merod mode: the unit is disabled.
    let mut writable = image.clone();
    writable["merod_mode"] = "read-write".into();
    let run = ansible.run(&root, writable).await;
    assert!(run.ok, "{}", run.output);
    assert_eq!(enabled(&root).await, "disabled");
    assert_eq!(wanted(&root).await, "");

    // Without merod_mode the role stops before changing anything.
    let mut unsaid = image.clone();
    unsaid.as_object_mut().unwrap().remove("merod_mode");
    let run = ansible.run(&root, unsaid).await;
    assert!(
        !run.ok && run.count("failed") == 1 && run.count("changed") == 0,
        "{}",
        run.output
    );
    assert!(run.output.contains("merod_mode"), "{}", run.output);

    // A config the daemon refuses fails the role (at check-config).
    let mut bad = image.clone();
    bad["fleet_mdma_url"] = "ftp://mdma.fleet.internal".into();
    let run = ansible.run(&root, bad).await;
    assert!(!run.ok && run.count("failed") == 1, "{}", run.output);
    assert!(run.output.contains("mdma_url"), "{}", run.output);
}
