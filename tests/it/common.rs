//! Shared helpers: ids, a running daemon, waiting for a condition, seeding state.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use fleet_sidecar::daemon::Telemetry;
use fleet_sidecar::daemon::{self, DaemonError};
use fleet_sidecar::testing::sandbox::Sandbox;
use fleet_sidecar::GroupId;
use fleet_sidecar::{merod::MerodOp, MerodError};
use fleet_sidecar::{State, StateStore};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub const A: &str = "38069a4cc4285c4245c84587ac60084ba53502a8b91c9b108bca40f10ec4d3df";
pub const B: &str = "abababababababababababababababababababababababababababababababab";
pub const C: &str = "c0ffee00c0ffee00c0ffee00c0ffee00c0ffee00c0ffee00c0ffee00c0ffee00";
pub const D: &str = "d00dd00dd00dd00dd00dd00dd00dd00dd00dd00dd00dd00dd00dd00dd00dd00d";

/// Leave on the first withdrawing poll, no grace, no mass-withdrawal guard (a withdrawal of
/// everything held is one whatever `mass_drop_min` says: then a hold of 1 s, the least the
/// config allows), no hourly limit: the first reference's rules, so a poll misread as
/// "nothing assigned" would leave at once.
pub const REFERENCE: &str = "leave_after_polls = 1\nleave_grace = \"0s\"\nmass_drop_min = 1000\nmass_drop_hold = \"1s\"\nmax_leaves_per_hour = 1000";

pub fn gid(s: &str) -> GroupId {
    s.parse().expect("test ids are valid")
}

/// The group id whose 32 bytes are all `n`.
pub fn id(n: u8) -> GroupId {
    GroupId::from_bytes([n; 32])
}

/// `id(1)` … `id(n)`.
pub fn ids(n: u8) -> BTreeSet<GroupId> {
    (1..=n).map(id).collect()
}

/// A failed merod call of `op`, failing with `cause`.
pub fn merod_err(op: MerodOp, cause: &str) -> MerodError {
    MerodError::Call {
        op,
        url: "http://merod.test/".into(),
        source: cause.into(),
    }
}

pub fn set(ids: &[&str]) -> BTreeSet<GroupId> {
    ids.iter().map(|s| gid(s)).collect()
}

pub fn strings(ids: &[&str]) -> BTreeSet<String> {
    ids.iter().map(|s| s.to_string()).collect()
}

/// A daemon running in this process.
pub struct Running {
    shutdown: CancellationToken,
    handle: JoinHandle<Result<(), DaemonError>>,
    /// Its metrics and live status.
    pub telemetry: Arc<Telemetry>,
}

impl Running {
    /// The status listener (`/healthz`, `/readyz`, `/metrics`) for this daemon on a
    /// loopback port, ready while the last good poll is under `ready_max_poll_age` old;
    /// cancel the token to stop it.
    pub async fn serve_status(
        &self,
        ready_max_poll_age: Duration,
    ) -> (std::net::SocketAddr, CancellationToken) {
        let stop = CancellationToken::new();
        let addr = fleet_sidecar::daemon::serve_status(
            "127.0.0.1:0".parse().unwrap(),
            Arc::clone(&self.telemetry),
            ready_max_poll_age,
            stop.clone(),
        )
        .await
        .expect("the status listener binds loopback");
        (addr, stop)
    }

    pub async fn stop(self) {
        self.shutdown.cancel();
        let r = tokio::time::timeout(Duration::from_secs(15), self.handle)
            .await
            .expect("the daemon stops within the shutdown grace");
        r.expect("daemon task").expect("daemon result");
    }
}

pub fn start(sb: &Sandbox, extra: &str) -> Running {
    let cfg = sb.config(extra).expect("config");
    let deps = sb.deps(&cfg).expect("deps");
    spawn_loop(cfg, deps)
}

/// The daemon's loop with `cfg` on `deps`, as a task of this runtime.
pub fn spawn_loop(cfg: fleet_sidecar::Config, deps: daemon::Deps) -> Running {
    let telemetry = Arc::clone(&deps.telemetry);
    let shutdown = CancellationToken::new();
    let handle = tokio::spawn(daemon::run(cfg, deps, shutdown.clone()));
    Running {
        shutdown,
        handle,
        telemetry,
    }
}

