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
use std::path::Path;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use nix::unistd::Pid;
use tokio::io::AsyncReadExt;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::install::{deliveries, file_work, Delivered, Deliveries, InstallError, FILES_DEADLINE};
use super::node_files::{token_fingerprint, NodeFilesView};
use super::units::UnitControl;
use crate::config::{is_executable, Config, LogsTokenConfig};
use crate::durable;
use crate::jobs::{self, Job, Schedule};
use crate::mdma::LogsToken;
use crate::metadata::{MetadataAttribute, MetadataClient, METADATA_TIMEOUT};
use crate::telemetry::Telemetry;

/// The token file's mode: the shippers run as root on the image; nobody else reads it.
const TOKEN_MODE: u32 = 0o600;
/// Largest held token read (a token is a few hundred bytes).
const MAX_TOKEN: u64 = 64 * 1024;
/// Bound of one configure script (it may restart its service).
pub(crate) const SCRIPT_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a script's process group has after `TERM` (at the script's end or its bound)
/// before `KILL`.
pub(crate) const SCRIPT_GRACE: Duration = Duration::from_secs(5);
/// How often the group is looked at during that grace.
const GROUP_POLL: Duration = Duration::from_millis(50);
/// How long the script's stderr is still read once its group has ended.
const STDERR_AFTER_END: Duration = Duration::from_secs(1);
/// Most of a failing script's stderr kept for the warning.
const MAX_SCRIPT_OUTPUT: u64 = 2048;
/// The only variables a script gets: no proxy, locale or secret of the daemon's reaches it.
const SCRIPT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// The loop's end of the job: hands it the tokens polls deliver.
#[derive(Debug)]
pub(crate) struct TokenInstaller {
    delivered: Deliveries<LogsToken>,
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
        let (delivered, rx) = deliveries();
        let job = TokenInstallJob {
            delivered: rx,
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
        self.delivered.offer(token);
    }
}

struct TokenInstallJob {
    /// The deliveries, and the one dealt with last (installed, or the one held already).
    delivered: Delivered<LogsToken>,
    cfg: LogsTokenConfig,
    units: Arc<dyn UnitControl>,
    metadata: Option<MetadataClient>,
    /// Asked to look at the token file at once, so polls report the new fingerprint.
    files: NodeFilesView,
    telemetry: Arc<Telemetry>,
}

/// Writes `token` to `file` unless the file holds the same bytes; `true` when written.
fn install(file: &Path, token: &[u8]) -> Result<bool, InstallError> {
    // An oversized file cannot hold the delivered token: it is replaced.
    let held = match durable::read_capped(file, MAX_TOKEN) {
        Err(e) if e.kind() == std::io::ErrorKind::FileTooLarge => None,
        read => read.map_err(InstallError::read(file))?,
    };
    let held_fp = held.as_deref().map(token_fingerprint);
    if held_fp.as_deref() == Some(token_fingerprint(token).as_str()) {
        return Ok(false);
    }
    durable::write_atomically(file, token, TOKEN_MODE)?;
    Ok(true)
}

