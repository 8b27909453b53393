//! Why a join waits, told to MDMA: after each fleet-join outcome, `POST
//! /api/fleet/join-status` when the outcome differs from the last one MDMA acknowledged, or
//! at every 10th attempt. A job on the crate's job harness (`jobs`), fed by the loop: the
//! loop hands it each outcome on a channel and never waits; the job counts the attempts
//! per namespace in a small file next to the state file (so they survive a restart),
//! reports, and shows the latest outcome per namespace in the live status. Best effort
//! throughout: a report MDMA did not take is sent again after the harness's back-off (one
//! answered 404, from an MDMA without the route, is not: a later outcome is), a failed
//! write is written again; each failure is logged once, and none changes anything about
//! joining.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::{timeout, Instant};
use tokio_util::sync::CancellationToken;
use tracing::warn;

use super::limits::MDMA_DEADLINE;
use crate::durable::parent_dir;
use crate::ids::{GroupId, PeerId};
use crate::jobs::{self, Job, JobHandle, Schedule};
use crate::mdma::{ControlPlane, JoinState, JoinStatus, RequestError};
use crate::merod::{Admission, Refusal};
use crate::outcome::{CallOutcome, Timed};
use crate::state::{write_atomically, StateError};
use crate::telemetry::{JoinReport, Telemetry};

/// The file, beside the state file, that keeps the attempts per namespace.
pub(crate) const JOIN_STATUS_FILE: &str = "fleet-join-status.json";
/// Longest `error` sent, in characters.
pub(crate) const MAX_ERROR: usize = 512;
/// A report is due at every this-many-th attempt even when nothing changed.
pub(crate) const REPORT_EVERY: u64 = 10;

/// How one fleet-join ended, as MDMA is told (what a report's fingerprint is).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct JoinOutcome {
    pub(crate) state: JoinState,
    pub(crate) refusals: Vec<Refusal>,
    pub(crate) error: Option<String>,
}

/// One fleet-join's end as the job takes it: what MDMA is told, and whether merod admitted
/// the node (`admitted: true`), which ends the namespace's count. An answer that only names
/// `admitted_by` is reported `admitted` but keeps the count: the join is still retried, and
/// the same outcome again is not due.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Attempt {
    pub(crate) outcome: JoinOutcome,
    pub(crate) settled: bool,
}

impl Attempt {
    /// The attempt one fleet-join call made (see [`JoinOutcome::of`]).
    pub(crate) fn of(answer: Result<&Admission, &str>) -> Self {
        Self {
            outcome: JoinOutcome::of(answer),
            settled: answer.is_ok_and(|a| a.admitted),
        }
    }
}

impl JoinOutcome {
    /// The outcome of one fleet-join call: `error` when it failed (`failure`, cut to
    /// [`MAX_ERROR`] chars), `admitted` on `admitted: true` or a set `admitted_by`,
    /// `refused` when admitting nodes said why not, `waiting` otherwise.
    pub(crate) fn of(answer: Result<&Admission, &str>) -> Self {
        match answer {
            Err(failure) => JoinOutcome {
                state: JoinState::Error,
                refusals: Vec::new(),
                error: Some(failure.chars().take(MAX_ERROR).collect()),
            },
            Ok(a) => JoinOutcome {
                state: if a.admitted || a.admitted_by.is_some() {
                    JoinState::Admitted
                } else if a.refusals.is_empty() {
                    JoinState::Waiting
                } else {
                    JoinState::Refused
                },
                refusals: a.refusals.clone(),
                error: None,
            },
        }
    }

    /// What `/status` shows of it.
    fn status(&self, attempts: u64) -> JoinReport {
        let reason = match (&self.error, self.refusals.first()) {
            (Some(e), _) => Some(e.clone()),
            (None, Some(r)) => Some(format!("{}: {}", r.peer, r.reason)),
            (None, None) => None,
        };
        JoinReport {
            state: self.state.as_str().to_owned(),
            reason,
            attempts,
        }
    }
}

/// What is kept per namespace: attempts so far and the last outcome MDMA acknowledged.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Entry {
    pub(crate) attempts: u64,
    pub(crate) reported: Option<JoinOutcome>,
}

