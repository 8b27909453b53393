//! Device-key login on images built with delegated access: merod's node key handed to
//! `mero-auth` (the login service), which lets a member log in with their device key. A job
//! beside the loop, independent of MDMA.
//!
//! Each check ([`LoginJob::run`]): while `[device_login] marker` exists, the key is read from
//! merod ([`MerodClient::node_key`](crate::merod::MerodClient::node_key): 64 hex, or rc.25's base58 of 32 bytes; anything else, a
//! 404 or no answer is no key and changes nothing). The same key as the one last handed over
//! ends the check. A key that differs from `key_file`'s is written there (64 lowercase hex
//! and a newline, mode 0600, atomically) and every unit of `restart_units` is restarted
//! through systemd's D-Bus API. A key the file already holds restarts only the units that
//! did not become active after the file was last written (`ActiveEnterTimestamp`; unknown
//! counts as not after): a daemon restart leaves a `mero-auth` that already read the key
//! alone. A failed restart fails the check, which is retried with the back-off; the next
//! one finds that unit still older than the file and restarts it.
//!
//! Checks come every [`WITH_KEY_EVERY`] once login is on, every [`WITHOUT_KEY_EVERY`]
//! otherwise (no marker, no key yet), and a failing one is retried within that too.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info};

use super::install::{file_work, InstallError, FILES_DEADLINE};
use super::units::{UnitControl, RESTART_TIMEOUT};
use crate::backoff::{Backoff, Jitter, RETRY_MIN};
use crate::config::{Config, DeviceLoginConfig};
use crate::durable;
use crate::jobs::{self, Job, Schedule};
use crate::merod::{MerodError, NodeKey, OnMerod, CHECK_TIMEOUT};
use crate::outcome::Timed;
use crate::telemetry::Telemetry;

/// Between checks while login is on (the key handed over).
pub(crate) const WITH_KEY_EVERY: Duration = Duration::from_secs(300);
/// Between checks while it is not (no marker, no key yet), and the longest wait after a
/// failed check.
pub(crate) const WITHOUT_KEY_EVERY: Duration = Duration::from_secs(15);
/// The key file's mode: only root (`mero-auth-start.sh`) reads it.
const KEY_MODE: u32 = 0o600;
/// Largest key file read: a key is 65 bytes; a larger file is not one and is replaced.
const MAX_KEY_FILE: u64 = 4096;
/// After a failed check: [`RETRY_MIN`] doubling to [`WITHOUT_KEY_EVERY`].
const RECHECK: Backoff = Backoff::new(RETRY_MIN, WITHOUT_KEY_EVERY, Jitter::Down);

/// Reads merod's node key ([`MerodClient`](crate::merod::MerodClient); a fake in tests).
#[async_trait]
pub(crate) trait NodeKeySource: Send + Sync {
    /// [`MerodClient::node_key`](crate::merod::MerodClient::node_key).
    async fn node_key(&self) -> Result<Option<NodeKey>, MerodError>;
}

#[async_trait]
impl<T: OnMerod> NodeKeySource for T {
    async fn node_key(&self) -> Result<Option<NodeKey>, MerodError> {
        self.merod().node_key().await
    }
}

/// What a good check found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Login {
    /// No marker: login is not handed over.
    Off,
    /// The marker, but merod holds no device yet (its "not minted" 404).
    NoKey,
    /// This key is in the key file and every unit started after it was written.
    On(NodeKey),
}

