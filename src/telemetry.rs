//! What the daemon tells the outside while it runs: Prometheus metrics and a live status
//! snapshot. The loop records into a [`Telemetry`]; the status listener (`telemetry/listener.rs`), the
//! systemd notifier (`notify.rs`) and `fleet-sidecar status` read it. Recording is cheap
//! (atomics and one `watch` channel) and never fails. What `/status` shows of the loop's
//! sets is cut to size in `projection`.

use std::collections::BTreeMap;
use std::sync::atomic::AtomicU64;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use crate::ids::GroupId;

mod listener;
mod projection;
pub use listener::serve;
pub(crate) use projection::{Projection, SetsVersion};

/// Label set `{outcome="..."}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct OutcomeLabel {
    /// How it ended: the `metric_label()` of the outcome or error type (`PollError`, a join
    /// or leave task's end, a state write). A timeout is its own label everywhere
    /// (`timeout`), never counted as an `error`.
    pub(crate) outcome: &'static str,
}

/// Label set `{job="...",outcome="ok|error|timeout"}`: one run of a job beside the loop.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct JobOutcomeLabel {
    /// The job's name (`jobs::Job::NAME`).
    pub(crate) job: &'static str,
    /// How the run ended.
    pub(crate) outcome: &'static str,
}

/// Label set `{job="..."}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct JobLabel {
    /// The job's name (`jobs::Job::NAME`).
    pub(crate) job: &'static str,
}

/// Label set `{set="desired|confirmed|admitted|pending_leave"}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct SetLabel {
    /// Which set.
    pub(crate) set: &'static str,
}

/// Label set `{call="should_join|confirm|fleet_join|leave|namespace_get"}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct CallLabel {
    /// Which outside call.
    pub(crate) call: &'static str,
}

/// Label set `{source="sysfs|sysfs-legacy|tdreport|quote|none"}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct SourceLabel {
    /// Where the MRTD came from; `none` while unreadable.
    pub(crate) source: &'static str,
}

pub(crate) type HistogramFamily = Family<CallLabel, Histogram, fn() -> Histogram>;

fn latency_histogram() -> Histogram {
    // 5 ms .. ~164 s: a loopback answer to a 90 s fleet-join.
    Histogram::new(exponential_buckets(0.005, 2.0, 16))
}

/// The lifecycle phase, as systemd and `/readyz` see it. Displayed (and serialized) as
/// `starting`, `waiting_for_merod`, `running`, `stopping`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Loading state, reading identity.
    #[default]
    Starting,
    /// Waiting for merod's admin API.
    WaitingForMerod,
    /// Reconciling.
    Running,
    /// Shutting down.
    Stopping,
}

impl std::fmt::Display for Phase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Phase::Starting => "starting",
            Phase::WaitingForMerod => "waiting_for_merod",
            Phase::Running => "running",
            Phase::Stopping => "stopping",
        })
    }
}