/// Counts one attempt that ended with `outcome`; whether a report is due: the outcome
/// differs from the last one acknowledged, or this is a 10th attempt.
pub(crate) fn count_attempt(entry: &mut Entry, outcome: &JoinOutcome) -> bool {
    entry.attempts = entry.attempts.saturating_add(1);
    entry.reported.as_ref() != Some(outcome) || entry.attempts % REPORT_EVERY == 0
}

/// The file's document.
#[derive(Default, Serialize, Deserialize)]
struct Document {
    version: u32,
    namespaces: BTreeMap<GroupId, Entry>,
}

/// Where the attempts of the daemon whose state file is `state_file` are kept.
pub(crate) fn file_beside(state_file: &Path) -> PathBuf {
    parent_dir(state_file).join(JOIN_STATUS_FILE)
}

/// Hands join outcomes to the job; sending never waits.
#[derive(Clone, Debug)]
pub(crate) struct JoinStatusHandle {
    tx: Option<mpsc::UnboundedSender<(GroupId, Attempt)>>,
    job: JobHandle<()>,
}

impl JoinStatusHandle {
    /// A handle that reports nothing (dry runs).
    pub(crate) fn idle() -> Self {
        Self {
            tx: None,
            job: JobHandle::idle(),
        }
    }

    /// Hands over the outcome of one fleet-join of `id`.
    pub(crate) fn record(&self, id: GroupId, attempt: Attempt) {
        if let Some(tx) = &self.tx {
            // The job ends only at shutdown; an outcome after that is not reported.
            if tx.send((id, attempt)).is_ok() {
                self.job.run_soon();
            }
        }
    }
}

/// What the job needs.
pub(crate) struct JobDeps {
    pub(crate) path: PathBuf,
    pub(crate) mdma: Arc<dyn ControlPlane>,
    pub(crate) peer_id: PeerId,
    pub(crate) telemetry: Arc<Telemetry>,
}

/// Bound of one run: the file written, at most one report that fails (each bounded by
/// [`MDMA_DEADLINE`]) among quick good ones, the file written again.
const RUN_DEADLINE: Duration = MDMA_DEADLINE.saturating_mul(3);

/// Starts the job ([`JoinStatusJob`] on the job harness): its first run loads the file (a
/// missing one is empty, an unreadable one is empty with a warning: only counts are lost),
/// then it runs when handed an outcome, or after a back-off while a report or a write is
/// still to be done, until `shutdown`.
pub(crate) fn spawn(deps: JobDeps, shutdown: CancellationToken) -> JoinStatusHandle {
    let (tx, outcomes) = mpsc::unbounded_channel();
    let telemetry = Arc::clone(&deps.telemetry);
    let job = JoinStatusJob {
        deps,
        outcomes,
        entries: None,
        due: BTreeMap::new(),
        dirty: false,
        writing: None,
    };
    JoinStatusHandle {
        tx: Some(tx),
        job: jobs::spawn(job, telemetry, shutdown),
    }
}

/// Why a run left something undone.
#[derive(Debug, thiserror::Error)]
pub(crate) enum JoinStatusFailed {
    /// MDMA did not take a report: it is sent again after the back-off (unless MDMA has no
    /// such route, a 404: then only a later outcome is reported).
    #[error("report not accepted: {0}")]
    Refused(RequestError),
    /// MDMA gave no answer within the bound; the report is sent again after the back-off.
    #[error("report not answered within {0:?}")]
    NoAnswer(Duration),
    /// The file could not be written (written again after the back-off).
    #[error("{0}")]
    Write(String),
}

impl Timed for JoinStatusFailed {
    fn is_timeout(&self) -> bool {
        match self {
            JoinStatusFailed::Refused(e) => e.is_timeout(),
            JoinStatusFailed::NoAnswer(_) => true,
            JoinStatusFailed::Write(_) => false,
        }
    }
}

