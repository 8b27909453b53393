//! A private systemd booted by `scripts/run-unit-under-systemd.sh` (step-wise mode), and a
//! node laid out for the shipped unit: merod's home, an MRTD attribute, a token file and a
//! config, all outside `/tmp` (the unit's `PrivateTmp=yes` hides the host's `/tmp` from the
//! daemon), with the loopback emulators the daemon reaches over the shared host network.

use std::collections::HashMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use fleet_sidecar::testing::mdma::MdmaEmulator;
use fleet_sidecar::testing::merod::MerodEmulator;
use fleet_sidecar::testing::sandbox::PEER_ID;

/// The unit under test, as shipped.
pub const UNIT: &str = "fleet-sidecar.service";
/// The credential name the tests load the fleet token as.
pub const CREDENTIAL: &str = "fleet-token";
/// Where systemd puts that credential for [`UNIT`] (`$CREDENTIALS_DIRECTORY/fleet-token`).
pub const CREDENTIAL_PATH: &str = "/run/credentials/fleet-sidecar.service/fleet-token";
/// The state file on the data disk, as on the fleet's images (`state_file` in every test
/// config; inside the private systemd's `/mnt` overlay, made writable by the unit's
/// `ReadWritePaths=-/mnt/data/fleet`).
pub const STATE_FILE: &str = "/mnt/data/fleet/fleet-confirmed.json";
/// Its directory, created in each boot before the unit starts (as a node image has it).
pub const STATE_DIR: &str = "/mnt/data/fleet";
/// The shipped config's log file (inside the private systemd's `/var` overlay).
pub const LOG_FILE: &str = "/var/log/fleet-sidecar.log";

fn manifest_path(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(rel)
}

fn tool() -> PathBuf {
    manifest_path("scripts/run-unit-under-systemd.sh")
}

/// Where test files live: cargo's per-target scratch directory (never under `/tmp` unless
/// the target directory itself is).
pub fn base_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("systemd")
}

/// Why this suite cannot run here, if it cannot: not root, the tool's prerequisites
/// missing, or test paths the unit's sandbox would hide.
pub fn skip_reason() -> Option<String> {
    if !nix::unistd::Uid::effective().is_root() {
        return Some("needs root (the tool boots systemd in new namespaces)".to_owned());
    }
    for bin in [
        "/lib/systemd/systemd",
        "/usr/bin/script",
        "/usr/bin/nsenter",
        "/usr/bin/unshare",
    ] {
        if !Path::new(bin).exists() {
            return Some(format!("{bin} is missing"));
        }
    }
    let hidden = ["/tmp", "/var/tmp", "/home", "/root", "/run"];
    for path in [
        base_dir(),
        PathBuf::from(env!("CARGO_BIN_EXE_fleet-sidecar")),
    ] {
        if hidden.iter().any(|h| path.starts_with(h)) {
            return Some(format!(
                "{} is under a directory the unit's sandbox hides (PrivateTmp=/ProtectHome=): set CARGO_TARGET_DIR elsewhere",
                path.display()
            ));
        }
    }
    None
}

/// Prints why the suite is skipped; true if it is.
pub fn skipped(test: &str) -> bool {
    match skip_reason() {
        Some(why) => {
            eprintln!("SKIPPED systemd test {test}: {why}");
            true
        }
        None => false,
    }
}

/// `systemctl show` properties.
pub type Props = HashMap<String, String>;

/// A private systemd (PID 1 of its own namespaces) with [`UNIT`] installed but not started.
/// Torn down on drop (after printing its report if the test is failing).
pub struct Boot {
    state: PathBuf,
}

impl Boot {
    /// Boots with an idle target as the boot unit and the shipped unit installed beside it.
    /// `Err` (the tool's output) when the tool cannot run here.
    pub async fn up() -> Result<Self, String> {
        Self::up_with(&[]).await
    }

    /// [`Boot::up`] with `extra` unit files installed too (not started).
    pub async fn up_with(extra: &[PathBuf]) -> Result<Self, String> {
        Self::boot(
            Some(&manifest_path("packaging/fleet-sidecar.service")),
            "/etc /var",
            extra,
        )
        .await
    }

    /// Boots for a package install: `/usr` is an overlay too (so `dpkg -i` never reaches the
    /// host's), and [`UNIT`] is a link to where the package puts it,
    /// `/usr/lib/systemd/system/fleet-sidecar.service`, dangling until it is installed.
    pub async fn up_for_package() -> Result<Self, String> {
        let boot = Self::boot(None, "/etc /var /usr", &[]).await?;
        std::os::unix::fs::symlink(
            format!("/usr/lib/systemd/system/{UNIT}"),
            boot.state.join("units").join(UNIT),
        )
        .map_err(|e| format!("cannot link the unit: {e}"))?;
        Ok(boot)
    }