/// Why a check failed (nothing is changed but what it did before failing; retried).
#[derive(Debug, thiserror::Error)]
pub(crate) enum LoginError {
    /// Whether the marker exists could not be told.
    #[error("cannot tell whether {path} exists: {source}")]
    Marker {
        /// The marker.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// merod's key could not be read, or what it answered is not a key.
    #[error("no node key from merod: {0}")]
    Key(#[source] MerodError),
    /// The key file could not be read or written (or not within its bound), or a unit
    /// could not be restarted.
    #[error(transparent)]
    Install(#[from] InstallError),
}

impl Timed for LoginError {
    fn is_timeout(&self) -> bool {
        match self {
            LoginError::Install(e) => e.is_timeout(),
            LoginError::Key(e) => e.is_timeout(),
            LoginError::Marker { .. } => false,
        }
    }
}

/// What the key file holds: its text, trimmed, and when it was last written.
#[derive(Debug, Default)]
struct KeyFile {
    /// `None`: no file, or one that cannot be a key (too large, not UTF-8).
    text: Option<String>,
    modified: Option<SystemTime>,
}

/// Starts the job for `cfg`'s `[device_login]`; nothing when it is off, in a dry run, or
/// without `source` (a test's own merod).
pub(crate) fn start(
    cfg: &Config,
    source: Option<Arc<dyn NodeKeySource>>,
    units: Arc<dyn UnitControl>,
    telemetry: Arc<Telemetry>,
    shutdown: CancellationToken,
) {
    let Some(source) = source else { return };
    if !cfg.device_login.enabled || cfg.dry_run {
        return;
    }
    jobs::spawn(
        LoginJob::new(cfg.device_login.clone(), source, units),
        telemetry,
        shutdown,
    );
}

/// The job: one check per run.
pub(crate) struct LoginJob {
    cfg: DeviceLoginConfig,
    source: Arc<dyn NodeKeySource>,
    units: Arc<dyn UnitControl>,
    /// The key last handed over (written and every unit started after it).
    active: Option<NodeKey>,
    /// What the latest good check found (each change is said once).
    found: Option<Login>,
    /// When the next check is due; `None` after a failed one (the back-off decides).
    next: Option<Instant>,
}

impl LoginJob {
    fn new(
        cfg: DeviceLoginConfig,
        source: Arc<dyn NodeKeySource>,
        units: Arc<dyn UnitControl>,
    ) -> Self {
        Self {
            cfg,
            source,
            units,
            active: None,
            found: None,
            next: None,
        }
    }

    /// One check (see the module docs).
    async fn check(&mut self) -> Result<Login, LoginError> {
        let marker = self.cfg.marker.clone();
        if !files(move || marker_exists(&marker)).await? {
            self.active = None;
            return Ok(Login::Off);
        }
        let key = match self.source.node_key().await.map_err(LoginError::Key)? {
            None => {
                self.active = None;
                return Ok(Login::NoKey);
            }
            Some(key) => key,
        };
        if self.active == Some(key) {
            return Ok(Login::On(key));
        }
        let path = self.cfg.key_file.clone();
        let held = files(move || read_key_file(&path)).await?;
        let restart = if held.text.as_deref() != Some(key.to_string().as_str()) {
            let path = self.cfg.key_file.clone();
            let line = format!("{key}\n");
            files(move || {
                durable::write_atomically(&path, line.as_bytes(), KEY_MODE)
                    .map_err(|e| LoginError::from(InstallError::from(e)))
            })
            .await?;
            info!(path = %self.cfg.key_file.display(), node_key = %key, "wrote merod's node key for device-key login");
            self.cfg.restart_units.clone()
        } else {
            let mut stale = Vec::new();
            for unit in &self.cfg.restart_units {
                let since = self.units.active_since(unit).await;
                if !started_after(since.as_ref().ok().copied().flatten(), held.modified) {
                    debug!(unit = %unit, since = ?since, "became active before the key file was written");
                    stale.push(unit.clone());
                }
            }
            stale
        };
        for unit in &restart {
            self.units
                .restart(unit)
                .await
                .map_err(|source| InstallError::Restart {
                    unit: unit.clone(),
                    source,
                })?;
        }
        self.active = Some(key);
        if restart.is_empty() {
            info!(node_key = %key, "device-key login is on for node key {key}");
        } else {
            info!(node_key = %key, restarted = ?restart, "device-key login is on for node key {key} ({} restarted)", restart.join(", "));
        }
        Ok(Login::On(key))
    }

    /// Says a change of what the checks find (the key's own line is said by the check).
    fn tell(&mut self, now: Login) {
        let before = self.found.replace(now);
        if before == Some(now) {
            return;
        }
        match now {
            Login::Off if matches!(before, Some(Login::On(_))) => info!(
                marker = %self.cfg.marker.display(),
                "device-key login is no longer kept up: the marker is gone"
            ),
            Login::Off => debug!(
                marker = %self.cfg.marker.display(),
                "device-key login is off: no marker"
            ),
            Login::NoKey => info!("device-key login waits: merod holds no device key yet"),
            Login::On(_) => {}
        }
    }
}

/// Runs `work` off the runtime, bounded by [`FILES_DEADLINE`].
async fn files<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, LoginError> + Send + 'static,
) -> Result<T, LoginError> {
    file_work("the key file", work).await
}

fn marker_exists(path: &Path) -> Result<bool, LoginError> {
    path.try_exists().map_err(|source| LoginError::Marker {
        path: path.to_owned(),
        source,
    })
}

/// The key file as it is; a file too large or not UTF-8 holds no key (it is replaced).
fn read_key_file(path: &Path) -> Result<KeyFile, LoginError> {
    let read_err = |source| LoginError::from(InstallError::read(path)(source));
    let bytes = match durable::read_capped(path, MAX_KEY_FILE) {
        Ok(None) => return Ok(KeyFile::default()),
        Err(e) if e.kind() == std::io::ErrorKind::FileTooLarge => return Ok(KeyFile::default()),
        Err(e) => return Err(read_err(e)),
        Ok(Some(bytes)) => bytes,
    };
    let modified = std::fs::metadata(path)
        .and_then(|m| m.modified())
        .map_err(read_err)?;
    Ok(KeyFile {
        text: String::from_utf8(bytes).ok().map(|t| t.trim().to_owned()),
        modified: Some(modified),
    })
}

/// Whether a unit that became active at `since` (`None`: never, or unknown) has read a key
/// file last written at `written` (`None`: unknown): only when strictly later.
fn started_after(since: Option<SystemTime>, written: Option<SystemTime>) -> bool {
    matches!((since, written), (Some(since), Some(written)) if since > written)
}

impl Job for LoginJob {
    type Output = Login;
    type Error = LoginError;
    const NAME: &'static str = "device_login";
    const FAILING: &'static str = "device-key login cannot be kept up";
    const EFFECT: &'static str = "nothing changed; checked again with the back-off";
    const RECOVERED: &'static str = "device-key login checks work again";

    fn schedule(&self) -> Schedule {
        let units = u32::try_from(self.cfg.restart_units.len()).unwrap_or(u32::MAX);
        // Two file steps, the key read, and per unit its timestamp and its restart.
        let deadline = FILES_DEADLINE
            .saturating_mul(2)
            .saturating_add(CHECK_TIMEOUT)
            .saturating_add(RESTART_TIMEOUT.saturating_mul(units.saturating_mul(2)))
            .saturating_add(Duration::from_secs(1));
        Schedule::when_asked(deadline)
            .min_gap(Duration::from_secs(1))
            .backoff(RECHECK)
    }

    async fn run(&mut self) -> Result<Login, LoginError> {
        let started = Instant::now();
        self.next = None;
        let found = self.check().await?;
        self.tell(found);
        let every = match found {
            Login::On(_) => WITH_KEY_EVERY,
            Login::Off | Login::NoKey => WITHOUT_KEY_EVERY,
        };
        self.next = Some(started + every);
        Ok(found)
    }

    fn failed(&mut self, _why: &str) {
        self.next = None;
    }

    async fn wake(&mut self) {
        jobs::sleep_until(self.next).await;
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::os::unix::fs::PermissionsExt;
    use std::sync::Mutex;

    use super::*;
    use crate::jobs::units::UnitError;
    use crate::merod::MerodOp;

    const K1: &str = "6f74442edba9238bfaf0a993ccf53b117e36e350614a1b7ba7c8a8ecf7422c5f";
    const K2: &str = "1111111111111111111111111111111111111111111111111111111111111111";
    const AUTH: &str = "mero-auth.service";

    fn key(hex: &str) -> NodeKey {
        NodeKey::parse(hex).unwrap()
    }

    /// merod: the answer each read gets, and how many were made.
    #[derive(Default)]
    struct Merod {
        answer: Mutex<Option<Result<Option<NodeKey>, ()>>>,
        reads: Mutex<usize>,
    }

    impl Merod {
        fn answer(&self, a: Result<Option<NodeKey>, ()>) {
            *self.answer.lock().unwrap() = Some(a);
        }
    }

    #[async_trait]
    impl NodeKeySource for Merod {
        async fn node_key(&self) -> Result<Option<NodeKey>, MerodError> {
            *self.reads.lock().unwrap() += 1;
            match *self.answer.lock().unwrap() {
                Some(Ok(k)) => Ok(k),
                _ => Err(MerodError::Answer {
                    op: MerodOp::Identity,
                    url: "http://127.0.0.1:2528/admin-api/identity".to_owned(),
                    reason: "publicKey is not a key".to_owned(),
                }),
            }
        }
    }

    /// systemd: when each unit became active (absent: never), the restarts it took (a
    /// restart makes the unit active now), the next `refuse` of them refused, and whether
    /// timestamps can be read at all.
    #[derive(Default)]
    struct Units {
        since: Mutex<HashMap<String, SystemTime>>,
        restarted: Mutex<Vec<String>>,
        refuse: Mutex<u32>,
        blind: Mutex<bool>,
    }

    impl Units {
        fn restarts(&self) -> Vec<String> {
            self.restarted.lock().unwrap().clone()
        }
        fn active_at(&self, unit: &str, at: SystemTime) {
            self.since.lock().unwrap().insert(unit.to_owned(), at);
        }
    }

    #[async_trait]
    impl UnitControl for Units {
        async fn restart(&self, unit: &str) -> Result<(), UnitError> {
            let mut refuse = self.refuse.lock().unwrap();
            if *refuse > 0 {
                *refuse -= 1;
                return Err(UnitError::Other("Access denied".to_owned()));
            }
            self.restarted.lock().unwrap().push(unit.to_owned());
            self.active_at(unit, SystemTime::now() + Duration::from_secs(1));
            Ok(())
        }
        async fn active_since(&self, unit: &str) -> Result<Option<SystemTime>, UnitError> {
            if *self.blind.lock().unwrap() {
                return Err(UnitError::Other("no bus".to_owned()));
            }
            Ok(self.since.lock().unwrap().get(unit).copied())
        }
    }

    struct Case {
        dir: tempfile::TempDir,
        merod: Arc<Merod>,
        units: Arc<Units>,
        job: LoginJob,
    }

    impl Case {
        /// A job over `units`, its marker present, merod answering `K1`.
        fn new(units: &[&str]) -> Self {
            let dir = tempfile::tempdir().unwrap();
            let cfg = DeviceLoginConfig {
                enabled: true,
                marker: dir.path().join("device-key-login"),
                key_file: dir.path().join("login-node-key"),
                restart_units: units.iter().map(|u| (*u).to_owned()).collect(),
            };
            std::fs::write(&cfg.marker, "").unwrap();
            let merod = Arc::new(Merod::default());
            merod.answer(Ok(Some(key(K1))));
            let units = Arc::new(Units::default());
            let job = LoginJob::new(cfg, merod.clone(), units.clone());
            Self {
                dir,
                merod,
                units,
                job,
            }
        }
        fn file(&self) -> std::path::PathBuf {
            self.dir.path().join("login-node-key")
        }
        fn written(&self) -> Option<String> {
            std::fs::read_to_string(self.file()).ok()
        }
        fn mtime(&self) -> SystemTime {
            std::fs::metadata(self.file()).unwrap().modified().unwrap()
        }
        /// The same job after a daemon restart: nothing in memory.
        fn restarted_daemon(&mut self) {
            self.job = LoginJob::new(self.job.cfg.clone(), self.merod.clone(), self.units.clone());
        }
    }

    #[tokio::test]
    async fn without_the_marker_nothing_is_read_written_or_restarted() {
        let mut c = Case::new(&[AUTH]);
        std::fs::remove_file(c.dir.path().join("device-key-login")).unwrap();
        assert_eq!(c.job.run().await.unwrap(), Login::Off);
        assert_eq!(*c.merod.reads.lock().unwrap(), 0, "merod is not asked");
        assert_eq!(c.written(), None);
        assert!(c.units.restarts().is_empty());
        let next = c.job.next.unwrap() - Instant::now();
        assert!(next <= WITHOUT_KEY_EVERY && next > WITHOUT_KEY_EVERY - Duration::from_secs(2));
    }

    #[tokio::test]
    async fn no_key_yet_or_a_failed_read_records_nothing() {
        let mut c = Case::new(&[AUTH]);
        c.merod.answer(Ok(None));
        assert_eq!(c.job.run().await.unwrap(), Login::NoKey);
        assert!(c.job.next.is_some());
        // Not a key (a 404 of another shape, a non-hex key, no answer): an error, retried.
        c.merod.answer(Err(()));
        let e = c.job.run().await.unwrap_err();
        assert!(matches!(e, LoginError::Key(_)), "{e}");
        c.job.failed(&e.to_string());
        assert_eq!(c.job.next, None, "the back-off decides the next check");
        assert_eq!(c.written(), None);
        assert!(c.units.restarts().is_empty());
    }

    #[tokio::test]
    async fn a_new_key_is_written_0600_with_one_restart_and_the_same_key_restarts_nothing() {
        let mut c = Case::new(&[AUTH]);
        assert_eq!(c.job.run().await.unwrap(), Login::On(key(K1)));
        assert_eq!(c.written().as_deref(), Some(&format!("{K1}\n")[..]));
        let mode = std::fs::metadata(c.file()).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        assert_eq!(c.units.restarts(), [AUTH]);
        let next = c.job.next.unwrap() - Instant::now();
        assert!(next <= WITH_KEY_EVERY && next > WITH_KEY_EVERY - Duration::from_secs(2));
        let mtime = c.mtime();
        for _ in 0..3 {
            assert_eq!(c.job.run().await.unwrap(), Login::On(key(K1)));
        }
        assert_eq!(c.units.restarts(), [AUTH], "the same key: no restart");
        assert_eq!(c.mtime(), mtime, "nor a write");
        assert_eq!(
            *c.merod.reads.lock().unwrap(),
            4,
            "but the key is read each check"
        );

        // A re-key: written again, a second restart.
        c.merod.answer(Ok(Some(key(K2))));
        assert_eq!(c.job.run().await.unwrap(), Login::On(key(K2)));
        assert_eq!(c.written().as_deref(), Some(&format!("{K2}\n")[..]));
        assert_eq!(c.units.restarts(), [AUTH, AUTH]);
    }

    #[tokio::test]
    async fn a_key_file_older_than_the_units_start_sets_login_on_without_a_restart() {
        let mut c = Case::new(&[AUTH]);
        std::fs::write(c.file(), format!(" {K1} \n")).unwrap();
        c.units
            .active_at(AUTH, c.mtime() + Duration::from_millis(1));
        assert_eq!(c.job.run().await.unwrap(), Login::On(key(K1)));
        assert!(c.units.restarts().is_empty(), "mero-auth read this key");
        assert_eq!(
            c.written().as_deref(),
            Some(&format!(" {K1} \n")[..]),
            "kept"
        );
        assert_eq!(c.job.active, Some(key(K1)));
    }

    #[tokio::test]
    async fn a_key_file_newer_than_the_units_start_or_an_unknown_start_restarts() {
        for (name, since) in [
            ("started at the very write", Some(Duration::ZERO)),
            ("started before", Some(Duration::from_secs(5))),
            ("never started", None),
        ] {
            let mut c = Case::new(&[AUTH]);
            std::fs::write(c.file(), format!("{K1}\n")).unwrap();
            if let Some(before) = since {
                c.units.active_at(AUTH, c.mtime() - before);
            }
            assert_eq!(c.job.run().await.unwrap(), Login::On(key(K1)), "{name}");
            assert_eq!(c.units.restarts(), [AUTH], "{name}");
        }
        // systemd's timestamp cannot be read: unknown is not "after".
        let mut c = Case::new(&[AUTH]);
        std::fs::write(c.file(), format!("{K1}\n")).unwrap();
        c.units.active_at(AUTH, c.mtime() + Duration::from_secs(5));
        *c.units.blind.lock().unwrap() = true;
        c.job.run().await.unwrap();
        assert_eq!(c.units.restarts(), [AUTH]);
    }

    #[tokio::test]
    async fn a_failed_restart_fails_the_check_and_the_next_restarts_only_what_is_stale() {
        let mut c = Case::new(&["a.service", "b.service"]);
        *c.units.refuse.lock().unwrap() = 1;
        let e = c.job.run().await.unwrap_err();
        assert!(e.to_string().contains("restart of a.service"), "{e}");
        assert_eq!(c.job.active, None);
        assert_eq!(c.written().as_deref(), Some(&format!("{K1}\n")[..]));
        // The retry: the file already holds the key, neither unit started after it.
        c.job.failed(&e.to_string());
        assert_eq!(c.job.run().await.unwrap(), Login::On(key(K1)));
        assert_eq!(c.units.restarts(), ["a.service", "b.service"]);

        // A daemon restart: a started after the file, b refused again and then retried.
        let mut c = Case::new(&["a.service", "b.service"]);
        c.job.run().await.unwrap();
        c.units
            .active_at("b.service", c.mtime() - Duration::from_secs(1));
        c.restarted_daemon();
        assert_eq!(c.job.run().await.unwrap(), Login::On(key(K1)));
        assert_eq!(
            c.units.restarts(),
            ["a.service", "b.service", "b.service"],
            "only b, which started before the file"
        );
    }

    #[tokio::test]
    async fn a_marker_that_goes_and_comes_back_is_checked_again() {
        let mut c = Case::new(&[AUTH]);
        c.job.run().await.unwrap();
        let marker = c.dir.path().join("device-key-login");
        std::fs::remove_file(&marker).unwrap();
        assert_eq!(c.job.run().await.unwrap(), Login::Off);
        assert_eq!(c.job.active, None);
        assert!(c.written().is_some(), "the file is left as it is");
        std::fs::write(&marker, "").unwrap();
        assert_eq!(c.job.run().await.unwrap(), Login::On(key(K1)));
        assert_eq!(
            c.units.restarts(),
            [AUTH],
            "mero-auth started after the file"
        );
    }

    #[tokio::test]
    async fn a_file_that_cannot_hold_a_key_is_replaced() {
        for junk in [vec![b'x'; 5000], vec![0xff, 0xfe], b"not a key\n".to_vec()] {
            let mut c = Case::new(&[AUTH]);
            std::fs::write(c.file(), &junk).unwrap();
            c.units.active_at(AUTH, c.mtime() + Duration::from_secs(5));
            c.job.run().await.unwrap();
            assert_eq!(c.written().as_deref(), Some(&format!("{K1}\n")[..]));
            assert_eq!(c.units.restarts(), [AUTH]);
        }
    }

    #[test]
    fn only_a_start_strictly_after_the_write_counts() {
        let t = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000);
        let later = t + Duration::from_micros(1);
        assert!(started_after(Some(later), Some(t)));
        assert!(!started_after(Some(t), Some(t)));
        assert!(!started_after(Some(t), Some(later)));
        assert!(!started_after(None, Some(t)));
        assert!(!started_after(Some(later), None));
    }
}