impl TokenInstallJob {
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

/// Runs `script` with `args` and only [`SCRIPT_PATH`] in its environment, in a process
/// group of its own, at most [`SCRIPT_TIMEOUT`], keeping at most [`MAX_SCRIPT_OUTPUT`] bytes
/// of its stderr for the error. When the script ends, or its time is up, whatever is left of
/// its group (a backgrounded command, children of a script that traps `TERM`) gets `TERM`,
/// then `KILL` after [`SCRIPT_GRACE`]: none of its processes outlives it. (A process that
/// leaves the group on purpose, with `setsid`, is out of reach.)
///
/// Errors: [`ScriptError`], why it did not succeed.
pub(crate) async fn run_script(script: &Path, args: &[&OsStr]) -> Result<(), ScriptError> {
    run_bounded(script, args, SCRIPT_TIMEOUT, SCRIPT_GRACE).await
}

/// Why a configure script did not succeed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ScriptError {
    /// It could not be started.
    #[error("cannot start it: {0}")]
    Start(#[source] std::io::Error),
    /// It did not end within its bound: its process group was killed.
    #[error("no end within {0:?}: its process group was killed")]
    NoEnd(Duration),
    /// Its end could not be waited for.
    #[error("cannot wait for it: {0}")]
    Wait(#[source] std::io::Error),
    /// It ended without success: its status and the end of its stderr (at most
    /// [`MAX_SCRIPT_OUTPUT`] bytes, escaped).
    #[error("{status}: {said}")]
    Failed {
        /// How it ended.
        status: std::process::ExitStatus,
        /// What it said on stderr.
        said: String,
    },
}

/// [`run_script`] within `limit`, its group given `grace` between `TERM` and `KILL`.
async fn run_bounded(
    script: &Path,
    args: &[&OsStr],
    limit: Duration,
    grace: Duration,
) -> Result<(), ScriptError> {
    let mut child = tokio::process::Command::new(script)
        .args(args)
        .env_clear()
        .env("PATH", SCRIPT_PATH)
        .env("LC_ALL", "C")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        // Its own group (its id the script's pid): what it starts can be ended with it.
        .process_group(0)
        .kill_on_drop(true)
        .spawn()
        .map_err(ScriptError::Start)?;
    let group = child
        .id()
        .and_then(|id| i32::try_from(id).ok())
        .map(Pid::from_raw);
    let stderr = child.stderr.take();
    // Read beside the wait: a backgrounded command holding the pipe open must not hold
    // the script's end.
    let reader = tokio::spawn(async move {
        let mut said = Vec::new();
        if let Some(err) = stderr {
            // What is past the cap is not read: the pipe closes when `err` is dropped.
            let _ = err.take(MAX_SCRIPT_OUTPUT).read_to_end(&mut said).await;
        }
        said
    });
    let waited = tokio::time::timeout(limit, child.wait()).await;
    if let Some(group) = group {
        end_group(group, &mut child, grace).await;
    }
    // Every writer of the pipe is gone now, but one that left the group: bounded.
    let said = match tokio::time::timeout(STDERR_AFTER_END, reader).await {
        Ok(Ok(said)) => said,
        _ => Vec::new(),
    };
    match waited {
        Err(_) => Err(ScriptError::NoEnd(limit)),
        Ok(Err(e)) => Err(ScriptError::Wait(e)),
        Ok(Ok(status)) if status.success() => Ok(()),
        Ok(Ok(status)) => {
            let said = String::from_utf8_lossy(&said);
            Err(ScriptError::Failed {
                status,
                said: said.trim().escape_debug().to_string(),
            })
        }
    }
}

/// Ends what is left of process group `group` (the script `child` leads it): `TERM`, then
/// `KILL` once `grace` passed with a process still in it. Returns at once when the group is
/// empty. The script is reaped on the way, so that it does not count as left.
async fn end_group(group: Pid, child: &mut tokio::process::Child, grace: Duration) {
    use nix::sys::signal::{killpg, Signal};
    let left = |child: &mut tokio::process::Child| {
        let _ = child.try_wait();
        killpg(group, None).is_ok()
    };
    if !left(child) {
        return;
    }
    let _ = killpg(group, Signal::SIGTERM);
    let deadline = tokio::time::Instant::now() + grace;
    while tokio::time::Instant::now() < deadline {
        tokio::time::sleep(GROUP_POLL).await;
        if !left(child) {
            return;
        }
    }
    warn!("a configure script's processes outlived {grace:?} after TERM: killed");
    let _ = killpg(group, Signal::SIGKILL);
    // Reaped, so no zombie of it stays (KILL cannot be refused).
    let _ = tokio::time::timeout(grace, child.wait()).await;
}

impl Job for TokenInstallJob {
    type Output = ();
    type Error = InstallError;
    const NAME: &'static str = "logs_token_install";
    const FAILING: &'static str = "the delivered logs token cannot be stored";
    const RECOVERED: &'static str = "the delivered logs token is stored";

    fn schedule(&self) -> Schedule {
        Schedule::when_asked(
            FILES_DEADLINE
                .saturating_add(METADATA_TIMEOUT.saturating_mul(2))
                .saturating_add(
                    SCRIPT_TIMEOUT
                        .saturating_add(SCRIPT_GRACE.saturating_mul(2))
                        .saturating_add(STDERR_AFTER_END)
                        .saturating_mul(2),
                )
                .saturating_add(super::units::RESTART_TIMEOUT)
                .saturating_add(Duration::from_secs(1)),
        )
    }

    async fn run(&mut self) -> Result<(), InstallError> {
        let Some(current) = self.delivered.new_one() else {
            return Ok(());
        };
        let Some(token) = current.clone() else {
            self.delivered.dealt_with(current);
            return Ok(());
        };
        let file = self.cfg.file.clone();
        let bytes = token.expose().as_bytes().to_vec();
        let written = file_work("the token file", move || install(&file, &bytes))
            .await
            .inspect_err(|_| Telemetry::count(&self.telemetry.logs_token_installs, "error"))?;
        self.delivered.dealt_with(current);
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
        self.delivered.all_dealt_with()
    }

    async fn wake(&mut self) {
        self.delivered.changed().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

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
            .unwrap_err()
            .to_string();
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

    /// An executable script in `dir` whose body is `body`; its background child's pid goes
    /// to `dir/child.pid`.
    fn script(dir: &Path, body: &str) -> PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let script = dir.join("s.sh");
        std::fs::write(&script, format!("#!/bin/sh\n{body}\n")).unwrap();
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
        script
    }

    /// Whether `pid` is gone (or a zombie its new parent has yet to reap), within 5 s.
    async fn gone_soon(pid_file: &Path) -> bool {
        let pid: i32 = std::fs::read_to_string(pid_file)
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        for _ in 0..100 {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            // The state follows the command's closing parenthesis.
            let state = stat.rsplit_once(") ").map(|(_, rest)| &rest[..1]);
            if matches!(state, None | Some("Z") | Some("X")) {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        false
    }

    #[tokio::test]
    async fn a_script_s_backgrounded_command_ends_with_it() {
        let dir = tempfile::tempdir().unwrap();
        let pid = dir.path().join("child.pid");
        let s = script(
            dir.path(),
            &format!("sleep 300 &\necho $! > {}\nexit 0", pid.display()),
        );
        // Its end is the script's, not its child's (which holds the stderr pipe open).
        run_bounded(&s, &[], Duration::from_secs(30), Duration::from_secs(2))
            .await
            .expect("the script itself succeeded");
        assert!(gone_soon(&pid).await, "the backgrounded sleep survived");
    }

    #[tokio::test]
    async fn at_its_limit_a_script_trapping_term_and_its_children_are_killed() {
        let dir = tempfile::tempdir().unwrap();
        let pid = dir.path().join("child.pid");
        let s = script(
            dir.path(),
            &format!(
                "trap '' TERM\nsh -c \"trap '' TERM; sleep 300\" &\necho $! > {}\nwhile :; do sleep 1; done",
                pid.display()
            ),
        );
        // 5 s: time for the script to start its child on a loaded machine.
        let err = run_bounded(&s, &[], Duration::from_secs(5), Duration::from_secs(1))
            .await
            .unwrap_err();
        assert!(matches!(err, ScriptError::NoEnd(_)), "{err}");
        assert!(gone_soon(&pid).await, "the child ignoring TERM survived");
    }
}