/// A snapshot of the daemon, served as JSON at `/status` and read by `fleet-sidecar status`.
/// Times are Unix seconds (wall clock).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LiveStatus {
    /// Lifecycle phase.
    pub phase: Phase,
    /// The PeerId once read.
    pub peer_id: Option<String>,
    /// The MRTD (96 hex chars) once read.
    pub mrtd: Option<String>,
    /// Where the MRTD came from.
    pub(crate) mrtd_source: Option<String>,
    /// Whether this run only logs its plans (`--dry-run`).
    pub dry_run: bool,
    /// Polls attempted so far (the loop's heartbeat; before that, one per second of the wait
    /// for merod).
    pub heartbeats: u64,
    /// When the latest poll was attempted.
    pub last_poll_at: Option<f64>,
    /// When the latest successful poll answered.
    pub last_ok_poll_at: Option<f64>,
    /// The latest poll's failure, if it failed.
    pub last_poll_error: Option<String>,
    /// Failed polls in a row.
    pub consecutive_failures: u64,
    /// What merod last said while it was not ready.
    pub waiting_for: Option<String>,
    /// The latest successful poll's assignments.
    pub desired: Vec<GroupId>,
    /// The latest successful poll's `retain`.
    pub retain: Vec<GroupId>,
    /// Namespaces merod admitted.
    pub admitted: Vec<GroupId>,
    /// Admitted namespaces MDMA acknowledged.
    pub confirmed: Vec<GroupId>,
    /// Joins running.
    pub joining: Vec<GroupId>,
    /// Leaves running.
    pub leaving: Vec<GroupId>,
    /// Withdrawn namespaces not left yet, with why.
    pub pending_leaves: BTreeMap<GroupId, String>,
    /// Mass-withdrawal guard: `idle`, `holding (… left)` or `released`.
    pub mass_drop: String,
    /// The latest state file write error while writes fail (no leave starts meanwhile).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state_write_error: Option<String>,
    /// While a state write has run for longer than 10 s without returning (a hung disk):
    /// when it started (Unix s). Joins, confirms and leaves wait for it; polls go on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state_write_stalled_since: Option<f64>,
    /// The fleet token the polls carry: `configured` (`fleet_token` or `fleet_token_file`),
    /// `registered` (issued by registration, this run or stored), `tokenless` (registered,
    /// MDMA issues no tokens) or `none`. Never the token itself.
    #[serde(default)]
    pub fleet_token: String,
    /// With `[registration]`: how it stands (`pending`, `stored token in use`,
    /// `registered at <unix s>`, `blocked: …`, `failed: …; next attempt in N s`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub registration: Option<String>,
    /// Namespaces merod holds that are neither in the state (admitted, joining), assigned
    /// nor retained, by merod's latest list: reported, left only with `leave_orphans`.
    #[serde(default)]
    pub orphans: Vec<GroupId>,
    /// When the state file's directory is on a RAM filesystem (lost at reboot): which, e.g.
    /// `tmpfs at /dev/shm`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state_ram_filesystem: Option<String>,
    /// While merod's admin API does not answer after start-up (polls go on; joins and
    /// leaves wait): what the last readiness probe saw.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub merod_not_answering: Option<String>,
    /// The latest read of what merod holds (`held_namespaces`); `None` before the first
    /// good read or after a failed one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub held_namespaces: Option<HeldStatus>,
    /// What polls report as `swarm_addrs` (the latest good read of merod's external
    /// addresses); `None` before the first good read and after a failed one (polls then
    /// send `[]`, not reported).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub swarm_addrs: Option<Vec<String>>,
    /// The node's executor account (what polls report as `executor_account`), once known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub executor_account: Option<String>,
    /// What polls report as `relay_url` (`""`: none); `None` before the first read of the
    /// instance metadata.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub relay_url: Option<String>,
    /// What polls report as `tls_cert_not_after` (`""`: no certificate, a self-signed
    /// placeholder, or unreadable); `None` when `[tls] report = false` or not looked at yet.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls_cert_not_after: Option<String>,
    /// What polls report as `logs_token_fp` (`""`: no token); `None` when
    /// `[logs_token] report = false` or not looked at yet.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logs_token_fp: Option<String>,
    /// The latest join outcome of each namespace whose joins have not gone through yet
    /// (the entry goes when merod admits it).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub join_outcomes: BTreeMap<GroupId, JoinReport>,
    /// Each job beside the loop (the held refresh `held`, merod's readiness watch
    /// `merod_readiness`, …), by name: how its runs went. Kept by the job harness, the same
    /// for every job.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub jobs: BTreeMap<String, JobStatus>,
}

/// How a job beside the loop is doing.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct JobStatus {
    /// Runs ended since start-up (good or not).
    pub runs: u64,
    /// When the latest run ended (Unix s).
    pub last_run_at: f64,
    /// When the latest good run started (Unix s): its result's age counts from there;
    /// `None` before the first good run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_good_at: Option<f64>,
    /// While its runs fail: why the latest one failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failing: Option<String>,
}

/// What the latest read of merod's namespaces found.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct HeldStatus {
    /// Namespaces merod lists.
    pub count: usize,
    /// When the read started (Unix s).
    pub read_at: f64,
    /// Whether polls carry it as `held_namespaces` (false above 512 ids or once older
    /// than 3 minutes).
    pub reported: bool,
}

/// The latest fleet-join outcome of a namespace not admitted yet.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct JoinReport {
    /// `admitted`, `refused`, `waiting` or `error`.
    pub state: String,
    /// The first refusal (`<peer>: <reason>`) or the error, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// fleet-join attempts so far (kept across restarts).
    pub attempts: u64,
}

/// Why `/readyz` says not ready.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum NotReady {
    /// The PeerId is not read yet (merod not up, or its config unreadable).
    #[error("identity not read yet ({0})")]
    NoIdentity(Phase),
    /// The daemon is shutting down.
    #[error("stopping")]
    Stopping,
    /// State writes fail: no leave starts meanwhile.
    #[error("the state file cannot be written ({0})")]
    StateUnwritable(String),
    /// A state write has not returned for this many seconds (a hung disk): joins,
    /// confirms and leaves wait for it.
    #[error("a state write has not returned for {0:.0} s")]
    StateWriteStalled(f64),
    /// merod's admin API does not answer: polls go on, joins and leaves wait.
    #[error("merod is not answering ({0})")]
    MerodNotAnswering(String),
    /// No poll has succeeded since start.
    #[error("no successful poll yet")]
    NoPollYet,
    /// The last successful poll is older than `ready_max_poll_age`.
    #[error("last successful poll {age_secs:.1} s ago (limit {} s){last_error}", .limit.as_secs())]
    PollTooOld {
        /// Seconds since it.
        age_secs: f64,
        /// `ready_max_poll_age`.
        limit: Duration,
        /// `: <the last poll error>`, or empty.
        last_error: String,
    },
}

