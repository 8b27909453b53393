//! The fleet token the polls carry, kept by a job on the job harness (`jobs`) beside the
//! loop: `fleet_token_file` or `registration` (it never stalls a poll: every call it makes
//! is bounded, each run too, and the loop never waits for it).
//!
//! Two ways to hold a token (docs/operator/fleet-token.md):
//! - **configured**: `fleet_token`, or `fleet_token_file`, which is read again after every
//!   poll MDMA refuses (401/403) and on SIGHUP, so a replaced file is used without a restart;
//! - **registration** (`[registration]`): the node earns its own token with a TDX quote
//!   (docs/mdma.md, "Attested registration"): the challenge, the nonce
//!   `sha256(challenge|peer_id|account|relay_url)`, a quote from merod over it, then
//!   `register`. The token is kept in `token_file` (0600, directory 0700, written
//!   atomically) and reused after a restart; the identity it was issued to is kept beside it
//!   in `fleet-registration.json`.
//!
//! When to attempt is decided by [`Machine`], pure (no I/O, no clock: `now` is passed in):
//! at once while no token is held; again once polls have been refused for
//! [`REJECTED_FOR`] in a row, or when the identity differs from the one registered with;
//! every attempt after the first waits `retry_interval` doubling up to [`RETRY_CAP`],
//! jittered, until MDMA accepts a poll with the token, so a fleet whose MDMA refuses
//! everyone does not storm it.
//!
//! Neither the issued token nor the enrolment token is ever logged, put in an error, in
//! `Debug`, `/status` or a metric: both are wrapped ([`FleetToken`], [`EnrolmentToken`]) and
//! leave the process only in the `X-Fleet-Token` header, the `register` body and the token
//! file.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tokio::sync::{watch, Notify};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::backoff::{Backoff, Jitter};
use crate::config::{read_token_file, Config, RegistrationConfig, TokenFileProblem};
use crate::durable::{self, parent_dir};
use crate::ids::PeerId;
use crate::jobs::{self, Job, Schedule};
use crate::mdma::{
    EnrolmentToken, FleetToken, MdmaClient, PollVerdict, RegisterError, RegisterRequest,
    CHALLENGE_TIMEOUT, REGISTER_TIMEOUT,
};
use crate::merod::{ListenCandidates, MerodError, NodeAccount, ATTEST_TIMEOUT, CHECK_TIMEOUT};
use crate::metadata::{MetadataAttribute, MetadataClient, MetadataError};
use crate::node_tls::{registration_csr, Csr, KeyUnreadable};
use crate::outcome::Timed;
use crate::telemetry::Telemetry;

/// Polls refused (401/403) for this long in a row make a held token count as rejected: the
/// node registers again.
pub(crate) const REJECTED_FOR: Duration = Duration::from_secs(30);
/// The longest wait between two registration attempts.
pub(crate) const RETRY_CAP: Duration = Duration::from_secs(600);
/// How often, while a token is held, the identity (account, relay URL) is read again to
/// find a change.
pub(crate) const IDENTITY_CHECK_INTERVAL: Duration = crate::metadata::REREAD_EVERY;
/// The identity a token was issued to, beside the token file (the reference's name).
pub(crate) const RECORD_FILE: &str = "fleet-registration.json";

/// Who the node is to MDMA: what the nonce binds and what a token was issued to. Written as
/// `fleet-registration.json` with sorted keys (the field order here).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Identity {
    /// merod's account id (`GET /admin-api/identity`).
    pub(crate) executor_account: String,
    /// The node's PeerId.
    pub(crate) peer_id: String,
    /// The relay URL (possibly empty).
    pub(crate) relay_url: String,
}

/// The registration nonce: lowercase hex of SHA-256 over the UTF-8 text
/// `challenge|peer_id|account|relay_url` (an empty relay URL keeps its slot), followed by
/// `|` and the lowercase hex SHA-256 of the CSR's base64 text when one is sent, so the
/// quote commits to the CSR MDMA signs.
pub(crate) fn nonce(challenge: &str, id: &Identity, csr: Option<&str>) -> String {
    let mut text = format!(
        "{challenge}|{}|{}|{}",
        id.peer_id, id.executor_account, id.relay_url
    );
    if let Some(csr) = csr {
        text.push('|');
        text.push_str(&hex::encode(Sha256::digest(csr.as_bytes())));
    }
    hex::encode(Sha256::digest(text.as_bytes()))
}

/// What token the polls carry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Held {
    /// None yet: polls go without `X-Fleet-Token`.
    None,
    /// A token issued by registration (this run's or a stored one).
    Token,
    /// MDMA registered the node but issues no tokens: polls go without one.
    Tokenless,
}

impl Held {
    /// The `fleet_token` word of `/status`.
    fn word(self) -> &'static str {
        match self {
            Held::None => "none",
            Held::Token => "registered",
            Held::Tokenless => "tokenless",
        }
    }
}

/// Why a registration is due.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Why {
    /// No token is held.
    NoToken,
    /// Polls have been refused for [`REJECTED_FOR`] in a row.
    Rejected,
    /// The identity differs from the one the token was issued to.
    IdentityChanged,
}

impl Why {
    fn as_str(self) -> &'static str {
        match self {
            Why::NoToken => "no token yet",
            Why::Rejected => "the token is refused",
            Why::IdentityChanged => "the identity changed",
        }
    }
}

/// What [`Machine::due`] says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Due {
    /// Attempt now.
    Now(Why),
    /// Nothing to do before this instant (a backoff, or a refusal streak reaching
    /// [`REJECTED_FOR`]); ask again then.
    At(Instant),
    /// Nothing to do until something changes.
    Idle,
}

/// The registration decisions, pure: what is held, what it was issued to, and the backoff.
#[derive(Clone, Debug)]
pub(crate) struct Machine {
    retry_interval: Duration,
    held: Held,
    /// The identity the held token (or the tokenless registration) was issued to.
    registered_as: Option<Identity>,
    /// The identity last observed.
    current: Option<Identity>,
    /// Attempts since MDMA last accepted a poll carrying a registered token.
    attempts: u32,
    /// No attempt before this.
    not_before: Option<Instant>,
    /// When the last registration succeeded: refusals count only from then on (polls
    /// refused before it were refusing the old token).
    registered_at: Option<Instant>,
}

