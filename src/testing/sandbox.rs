//! A throwaway node layout around the two emulators: a temp directory holding a merod
//! home (`{dir}/calimero/default/config.toml` with a PeerId), a fake sysfs MRTD attribute,
//! the state and log files, and a config file pointing the real sidecar at the emulators.
//! The demo and the integration tests run the real daemon in it, unprivileged.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use tempfile::TempDir;

use super::mdma::MdmaEmulator;
use super::merod::MerodEmulator;
use crate::config::{Config, ConfigError};
use crate::daemon::Deps;
use crate::mdma::MdmaClient;
use crate::merod::{ListenCandidates, MerodClient};
use crate::telemetry::Telemetry;

/// The PeerId written into the sandbox's merod config.toml (the merod emulator's own).
pub use super::merod::PEER_ID;
/// The sandbox's MRTD: 48 bytes 0x00, 0x01, … 0x2f, hex-encoded.
pub const MRTD_HEX: &str = "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f202122232425262728292a2b2c2d2e2f";

/// Emulators plus a temp directory laid out like a node.
pub struct Sandbox {
    /// The MDMA emulator.
    pub mdma: MdmaEmulator,
    /// The merod emulator.
    pub merod: MerodEmulator,
    /// The fleet token MDMA expects, if any.
    pub token: Option<String>,
    dir: TempDir,
}

impl Sandbox {
    /// Starts both emulators (MDMA expecting `token` when set) and lays out the directory.
    ///
    /// Errors: the I/O error of binding a port or writing a file.
    pub async fn start(token: Option<&str>) -> Result<Self, std::io::Error> {
        let dir = tempfile::Builder::new()
            .prefix("fleet-sidecar-")
            .tempdir()?;
        let node_dir = dir.path().join("calimero").join("default");
        std::fs::create_dir_all(&node_dir)?;
        let merod = MerodEmulator::start().await?;
        let listen_port = merod.addr().port();
        std::fs::write(
            node_dir.join("config.toml"),
            format!(
                "[identity]\npeer_id = \"{PEER_ID}\"\nkeypair = \"sandbox-keypair-not-a-secret\"\n\n[server]\nlisten = [\"/ip4/127.0.0.1/tcp/{listen_port}\"]\n"
            ),
        )?;
        let mrtd: Vec<u8> = (0u8..48).collect();
        std::fs::write(dir.path().join("mrtd-sha384"), mrtd)?;
        let mdma = MdmaEmulator::start(token.map(str::to_owned)).await?;
        Ok(Self {
            mdma,
            merod,
            token: token.map(str::to_owned),
            dir,
        })
    }

    /// The sandbox directory.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Where the daemon keeps its state.
    pub fn state_file(&self) -> PathBuf {
        self.dir.path().join("state").join("fleet-confirmed.json")
    }

    /// Where the daemon appends its log.
    pub fn log_file(&self) -> PathBuf {
        self.dir.path().join("fleet-sidecar.log")
    }

    /// The `[device_login] marker` of the sandbox's config (absent until a test makes it).
    pub fn device_login_marker(&self) -> PathBuf {
        self.dir.path().join("device-key-login")
    }

    /// The `[device_login] key_file` of the sandbox's config.
    pub fn login_key_file(&self) -> PathBuf {
        self.dir.path().join("login-node-key")
    }

    /// The full config text pointing at the emulators, every file the daemon writes or
    /// looks at inside the sandbox; `extra` is inserted as top-level keys (e.g.
    /// `leave_after_polls = 1`).
    pub fn config_text(&self, extra: &str) -> String {
        let token = self
            .token
            .as_deref()
            .map(|t| format!("fleet_token = \"{t}\"\n"))
            .unwrap_or_default();
        format!(
            "mdma_url = \"{mdma}\"\n{token}poll_interval = \"1s\"\nstate_file = \"{state}\"\nlog_file = \"{log}\"\n{extra}\n\n[merod]\nhome = \"{home}\"\nnode = \"default\"\n\n[tdx]\nmrtd_path = \"{mrtd}\"\nsources = [\"sysfs\"]\n\n[tls]\ndir = \"{tls}\"\n\n[logs_token]\nfile = \"{logs_token}\"\n\n[device_login]\nmarker = \"{marker}\"\nkey_file = \"{login_key}\"\n",
            mdma = self.mdma.url(),
            state = self.state_file().display(),
            log = self.log_file().display(),
            home = self.dir.path().join("calimero").display(),
            mrtd = self.dir.path().join("mrtd-sha384").display(),
            tls = self.dir.path().join("tls").display(),
            logs_token = self.dir.path().join("provided_token").display(),
            marker = self.device_login_marker().display(),
            login_key = self.login_key_file().display(),
        )
    }

    /// Writes [`Sandbox::config_text`] to `{dir}/fleet-sidecar.toml` and returns its path.
    ///
    /// Errors: the I/O error of the write.
    pub fn write_config(&self, extra: &str) -> Result<PathBuf, std::io::Error> {
        let path = self.dir.path().join("fleet-sidecar.toml");
        std::fs::write(&path, self.config_text(extra))?;
        Ok(path)
    }

    /// The validated config (written to disk first, as the daemon would read it).
    ///
    /// Errors: [`ConfigError`] (an `extra` the schema refuses).
    pub fn config(&self, extra: &str) -> Result<Config, ConfigError> {
        let path = self
            .write_config(extra)
            .map_err(|source| ConfigError::Read {
                path: self.dir.path().join("fleet-sidecar.toml"),
                source,
            })?;
        Config::load(&path)
    }

    /// Makes merod hold `n` namespaces (ids `1`, `2`, … as 64 hex), each one group with
    /// three member accounts (the node's own, [`super::merod::ACCOUNT_ID`], a `ReadOnlyTee`,
    /// and two `Member`s, one device each) and one context, merod with its seal route: a
    /// node at fleet scale for the jobs that walk the namespaces. Returns the ids.
    pub fn hold_with_members(&self, n: usize) -> Vec<String> {
        use super::merod::ACCOUNT_ID;
        let ids: Vec<String> = (0..n).map(|i| format!("{:064x}", i + 1)).collect();
        for (i, id) in ids.iter().enumerate() {
            let (a, b) = (format!("{:064x}", 2 * i + 1), format!("{:064x}", 2 * i + 2));
            self.merod.hold(id);
            self.merod.set_group_members(
                id,
                &[(ACCOUNT_ID, "ReadOnlyTee"), (&a, "Member"), (&b, "Member")],
            );
            self.merod.set_contexts(id, &[format!("ctx{i}")]);
            self.merod.set_member_devices(
                id,
                &[
                    (ACCOUNT_ID, &[("d0", "k0")]),
                    (&a, &[("d1", "k1")]),
                    (&b, &[("d2", "k2")]),
                ],
            );
        }
        self.merod.set_seal_route(true);
        ids
    }

    /// The real MDMA and merod clients, pointed at the emulators as `cfg` says.
    ///
    /// Errors: a client that cannot be built.
    pub fn deps(&self, cfg: &Config) -> Result<Deps, Box<dyn std::error::Error + Send + Sync>> {
        let mdma = MdmaClient::new(&cfg.mdma_url, cfg.fleet_token.clone(), None)?;
        let merod = MerodClient::new(&self.merod.url())?;
        Ok(Deps::real(
            cfg,
            mdma,
            Arc::new(merod.clone()),
            Arc::new(ListenCandidates::new(merod, Vec::new())),
            Arc::new(Telemetry::new()),
        )?)
    }
}