impl LiveStatus {
    /// Whether `/readyz` says ready at `now` (Unix s): the identity is known and a poll
    /// succeeded within `max_poll_age`. Errors: [`NotReady`], the reason it is not ready.
    pub fn readiness(&self, now: f64, max_poll_age: Duration) -> Result<(), NotReady> {
        if self.peer_id.is_none() {
            return Err(NotReady::NoIdentity(self.phase));
        }
        if self.phase == Phase::Stopping {
            return Err(NotReady::Stopping);
        }
        if let Some(e) = &self.state_write_error {
            return Err(NotReady::StateUnwritable(e.clone()));
        }
        if let Some(since) = self.state_write_stalled_since {
            return Err(NotReady::StateWriteStalled((now - since).max(0.0)));
        }
        if let Some(e) = &self.merod_not_answering {
            return Err(NotReady::MerodNotAnswering(e.clone()));
        }
        match self.last_ok_poll_at {
            None => Err(NotReady::NoPollYet),
            Some(t) if now - t > max_poll_age.as_secs_f64() => Err(NotReady::PollTooOld {
                age_secs: now - t,
                limit: max_poll_age,
                last_error: self
                    .last_poll_error
                    .as_deref()
                    .map(|e| format!(": {e}"))
                    .unwrap_or_default(),
            }),
            Some(_) => Ok(()),
        }
    }

    /// The one-line summary systemd shows (`STATUS=`), at `now` (Unix s).
    pub fn summary(&self, now: f64) -> String {
        match self.phase {
            Phase::Starting => return "starting".to_owned(),
            Phase::WaitingForMerod => {
                return format!(
                    "waiting for merod: {}",
                    self.waiting_for.as_deref().unwrap_or("no answer yet")
                )
            }
            Phase::Stopping => return "stopping".to_owned(),
            Phase::Running => {}
        }
        // Polls go on while merod does not answer: said first, the rest as usual.
        let mut s = match &self.merod_not_answering {
            Some(e) => format!("waiting for merod ({e}), polling meanwhile: "),
            None => String::new(),
        };
        if let Some(since) = self.state_write_stalled_since {
            s.push_str(&format!(
                "state write pending for {:.0} s (joins, confirms and leaves wait): ",
                (now - since).max(0.0)
            ));
        }
        s.push_str(&format!("{} confirmed", self.confirmed.len()));
        let unconfirmed = self.admitted.len().saturating_sub(self.confirmed.len());
        if unconfirmed > 0 {
            s.push_str(&format!(", {unconfirmed} admitted unconfirmed"));
        }
        if !self.pending_leaves.is_empty() {
            s.push_str(&format!(", {} pending leave", self.pending_leaves.len()));
        }
        match (
            &self.last_poll_error,
            self.last_poll_at,
            self.last_ok_poll_at,
        ) {
            (None, Some(t), _) => {
                s.push_str(&format!(", last poll ok {:.1} s ago", (now - t).max(0.0)))
            }
            (Some(e), _, Some(ok)) => s.push_str(&format!(
                ", last {} poll(s) failed ({e}), last ok {:.0} s ago",
                self.consecutive_failures,
                (now - ok).max(0.0)
            )),
            (Some(e), _, None) => s.push_str(&format!(", no successful poll yet ({e})")),
            (None, None, _) => s.push_str(", no poll yet"),
        }
        if self.dry_run {
            s.push_str(" [dry-run]");
        }
        s
    }
}

/// Now as Unix seconds.
pub fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// What an observer is told of the status before a change: the fields a change is judged
/// by. The whole status (every namespace list) is not copied on each update for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct StatusMark {
    /// The lifecycle phase.
    pub(crate) phase: Phase,
    /// Polls attempted (before that, one per second of the wait for merod).
    pub(crate) heartbeats: u64,
    /// Whether merod answers (see [`LiveStatus::merod_not_answering`]).
    pub(crate) merod_answering: bool,
}

impl LiveStatus {
    /// This status's [`StatusMark`].
    pub(crate) fn mark(&self) -> StatusMark {
        StatusMark {
            phase: self.phase,
            heartbeats: self.heartbeats,
            merod_answering: self.merod_not_answering.is_none(),
        }
    }

    /// Whether the daemon serves: running, and merod has answered (`READY=1`).
    pub fn serving(&self) -> bool {
        self.phase == Phase::Running && self.merod_not_answering.is_none()
    }
}

