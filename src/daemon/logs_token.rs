//! The log shippers' token MDMA delivers (`logs_token` in a should-join answer that passed
//! the gate), installed by a job beside the loop: the poll only hands it over
//! ([`TokenInstaller::offer`]) and never waits.
//!
//! Installed only when its SHA-256 differs from the held token's (MDMA sends it while the
//! fingerprints differ; the Bash sidecar reinstalled it and restarted vector every poll when
//! MDMA's two views disagreed): written atomically to `[logs_token] file`, mode 0600 as
//! created, exactly its bytes (no newline). Then the image's configure scripts run, each a
//! bounded subprocess (they are the image's interface): vector's, then `vector_unit` is
//! restarted through systemd's D-Bus API; vmagent's (which restarts vmagent itself). Each
//! with its endpoint (`logs_endpoint` / `metrics_endpoint`, else the instance metadata's
//! `logs-endpoint` / `metrics-endpoint`). A script's failure is a warning, tried again with
//! the next delivery that differs; a write that fails is retried with the back-off. An
//! empty delivery is none (the parser drops it), so it never wipes a good token.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use tokio::io::AsyncReadExt;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::node_files::{token_fingerprint, NodeFilesView};
use super::units::UnitControl;
use crate::backoff::RETRY;
use crate::config::{is_executable, Config, LogsTokenConfig};
use crate::durable::{self, WriteError};
use crate::jobs::{self, Job, Schedule};
use crate::mdma::LogsToken;
use crate::metadata::{MetadataAttribute, MetadataClient, METADATA_TIMEOUT};
use crate::outcome::Timed;
use crate::telemetry::Telemetry;

/// The token file's mode: the shippers run as root on the image; nobody else reads it.
const TOKEN_MODE: u32 = 0o600;
/// Largest held token read (a token is a few hundred bytes).
const MAX_TOKEN: u64 = 64 * 1024;
/// Bound of reading the held token and writing the new one.
const FILES_DEADLINE: Duration = Duration::from_secs(10);
/// Bound of one configure script (it may restart its service).
pub(crate) const SCRIPT_TIMEOUT: Duration = Duration::from_secs(60);
/// Most of a failing script's stderr kept for the warning.
const MAX_SCRIPT_OUTPUT: u64 = 2048;
/// The only variables a script gets: no proxy, locale or secret of the daemon's reaches it.
const SCRIPT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// Why a token could not be installed (retried with the back-off).
#[derive(Debug, thiserror::Error)]
pub(crate) enum TokenInstallError {
    /// The held token could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The token could not be written.
    #[error(transparent)]
    Write(#[from] WriteError),
    /// The file work did not end within its bound (a hung disk).
    #[error("the token file did not answer within {0:?}")]
    Stalled(Duration),
}

impl Timed for TokenInstallError {
    fn is_timeout(&self) -> bool {
        matches!(self, TokenInstallError::Stalled(_))
    }
}

/// The loop's end of the job: hands it the tokens polls deliver.
#[derive(Debug)]
pub(crate) struct TokenInstaller {
    delivered: watch::Sender<Option<LogsToken>>,
}

impl TokenInstaller {
    /// Starts the job for `cfg`'s `[logs_token]`, or `None` when installs are off or
    /// nothing may be written (a dry run).
    pub(crate) fn start(
        cfg: &Config,
        units: Arc<dyn UnitControl>,
        metadata: Option<MetadataClient>,
        files: NodeFilesView,
        telemetry: Arc<Telemetry>,
        shutdown: CancellationToken,
    ) -> Option<Self> {
        if !cfg.logs_token.install || cfg.dry_run {
            return None;
        }
        let (delivered, rx) = watch::channel(None);
        let job = InstallJob {
            delivered: rx,
            handled: None,
            cfg: cfg.logs_token.clone(),
            units,
            metadata,
            files,
            telemetry: Arc::clone(&telemetry),
        };
        jobs::spawn(job, telemetry, shutdown);
        Some(Self { delivered })
    }