/// The join-status job. Everything a run has to do is kept here, not in the run, so a
/// run cut at its deadline leaves nothing lost: the next run takes it up.
struct JoinStatusJob {
    deps: JobDeps,
    outcomes: mpsc::UnboundedReceiver<(GroupId, Attempt)>,
    /// Attempts per namespace; `None` until the file is loaded.
    entries: Option<BTreeMap<GroupId, Entry>>,
    /// Reports due, with the attempts they carry: the latest outcome per namespace.
    due: BTreeMap<GroupId, (JoinOutcome, u64)>,
    /// `entries` changed since the file was last written.
    dirty: bool,
    /// A write still under way (a run cut during it): awaited before another starts, so a
    /// hung disk holds one blocking thread, not one per run.
    writing: Option<JoinHandle<Result<(), StateError>>>,
}

impl Job for JoinStatusJob {
    type Output = ();
    type Error = JoinStatusFailed;
    const NAME: &'static str = "join_status";
    const FAILING: &'static str = "join-status not reported or not kept";
    const EFFECT: &'static str = "joining goes on: reports are best effort (an MDMA without the route answers 404), and attempts not written may count from an older number after a restart";
    const RECOVERED: &'static str = "join-status reported and kept again";

    fn schedule(&self) -> Schedule {
        Schedule::when_asked(RUN_DEADLINE)
    }

    async fn run(&mut self) -> Result<(), JoinStatusFailed> {
        if self.entries.is_none() {
            self.entries = Some(load(&self.deps).await);
        }
        self.take_outcomes();
        // The counts are on disk before the reports go out; a failed write is tried again
        // below, after the reports, which do not wait for it.
        let _ = self.write().await;
        let reported = self.report_due().await;
        self.write().await?;
        reported
    }

    fn retry_after(error: &JoinStatusFailed) -> Option<Duration> {
        match error {
            JoinStatusFailed::Refused(e) => e.retry_after(),
            JoinStatusFailed::NoAnswer(_) | JoinStatusFailed::Write(_) => None,
        }
    }

    fn idle(&self) -> bool {
        self.entries.is_some()
            && self.outcomes.is_empty()
            && self.due.is_empty()
            && !self.dirty
            && self.writing.is_none()
    }
}

/// The attempts kept in the file at `deps.path`, shown in the live status.
async fn load(deps: &JobDeps) -> BTreeMap<GroupId, Entry> {
    let path = deps.path.clone();
    let read = tokio::task::spawn_blocking(move || std::fs::read(&path)).await;
    let entries = match read {
        Ok(Ok(bytes)) => match serde_json::from_slice::<Document>(&bytes) {
            Ok(doc) => doc.namespaces,
            Err(e) => {
                warn!(path = %deps.path.display(), "join-status file unreadable ({e}); join attempts are counted from 0 again");
                BTreeMap::new()
            }
        },
        Ok(Err(e)) if e.kind() == std::io::ErrorKind::NotFound => BTreeMap::new(),
        Ok(Err(e)) => {
            warn!(path = %deps.path.display(), "cannot read the join-status file ({e}); join attempts are counted from 0 again");
            BTreeMap::new()
        }
        Err(e) => {
            warn!(
                "the join-status file reader stopped ({e}); join attempts are counted from 0 again"
            );
            BTreeMap::new()
        }
    };
    deps.telemetry.update(|st| {
        st.join_outcomes = entries
            .iter()
            .filter_map(|(id, e)| e.reported.as_ref().map(|o| (*id, o.status(e.attempts))))
            .collect();
    });
    entries
}

impl JoinStatusJob {
    /// Counts every outcome handed over so far, and shows it (no await: a cut run never
    /// counts one twice or loses one).
    fn take_outcomes(&mut self) {
        let Some(entries) = self.entries.as_mut() else {
            return;
        };
        while let Ok((id, Attempt { outcome, settled })) = self.outcomes.try_recv() {
            let entry = entries.entry(id).or_default();
            let due = count_attempt(entry, &outcome);
            let attempts = entry.attempts;
            self.deps.telemetry.update(|st| {
                if settled {
                    st.join_outcomes.remove(&id);
                } else {
                    st.join_outcomes.insert(id, outcome.status(attempts));
                }
            });
            if settled {
                entries.remove(&id);
            }
            if due {
                self.due.insert(id, (outcome, attempts));
            } else {
                // MDMA holds this very outcome: an older one still due is stale.
                self.due.remove(&id);
            }
            self.dirty = true;
        }
    }