    async fn boot(unit: Option<&Path>, overlays: &str, extra: &[PathBuf]) -> Result<Self, String> {
        let base = base_dir();
        std::fs::create_dir_all(&base).map_err(|e| format!("{}: {e}", base.display()))?;
        // Its own directory: tests boot in parallel, and the tool copies the file.
        let idle_dir = tempfile::tempdir_in(&base).map_err(|e| e.to_string())?;
        let idle = idle_dir.path().join("sysd-test-idle.target");
        std::fs::write(
            &idle,
            "[Unit]\nDescription=test harness: boot without starting the unit under test\n",
        )
        .map_err(|e| e.to_string())?;
        let out = tokio::process::Command::new(tool())
            .arg("up")
            .arg(&idle)
            .args(unit)
            .args(extra)
            .env("SYSD_SHARE_NET", "1")
            .env("SYSD_BASE", base.join("boots"))
            // /mnt too, so the state directory on the "data disk" never reaches the host's.
            .env("SYSD_OVERLAYS", format!("{overlays} /mnt"))
            // PID 1 logs each sd_notify message at debug level (READY=1, STOPPING=1, ...).
            .env("SYSD_LOG_LEVEL", "debug")
            .output()
            .await
            .map_err(|e| format!("cannot run the tool: {e}"))?;
        let state = String::from_utf8_lossy(&out.stdout).trim().to_owned();
        if !out.status.success() || state.is_empty() {
            return Err(format!(
                "the tool could not boot systemd ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        let boot = Self {
            state: PathBuf::from(state),
        };
        boot.run(&["mkdir", "-p", STATE_DIR]).await;
        Ok(boot)
    }

    /// Runs `args` inside the private namespaces; returns stdout, panics on failure.
    pub async fn run(&self, args: &[&str]) -> String {
        succeeded(args, &self.output(args).await)
    }

    /// Runs `args` inside the private namespaces.
    pub async fn output(&self, args: &[&str]) -> std::process::Output {
        tokio::process::Command::new(tool())
            .arg("exec")
            .arg(&self.state)
            .args(args)
            .output()
            .await
            .expect("the tool runs")
    }

    /// Adds `text` as drop-in `test.conf` of [`UNIT`] and reloads systemd.
    pub async fn drop_in(&self, text: &str) {
        let dir = self.state.join("units").join(format!("{UNIT}.d"));
        std::fs::create_dir_all(&dir).expect("drop-in dir");
        std::fs::write(dir.join("test.conf"), text).expect("drop-in");
        self.run(&["systemctl", "daemon-reload"]).await;
    }

    /// `systemctl show` of [`UNIT`].
    pub async fn show(&self) -> Props {
        self.run(&["systemctl", "show", UNIT])
            .await
            .lines()
            .filter_map(|l| l.split_once('='))
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect()
    }

    /// [`UNIT`]'s journal (systemd's own lines about it included), `short-unix` format.
    pub async fn journal(&self) -> String {
        self.run(&["journalctl", "--no-pager", "-o", "short-unix", "-u", UNIT])
            .await
    }

    /// The daemon's own lines, by its `SYSLOG_IDENTIFIER` (`journalctl -t fleet-sidecar`),
    /// `short-unix` format. Not by unit: this boot's systemd logs at debug level from the
    /// service's forked child while that child is still in `init.scope`, and journald
    /// keeps that context for the PID for a few seconds, so the daemon's first lines after
    /// exec can be filed under `init.scope` (seen under load: 9 lines over 7 s).
    pub async fn daemon_journal(&self) -> String {
        self.run(&[
            "journalctl",
            "--no-pager",
            "-o",
            "short-unix",
            "-t",
            "fleet-sidecar",
        ])
        .await
    }

    /// The whole journal of the boot (only the unit under test and journald run in it).
    pub async fn journal_all(&self) -> String {
        self.run(&["journalctl", "--no-pager", "-o", "short-unix"])
            .await
    }

    /// A file inside the private namespaces (`None` if it cannot be read).
    pub async fn read(&self, path: &str) -> Option<String> {
        let out = self.output(&["cat", path]).await;
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Polls [`Boot::show`] every 200 ms until `ok` holds; panics naming `what` after `limit`.
    pub async fn until(&self, what: &str, limit: Duration, ok: impl Fn(&Props) -> bool) -> Props {
        let start = Instant::now();
        loop {
            let p = self.show().await;
            if ok(&p) {
                return p;
            }
            assert!(
                start.elapsed() < limit,
                "timed out after {limit:?} waiting for: {what}; now {}",
                brief(&p)
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Checks `ok` on [`Boot::show`] every 200 ms for `span`; panics naming `what` the first
    /// time it does not hold.
    pub async fn holds(&self, what: &str, span: Duration, ok: impl Fn(&Props) -> bool) {
        let start = Instant::now();
        while start.elapsed() < span {
            let p = self.show().await;
            assert!(
                ok(&p),
                "{what} broken after {:?}: {}",
                start.elapsed(),
                brief(&p)
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Polls `read(path)` until `ok` holds on its text; panics after `limit`.
    pub async fn until_file(
        &self,
        path: &str,
        limit: Duration,
        ok: impl Fn(&str) -> bool,
    ) -> String {
        let start = Instant::now();
        loop {
            let text = self.read(path).await.unwrap_or_default();
            if ok(&text) {
                return text;
            }
            assert!(
                start.elapsed() < limit,
                "timed out after {limit:?} waiting on {path}: {text}"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

impl Drop for Boot {
    fn drop(&mut self) {
        if std::thread::panicking() {
            if let Ok(out) = std::process::Command::new(tool())
                .arg("report")
                .arg(&self.state)
                .arg(UNIT)
                .output()
            {
                eprintln!("{}", String::from_utf8_lossy(&out.stdout));
            }
        }
        let _ = std::process::Command::new(tool())
            .arg("down")
            .arg(&self.state)
            .env("SYSD_BASE", base_dir().join("boots"))
            .output();
    }
}

/// The properties a failure message shows.
pub fn brief(p: &Props) -> String {
    [
        "ActiveState",
        "SubState",
        "Result",
        "NRestarts",
        "MainPID",
        "ExecMainStatus",
        "StatusText",
    ]
    .iter()
    .map(|k| format!("{k}={}", p.get(*k).map(String::as_str).unwrap_or("?")))
    .collect::<Vec<_>>()
    .join(" ")
}

/// A property, or "" when absent.
pub fn prop<'a>(p: &'a Props, key: &str) -> &'a str {
    p.get(key).map(String::as_str).unwrap_or("")
}

/// `NRestarts` as a number.
pub fn restarts(p: &Props) -> u32 {
    prop(p, "NRestarts").parse().unwrap_or(u32::MAX)
}

/// A node for the shipped unit: the emulators, and under [`base_dir`] a merod home
/// (`calimero/default/config.toml`, mode 0600, with the PeerId and the emulator's listen
/// address), the MRTD attribute, a token file (0600) and the config.
pub struct Node {
    pub mdma: MdmaEmulator,
    pub merod: MerodEmulator,
    pub dir: tempfile::TempDir,
}

impl Node {
    /// Starts the emulators (MDMA expecting `token` when set) and lays out the files.
    pub async fn start(token: Option<&str>) -> Self {
        std::fs::create_dir_all(base_dir()).expect("base dir");
        let dir = tempfile::Builder::new()
            .prefix("node-")
            .tempdir_in(base_dir())
            .expect("node dir");
        let merod = MerodEmulator::start().await.expect("merod emulator");
        let mdma = MdmaEmulator::start(token.map(str::to_owned))
            .await
            .expect("MDMA emulator");
        let node_dir = dir.path().join("calimero/default");
        std::fs::create_dir_all(&node_dir).expect("merod home");
        let merod_config = node_dir.join("config.toml");
        std::fs::write(
            &merod_config,
            format!(
                "[identity]\npeer_id = \"{PEER_ID}\"\nkeypair = \"test-keypair-not-a-secret\"\n\n[server]\nlisten = [\"/ip4/127.0.0.1/tcp/{}\"]\n",
                merod.addr().port()
            ),
        )
        .expect("merod config");
        std::fs::set_permissions(&merod_config, std::fs::Permissions::from_mode(0o600))
            .expect("chmod merod config");
        std::fs::write(dir.path().join("mrtd"), (0u8..48).collect::<Vec<u8>>()).expect("mrtd");
        let node = Self { mdma, merod, dir };
        if let Some(t) = token {
            let file = node.path("token");
            std::fs::write(&file, format!("{t}\n")).expect("token file");
            std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600))
                .expect("chmod token");
        }
        node
    }

    /// A path in the node directory.
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// Writes `fleet-sidecar.toml`: the state on the data disk ([`STATE_FILE`]), the shipped
    /// log path, merod's home and the MRTD here, the MDMA emulator, `extra` top-level keys.
    /// Returns its path.
    pub fn config(&self, extra: &str) -> PathBuf {
        let path = self.path("fleet-sidecar.toml");
        std::fs::write(
            &path,
            format!(
                "mdma_url = \"{}\"\npoll_interval = \"1s\"\nstate_file = \"{STATE_FILE}\"\n{extra}\n\n[merod]\nhome = \"{}\"\nnode = \"default\"\n\n[tdx]\nmrtd_path = \"{}\"\nsources = [\"sysfs\"]\n",
                self.mdma.url(),
                self.path("calimero").display(),
                self.path("mrtd").display(),
            ),
        )
        .expect("config");
        path
    }
}

/// The stdout of a command that ran `args`; panics with its output if it failed.
pub fn succeeded(args: &[&str], out: &std::process::Output) -> String {
    assert!(
        out.status.success(),
        "{args:?} failed ({}): {}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The drop-in lines pointing `ExecStart=` at the test binary and `config`.
pub fn exec_start(config: &Path) -> String {
    format!(
        "[Service]\nExecStart=\nExecStart={} run --config {}\n",
        env!("CARGO_BIN_EXE_fleet-sidecar"),
        config.display()
    )
}