    /// Hands over the token a poll delivered; the job wakes only when it differs from the
    /// one handed over before (MDMA repeats a delivery every poll).
    pub(crate) fn offer(&self, token: LogsToken) {
        jobs::offer(&self.delivered, token);
    }
}

struct InstallJob {
    delivered: watch::Receiver<Option<LogsToken>>,
    /// The delivery last dealt with (installed, or the one held already).
    handled: Option<LogsToken>,
    cfg: LogsTokenConfig,
    units: Arc<dyn UnitControl>,
    metadata: Option<MetadataClient>,
    /// Asked to look at the token file at once, so polls report the new fingerprint.
    files: NodeFilesView,
    telemetry: Arc<Telemetry>,
}

/// Writes `token` to `file` unless the file holds the same bytes; `true` when written.
fn install(file: &Path, token: &[u8]) -> Result<bool, TokenInstallError> {
    // An oversized file cannot hold the delivered token: it is replaced.
    let held = match durable::read_capped(file, MAX_TOKEN) {
        Err(e) if e.kind() == std::io::ErrorKind::FileTooLarge => None,
        read => read.map_err(|source| TokenInstallError::Read {
            path: file.to_owned(),
            source,
        })?,
    };
    let held_fp = held.as_deref().map(token_fingerprint);
    if held_fp.as_deref() == Some(token_fingerprint(token).as_str()) {
        return Ok(false);
    }
    durable::write_atomically(file, token, TOKEN_MODE)?;
    Ok(true)
}

impl InstallJob {
    /// The endpoint for a shipper: configured, else the metadata attribute, else `""`.
    async fn endpoint(&self, configured: Option<&String>, attribute: MetadataAttribute) -> String {
        if let Some(e) = configured {
            return e.clone();
        }
        match &self.metadata {
            Some(md) => md.value(attribute).await.unwrap_or_else(|e| {
                warn!("cannot read the metadata's {attribute}: {e}");
                String::new()
            }),
            None => String::new(),
        }
    }

    /// Runs one shipper's configure script with the image's arguments; `true` when it
    /// succeeded. Each reason it cannot is a warning.
    async fn configure(&self, name: &str, script: &Path, config: &Path, endpoint: &str) -> bool {
        if endpoint.is_empty() {
            warn!(shipper = name, "no endpoint for {name} (configured or in the instance metadata): the token is stored but {name} is not configured");
            return false;
        }
        if !is_executable(script) || !config.is_file() {
            warn!(shipper = name, script = %script.display(), config = %config.display(), "{name} cannot be configured: its script is not executable or its config is missing");
            return false;
        }
        let token_file = self.cfg.file.as_os_str();
        let args = [
            config.as_os_str(),
            OsStr::new(endpoint),
            OsStr::new("true"),
            OsStr::new("provided"),
            token_file,
        ];
        match run_script(script, &args).await {
            Ok(()) => {
                info!(shipper = name, "configured {name} with the new token");
                true
            }
            Err(why) => {
                warn!(shipper = name, script = %script.display(), "configuring {name} failed: {why}; tried again with the next token MDMA delivers");
                false
            }
        }
    }
}

/// Runs `script` with `args` and only [`SCRIPT_PATH`] in its environment, at most
/// [`SCRIPT_TIMEOUT`] (killed after), keeping at most [`MAX_SCRIPT_OUTPUT`] bytes of its
/// stderr for the error.
///
/// Errors: why it did not succeed (not started, killed at the bound, a non-zero exit with
/// the end of its stderr).
pub(crate) async fn run_script(script: &Path, args: &[&OsStr]) -> Result<(), String> {
    let mut child = tokio::process::Command::new(script)
        .args(args)
        .env_clear()
        .env("PATH", SCRIPT_PATH)
        .env("LC_ALL", "C")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| format!("cannot start it: {e}"))?;
    let stderr = child.stderr.take();
    let run = async {
        let mut said = Vec::new();
        if let Some(err) = stderr {
            // What is past the cap is not read: the pipe closes when `err` is dropped.
            let _ = err.take(MAX_SCRIPT_OUTPUT).read_to_end(&mut said).await;
        }
        (child.wait().await, said)
    };
    match tokio::time::timeout(SCRIPT_TIMEOUT, run).await {
        Err(_) => Err(format!("no end within {SCRIPT_TIMEOUT:?}: killed")),
        Ok((Err(e), _)) => Err(format!("cannot wait for it: {e}")),
        Ok((Ok(status), _)) if status.success() => Ok(()),
        Ok((Ok(status), said)) => {
            let said = String::from_utf8_lossy(&said);
            Err(format!("{status}: {}", said.trim().escape_debug()))
        }
    }
}

#[async_trait]
impl Job for InstallJob {
    type Output = ();
    type Error = TokenInstallError;
    const NAME: &'static str = "logs_token_install";
    const FAILING: &'static str = "the delivered logs token cannot be stored";
    const EFFECT: &'static str = "retried with the back-off";
    const RECOVERED: &'static str = "the delivered logs token is stored";