    /// Sends the due reports, stopping at the first that fails (it stays due, or on a 404
    /// every due report is dropped: the route is absent).
    async fn report_due(&mut self) -> Result<(), JoinStatusFailed> {
        while let Some((&id, (outcome, attempts))) = self.due.first_key_value() {
            let report = JoinStatus {
                state: outcome.state,
                refusals: outcome.refusals.clone(),
                error: outcome.error.clone(),
                peer_id: self.deps.peer_id.to_string(),
                group_id: id,
                attempts: *attempts,
            };
            if let Err(e) = self.send(&report).await {
                if matches!(
                    &e,
                    JoinStatusFailed::Refused(RequestError::Status { status: 404, .. })
                ) {
                    self.due.clear();
                }
                return Err(e);
            }
            let Some((outcome, _)) = self.due.remove(&id) else {
                continue;
            };
            if let Some(entry) = self.entries.as_mut().and_then(|e| e.get_mut(&id)) {
                entry.reported = Some(outcome);
                self.dirty = true;
            }
        }
        Ok(())
    }

    /// Sends one report, bounded by [`MDMA_DEADLINE`].
    async fn send(&self, report: &JoinStatus) -> Result<(), JoinStatusFailed> {
        let t = &self.deps.telemetry;
        let started = Instant::now();
        let result = timeout(MDMA_DEADLINE, self.deps.mdma.join_status(report)).await;
        t.observe("join_status", started.elapsed());
        let outcome = CallOutcome::of_bounded(result.as_ref().ok());
        Telemetry::count(&t.join_status_reports, outcome.label());
        match result {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(JoinStatusFailed::Refused(e)),
            Err(_) => Err(JoinStatusFailed::NoAnswer(MDMA_DEADLINE)),
        }
    }