/// Called on every status change with the [`StatusMark`] before it and the status after.
pub(crate) type Observer = Box<dyn Fn(StatusMark, &LiveStatus) + Send + Sync>;

/// Metrics and live status of one daemon.
pub struct Telemetry {
    registry: Registry,
    /// `fleet_sidecar_polls_total{outcome}`: ok, transport, timeout, status, malformed.
    pub(crate) polls: Family<OutcomeLabel, Counter>,
    /// `fleet_sidecar_last_successful_poll_timestamp_seconds`.
    pub(crate) last_ok_poll: Gauge<f64, AtomicU64>,
    /// `fleet_sidecar_joins_total{outcome}`: admitted, not_admitted, error, timeout, not_held.
    pub(crate) joins: Family<OutcomeLabel, Counter>,
    /// `fleet_sidecar_confirms_total{outcome}`: ok, error.
    pub(crate) confirms: Family<OutcomeLabel, Counter>,
    /// `fleet_sidecar_leaves_total{outcome}`: left, failed, timeout, not_held (a joining-only
    /// namespace merod did not hold: dropped with no leave call).
    pub(crate) leaves: Family<OutcomeLabel, Counter>,
    /// `fleet_sidecar_state_writes_total{outcome}`: ok, error (a failed write of the state
    /// file, or a failed check that one can be written before a leave).
    pub(crate) state_writes: Family<OutcomeLabel, Counter>,
    /// `fleet_sidecar_namespaces{set}`.
    pub(crate) namespaces: Family<SetLabel, Gauge>,
    /// `fleet_sidecar_call_duration_seconds{call}`.
    pub(crate) call_seconds: HistogramFamily,
    /// `fleet_sidecar_mrtd_source{source}`: 1 for the current source.
    pub(crate) mrtd_source: Family<SourceLabel, Gauge>,
    /// `fleet_sidecar_mass_withdrawal_hold`: 1 while the mass-withdrawal guard holds every
    /// leave, else 0 (follows [`LiveStatus::mass_drop`]).
    pub(crate) mass_withdrawal_hold: Gauge,
    /// `fleet_sidecar_pending_leave_oldest_absence_seconds`: the longest absence observed
    /// among the withdrawn namespaces not left yet (0 when none): how far the oldest pending
    /// leave is into `leave_grace`, or past it while a guard or rate limit holds it.
    pub(crate) pending_leave_absence: Gauge<f64, AtomicU64>,
    /// `fleet_sidecar_poll_resends_total`: should-joins sent once more on a fresh
    /// connection because MDMA (or a load balancer) closed the kept-alive one as it was
    /// reused; such a poll does not fail.
    pub(crate) poll_resends: Counter,
    /// `fleet_sidecar_registrations_total{outcome}`: registered, tokenless, refused,
    /// unavailable, blocked, error, timeout.
    pub(crate) registrations: Family<OutcomeLabel, Counter>,
    /// `fleet_sidecar_tls_installs_total{outcome}`: delivered certificates installed,
    /// unchanged, refused (not over the node's key), error (a file could not be read or
    /// written).
    pub(crate) tls_installs: Family<OutcomeLabel, Counter>,
    /// `fleet_sidecar_unit_restarts_total{outcome}`: systemd unit restarts asked for over
    /// D-Bus after an install (ok, error, timeout).
    pub(crate) unit_restarts: Family<OutcomeLabel, Counter>,
    /// `fleet_sidecar_logs_token_installs_total{outcome}`: delivered log shippers' tokens
    /// installed, unchanged (the one held), error (the file could not be read or written).
    pub(crate) logs_token_installs: Family<OutcomeLabel, Counter>,
    /// `fleet_sidecar_state_on_ram_filesystem`: 1 when the state file's directory is on a
    /// RAM filesystem (tmpfs, ramfs, an overlay whose upper layer is one), else 0.
    pub(crate) state_on_ram_filesystem: Gauge,
    /// `fleet_sidecar_state_write_stalled`: 1 while a state write has run for longer than
    /// 10 s without returning (a hung disk), else 0.
    pub(crate) state_write_stalled: Gauge,
    /// `fleet_sidecar_orphan_namespaces`: how many namespaces merod holds that are neither
    /// in the state, assigned nor retained (follows [`LiveStatus::orphans`]).
    pub(crate) orphan_namespaces: Gauge,
    /// `fleet_sidecar_held_namespaces`: namespaces merod listed in the latest read; -1 while
    /// the latest read failed (or none was made yet).
    pub(crate) held_namespaces: Gauge,
    /// `fleet_sidecar_held_drift_total`: namespaces the state recorded as held that merod
    /// said it no longer holds (dropped from the state, joined again while assigned).
    pub(crate) held_drift: Counter,
    /// `fleet_sidecar_join_status_reports_total{outcome}`: `POST /api/fleet/join-status`:
    /// ok, error, timeout.
    pub(crate) join_status_reports: Family<OutcomeLabel, Counter>,
    /// `fleet_sidecar_role_reads_total{outcome}`: reads of the node's role for a confirm
    /// (identity and members): ok (a role or none), error, timeout.
    pub(crate) role_reads: Family<OutcomeLabel, Counter>,
    /// `fleet_sidecar_job_runs_total{job,outcome}`: runs of each job beside the loop (see
    /// `jobs`): ok, error, timeout. Declared by the job harness, the same for every job.
    pub(crate) job_runs: Family<JobOutcomeLabel, Counter>,
    /// `fleet_sidecar_job_run_seconds{job}`: how long each run of a job took.
    pub(crate) job_run_seconds: Family<JobLabel, Histogram, fn() -> Histogram>,
    /// `fleet_sidecar_job_last_success_timestamp_seconds{job}`: when the latest good result
    /// of a job was had (Unix time; its age is `time() -` this); absent before the first.
    pub(crate) job_last_success: Family<JobLabel, Gauge<f64, AtomicU64>>,
    status: watch::Sender<LiveStatus>,
    /// The [`projection::SetsVersion`] the status's large lists (`desired`, `retain`,
    /// `admitted`, `confirmed`) were last filled from: the same again means the same lists,
    /// so they are not compared id by id.
    published_sets: std::sync::Mutex<Option<projection::SetsVersion>>,
    observers: std::sync::Mutex<Vec<Observer>>,
    /// The loop's liveness: bumped on every turn of the reconcile loop (at least once a
    /// second, and after every poll) and every second of the wait for merod. The systemd
    /// watchdog is fed only while it moves, whatever `poll_interval` is.
    pub loop_turns: std::sync::atomic::AtomicU64,
}