    fn schedule(&self) -> Schedule {
        Schedule {
            every: None,
            min_gap: Duration::ZERO,
            deadline: FILES_DEADLINE
                .saturating_add(METADATA_TIMEOUT.saturating_mul(2))
                .saturating_add(SCRIPT_TIMEOUT.saturating_mul(2))
                .saturating_add(super::units::RESTART_TIMEOUT)
                .saturating_add(Duration::from_secs(1)),
            backoff: RETRY,
        }
    }

    async fn run(&mut self) -> Result<(), TokenInstallError> {
        let current = self.delivered.borrow_and_update().clone();
        if current == self.handled {
            return Ok(());
        }
        let Some(token) = current.clone() else {
            self.handled = current;
            return Ok(());
        };
        let file = self.cfg.file.clone();
        let bytes = token.expose().as_bytes().to_vec();
        let work = tokio::task::spawn_blocking(move || install(&file, &bytes));
        let written = match tokio::time::timeout(FILES_DEADLINE, work).await {
            Ok(Ok(done)) => done,
            Ok(Err(_)) | Err(_) => Err(TokenInstallError::Stalled(FILES_DEADLINE)),
        }
        .inspect_err(|_| Telemetry::count(&self.telemetry.logs_token_installs, "error"))?;
        self.handled = current;
        if !written {
            Telemetry::count(&self.telemetry.logs_token_installs, "unchanged");
            return Ok(());
        }
        let fp = token_fingerprint(token.expose().as_bytes());
        info!(path = %self.cfg.file.display(), logs_token_fp = %fp, "installed the log shippers' token MDMA delivered");
        Telemetry::count(&self.telemetry.logs_token_installs, "installed");
        self.files.look_soon();
        if self.cfg.vector {
            let endpoint = self
                .endpoint(
                    self.cfg.logs_endpoint.as_ref(),
                    MetadataAttribute::LogsEndpoint,
                )
                .await;
            let configured = self
                .configure(
                    "vector",
                    &self.cfg.vector_script,
                    &self.cfg.vector_config,
                    &endpoint,
                )
                .await;
            if configured {
                if let Err(e) = self.units.restart(&self.cfg.vector_unit).await {
                    warn!(unit = %self.cfg.vector_unit, "cannot restart vector for the new token: {e}");
                }
            }
        }
        if self.cfg.vmagent {
            let endpoint = self
                .endpoint(
                    self.cfg.metrics_endpoint.as_ref(),
                    MetadataAttribute::MetricsEndpoint,
                )
                .await;
            self.configure(
                "vmagent",
                &self.cfg.vmagent_script,
                &self.cfg.vmagent_config,
                &endpoint,
            )
            .await;
        }
        Ok(())
    }

    fn idle(&self) -> bool {
        *self.delivered.borrow() == self.handled
    }

    async fn wake(&mut self) {
        if self.delivered.changed().await.is_err() {
            // The loop is gone (shutdown): nothing will be delivered again.
            std::future::pending::<()>().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_is_written_only_when_it_differs_0600_without_a_newline() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("vector/provided_token");
        assert!(install(&file, b"tok-1").unwrap());
        assert_eq!(std::fs::read(&file).unwrap(), b"tok-1");
        let mode = std::fs::metadata(&file).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        assert!(
            !install(&file, b"tok-1").unwrap(),
            "the same token: nothing"
        );
        assert!(install(&file, b"tok-2").unwrap());
        assert_eq!(std::fs::read(&file).unwrap(), b"tok-2");
    }

    #[tokio::test]
    async fn a_script_gets_its_arguments_and_no_environment_and_is_bounded_in_output() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("out");
        let script = dir.path().join("s.sh");
        std::fs::write(
            &script,
            format!(
                "#!/bin/sh\necho \"$# $1 $2 ${{HTTPS_PROXY:-none}} $LC_ALL\" > {}\nhead -c 100000 /dev/zero >&2\nexit 3\n",
                out.display()
            ),
        )
        .unwrap();
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
        let err = run_script(&script, &[OsStr::new("a b"), OsStr::new("https://e")])
            .await
            .unwrap_err();
        assert!(err.starts_with("exit status: 3"), "{err}");
        assert!(
            err.len() < 4 * MAX_SCRIPT_OUTPUT as usize + 64,
            "{}",
            err.len()
        );
        assert_eq!(
            std::fs::read_to_string(&out).unwrap(),
            "2 a b https://e none C\n"
        );
        assert!(run_script(Path::new("/nonexistent"), &[]).await.is_err());
    }
}