    /// Writes the entries if they changed (on the blocking pool: a slow disk delays only
    /// this job), after any write still under way.
    async fn write(&mut self) -> Result<(), JoinStatusFailed> {
        loop {
            if let Some(writing) = self.writing.as_mut() {
                let written = writing.await;
                self.writing = None;
                let failure = match written {
                    Ok(Ok(())) => None,
                    Ok(Err(e)) => Some(e.to_string()),
                    Err(e) => Some(format!("the join-status writer stopped: {e}")),
                };
                if let Some(failure) = failure {
                    self.dirty = true;
                    return Err(JoinStatusFailed::Write(failure));
                }
            }
            if !self.dirty {
                return Ok(());
            }
            let doc = Document {
                version: 1,
                namespaces: self.entries.clone().unwrap_or_default(),
            };
            let bytes = serde_json::to_vec_pretty(&doc).map_err(|e| {
                JoinStatusFailed::Write(format!("cannot render the join-status file: {e}"))
            })?;
            self.dirty = false;
            let path = self.deps.path.clone();
            self.writing = Some(tokio::task::spawn_blocking(move || {
                write_atomically(&path, &bytes)
            }));
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;
    use std::sync::Mutex;

    use async_trait::async_trait;

    use super::*;
    use crate::mdma::{ConfirmError, NodeReport, PollError, RequestMethod, ShouldJoin};
    use crate::merod::TeeRole;
    use crate::mrtd::Mrtd;

    /// An MDMA that answers join-status reports as scripted (HTTP statuses; `Ok` once the
    /// script is out) and records them.
    #[derive(Default)]
    struct Scripted {
        answers: Mutex<VecDeque<u16>>,
        reports: Mutex<Vec<JoinStatus>>,
    }

    #[async_trait]
    impl ControlPlane for Scripted {
        async fn should_join(
            &self,
            _: &PeerId,
            _: Option<&Mrtd>,
            _: NodeReport<'_>,
        ) -> Result<ShouldJoin, PollError> {
            unimplemented!("the job never polls")
        }

        async fn confirm(
            &self,
            _: &PeerId,
            _: GroupId,
            _: Option<TeeRole>,
        ) -> Result<(), ConfirmError> {
            unimplemented!("the job never confirms")
        }

        async fn join_status(&self, report: &JoinStatus) -> Result<(), RequestError> {
            self.reports.lock().unwrap().push(report.clone());
            match self.answers.lock().unwrap().pop_front() {
                None => Ok(()),
                Some(status) => Err(RequestError::Status {
                    method: RequestMethod::Post,
                    url: "http://127.0.0.1:1/api/fleet/join-status".parse().unwrap(),
                    status,
                    retry_after_secs: None,
                    body: Box::default(),
                }),
            }
        }
    }

    /// The job on `answers`, its file in `dir`.
    fn started(
        dir: &Path,
        answers: &[u16],
    ) -> (
        Arc<Scripted>,
        Arc<Telemetry>,
        CancellationToken,
        JoinStatusHandle,
    ) {
        let mdma = Arc::new(Scripted {
            answers: Mutex::new(answers.iter().copied().collect()),
            ..Scripted::default()
        });
        let telemetry = Arc::new(Telemetry::new());
        let stop = CancellationToken::new();
        let handle = spawn(
            JobDeps {
                path: dir.join(JOIN_STATUS_FILE),
                mdma: Arc::clone(&mdma) as Arc<dyn ControlPlane>,
                peer_id: "12D3KooWJ6X2tBZEd8qKWvJyhtH2v2XyP4eQ9dcU2xZ8Y6YrjcVk"
                    .parse()
                    .unwrap(),
                telemetry: Arc::clone(&telemetry),
            },
            stop.clone(),
        );
        (mdma, telemetry, stop, handle)
    }

    fn reports(mdma: &Scripted) -> Vec<(JoinState, u64)> {
        let reports = mdma.reports.lock().unwrap();
        reports.iter().map(|r| (r.state, r.attempts)).collect()
    }

    /// Waits (real time, at most 10 s) until `done`.
    async fn until(what: &str, done: impl Fn() -> bool) {
        let limit = Instant::now() + Duration::from_secs(10);
        while !done() {
            assert!(Instant::now() < limit, "{what}: not within 10 s");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn runs(telemetry: &Telemetry) -> u64 {
        telemetry
            .snapshot()
            .jobs
            .get("join_status")
            .map_or(0, |j| j.runs)
    }

    fn file(dir: &Path) -> BTreeMap<GroupId, Entry> {
        let bytes = std::fs::read(dir.join(JOIN_STATUS_FILE)).unwrap();
        serde_json::from_slice::<Document>(&bytes)
            .unwrap()
            .namespaces
    }

    const A: GroupId = GroupId::from_bytes([0xaa; 32]);

    #[tokio::test]
    async fn a_report_mdma_did_not_take_is_sent_again_after_the_back_off() {
        let dir = tempfile::tempdir().unwrap();
        let (mdma, telemetry, stop, handle) = started(dir.path(), &[503]);
        let waiting = Attempt::of(Ok(&admission(false, &[])));
        handle.record(A, waiting.clone());
        // Sent again without a new attempt, and then acknowledged in the file.
        until("the report sent again", || reports(&mdma).len() == 2).await;
        assert_eq!(reports(&mdma), [(JoinState::Waiting, 1); 2]);
        until("the second run ended", || runs(&telemetry) == 2).await;
        assert_eq!(file(dir.path())[&A].reported, Some(waiting.outcome.clone()));
        assert_eq!(telemetry.snapshot().jobs["join_status"].failing, None);
        // The same outcome again is not due: nothing is sent.
        handle.record(A, waiting);
        until("the third run ended", || runs(&telemetry) == 3).await;
        assert_eq!(file(dir.path())[&A].attempts, 2);
        assert_eq!(reports(&mdma).len(), 2);
        stop.cancel();
    }

    #[tokio::test]
    async fn a_report_answered_404_is_not_sent_again_until_a_later_outcome() {
        let dir = tempfile::tempdir().unwrap();
        let (mdma, telemetry, stop, handle) = started(dir.path(), &[404]);
        let waiting = Attempt::of(Ok(&admission(false, &[])));
        handle.record(A, waiting.clone());
        until("the first run ended", || runs(&telemetry) == 1).await;
        assert_eq!(reports(&mdma).len(), 1);
        // Past the first back-off (at most 2 s): nothing was sent again, and the job is
        // still shown failing (an empty run would have passed for a recovery).
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert_eq!(reports(&mdma).len(), 1);
        let status = telemetry.snapshot().jobs["join_status"].clone();
        assert_eq!(status.runs, 1);
        assert!(
            status.failing.as_deref().unwrap().contains("HTTP 404"),
            "{status:?}"
        );
        // The next attempt is due (MDMA acknowledged nothing) and carries its count.
        handle.record(A, waiting);
        until("the next report", || reports(&mdma).len() == 2).await;
        assert_eq!(reports(&mdma)[1], (JoinState::Waiting, 2));
        stop.cancel();
    }

    #[tokio::test]
    async fn an_answer_naming_admitted_by_alone_is_reported_admitted_and_keeps_its_count() {
        let dir = tempfile::tempdir().unwrap();
        let (mdma, telemetry, stop, handle) = started(dir.path(), &[]);
        let by = Admission {
            admitted_by: Some("12D3KooWA".into()),
            ..admission(false, &[])
        };
        handle.record(A, Attempt::of(Ok(&by)));
        until("the report", || reports(&mdma).len() == 1).await;
        assert_eq!(reports(&mdma), [(JoinState::Admitted, 1)]);
        until("the first run ended", || runs(&telemetry) == 1).await;
        // merod did not say `admitted: true`: the join goes on, and so does the count, so
        // the same answer again is not reported again.
        handle.record(A, Attempt::of(Ok(&by)));
        until("the second run ended", || runs(&telemetry) == 2).await;
        assert_eq!(file(dir.path())[&A].attempts, 2);
        assert_eq!(reports(&mdma).len(), 1);
        // `admitted: true` ends the count.
        handle.record(A, Attempt::of(Ok(&admission(true, &[]))));
        until("the third run ended", || runs(&telemetry) == 3).await;
        assert!(!file(dir.path()).contains_key(&A));
        stop.cancel();
    }

    fn admission(admitted: bool, refusals: &[(&str, &str)]) -> Admission {
        Admission {
            admitted,
            status: String::new(),
            reasons: Vec::new(),
            refusals: refusals
                .iter()
                .map(|(p, r)| Refusal {
                    peer: (*p).to_owned(),
                    reason: (*r).to_owned(),
                })
                .collect(),
            admitted_by: None,
        }
    }

    #[test]
    fn the_state_follows_the_answer() {
        assert_eq!(
            JoinOutcome::of(Ok(&admission(true, &[]))).state,
            JoinState::Admitted
        );
        let refused = JoinOutcome::of(Ok(&admission(false, &[("12D3KooWA", "MRTD not allowed")])));
        assert_eq!(refused.state, JoinState::Refused);
        assert_eq!(refused.refusals[0].reason, "MRTD not allowed");
        assert_eq!(
            JoinOutcome::of(Ok(&admission(false, &[]))).state,
            JoinState::Waiting
        );
        let failed = JoinOutcome::of(Err(&"x".repeat(600)));
        assert_eq!(failed.state, JoinState::Error);
        assert_eq!(failed.error.unwrap().chars().count(), MAX_ERROR);
    }

    #[test]
    fn a_report_is_due_on_a_change_or_every_tenth_attempt() {
        let waiting = JoinOutcome::of(Ok(&admission(false, &[])));
        let refused = JoinOutcome::of(Ok(&admission(false, &[("p", "r")])));
        let mut e = Entry::default();
        assert!(
            count_attempt(&mut e, &waiting),
            "first attempt: nothing acknowledged yet"
        );
        // Not acknowledged (MDMA failed): due again.
        assert!(count_attempt(&mut e, &waiting));
        e.reported = Some(waiting.clone());
        let mut due = Vec::new();
        for _ in 3..=21 {
            if count_attempt(&mut e, &waiting) {
                due.push(e.attempts);
            }
        }
        assert_eq!(due, [10, 20], "unchanged: only every 10th attempt");
        assert!(
            count_attempt(&mut e, &refused),
            "a changed outcome is due at once"
        );
        assert_eq!(e.attempts, 22);
    }

    #[test]
    fn the_file_lives_beside_the_state_file() {
        assert_eq!(
            file_beside(Path::new("/var/lib/fleet-sidecar/state.json")),
            Path::new("/var/lib/fleet-sidecar/fleet-join-status.json")
        );
        assert_eq!(
            file_beside(Path::new("state.json")),
            Path::new("./fleet-join-status.json")
        );
    }
}