impl Machine {
    /// The machine at start: `held` from the token file, `registered_as` from its record.
    pub(crate) fn new(
        retry_interval: Duration,
        held: Held,
        registered_as: Option<Identity>,
    ) -> Self {
        Self {
            retry_interval,
            held,
            registered_as,
            current: None,
            attempts: 0,
            not_before: None,
            registered_at: None,
        }
    }

    /// What is held.
    pub(crate) fn held(&self) -> Held {
        self.held
    }

    /// Whether to attempt a registration at `now`, polls having been refused since
    /// `refused_since` (if they are).
    pub(crate) fn due(&self, now: Instant, refused_since: Option<Instant>) -> Due {
        let refused_since = match (refused_since, self.registered_at) {
            (Some(since), Some(at)) => Some(since.max(at)),
            (since, _) => since,
        };
        let why = match (self.held, refused_since) {
            (Held::None, _) => Why::NoToken,
            (_, Some(since)) if now >= since + REJECTED_FOR => Why::Rejected,
            _ if self.identity_changed() => Why::IdentityChanged,
            (_, Some(since)) => return Due::At(since + REJECTED_FOR),
            (_, None) => return Due::Idle,
        };
        match self.not_before {
            Some(t) if t > now => Due::At(t),
            _ => Due::Now(why),
        }
    }

    fn identity_changed(&self) -> bool {
        matches!((&self.registered_as, &self.current), (Some(r), Some(c)) if r != c)
    }

    /// The identity as read now. Returns `true` when a held token had no record of whom it
    /// was issued to (a token file from before the record): the identity is adopted as its
    /// record, to be written, rather than registering again.
    pub(crate) fn observe(&mut self, id: Identity) -> bool {
        let adopt = self.held != Held::None && self.registered_as.is_none();
        if adopt {
            self.registered_as = Some(id.clone());
        }
        self.current = Some(id);
        adopt
    }

    /// An attempt ended at `now`: registered as `id` holding `held`, or failed (`None`:
    /// refused, unavailable, blocked, any error). Returns the wait before another attempt
    /// may start (jittered with `jitter` in `[0, 1)`).
    pub(crate) fn attempted(
        &mut self,
        now: Instant,
        jitter: f64,
        registered: Option<(Identity, Held)>,
    ) -> Duration {
        self.attempts = self.attempts.saturating_add(1);
        let wait = retry_wait(self.retry_interval, self.attempts, jitter);
        self.not_before = Some(now + wait);
        if let Some((id, held)) = registered {
            self.registered_at = Some(now);
            self.held = held;
            self.registered_as = Some(id.clone());
            self.current = Some(id);
        }
        wait
    }

    /// MDMA accepted a poll: with a registered token held, the next failure's wait starts
    /// again at `retry_interval` (an accepted untokened poll says nothing of registration).
    pub(crate) fn accepted(&mut self) {
        if self.held == Held::Token {
            self.attempts = 0;
        }
    }

    /// A token was put in place from the token file (SIGHUP) at `now`: it is held from
    /// now on, and refusals count from then.
    pub(crate) fn replaced(&mut self, now: Instant) {
        self.held = Held::Token;
        self.registered_at = Some(now);
    }
}

/// The wait after the `attempt`-th attempt in a row (1-based) since polls were last
/// accepted: `first · 2^(attempt-1)`, stretched by up to half (`jitter` in `[0, 1)`),
/// capped at [`RETRY_CAP`]; never below `first` (or the cap).
pub(crate) fn retry_wait(first: Duration, attempt: u32, jitter: f64) -> Duration {
    Backoff::new(first, RETRY_CAP, Jitter::Up).wait(attempt, jitter)
}