impl std::fmt::Debug for Telemetry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Telemetry")
            .field("status", &*self.status.borrow())
            .finish_non_exhaustive()
    }
}

impl Default for Telemetry {
    fn default() -> Self {
        Self::new()
    }
}

impl Telemetry {
    /// Records that the loop is alive (see [`Telemetry::loop_turns`]).
    pub(crate) fn mark_alive(&self) {
        self.loop_turns
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// A fresh registry with every metric registered under the `fleet_sidecar_` prefix.
    pub fn new() -> Self {
        let mut telemetry = Self {
            registry: Registry::with_prefix("fleet_sidecar"),
            polls: Default::default(),
            last_ok_poll: Default::default(),
            joins: Default::default(),
            confirms: Default::default(),
            leaves: Default::default(),
            state_writes: Default::default(),
            namespaces: Default::default(),
            call_seconds: Family::new_with_constructor(latency_histogram),
            mrtd_source: Default::default(),
            mass_withdrawal_hold: Default::default(),
            pending_leave_absence: Default::default(),
            poll_resends: Default::default(),
            registrations: Default::default(),
            tls_installs: Default::default(),
            unit_restarts: Default::default(),
            logs_token_installs: Default::default(),
            state_on_ram_filesystem: Default::default(),
            state_write_stalled: Default::default(),
            orphan_namespaces: Default::default(),
            held_namespaces: Default::default(),
            held_drift: Default::default(),
            join_status_reports: Default::default(),
            role_reads: Default::default(),
            job_runs: Default::default(),
            job_run_seconds: Family::new_with_constructor(latency_histogram),
            job_last_success: Default::default(),
            status: watch::Sender::new(LiveStatus::default()),
            published_sets: std::sync::Mutex::new(None),
            observers: std::sync::Mutex::new(Vec::new()),
            loop_turns: std::sync::atomic::AtomicU64::new(0),
        };
        telemetry.register_loop_metrics();
        telemetry.register_node_metrics();
        telemetry.register_job_metrics();
        telemetry.export_known_outcomes();
        telemetry
    }

    /// The loop's metrics: polls, joins, confirms, leaves, state writes, the sets, call
    /// latencies, the MRTD's source, the leave guards.
    fn register_loop_metrics(&mut self) {
        let registry = &mut self.registry;
        registry.register(
            "polls",
            "MDMA should-join polls by outcome",
            self.polls.clone(),
        );
        registry.register(
            "last_successful_poll_timestamp_seconds",
            "Unix time of the latest successful poll",
            self.last_ok_poll.clone(),
        );
        registry.register(
            "joins",
            "fleet-join attempts by outcome",
            self.joins.clone(),
        );
        registry.register(
            "confirms",
            "MDMA confirms by outcome",
            self.confirms.clone(),
        );
        registry.register("leaves", "namespace leaves by outcome", self.leaves.clone());
        registry.register(
            "state_writes",
            "state file writes by outcome",
            self.state_writes.clone(),
        );
        registry.register(
            "namespaces",
            "namespaces in each set (desired, admitted, confirmed, pending_leave)",
            self.namespaces.clone(),
        );
        registry.register(
            "call_duration_seconds",
            "latency of outside calls (MDMA and merod) in seconds",
            self.call_seconds.clone(),
        );
        registry.register(
            "mrtd_source",
            "1 for where the MRTD was read from (none: unreadable)",
            self.mrtd_source.clone(),
        );
        registry.register(
            "mass_withdrawal_hold",
            "1 while the mass-withdrawal guard holds every leave",
            self.mass_withdrawal_hold.clone(),
        );
        registry.register(
            "pending_leave_oldest_absence_seconds",
            "longest absence observed (monotonic) among withdrawn namespaces not left yet",
            self.pending_leave_absence.clone(),
        );
        registry.register(
            "poll_resends",
            "should-join polls sent once more on a fresh connection after a kept-alive one was closed as it was reused",
            self.poll_resends.clone(),
        );
    }

    /// The node's metrics beside the loop: dropped log lines, registration, what MDMA
    /// delivers, the state file's disk, what merod holds, join-status reports, role reads.
    fn register_node_metrics(&mut self) {
        let registry = &mut self.registry;
        // The process's sinks, shared by every Telemetry of the process.
        let lines_dropped = crate::dropped::dropped_lines().clone();
        for sink in crate::dropped::SINKS {
            drop(lines_dropped.get_or_create(&crate::dropped::SinkLabel { sink }));
        }
        registry.register(
            "log_lines_dropped",
            "log lines (and notify messages) dropped because their sink (stderr, log_file, journal, notify) was not reading",
            lines_dropped,
        );
        registry.register(
            "registrations",
            "attested registration attempts by outcome",
            self.registrations.clone(),
        );
        registry.register(
            "tls_installs",
            "TLS certificates MDMA delivered, by what became of them",
            self.tls_installs.clone(),
        );
        registry.register(
            "unit_restarts",
            "systemd unit restarts asked for over D-Bus after a certificate install",
            self.unit_restarts.clone(),
        );
        registry.register(
            "logs_token_installs",
            "log shippers' tokens MDMA delivered, by what became of them",
            self.logs_token_installs.clone(),
        );
        registry.register(
            "state_on_ram_filesystem",
            "1 when the state file's directory is on a RAM filesystem, lost at reboot",
            self.state_on_ram_filesystem.clone(),
        );
        registry.register(
            "state_write_stalled",
            "1 while a state write has run for over 10 s without returning (a hung disk)",
            self.state_write_stalled.clone(),
        );
        registry.register(
            "orphan_namespaces",
            "namespaces merod holds that are neither in the state, assigned nor retained",
            self.orphan_namespaces.clone(),
        );
        self.held_namespaces.set(-1);
        registry.register(
            "held_namespaces",
            "namespaces merod listed in the latest read (-1: the latest read failed)",
            self.held_namespaces.clone(),
        );
        registry.register(
            "held_drift",
            "namespaces recorded as held that merod no longer holds",
            self.held_drift.clone(),
        );
        registry.register(
            "join_status_reports",
            "MDMA join-status reports by outcome",
            self.join_status_reports.clone(),
        );
        registry.register(
            "role_reads",
            "reads of the node's role in a namespace (for the confirm) by outcome",
            self.role_reads.clone(),
        );
    }

    /// The job harness's metrics, per job.
    fn register_job_metrics(&mut self) {
        let registry = &mut self.registry;
        registry.register(
            "job_runs",
            "runs of each job beside the loop by outcome",
            self.job_runs.clone(),
        );
        registry.register(
            "job_run_seconds",
            "duration of each run of a job beside the loop",
            self.job_run_seconds.clone(),
        );
        registry.register(
            "job_last_success_timestamp_seconds",
            "when each job beside the loop last had a good result (Unix time)",
            self.job_last_success.clone(),
        );
    }

    /// Every known outcome exported from the start (at 0), so dashboards and alerts see the
    /// series before the first event.
    fn export_known_outcomes(&self) {
        for (family, outcomes) in [
            (
                &self.polls,
                &["ok", "transport", "timeout", "status", "malformed"][..],
            ),
            (
                &self.joins,
                &["admitted", "not_admitted", "error", "timeout", "not_held"][..],
            ),
            (&self.confirms, &["ok", "error", "timeout"][..]),
            (&self.leaves, &["left", "failed", "timeout", "not_held"][..]),
            (&self.state_writes, &["ok", "error"][..]),
            (
                &self.registrations,
                &[
                    "registered",
                    "tokenless",
                    "refused",
                    "unavailable",
                    "blocked",
                    "error",
                    "timeout",
                ][..],
            ),
            (&self.join_status_reports, &["ok", "error", "timeout"][..]),
            (
                &self.tls_installs,
                &["installed", "unchanged", "refused", "error"][..],
            ),
            (&self.unit_restarts, &["ok", "error", "timeout"][..]),
            (
                &self.logs_token_installs,
                &["installed", "unchanged", "error"][..],
            ),
            (&self.role_reads, &["ok", "error", "timeout"][..]),
        ] {
            for &outcome in outcomes {
                drop(family.get_or_create(&OutcomeLabel { outcome }));
            }
        }
    }

    /// The metrics in the OpenMetrics text format (what Prometheus scrapes).
    pub fn encode_metrics(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }

    /// Counts one outcome of `family`, labelled `outcome` (a `metric_label()`).
    pub(crate) fn count(family: &Family<OutcomeLabel, Counter>, outcome: &'static str) {
        family.get_or_create(&OutcomeLabel { outcome }).inc();
    }

    /// Records how long `call` took.
    pub(crate) fn observe(&self, call: &'static str, took: Duration) {
        self.call_seconds
            .get_or_create(&CallLabel { call })
            .observe(took.as_secs_f64());
    }

    /// Sets the MRTD source gauge (`None`: unreadable).
    pub(crate) fn set_mrtd_source(&self, source: Option<&'static str>) {
        self.mrtd_source.clear();
        self.mrtd_source
            .get_or_create(&SourceLabel {
                source: source.unwrap_or("none"),
            })
            .set(1);
    }

    /// Changes the live status; watchers are woken and observers called, synchronously,
    /// from the caller (the loop itself: a stalled loop calls nobody). Observers get the
    /// [`StatusMark`] before the change, so nothing is copied; an observer must not call
    /// `update` itself.
    #[doc(hidden)] // for examples/cycle-profile; the loop is its only writer
    pub fn update(&self, f: impl FnOnce(&mut LiveStatus)) {
        {
            let observers = self.observers.lock().unwrap_or_else(|p| p.into_inner());
            let before = self.status.borrow().mark();
            self.status.send_modify(f);
            if !observers.is_empty() {
                let after = self.status.borrow();
                for observe in observers.iter() {
                    observe(before, &after);
                }
            }
        }
        let status = self.status.borrow();
        let holding = status.mass_drop.starts_with("holding");
        self.mass_withdrawal_hold.set(i64::from(holding));
        self.state_on_ram_filesystem
            .set(i64::from(status.state_ram_filesystem.is_some()));
        self.orphan_namespaces
            .set(i64::try_from(status.orphans.len()).unwrap_or(i64::MAX));
    }

    /// Adds an observer of every status change (e.g. the systemd notifier).
    pub(crate) fn add_observer(&self, observer: Observer) {
        self.observers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(observer);
    }

    /// The live status now.
    pub fn snapshot(&self) -> LiveStatus {
        self.status.borrow().clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stalled_state_write_makes_readyz_not_ready_and_leads_the_status_line() {
        let max = Duration::from_secs(30);
        let mut s = LiveStatus {
            phase: Phase::Running,
            peer_id: Some("12D3KooW".into()),
            last_poll_at: Some(99.0),
            last_ok_poll_at: Some(99.0),
            ..LiveStatus::default()
        };
        assert_eq!(s.readiness(100.0, max), Ok(()));
        s.state_write_stalled_since = Some(88.0);
        let e = s.readiness(100.0, max).unwrap_err();
        assert_eq!(e, NotReady::StateWriteStalled(12.0));
        assert_eq!(e.to_string(), "a state write has not returned for 12 s");
        assert_eq!(
            s.summary(100.0),
            "state write pending for 12 s (joins, confirms and leaves wait): 0 confirmed, last poll ok 1.0 s ago"
        );
        s.state_write_stalled_since = None;
        assert_eq!(s.readiness(100.0, max), Ok(()));
        assert_eq!(s.summary(100.0), "0 confirmed, last poll ok 1.0 s ago");
    }

    #[test]
    fn readiness_needs_identity_and_a_recent_good_poll() {
        let max = Duration::from_secs(30);
        let mut s = LiveStatus {
            phase: Phase::WaitingForMerod,
            ..LiveStatus::default()
        };
        let e = s.readiness(100.0, max).unwrap_err();
        assert_eq!(e.to_string(), "identity not read yet (waiting_for_merod)");
        s.peer_id = Some("12D3KooW".into());
        s.phase = Phase::Running;
        assert_eq!(s.readiness(100.0, max), Err(NotReady::NoPollYet));
        s.last_ok_poll_at = Some(90.0);
        assert!(s.readiness(100.0, max).is_ok());
        s.last_poll_error = Some("HTTP 503".into());
        let e = s.readiness(121.0, max).unwrap_err().to_string();
        assert!(e.contains("31.0 s ago") && e.contains("HTTP 503"), "{e}");
        s.phase = Phase::Stopping;
        assert!(s.readiness(100.0, max).is_err());
    }

    #[test]
    fn the_ram_filesystem_and_orphan_gauges_follow_the_status() {
        let t = Telemetry::new();
        let text = t.encode_metrics();
        assert!(
            text.contains("fleet_sidecar_state_on_ram_filesystem 0\n"),
            "{text}"
        );
        assert!(
            text.contains("fleet_sidecar_orphan_namespaces 0\n"),
            "{text}"
        );
        let id: GroupId = "ab".repeat(32).parse().unwrap();
        t.update(|s| {
            s.state_ram_filesystem = Some("tmpfs at /dev/shm".into());
            s.orphans = vec![id];
        });
        let text = t.encode_metrics();
        assert!(
            text.contains("fleet_sidecar_state_on_ram_filesystem 1\n"),
            "{text}"
        );
        assert!(
            text.contains("fleet_sidecar_orphan_namespaces 1\n"),
            "{text}"
        );
        let status = serde_json::to_value(t.snapshot()).unwrap();
        assert_eq!(status["state_ram_filesystem"], "tmpfs at /dev/shm");
        assert_eq!(status["orphans"][0], id.to_string());
    }

    #[test]
    fn the_hold_gauge_follows_the_mass_withdrawal_guard() {
        let t = Telemetry::new();
        assert!(t
            .encode_metrics()
            .contains("fleet_sidecar_mass_withdrawal_hold 0\n"));
        t.update(|s| s.mass_drop = "holding every leave (10 s of 600 s left)".into());
        assert!(t
            .encode_metrics()
            .contains("fleet_sidecar_mass_withdrawal_hold 1\n"));
        t.update(|s| s.mass_drop = "released".into());
        assert_eq!(t.mass_withdrawal_hold.get(), 0);
    }

    #[test]
    fn summary_lines() {
        let mut s = LiveStatus {
            phase: Phase::Running,
            confirmed: vec![GroupId::from_bytes([1; 32]); 3],
            admitted: vec![GroupId::from_bytes([1; 32]); 3],
            last_poll_at: Some(99.6),
            last_ok_poll_at: Some(99.6),
            ..LiveStatus::default()
        };
        assert_eq!(s.summary(100.0), "3 confirmed, last poll ok 0.4 s ago");
        s.last_poll_error = Some("HTTP 503".into());
        s.consecutive_failures = 2;
        s.last_ok_poll_at = Some(90.0);
        assert_eq!(
            s.summary(100.0),
            "3 confirmed, last 2 poll(s) failed (HTTP 503), last ok 10 s ago"
        );
        s.phase = Phase::WaitingForMerod;
        s.waiting_for = Some("connection refused".into());
        assert_eq!(s.summary(100.0), "waiting for merod: connection refused");
    }

    #[test]
    fn metrics_encode_with_the_prefix() {
        let t = Telemetry::new();
        Telemetry::count(&t.polls, "ok");
        Telemetry::count(&t.polls, "ok");
        t.observe("should_join", Duration::from_millis(3));
        t.set_mrtd_source(Some("sysfs"));
        t.last_ok_poll.set(1234.5);
        let text = t.encode_metrics();
        assert!(
            text.contains("fleet_sidecar_polls_total{outcome=\"ok\"} 2"),
            "{text}"
        );
        assert!(
            text.contains("fleet_sidecar_mrtd_source{source=\"sysfs\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("fleet_sidecar_call_duration_seconds_count{call=\"should_join\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("fleet_sidecar_last_successful_poll_timestamp_seconds 1234.5"),
            "{text}"
        );
        assert!(text.ends_with("# EOF\n"));
    }

    #[test]
    fn a_timeout_is_its_own_outcome_label_for_every_call() {
        let t = Telemetry::new();
        Telemetry::count(&t.joins, "timeout");
        Telemetry::count(&t.joins, "error");
        Telemetry::count(&t.joins, "error");
        let text = t.encode_metrics();
        for line in [
            "fleet_sidecar_joins_total{outcome=\"timeout\"} 1",
            "fleet_sidecar_joins_total{outcome=\"error\"} 2",
            "fleet_sidecar_confirms_total{outcome=\"timeout\"} 0",
            "fleet_sidecar_leaves_total{outcome=\"timeout\"} 0",
            "fleet_sidecar_polls_total{outcome=\"timeout\"} 0",
            "fleet_sidecar_joins_total{outcome=\"not_admitted\"} 0",
        ] {
            assert!(text.contains(line), "{line} missing from:\n{text}");
        }
    }
}