/// Waits until `f` holds, polling every 50 ms; panics naming `what` after `limit`.
pub async fn eventually(what: &str, limit: Duration, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while !f() {
        assert!(
            start.elapsed() < limit,
            "timed out after {limit:?} waiting for: {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Writes a state document and returns its bytes.
pub fn seed(sb: &Sandbox, admitted: &[&str], confirmed: &[&str]) -> Vec<u8> {
    save_state(&sb.state_file(), &set(admitted), &set(confirmed));
    std::fs::read(sb.state_file()).expect("read seeded state")
}

/// Writes a state with `admitted` and `confirmed` to `path`.
pub fn save_state(
    path: &std::path::Path,
    admitted: &BTreeSet<GroupId>,
    confirmed: &BTreeSet<GroupId>,
) {
    StateStore::new(path)
        .save(&State {
            admitted: admitted.clone(),
            confirmed: confirmed.clone(),
            ..State::default()
        })
        .expect("seed state");
}

/// The state the daemon wrote (checked against proto/state.schema.json), or the empty
/// state when there is no file yet.
pub fn load(sb: &Sandbox) -> State {
    load_state(&sb.state_file())
}

/// The state at `path` (checked against proto/state.schema.json), or the empty state when
/// there is no file yet.
pub fn load_state(path: &std::path::Path) -> State {
    if let Ok(bytes) = std::fs::read(path) {
        crate::schema::assert_state_valid(&bytes);
    }
    StateStore::new(path)
        .load()
        .expect("state readable")
        .unwrap_or_default()
}

/// Waits for a child process to exit (polling, so the runtime keeps serving the emulators);
/// panics after `limit`.
pub async fn wait_exit(
    child: &mut std::process::Child,
    limit: Duration,
) -> std::process::ExitStatus {
    let t = Instant::now();
    loop {
        if let Some(s) = child.try_wait().expect("child status") {
            return s;
        }
        assert!(
            t.elapsed() < limit,
            "the daemon did not stop within {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The first `fleet-join` request merod received.
pub fn first_fleet_join(sb: &Sandbox) -> fleet_sidecar::testing::merod::CallRecord {
    sb.merod
        .calls()
        .into_iter()
        .find(|c| c.path == "/admin-api/tee/fleet-join")
        .expect("a fleet-join call")
}

/// A merod home (`{dir}/calimero/default/config.toml` with a PeerId) for tests that drive
/// the loop with in-memory fakes; `config` points the daemon at it.
pub struct NodeDir {
    pub dir: tempfile::TempDir,
}

impl NodeDir {
    pub fn new() -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let node = dir.path().join("calimero/default");
        std::fs::create_dir_all(&node).expect("node dir");
        std::fs::write(
            node.join("config.toml"),
            format!(
                "[identity]\npeer_id = \"{}\"\n",
                fleet_sidecar::testing::sandbox::PEER_ID
            ),
        )
        .expect("merod config");
        Self { dir }
    }

    /// A config with the state in `{dir}/state.json`, the MRTD from `{dir}/none` (absent
    /// unless a test writes it) and `extra` top-level keys.
    pub fn config(&self, extra: &str) -> fleet_sidecar::Config {
        let d = self.dir.path().display();
        let text = format!(
            "mdma_url = \"http://127.0.0.1:9\"\nstate_file = \"{d}/state.json\"\nlog_file = \"{d}/log\"\n{extra}\n[merod]\nhome = \"{d}/calimero\"\n[tdx]\nmrtd_path = \"{d}/none\"\nsources = [\"sysfs\"]\n[tls]\ndir = \"{d}/tls\"\n[logs_token]\nfile = \"{d}/provided_token\"\n"
        );
        fleet_sidecar::Config::from_toml(&text, std::path::Path::new("test.toml"))
            .expect("test config")
    }

    pub fn state_file(&self) -> std::path::PathBuf {
        self.dir.path().join("state.json")
    }

    /// Writes a state with `admitted` and `confirmed` to `state_file()`.
    pub fn seed(&self, admitted: &BTreeSet<GroupId>, confirmed: &BTreeSet<GroupId>) {
        save_state(&self.state_file(), admitted, confirmed);
    }

    /// The state the daemon wrote, as [`load_state`] reads it.
    pub fn state(&self) -> State {
        load_state(&self.state_file())
    }
}

/// A daemon process started by a test; killed (and reaped) when dropped, so a test that
/// fails before stopping it leaves no daemon behind polling a dead emulator.
pub struct DaemonProcess(Option<std::process::Child>);

impl DaemonProcess {
    /// Takes charge of a daemon a test spawned itself (killed and reaped when dropped).
    pub fn new(child: std::process::Child) -> Self {
        Self(Some(child))
    }

    /// Waits for it to exit and collects its piped output (see `Child::wait_with_output`).
    pub fn wait_with_output(mut self) -> std::io::Result<std::process::Output> {
        self.0.take().expect("a running child").wait_with_output()
    }

    /// Sends it `signal`.
    pub fn signal(&self, signal: nix::sys::signal::Signal) {
        let pid = nix::unistd::Pid::from_raw(self.id() as i32);
        nix::sys::signal::kill(pid, signal).expect("the daemon takes a signal");
    }

    /// Stops it with `signal` (SIGTERM or SIGINT), waits at most [`STOP_LIMIT`] for its exit
    /// (polling, so the runtime keeps serving the emulators; past it the test fails) and
    /// collects its piped output, exit status included.
    pub async fn stop_with(mut self, signal: nix::sys::signal::Signal) -> std::process::Output {
        self.signal(signal);
        wait_exit(&mut self, STOP_LIMIT).await;
        self.wait_with_output().expect("the daemon's output")
    }

    /// [`DaemonProcess::stop_with`] SIGTERM: what a test does at its end.
    pub async fn stop(self) -> std::process::Output {
        self.stop_with(nix::sys::signal::Signal::SIGTERM).await
    }
}

/// How long a stopped daemon may take to exit: its own shutdown grace is 10 s.
pub const STOP_LIMIT: Duration = Duration::from_secs(15);

/// How long one command of the daemon's binary (`check-config`, `status`, …) may take.
pub const RUN_LIMIT: Duration = Duration::from_secs(60);

/// The daemon binary run once with `args` (and `env`), its stdout and stderr read beside
/// the wait, bounded by [`RUN_LIMIT`] (killed past it, and the test fails).
pub fn run_once(args: &[&str], env: &[(&str, &str)]) -> std::process::Output {
    use std::io::Read;
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_fleet-sidecar"));
    cmd.args(args)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().expect("the binary starts");
    let read = |pipe: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut bytes = Vec::new();
            if let Some(mut pipe) = pipe {
                let _ = pipe.read_to_end(&mut bytes);
            }
            bytes
        })
    };
    let stdout = read(
        child
            .stdout
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    );
    let stderr = read(
        child
            .stderr
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    );
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("the binary's status") {
            break status;
        }
        if started.elapsed() > RUN_LIMIT {
            let _ = child.kill();
            let _ = child.wait();
            panic!("fleet-sidecar {args:?} did not end within {RUN_LIMIT:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    std::process::Output {
        status,
        stdout: stdout.join().expect("stdout read"),
        stderr: stderr.join().expect("stderr read"),
    }
}

impl std::ops::Deref for DaemonProcess {
    type Target = std::process::Child;
    fn deref(&self) -> &Self::Target {
        self.0.as_ref().expect("a running child")
    }
}

impl std::ops::DerefMut for DaemonProcess {
    fn deref_mut(&mut self) -> &mut Self::Target {
        self.0.as_mut().expect("a running child")
    }
}

impl Drop for DaemonProcess {
    fn drop(&mut self) {
        if let Some(child) = &mut self.0 {
            if let Ok(None) = child.try_wait() {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
    }
}

/// The daemon binary's `run` with `config`, its output piped (to read) or dropped, and
/// extra environment variables.
pub fn spawn_daemon(
    config: &std::path::Path,
    piped: bool,
    env: &[(&str, &std::ffi::OsStr)],
) -> DaemonProcess {
    let out = || {
        if piped {
            std::process::Stdio::piped()
        } else {
            std::process::Stdio::null()
        }
    };
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_fleet-sidecar"));
    cmd.arg("--config").arg(config).arg("run");
    for (k, v) in env {
        cmd.env(k, v);
    }
    DaemonProcess(Some(
        cmd.stdout(out())
            .stderr(out())
            .spawn()
            .expect("the daemon starts"),
    ))
}

/// A TLS server configuration (ring, safe default versions, no client auth) presenting
/// `leaf`, whose key is `key`.
pub fn tls_server_config(
    leaf: &rcgen::Certificate,
    key: &rcgen::KeyPair,
) -> tokio_rustls::rustls::ServerConfig {
    use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
    tokio_rustls::rustls::ServerConfig::builder_with_provider(Arc::new(
        tokio_rustls::rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .expect("ring supports the default versions")
    .with_no_client_auth()
    .with_single_cert(
        vec![CertificateDer::from(leaf.der().to_vec())],
        PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
    )
    .expect("a generated certificate and key")
}

/// The value of one series (`name{labels}`, exactly as exported) in a `/metrics` body;
/// panics naming it when it is not there (every series is exported from the start).
pub fn metric(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| {
            l.strip_prefix(series)?
                .strip_prefix(' ')?
                .trim()
                .parse()
                .ok()
        })
        .unwrap_or_else(|| panic!("no {series} in:\n{text}"))
}

/// A loopback HTTP server that reads the request, then writes `head` and hands the socket
/// to `then`.
pub async fn raw_server<F, Fut>(head: &'static str, then: F) -> url::Url
where
    F: Fn(tokio::net::TcpStream) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let then = Arc::new(then);
    tokio::spawn(async move {
        while let Ok((mut tcp, _)) = listener.accept().await {
            let then = Arc::clone(&then);
            tokio::spawn(async move {
                let mut buf = vec![0u8; 64 * 1024];
                let _ = tokio::io::AsyncReadExt::read(&mut tcp, &mut buf).await;
                if tokio::io::AsyncWriteExt::write_all(&mut tcp, head.as_bytes())
                    .await
                    .is_ok()
                {
                    then(tcp).await;
                }
            });
        }
    });
    format!("http://127.0.0.1:{port}/").parse().unwrap()
}

/// The head of a chunked `200` JSON answer, for [`raw_server`].
pub const CHUNKED: &str =
    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n";