/// Why one registration attempt failed. Never holds a token.
#[derive(Debug, thiserror::Error)]
pub(crate) enum AttemptError {
    /// The account is not known yet: registration waits for it.
    #[error(
        "merod holds no account yet (it is minted when the node first takes part in a namespace)"
    )]
    NotMinted,
    /// The account could not be read.
    #[error("the account is unknown: {0}")]
    Identity(#[source] MerodError),
    /// A metadata attribute could not be read (and none was read before).
    #[error(transparent)]
    Metadata(MetadataError),
    /// The enrolment token file could not be read.
    #[error("cannot read enrolment_token_file {path}: {source}")]
    EnrolmentFile {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The challenge call failed.
    #[error("challenge: {0}")]
    Challenge(#[source] RegisterError),
    /// merod made no quote.
    #[error("quote: {0}")]
    Attest(#[source] MerodError),
    /// The register call failed (403 verdict, 503, other).
    #[error("register: {0}")]
    Register(#[source] RegisterError),
    /// `key.pem` exists but could not be read, so whether a CSR belongs in the
    /// registration is unknown.
    #[error("CSR: {0}")]
    Csr(#[source] KeyUnreadable),
}

impl AttemptError {
    /// The `outcome` label of `fleet_sidecar_registrations_total`: `blocked`, `refused`,
    /// `unavailable`, `timeout` or `error`.
    fn metric_label(&self) -> &'static str {
        match self {
            AttemptError::NotMinted | AttemptError::Identity(_) => "blocked",
            AttemptError::Register(RegisterError::Refused { .. }) => "refused",
            AttemptError::Register(RegisterError::Unavailable { .. }) => "unavailable",
            AttemptError::Challenge(e) | AttemptError::Register(e) if e.is_timeout() => "timeout",
            AttemptError::Attest(e) if e.is_timeout() => "timeout",
            _ => "error",
        }
    }

    /// What the registration waits on, when it is blocked (said once, on the edge).
    fn blocked_on(&self) -> Option<String> {
        match self {
            AttemptError::NotMinted | AttemptError::Identity(_) => Some(self.to_string()),
            _ => None,
        }
    }
}

impl Timed for AttemptError {
    fn is_timeout(&self) -> bool {
        self.metric_label() == "timeout"
    }
}

/// Why the token file or its record could not be written. Never holds the token.
#[derive(Debug, thiserror::Error)]
pub(crate) enum StoreError {
    /// Creating the directory, the temp file, writing, syncing or renaming failed.
    #[error(transparent)]
    Write(#[from] durable::WriteError),
    /// The writer stopped (it runs on the blocking pool).
    #[error("the write of {path} stopped: {source}")]
    Stopped {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: tokio::task::JoinError,
    },
}

/// The token and its record are secrets: readable by the service's user only.
const PRIVATE_MODE: u32 = 0o600;

/// Writes `bytes` to `path` with [`durable::write_atomically`], mode 0600 (its directory
/// created 0700 if missing). Blocking: run it on the blocking pool.
///
/// Errors: [`StoreError::Write`] naming the path and step.
pub(crate) fn write_private(path: &Path, bytes: &[u8]) -> Result<(), StoreError> {
    Ok(durable::write_atomically(path, bytes, PRIVATE_MODE)?)
}

/// [`write_private`] on the blocking pool, so a slow disk delays only this job.
async fn write_private_async(path: PathBuf, bytes: Vec<u8>) -> Result<(), StoreError> {
    let file = path.clone();
    tokio::task::spawn_blocking(move || write_private(&file, &bytes))
        .await
        .map_err(|source| StoreError::Stopped { path, source })?
}

/// The record file beside `token_file`.
pub(crate) fn record_path(token_file: &Path) -> PathBuf {
    token_file.with_file_name(RECORD_FILE)
}

/// The token file and its record as found at start: the token (if the file is usable), the
/// identity it was issued to (if recorded), and what was wrong (never the token).
struct Stored {
    token: Option<FleetToken>,
    record: Option<Identity>,
    problem: Option<String>,
}

/// Reads the token file (it must be private and hold a sendable token) and its record.
/// Blocking.
fn load_stored(token_file: &Path) -> Stored {
    let (token, problem) = match read_token_file(token_file) {
        Ok(t) => (Some(t), None),
        Err(TokenFileProblem::Unreadable(e)) if e.kind() == std::io::ErrorKind::NotFound => {
            (None, None)
        }
        Err(p) => (None, Some(format!("{}: {p}", token_file.display()))),
    };
    let record = std::fs::read(record_path(token_file))
        .ok()
        .and_then(|bytes| crate::strict_json::from_slice::<Identity>(&bytes).ok());
    Stored {
        token,
        record,
        problem,
    }
}

/// Whether the registered token's file is there (never its content): what `check-config`
/// and `status` say of it.
pub(crate) fn token_file_presence(file: &Path) -> String {
    match std::fs::metadata(file) {
        Ok(m) if m.is_file() => format!(
            "ok    token_file {} is present: the stored fleet token is reused, no new registration",
            file.display()
        ),
        Ok(_) => format!("fail  token_file {} is not a regular file", file.display()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => format!(
            "info  token_file {} is absent: the node registers at start",
            file.display()
        ),
        Err(e) => format!("fail  token_file {}: {e}", file.display()),
    }
}

/// Where the token comes from.
enum Source {
    /// `fleet_token_file`: read again on a refused poll and on SIGHUP.
    File(PathBuf),
    /// `[registration]`.
    Registration(Box<Registrar>),
}

/// What a registration needs besides MDMA: merod, the metadata server, the settings.
struct Registrar {
    /// merod at the `[server].listen` address the loop chose.
    merod: Arc<ListenCandidates>,
    cfg: RegistrationConfig,
    /// The instance metadata (`relay-url`, `enrolment-token`), shared with the poll's
    /// `relay_url`, so both send the value last read.
    metadata: MetadataClient,
    /// `[tls] dir`, where `key.pem` is and the CSR is kept; `None` with `[tls] csr = false`.
    csr_dir: Option<PathBuf>,
}

/// The fleet token's job: keeps the token the MDMA client sends (see the module docs).
pub(crate) struct TokenJob {
    mdma: MdmaClient,
    source: Source,
    hup: Notify,
    /// `true` once the token to start with is settled: a stored or configured one in place,
    /// or the first registration attempt ended (registered or not); what `once` waits for.
    settled: watch::Sender<bool>,
}

/// Why the token job could not be built.
#[derive(Debug, thiserror::Error)]
#[error(transparent)]
pub(crate) struct JobError(#[from] MetadataError);

impl TokenJob {
    /// The job for `cfg`, sending through `mdma` (whose clones share its token), or `None`
    /// when there is nothing to keep (an inline `fleet_token`, or no token at all).
    /// Registration reads the instance metadata through `metadata` (a client of its own
    /// when `None`).
    ///
    /// Errors: [`JobError`] when the metadata HTTP client cannot be built.
    pub(crate) fn for_config(
        cfg: &Config,
        mdma: &MdmaClient,
        merod: &Arc<ListenCandidates>,
        metadata: Option<&MetadataClient>,
    ) -> Result<Option<Arc<Self>>, JobError> {
        let source = match (&cfg.registration, &cfg.fleet_token_file) {
            (Some(reg), _) => Source::Registration(Box::new(Registrar {
                merod: Arc::clone(merod),
                cfg: reg.clone(),
                metadata: match metadata {
                    Some(m) => m.clone(),
                    None => MetadataClient::new(reg.metadata_url.clone())?,
                },
                csr_dir: cfg.tls.csr.then(|| cfg.tls.dir.clone()),
            })),
            (None, Some(file)) => Source::File(file.clone()),
            (None, None) => return Ok(None),
        };
        Ok(Some(Arc::new(Self {
            mdma: mdma.clone(),
            source,
            hup: Notify::new(),
            settled: watch::Sender::new(false),
        })))
    }

    /// Waits until the token to start with is settled: at once with a configured or stored
    /// token (or in a dry run), else until the first registration attempt ended, registered
    /// or not (each of its calls is bounded, so this is too). `once` waits for this before
    /// its poll, so the poll carries a token the attempt earned, and the process does not
    /// exit in the middle of a registration.
    pub(crate) async fn settled(&self) {
        let mut settled = self.settled.subscribe();
        // The sender lives as long as `self`: this ends when the value turns `true`.
        let _ = settled.wait_for(|done| *done).await;
    }

    /// SIGHUP: read the token file again.
    pub(crate) fn reload(&self) {
        self.hup.notify_one();
    }

    /// Starts the job for the node `peer_id`: a stored token is put in place before this
    /// returns (so the first poll carries it), then the job runs on the job harness until
    /// `shutdown` ([`TokenFileWatch`] for `fleet_token_file`, [`Registering`] for
    /// `[registration]`). With `dry_run`, nothing is registered or written (the stored
    /// token is still used).
    pub(crate) async fn start(
        self: Arc<Self>,
        peer_id: PeerId,
        telemetry: Arc<Telemetry>,
        shutdown: CancellationToken,
        dry_run: bool,
    ) {
        let reg = match &self.source {
            Source::File(path) => {
                self.settled.send_replace(true);
                telemetry.update(|st| st.fleet_token = "configured".to_owned());
                let verdicts = self.mdma.verdicts();
                let edges = Edges::new(&verdicts);
                let job = TokenFileWatch {
                    path: path.clone(),
                    token: self,
                    verdicts,
                    edges,
                    why: None,
                };
                jobs::spawn(job, telemetry, shutdown);
                return;
            }
            Source::Registration(reg) => reg,
        };
        let file = reg.cfg.token_file.clone();
        let stored = tokio::task::spawn_blocking(move || {
            // Before any write: a crash during an earlier token write may have left a temp
            // copy of the token beside it (a dry run writes nothing, so it removes nothing
            // either).
            let removed = if dry_run {
                0
            } else {
                durable::remove_stale_temp_files(parent_dir(&file))
            };
            if removed > 0 {
                info!(
                    removed,
                    "removed temp files an interrupted token write left behind"
                );
            }
            load_stored(&file)
        })
        .await
        .unwrap_or(Stored {
            token: None,
            record: None,
            problem: Some("the token file reader stopped".to_owned()),
        });
        if let Some(problem) = &stored.problem {
            warn!("stored fleet token unusable ({problem}): registering again");
        }
        let held = if stored.token.is_some() {
            info!(token_file = %reg.cfg.token_file.display(), "using the stored fleet token (no new registration)");
            Held::Token
        } else {
            info!(token_file = %reg.cfg.token_file.display(), "no stored fleet token: registering (polls go on without a token meanwhile)");
            Held::None
        };
        self.mdma.set_token(stored.token);
        if let Some(record) = &stored.record {
            // What the stored token was issued to was read by an earlier run.
            reg.metadata
                .remember(MetadataAttribute::RelayUrl, &record.relay_url);
        }
        let machine = Machine::new(reg.cfg.retry_interval, held, stored.record);
        telemetry.update(|st| {
            st.fleet_token = held.word().to_owned();
            st.registration = Some(if held == Held::Token {
                "stored token in use".to_owned()
            } else {
                "pending".to_owned()
            });
        });
        if held == Held::Token || dry_run {
            self.settled.send_replace(true);
        }
        if dry_run {
            info!("dry run: no registration is attempted");
            return;
        }
        let verdicts = self.mdma.verdicts();
        let edges = Edges::new(&verdicts);
        let accepted = edges.accepted;
        let job = Registering {
            edges,
            accepted,
            verdicts,
            token: self,
            machine,
            peer_id,
            telemetry: Arc::clone(&telemetry),
            next_check: Instant::now() + IDENTITY_CHECK_INTERVAL,
            attempting: false,
        };
        jobs::spawn(job, telemetry, shutdown);
    }
}

/// Why `fleet_token_file` could not be used. Never holds the token.
#[derive(Debug, thiserror::Error)]
pub(crate) enum TokenFileUnusable {
    /// The file is unreadable, not private, or holds no sendable token.
    #[error("{path}: {problem}")]
    Problem {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        problem: TokenFileProblem,
    },
    /// The reader stopped (it runs on the blocking pool).
    #[error("the fleet_token_file reader stopped: {0}")]
    Stopped(#[source] tokio::task::JoinError),
}

impl Timed for TokenFileUnusable {
    fn is_timeout(&self) -> bool {
        false
    }
}

/// `fleet_token_file` read again after every refused poll and on SIGHUP, a job on the job
/// harness: idle until one of those comes ([`Job::wake`]).
struct TokenFileWatch {
    path: PathBuf,
    token: Arc<TokenJob>,
    verdicts: watch::Receiver<PollVerdict>,
    edges: Edges,
    /// What asked for the next read (`None`: nothing, the job is idle).
    why: Option<&'static str>,
}

impl Job for TokenFileWatch {
    type Output = ();
    type Error = TokenFileUnusable;
    const NAME: &'static str = "fleet_token_file";
    const FAILING: &'static str = "fleet_token_file cannot be used";
    const EFFECT: &'static str =
        "keeping the token in use; read again on the next refused poll or SIGHUP";
    const RECOVERED: &'static str = "fleet_token_file usable again";

    fn schedule(&self) -> Schedule {
        Schedule::when_asked(TOKEN_FILE_DEADLINE)
    }

    async fn run(&mut self) -> Result<(), TokenFileUnusable> {
        let why = self.why.take().unwrap_or("a request");
        let file = self.path.clone();
        let token = tokio::task::spawn_blocking(move || read_token_file(&file))
            .await
            .map_err(TokenFileUnusable::Stopped)?
            .map_err(|problem| TokenFileUnusable::Problem {
                path: self.path.clone(),
                problem,
            })?;
        let path = self.path.display();
        if self.token.mdma.token().as_ref() != Some(&token) {
            self.token.mdma.set_token(Some(token));
            info!(path = %path, "fleet_token_file read again after {why}: the token changed, polls carry the new one");
        } else if why == "SIGHUP" {
            info!(path = %path, "SIGHUP: fleet_token_file read again, token unchanged");
        }
        Ok(())
    }

    fn idle(&self) -> bool {
        self.why.is_none()
    }

    async fn wake(&mut self) {
        loop {
            tokio::select! {
                () = self.token.hup.notified() => {
                    self.why = Some("SIGHUP");
                    return;
                }
                changed = self.verdicts.changed() => {
                    if changed.is_err() {
                        // The MDMA client is gone: only SIGHUP is left to wait for.
                        self.token.hup.notified().await;
                        self.why = Some("SIGHUP");
                        return;
                    }
                    let v = *self.verdicts.borrow_and_update();
                    self.edges.see(&v, self.token.mdma.has_token());
                    if v.refused_since.is_some() {
                        self.why = Some("a refused poll");
                        return;
                    }
                }
            }
        }
    }
}

/// Bound of one read of `fleet_token_file` (a local file; past this the disk hangs).
const TOKEN_FILE_DEADLINE: Duration = Duration::from_secs(10);

/// Bound of one registration attempt: each of its calls in turn at its own bound (the
/// account, two metadata attributes, the challenge, a quote and its fallback, `register`),
/// and the writes of the token and its record.
const ATTEMPT_DEADLINE: Duration = CHECK_TIMEOUT
    .saturating_add(crate::metadata::METADATA_TIMEOUT.saturating_mul(2))
    .saturating_add(CHALLENGE_TIMEOUT)
    .saturating_add(ATTEST_TIMEOUT.saturating_mul(2))
    .saturating_add(REGISTER_TIMEOUT)
    .saturating_add(Duration::from_secs(10));

/// `[registration]`, a job on the job harness: one run is one attempt, when [`Machine::due`]
/// says (the job is idle otherwise, and [`Job::wake`] waits for that time, for a change of
/// MDMA's verdict on the polls, or for SIGHUP). While waiting it also reads the identity
/// every [`IDENTITY_CHECK_INTERVAL`] while a token is held, and reads `token_file` again on
/// SIGHUP. The machine keeps its own back-off (`retry_interval` doubling up to
/// [`RETRY_CAP`], started again when MDMA accepts a poll with the token); the harness's is
/// only when it looks again.
struct Registering {
    token: Arc<TokenJob>,
    machine: Machine,
    peer_id: PeerId,
    telemetry: Arc<Telemetry>,
    verdicts: watch::Receiver<PollVerdict>,
    edges: Edges,
    /// [`PollVerdict::accepted`] when last seen.
    accepted: u64,
    next_check: Instant,
    /// An attempt started and its outcome is not folded in yet.
    attempting: bool,
}

impl Job for Registering {
    type Output = ();
    type Error = AttemptError;
    const NAME: &'static str = "registration";
    const FAILING: &'static str = "registration failed";
    const EFFECT: &'static str = "polls go on meanwhile; the next attempt after a back-off";
    const RECOVERED: &'static str = "registration no longer failing";

    fn schedule(&self) -> Schedule {
        Schedule::when_asked(ATTEMPT_DEADLINE).backoff(Backoff::new(
            RETRY_CAP,
            RETRY_CAP,
            Jitter::None,
        ))
    }

    async fn run(&mut self) -> Result<(), AttemptError> {
        let refused_since = self.verdicts.borrow().refused_since;
        // Only a poll accepted since the harness looked makes an attempt not due: the
        // token in use works again.
        let Due::Now(why) = self.machine.due(Instant::now(), refused_since) else {
            return Ok(());
        };
        let Source::Registration(reg) = &self.token.source else {
            return Ok(());
        };
        self.attempting = true;
        let outcome = reg.attempt(&self.token.mdma, &self.peer_id).await;
        let settled = self.settle(why, outcome).await;
        self.token.settled.send_replace(true);
        self.next_check = Instant::now() + IDENTITY_CHECK_INTERVAL;
        settled
    }

    fn retry_after(error: &AttemptError) -> Option<Duration> {
        match error {
            AttemptError::Challenge(e) | AttemptError::Register(e) => e.retry_after(),
            _ => None,
        }
    }

    fn failed(&mut self, why: &str) {
        // An attempt cut at its deadline still counts: it backs off like any other, and
        // what `once` waits for has happened.
        if std::mem::take(&mut self.attempting) {
            Telemetry::count(&self.telemetry.registrations, "timeout");
            let wait = self
                .machine
                .attempted(Instant::now(), fastrand::f64(), None);
            let text = format!("failed: {why}; next attempt in {}s", wait.as_secs());
            self.telemetry.update(|st| st.registration = Some(text));
            self.token.settled.send_replace(true);
        }
    }

    fn idle(&self) -> bool {
        let refused_since = self.verdicts.borrow().refused_since;
        !matches!(self.machine.due(Instant::now(), refused_since), Due::Now(_))
    }

    async fn wake(&mut self) {
        let Source::Registration(reg) = &self.token.source else {
            return std::future::pending().await;
        };
        loop {
            let refused_since = self.verdicts.borrow().refused_since;
            let wake = match self.machine.due(Instant::now(), refused_since) {
                Due::Now(_) => return,
                Due::At(t) => t.min(self.next_check),
                Due::Idle => self.next_check,
            };
            tokio::select! {
                () = self.token.hup.notified() => {
                    let file = reg.cfg.token_file.clone();
                    if let Ok(Ok(token)) = tokio::task::spawn_blocking(move || read_token_file(&file)).await {
                        if self.token.mdma.token().as_ref() != Some(&token) {
                            self.token.mdma.set_token(Some(token));
                            self.machine.replaced(Instant::now());
                            self.telemetry.update(|st| st.fleet_token = Held::Token.word().to_owned());
                            info!(token_file = %reg.cfg.token_file.display(), "SIGHUP: token_file changed, polls carry the new token");
                        } else {
                            info!("SIGHUP: token_file read again, token unchanged");
                        }
                    }
                }
                changed = self.verdicts.changed() => {
                    if changed.is_err() {
                        return std::future::pending().await;
                    }
                    let v = *self.verdicts.borrow_and_update();
                    self.edges.see(&v, self.token.mdma.has_token());
                    if v.accepted != self.accepted {
                        self.accepted = v.accepted;
                        self.machine.accepted();
                    }
                }
                () = tokio::time::sleep_until(wake) => {
                    if Instant::now() >= self.next_check {
                        self.next_check = Instant::now() + IDENTITY_CHECK_INTERVAL;
                        if self.machine.held() != Held::None {
                            if let Ok(id) = reg.identity(&self.peer_id).await {
                                if self.machine.observe(id.clone()) {
                                    reg.write_record(&id).await;
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

impl Registering {
    /// Folds one attempt's outcome: the machine, the token in place, the metric, the
    /// status, then the token and its record stored (last: a run cut while writing has
    /// already put the token in use). A failure is returned for the harness to tell.
    async fn settle(
        &mut self,
        why: Why,
        outcome: Result<(Identity, Option<FleetToken>), AttemptError>,
    ) -> Result<(), AttemptError> {
        let Source::Registration(reg) = &self.token.source else {
            return Ok(());
        };
        self.attempting = false;
        let telemetry = &self.telemetry;
        let now = Instant::now();
        let (id, token) = match outcome {
            Ok(registered) => registered,
            Err(e) => {
                Telemetry::count(&telemetry.registrations, e.metric_label());
                let wait = self.machine.attempted(now, fastrand::f64(), None);
                let text = match e.blocked_on() {
                    Some(on) => format!("blocked: {on}; next attempt in {}s", wait.as_secs()),
                    None => format!("failed: {e}; next attempt in {}s", wait.as_secs()),
                };
                debug!(reason = why.as_str(), "registration attempt failed: {e}");
                telemetry.update(|st| st.registration = Some(text));
                return Err(e);
            }
        };
        let held = if token.is_some() {
            Held::Token
        } else {
            Held::Tokenless
        };
        self.machine
            .attempted(now, fastrand::f64(), Some((id.clone(), held)));
        let stored = token.as_ref().map(|t| t.expose().as_bytes().to_vec());
        match held {
            Held::Token => {
                info!(reason = why.as_str(), account = %id.executor_account, relay_url = %id.relay_url, "registered with MDMA: polls carry the issued fleet token");
                Telemetry::count(&telemetry.registrations, "registered");
            }
            _ => {
                warn!(reason = why.as_str(), "registered with MDMA, but it issued no fleet token (it has no signing key): polling without one");
                Telemetry::count(&telemetry.registrations, "tokenless");
            }
        }
        self.token.mdma.set_token(token);
        telemetry.update(|st| {
            st.fleet_token = held.word().to_owned();
            st.registration = Some(format!("registered at {:.0}", crate::telemetry::unix_now()));
        });
        if let Some(bytes) = stored {
            if let Err(e) = write_private_async(reg.cfg.token_file.clone(), bytes).await {
                warn!("registered, but the token cannot be kept ({e}): it is used now and the node registers again after a restart");
            }
        }
        reg.write_record(&id).await;
        Ok(())
    }
}

impl Registrar {
    /// The identity as it is now: the account from merod, the relay URL from the config or
    /// the metadata.
    async fn identity(&self, peer_id: &PeerId) -> Result<Identity, AttemptError> {
        let account = match self.merod.current().identity().await {
            Ok(NodeAccount::Account(a)) => a,
            Ok(NodeAccount::NotMinted) => return Err(AttemptError::NotMinted),
            Err(e) => return Err(AttemptError::Identity(e)),
        };
        let relay_url = match &self.cfg.relay_url {
            Some(r) => r.clone(),
            None => self
                .metadata
                .value(MetadataAttribute::RelayUrl)
                .await
                .map_err(AttemptError::Metadata)?,
        };
        Ok(Identity {
            executor_account: account,
            peer_id: peer_id.to_string(),
            relay_url,
        })
    }

    /// One registration: identity, enrolment token, challenge, nonce, quote (with the
    /// fallback to `tee/attest` on a 404), register.
    async fn attempt(
        &self,
        mdma: &MdmaClient,
        peer_id: &PeerId,
    ) -> Result<(Identity, Option<FleetToken>), AttemptError> {
        let id = self.identity(peer_id).await?;
        let enrolment_token = match &self.cfg.enrolment_token_file {
            Some(path) => {
                let file = path.clone();
                let text = tokio::task::spawn_blocking(move || std::fs::read_to_string(file))
                    .await
                    .map_err(|e| AttemptError::EnrolmentFile {
                        path: path.clone(),
                        source: std::io::Error::other(e),
                    })?
                    .map_err(|source| AttemptError::EnrolmentFile {
                        path: path.clone(),
                        source,
                    })?;
                EnrolmentToken::new(text.trim())
            }
            None => EnrolmentToken::new(
                self.metadata
                    .value(MetadataAttribute::EnrolmentToken)
                    .await
                    .map_err(AttemptError::Metadata)?,
            ),
        };
        let csr = self.csr(&id.relay_url).await?;
        let challenge = mdma.challenge().await.map_err(AttemptError::Challenge)?;
        let nonce = nonce(&challenge.challenge, &id, csr.as_deref());
        let (quote, registration_bound) =
            match self.merod.current().registration_attest(&nonce).await {
                Ok(Some(q)) => (q, true),
                Ok(None) => {
                    debug!(
                    "merod has no registration-attest (404): quoting with tee/attest, no binding"
                );
                    (
                        self.merod
                            .current()
                            .attest(&nonce)
                            .await
                            .map_err(AttemptError::Attest)?,
                        false,
                    )
                }
                Err(e) => return Err(AttemptError::Attest(e)),
            };
        let request = RegisterRequest {
            peer_id: peer_id.clone(),
            executor_account: id.executor_account.clone(),
            relay_url: id.relay_url.clone(),
            challenge: challenge.challenge,
            quote,
            enrolment_token,
            registration_bound,
            csr,
        };
        let registered = mdma
            .register(&request)
            .await
            .map_err(AttemptError::Register)?;
        Ok((id, registered.token))
    }

    /// The CSR to send for `relay_url` (see [`registration_csr`]), `None` when there is
    /// none to send; made on the blocking pool (the attempt's deadline bounds the wait).
    async fn csr(&self, relay_url: &str) -> Result<Option<String>, AttemptError> {
        let Some(dir) = self.csr_dir.clone() else {
            return Ok(None);
        };
        let relay_url = relay_url.to_owned();
        let made = tokio::task::spawn_blocking(move || registration_csr(&dir, &relay_url))
            .await
            .map_err(|e| {
                AttemptError::Csr(KeyUnreadable {
                    path: self.csr_dir.clone().unwrap_or_default().join("key.pem"),
                    source: std::io::Error::other(e),
                })
            })?;
        match made.map_err(AttemptError::Csr)? {
            Csr::Ready(text) => Ok(Some(text)),
            Csr::NoHost => {
                debug!("no CSR: the relay URL has no host to ask a certificate for");
                Ok(None)
            }
            Csr::Without(why) => {
                warn!("registering without a CSR, so MDMA signs no TLS certificate: {why}");
                Ok(None)
            }
        }
    }

    /// Writes the record of whom the token was issued to (a failure is logged: the next
    /// identity check adopts the identity again).
    async fn write_record(&self, id: &Identity) {
        let path = record_path(&self.cfg.token_file);
        let bytes = match serde_json::to_vec(id) {
            Ok(b) => b,
            Err(e) => {
                warn!("cannot render the registration record: {e}");
                return;
            }
        };
        if let Err(e) = write_private_async(path, bytes).await {
            warn!("{e}");
        }
    }
}

/// Logs the edges of refused polls once each: "no token yet" apart from "token rejected",
/// and the recovery (the next poll MDMA accepts).
struct Edges {
    /// While polls are refused: whether a token was sent when it began.
    refused: Option<bool>,
    /// [`PollVerdict::accepted`] when last seen.
    accepted: u64,
}

impl Edges {
    /// Nothing refused yet; `verdicts` as they are now.
    fn new(verdicts: &watch::Receiver<PollVerdict>) -> Self {
        Self {
            refused: None,
            accepted: verdicts.borrow().accepted,
        }
    }

    fn see(&mut self, v: &PollVerdict, has_token: bool) {
        let accepted = std::mem::replace(&mut self.accepted, v.accepted) != v.accepted;
        match (v.refused_since.is_some(), self.refused) {
            (true, None) => {
                if has_token {
                    warn!("MDMA refuses the fleet token (HTTP 401/403): token rejected; polls go on, nothing is joined or left");
                } else {
                    warn!("MDMA refuses polls without a token (HTTP 401/403): no token yet; polls go on, nothing is joined or left");
                }
                self.refused = Some(has_token);
            }
            (false, Some(_)) if accepted => {
                info!("MDMA accepts the polls again");
                self.refused = None;
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);
    const RETRY: Duration = Duration::from_secs(30);

    fn id(account: &str) -> Identity {
        Identity {
            executor_account: account.to_owned(),
            peer_id: "12D3KooWJ6X2tBZEd8qKWvJyhtH2v2XyP4eQ9dcU2xZ8Y6YrjcVk".to_owned(),
            relay_url: "https://relay.example".to_owned(),
        }
    }

    #[test]
    fn the_nonce_is_the_hex_sha256_of_the_four_fields_joined_by_bars() {
        let n = nonce("c1", &id("acc"), None);
        // printf '%s' 'c1|12D3KooWJ6X2tBZEd8qKWvJyhtH2v2XyP4eQ9dcU2xZ8Y6YrjcVk|acc|https://relay.example' | sha256sum
        assert_eq!(
            n,
            "f656a776bd848efde7114cf4bb52a3fd43392daa485bedeb17fc8920aaec5cfb"
        );
        let mut empty = id("acc");
        empty.relay_url.clear();
        assert_eq!(
            nonce("c1", &empty, None),
            hex::encode(Sha256::digest(
                b"c1|12D3KooWJ6X2tBZEd8qKWvJyhtH2v2XyP4eQ9dcU2xZ8Y6YrjcVk|acc|"
            ))
        );
        // With a CSR, `|sha256hex(csr_b64)` follows (of the base64 text, not the DER):
        // h=$(printf '%s' QUJD | sha256sum | cut -d' ' -f1)
        // printf '%s' "c1|12D3…jcVk|acc|https://relay.example|$h" | sha256sum
        assert_eq!(
            nonce("c1", &id("acc"), Some("QUJD")),
            "62dd6a32fc34603e2c46d3c28a1517ff4c94a1f92b350b3c79936633e3dd0210"
        );
        assert!(n
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)));
    }

    #[test]
    fn without_a_token_an_attempt_is_due_at_once_then_backs_off() {
        let t0 = Instant::now();
        let mut m = Machine::new(RETRY, Held::None, None);
        assert_eq!(m.due(t0, None), Due::Now(Why::NoToken));
        let wait = m.attempted(t0, 0.0, None);
        assert_eq!(wait, RETRY);
        assert_eq!(m.due(t0 + S, None), Due::At(t0 + RETRY));
        assert_eq!(m.due(t0 + RETRY, None), Due::Now(Why::NoToken));
        // Accepted polls without a token say nothing of registration: the backoff goes on.
        m.accepted();
        assert_eq!(m.attempted(t0 + RETRY, 0.0, None), 2 * RETRY);
    }

    #[test]
    fn the_backoff_doubles_from_retry_interval_jittered_up_to_ten_minutes() {
        let waits: Vec<u64> = (1..=7)
            .map(|n| retry_wait(RETRY, n, 0.0).as_secs())
            .collect();
        assert_eq!(waits, [30, 60, 120, 240, 480, 600, 600]);
        for n in 1..=40 {
            for j in [-1.0, 0.0, 0.5, 0.999, 3.0] {
                let w = retry_wait(RETRY, n, j);
                assert!(
                    w >= retry_wait(RETRY, n, 0.0) && w <= RETRY_CAP,
                    "{n} {j}: {w:?}"
                );
            }
        }
        assert_eq!(retry_wait(RETRY, 1, 0.999).as_secs(), 44);
        assert_eq!(retry_wait(S, u32::MAX, 0.5), RETRY_CAP);
    }

    #[test]
    fn a_held_token_is_reused_and_nothing_is_due_while_polls_pass() {
        let t0 = Instant::now();
        let mut m = Machine::new(RETRY, Held::Token, Some(id("acc")));
        assert_eq!(m.due(t0, None), Due::Idle);
        assert!(!m.observe(id("acc")));
        assert_eq!(m.due(t0 + 100 * S, None), Due::Idle);
    }

    #[test]
    fn a_token_refused_for_30_s_in_a_row_is_registered_again() {
        let t0 = Instant::now();
        let m = Machine::new(RETRY, Held::Token, Some(id("acc")));
        assert_eq!(m.due(t0, Some(t0)), Due::At(t0 + REJECTED_FOR));
        assert_eq!(
            m.due(t0 + REJECTED_FOR - S, Some(t0)),
            Due::At(t0 + REJECTED_FOR)
        );
        assert_eq!(m.due(t0 + REJECTED_FOR, Some(t0)), Due::Now(Why::Rejected));
        // A tokenless registration whose polls are refused is registered again too.
        let tokenless = Machine::new(RETRY, Held::Tokenless, Some(id("acc")));
        assert_eq!(
            tokenless.due(t0 + REJECTED_FOR, Some(t0)),
            Due::Now(Why::Rejected)
        );
    }

    #[test]
    fn a_refusing_mdma_is_not_stormed_re_registrations_back_off_until_a_poll_passes() {
        let t0 = Instant::now();
        let mut m = Machine::new(RETRY, Held::Token, Some(id("acc")));
        let mut now = t0 + REJECTED_FOR;
        let mut attempts = Vec::new();
        // MDMA registers the node every time but refuses every poll (since t0).
        while now < t0 + Duration::from_secs(3600) {
            match m.due(now, Some(t0)) {
                Due::Now(why) => {
                    assert_eq!(why, Why::Rejected);
                    attempts.push((now - t0).as_secs());
                    m.attempted(now, 0.0, Some((id("acc"), Held::Token)));
                }
                Due::At(t) => now = t,
                Due::Idle => unreachable!(),
            }
        }
        assert_eq!(
            attempts,
            [30, 60, 120, 240, 480, 960, 1560, 2160, 2760, 3360]
        );
        // Once a poll passes, the next failure starts again at retry_interval.
        m.accepted();
        assert_eq!(m.attempted(now, 0.0, None), RETRY);
    }

    #[test]
    fn refusals_of_the_old_token_do_not_count_against_a_new_registration() {
        let t0 = Instant::now();
        let mut m = Machine::new(RETRY, Held::Token, Some(id("acc")));
        let at = t0 + REJECTED_FOR;
        assert_eq!(m.due(at, Some(t0)), Due::Now(Why::Rejected));
        m.attempted(at, 0.0, Some((id("acc"), Held::Token)));
        // The next poll with the new token comes late (failed polls back off): the streak
        // of the old token's refusals is still running, but counts only from the
        // registration on.
        let later = at + REJECTED_FOR - S;
        assert_eq!(m.due(later, Some(t0)), Due::At(at + REJECTED_FOR));
        // Refused for 30 s after it too: the new token is rejected as well.
        assert_eq!(m.due(at + REJECTED_FOR, Some(t0)), Due::Now(Why::Rejected));
        // A token put in place by SIGHUP starts the count afresh too.
        let mut m = Machine::new(RETRY, Held::None, None);
        m.replaced(at);
        assert_eq!(m.due(at + S, Some(t0)), Due::At(at + REJECTED_FOR));
    }

    #[test]
    fn an_identity_change_registers_again_through_the_same_backoff() {
        let t0 = Instant::now();
        let mut m = Machine::new(RETRY, Held::Token, Some(id("acc")));
        assert!(!m.observe(id("other")));
        assert_eq!(m.due(t0, None), Due::Now(Why::IdentityChanged));
        m.attempted(t0, 0.0, None);
        assert_eq!(m.due(t0 + S, None), Due::At(t0 + RETRY));
        m.attempted(t0 + RETRY, 0.0, Some((id("other"), Held::Token)));
        assert_eq!(m.due(t0 + 10 * RETRY, None), Due::Idle);
        // Back to the first identity: a change again.
        m.observe(id("acc"));
        assert_eq!(m.due(t0 + 10 * RETRY, None), Due::Now(Why::IdentityChanged));
    }

    #[test]
    fn a_stored_token_without_a_record_adopts_the_identity_instead_of_registering() {
        let t0 = Instant::now();
        let mut m = Machine::new(RETRY, Held::Token, None);
        assert!(m.observe(id("acc")));
        assert_eq!(m.due(t0, None), Due::Idle);
        assert!(!m.observe(id("acc")));
        // Without a token nothing is adopted.
        let mut none = Machine::new(RETRY, Held::None, None);
        assert!(!none.observe(id("acc")));
    }

    #[test]
    fn a_replaced_token_is_held() {
        let t0 = Instant::now();
        let mut m = Machine::new(RETRY, Held::None, None);
        m.replaced(t0);
        assert_eq!(m.held(), Held::Token);
        assert_eq!(m.due(t0, None), Due::Idle);
    }

    #[test]
    fn the_token_file_is_written_atomically_private_in_a_private_directory() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("fleet/sub/fleet-token");
        write_private(&file, b"NEVER-LOGGED-TOKEN-1").unwrap();
        assert_eq!(std::fs::read(&file).unwrap(), b"NEVER-LOGGED-TOKEN-1");
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&file), 0o600);
        assert_eq!(mode(&dir.path().join("fleet/sub")), 0o700);
        assert_eq!(mode(&dir.path().join("fleet")), 0o700);
        write_private(&file, b"NEVER-LOGGED-TOKEN-2").unwrap();
        assert_eq!(std::fs::read(&file).unwrap(), b"NEVER-LOGGED-TOKEN-2");
        // Nothing but the file is left in the directory (the temp file was renamed).
        let names: Vec<_> = std::fs::read_dir(dir.path().join("fleet/sub"))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["fleet-token"]);
        // The stored token and its record read back.
        write_private(
            &record_path(&file),
            &serde_json::to_vec(&id("acc")).unwrap(),
        )
        .unwrap();
        let stored = load_stored(&file);
        assert_eq!(stored.token.unwrap().expose(), "NEVER-LOGGED-TOKEN-2");
        assert_eq!(stored.record, Some(id("acc")));
        assert!(stored.problem.is_none());
        // A record with sorted keys, as the reference writes it.
        let text = std::fs::read_to_string(record_path(&file)).unwrap();
        assert!(
            text.starts_with(r#"{"executor_account":"acc","peer_id":"#),
            "{text}"
        );
    }

    #[test]
    fn a_missing_token_file_is_no_token_and_a_readable_one_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("fleet-token");
        let stored = load_stored(&file);
        assert!(stored.token.is_none() && stored.problem.is_none());
        std::fs::write(&file, "NEVER-LOGGED-TOKEN-x").unwrap();
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
        let stored = load_stored(&file);
        assert!(stored.token.is_none());
        let problem = stored.problem.unwrap();
        assert!(problem.contains("group or others"), "{problem}");
        assert!(!problem.contains("NEVER-LOGGED-TOKEN"), "{problem}");
    }
}
