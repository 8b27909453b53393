//! Why a join waits, told to MDMA: after each fleet-join outcome, `POST
//! /api/fleet/join-status` when the outcome differs from the last one MDMA acknowledged, or
//! at every 10th attempt. A background job with an owner of its own: the loop hands it
//! each outcome on a channel and never waits; the job counts the attempts per namespace
//! in a small file next to the state file (so they survive a restart), reports, and
//! shows the latest outcome per namespace in the live status. Best effort throughout: a
//! failed report (an MDMA without the route answers 404) or a failed write is logged once
//! and changes nothing about joining.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;
use tokio::time::{timeout, Instant};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::durable::parent_dir;
use crate::ids::{GroupId, PeerId};
use crate::mdma::{ControlPlane, JoinState, JoinStatus};
use crate::merod::{Admission, Refusal};
use crate::outcome::CallOutcome;
use crate::state::write_atomically;
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

impl JoinOutcome {
    /// The outcome of one fleet-join call: `error` when it failed (`failure`, cut to
    /// [`MAX_ERROR`] chars), `admitted` on `admitted: true`, `refused` when admitting
    /// nodes said why not, `waiting` otherwise.
    pub(crate) fn of(answer: Result<&Admission, &str>) -> Self {
        match answer {
            Err(failure) => JoinOutcome {
                state: JoinState::Error,
                refusals: Vec::new(),
                error: Some(failure.chars().take(MAX_ERROR).collect()),
            },
            Ok(a) => JoinOutcome {
                state: if a.admitted {
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
    tx: Option<mpsc::UnboundedSender<(GroupId, JoinOutcome)>>,
}

impl JoinStatusHandle {
    /// A handle that reports nothing (dry runs).
    pub(crate) fn idle() -> Self {
        Self { tx: None }
    }

    /// Hands over the outcome of one fleet-join of `id`.
    pub(crate) fn record(&self, id: GroupId, outcome: JoinOutcome) {
        if let Some(tx) = &self.tx {
            // The job ends only at shutdown; an outcome after that is not reported.
            let _ = tx.send((id, outcome));
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

/// Starts the job; it loads the file first (a missing one is empty, an unreadable one is
/// empty with a warning: only counts are lost).
pub(crate) fn spawn(deps: JobDeps, shutdown: CancellationToken) -> JoinStatusHandle {
    let (tx, mut rx) = mpsc::unbounded_channel::<(GroupId, JoinOutcome)>();
    tokio::spawn(async move {
        let mut job = Job::load(deps).await;
        loop {
            let next = tokio::select! {
                () = shutdown.cancelled() => return,
                next = rx.recv() => next,
            };
            let Some((id, outcome)) = next else { return };
            job.on_outcome(id, outcome).await;
        }
    });
    JoinStatusHandle { tx: Some(tx) }
}

struct Job {
    deps: JobDeps,
    entries: BTreeMap<GroupId, Entry>,
    /// The last failure of a report and of a write, logged only when it changes.
    report_failing: Option<String>,
    write_failing: Option<String>,
}

impl Job {
    async fn load(deps: JobDeps) -> Self {
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
                warn!("the join-status file reader stopped ({e}); join attempts are counted from 0 again");
                BTreeMap::new()
            }
        };
        deps.telemetry.update(|st| {
            st.join_outcomes = entries
                .iter()
                .filter_map(|(id, e)| e.reported.as_ref().map(|o| (*id, o.status(e.attempts))))
                .collect();
        });
        Job {
            deps,
            entries,
            report_failing: None,
            write_failing: None,
        }
    }

    async fn on_outcome(&mut self, id: GroupId, outcome: JoinOutcome) {
        let entry = self.entries.entry(id).or_default();
        let due = count_attempt(entry, &outcome);
        let attempts = entry.attempts;
        let admitted = outcome.state == JoinState::Admitted;
        self.deps.telemetry.update(|st| {
            if admitted {
                st.join_outcomes.remove(&id);
            } else {
                st.join_outcomes.insert(id, outcome.status(attempts));
            }
        });
        // The count is on disk before the report goes out.
        self.write().await;
        if due {
            let report = JoinStatus {
                state: outcome.state,
                refusals: outcome.refusals.clone(),
                error: outcome.error.clone(),
                peer_id: self.deps.peer_id.to_string(),
                group_id: id,
                attempts,
            };
            if self.report(&report).await {
                if let Some(e) = self.entries.get_mut(&id) {
                    e.reported = Some(outcome);
                }
            }
        }
        if admitted {
            self.entries.remove(&id);
        }
        self.write().await;
    }

    /// Sends one report; whether MDMA acknowledged it.
    async fn report(&mut self, report: &JoinStatus) -> bool {
        let t = &self.deps.telemetry;
        let limit = super::limits::MDMA_DEADLINE;
        let started = Instant::now();
        let result = timeout(limit, self.deps.mdma.join_status(report)).await;
        t.observe("join_status", started.elapsed());
        let outcome = CallOutcome::of_bounded(result.as_ref().ok());
        Telemetry::count(&t.join_status_reports, outcome.label());
        let failure = match result {
            Ok(Ok(())) => {
                if self.report_failing.take().is_some() {
                    info!("join-status reports accepted by MDMA again");
                }
                return true;
            }
            Ok(Err(e)) => e.to_string(),
            Err(_) => format!("join-status gave no answer within {limit:?}"),
        };
        if self.report_failing.as_deref() != Some(failure.as_str()) {
            warn!("join-status report not accepted ({failure}); joining goes on, reports are best effort (an MDMA without the route answers 404)");
        } else {
            debug!("join-status report not accepted ({failure})");
        }
        self.report_failing = Some(failure);
        false
    }

    /// Writes the entries (on the blocking pool: a slow disk delays only this job).
    async fn write(&mut self) {
        let doc = Document {
            version: 1,
            namespaces: self.entries.clone(),
        };
        let bytes = match serde_json::to_vec_pretty(&doc) {
            Ok(b) => b,
            Err(e) => {
                warn!("cannot render the join-status file: {e}");
                return;
            }
        };
        let path = self.deps.path.clone();
        let written = tokio::task::spawn_blocking(move || write_atomically(&path, &bytes)).await;
        let failure = match written {
            Ok(Ok(())) => {
                if self.write_failing.take().is_some() {
                    info!(path = %self.deps.path.display(), "join-status file written again");
                }
                return;
            }
            Ok(Err(e)) => e.to_string(),
            Err(e) => format!("the join-status writer stopped: {e}"),
        };
        if self.write_failing.as_deref() != Some(failure.as_str()) {
            warn!("{failure}; join attempts may be counted from an older number after a restart");
        }
        self.write_failing = Some(failure);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
