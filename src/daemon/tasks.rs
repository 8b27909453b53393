//! The join and leave tasks, and the events they send back to the loop.
//!
//! A task makes the merod and MDMA calls of one namespace, each under its deadline, and
//! reports its end as an [`Event`]; only the loop changes the state.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot, Semaphore};
use tokio::time::{timeout, Instant};
use tracing::{error, info, info_span, warn, Instrument};

use crate::ids::{GroupId, PeerId};
use crate::mdma::{ConfirmError, ControlPlane, MDMA_TIMEOUT};
use crate::merod::{Node, CHECK_TIMEOUT};
use crate::telemetry::Telemetry;

use super::Sidecar;

/// How a join task ended.
#[derive(Debug)]
pub(super) enum JoinEnd {
    Confirmed,
    NotAdmitted {
        status: String,
        reasons: Vec<String>,
    },
    /// A merod call (fleet-join or the membership check) failed; `timed_out` when it ran
    /// out of time rather than being refused.
    Failed {
        reason: String,
        timed_out: bool,
    },
    NotHeld,
    NotPersisted,
    ConfirmFailed(ConfirmError),
    ConfirmTimedOut(Duration),
}

#[derive(Debug)]
pub(super) enum LeaveEnd {
    Left,
    /// Only joining (no admission recorded) and merod does not hold it: no leave was sent.
    NeverHeld,
    /// merod still lists it, or cannot tell; `timed_out` when the leave call ran out of time.
    StillHeld {
        reason: String,
        timed_out: bool,
    },
}

#[derive(Debug)]
pub(super) enum Event {
    Admitted {
        id: GroupId,
        ack: oneshot::Sender<()>,
    },
    JoinEnded {
        id: GroupId,
        end: JoinEnd,
        /// From the join task's start (waiting for a join slot included) to its end.
        took: Duration,
    },
    LeaveEnded {
        id: GroupId,
        end: LeaveEnd,
        took: Duration,
    },
}

/// What a task needs to make its calls and time them.
struct Calls {
    merod: Arc<dyn Node>,
    mdma: Arc<dyn ControlPlane>,
    telemetry: Arc<Telemetry>,
}

/// Runs `fut` under `limit`, recording its duration as `call`. `None` on timeout.
async fn timed<T>(
    telemetry: &Telemetry,
    call: &'static str,
    limit: Duration,
    fut: impl Future<Output = T>,
) -> Option<T> {
    let started = Instant::now();
    let result = timeout(limit, fut).await.ok();
    telemetry.observe(call, started.elapsed());
    result
}

/// Whether merod holds `id` (`GET /admin-api/namespaces/{id}`, bounded by
/// [`CHECK_TIMEOUT`]). `Err`: why it could not tell ("membership check …"), and whether
/// that was a timeout.
async fn check_held(
    telemetry: &Telemetry,
    merod: &dyn Node,
    id: GroupId,
) -> Result<bool, (String, bool)> {
    match timed(
        telemetry,
        "namespace_get",
        CHECK_TIMEOUT,
        merod.holds_namespace(id),
    )
    .await
    {
        Some(Ok(held)) => Ok(held),
        Some(Err(e)) => Err((format!("membership check failed: {e}"), e.is_timeout())),
        None => Err((
            format!("membership check gave no answer within {CHECK_TIMEOUT:?}"),
            true,
        )),
    }
}

async fn join_task(
    id: GroupId,
    calls: &Calls,
    peer_id: PeerId,
    permits: Arc<Semaphore>,
    join_timeout: Duration,
    events: &mpsc::UnboundedSender<Event>,
) -> JoinEnd {
    let Ok(_permit) = permits.acquire_owned().await else {
        return JoinEnd::Failed {
            reason: "join slots closed".to_owned(),
            timed_out: false,
        };
    };
    let t = &calls.telemetry;
    let admission = match timed(t, "fleet_join", join_timeout, calls.merod.fleet_join(id)).await {
        None => {
            return JoinEnd::Failed {
                reason: format!("no answer within {join_timeout:?} (abandoned)"),
                timed_out: true,
            }
        }
        Some(Err(e)) => {
            return JoinEnd::Failed {
                timed_out: e.is_timeout(),
                reason: e.to_string(),
            }
        }
        Some(Ok(a)) => a,
    };
    if !admission.admitted {
        return JoinEnd::NotAdmitted {
            status: admission.status,
            reasons: admission.reasons,
        };
    }
    match check_held(t, calls.merod.as_ref(), id).await {
        Ok(true) => {}
        Ok(false) => return JoinEnd::NotHeld,
        Err((why, timed_out)) => {
            return JoinEnd::Failed {
                reason: format!("admitted, but the {why}"),
                timed_out,
            }
        }
    }
    let (ack, acked) = oneshot::channel();
    if events.send(Event::Admitted { id, ack }).is_err() || acked.await.is_err() {
        return JoinEnd::NotPersisted;
    }
    let limit = MDMA_TIMEOUT + Duration::from_secs(1);
    match timed(t, "confirm", limit, calls.mdma.confirm(&peer_id, id)).await {
        Some(Ok(())) => JoinEnd::Confirmed,
        Some(Err(e)) => JoinEnd::ConfirmFailed(e),
        None => JoinEnd::ConfirmTimedOut(limit),
    }
}

/// Leaves `id` and checks merod no longer lists it. `maybe_held`: only a fleet-join was
/// recorded, not its admission; merod is asked first, and the leave is sent only if it does
/// hold the namespace (nothing irreversible for a join that never went through).
async fn leave_task(
    id: GroupId,
    merod: &Arc<dyn Node>,
    telemetry: &Telemetry,
    leave_timeout: Duration,
    maybe_held: bool,
) -> LeaveEnd {
    if maybe_held {
        match check_held(telemetry, merod.as_ref(), id).await {
            Ok(false) => return LeaveEnd::NeverHeld,
            Ok(true) => {}
            Err((why, timed_out)) => {
                return LeaveEnd::StillHeld {
                    reason: format!("before the leave, {why}"),
                    timed_out,
                }
            }
        }
    }
    let (leave, timed_out) =
        match timed(telemetry, "leave", leave_timeout, merod.leave_namespace(id)).await {
            Some(Ok(())) => ("left".to_owned(), false),
            Some(Err(e)) => (e.to_string(), e.is_timeout()),
            None => (
                format!("no answer within {leave_timeout:?}: outcome unknown"),
                true,
            ),
        };
    let still_held = |reason: String| LeaveEnd::StillHeld { reason, timed_out };
    match check_held(telemetry, merod.as_ref(), id).await {
        Ok(false) => LeaveEnd::Left,
        Ok(true) => still_held(format!("leave: {leave}; merod still lists it")),
        Err((why, _)) => still_held(format!("leave: {leave}; {why}")),
    }
}

impl Sidecar {
    fn spawn<F>(&mut self, id: GroupId, fut: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let handle = self.tasks.spawn(fut);
        self.task_ids.insert(handle.id(), id);
    }

    pub(super) fn spawn_join(&mut self, id: GroupId) {
        info!(namespace_id = %id, "joining (fleet-join)");
        let merod = Arc::clone(&self.deps.merod);
        let mdma = Arc::clone(&self.deps.mdma);
        let peer_id = self.peer_id.clone();
        let permits = Arc::clone(&self.join_permits);
        let events = self.events_tx.clone();
        let join_timeout = self.cfg.join_timeout;
        let telemetry = Arc::clone(&self.deps.telemetry);
        self.joining.insert(id);
        let task = async move {
            let calls = Calls {
                merod,
                mdma,
                telemetry,
            };
            let started = Instant::now();
            let end = join_task(id, &calls, peer_id, permits, join_timeout, &events).await;
            let took = started.elapsed();
            // The loop owns the receiver for the life of every task.
            let _ = events.send(Event::JoinEnded { id, end, took });
        };
        self.spawn(id, task.instrument(info_span!("join", namespace_id = %id)));
    }

    pub(super) fn spawn_leave(&mut self, id: GroupId) {
        let maybe_held = !self.state.admitted.contains(&id);
        if maybe_held {
            warn!(namespace_id = %id, "leaving if merod holds it: withdrawn by MDMA after a fleet-join whose admission was never recorded (irreversible: merod purges this namespace's keys)");
        } else {
            warn!(namespace_id = %id, "leaving: withdrawn by MDMA (irreversible: merod purges this namespace's keys)");
        }
        let merod = Arc::clone(&self.deps.merod);
        let events = self.events_tx.clone();
        let leave_timeout = self.cfg.leave_timeout;
        let telemetry = Arc::clone(&self.deps.telemetry);
        self.leaving.insert(id);
        let task = async move {
            let started = Instant::now();
            let end = leave_task(id, &merod, &telemetry, leave_timeout, maybe_held).await;
            let took = started.elapsed();
            let _ = events.send(Event::LeaveEnded { id, end, took });
        };
        self.spawn(id, task.instrument(info_span!("leave", namespace_id = %id)));
    }

    pub(super) fn on_task_done(
        &mut self,
        done: Result<(tokio::task::Id, ()), tokio::task::JoinError>,
    ) {
        let task_id = match &done {
            Ok((id, ())) => *id,
            Err(e) => e.id(),
        };
        let Some(group) = self.task_ids.remove(&task_id) else {
            return;
        };
        if let Err(e) = done {
            // Ended without its outcome (a panic, or cut at shutdown): a failed attempt,
            // backed off like any other.
            if self.joining.remove(&group) {
                self.back_off_join(group);
            }
            if self.leaving.remove(&group) {
                self.back_off_leave(group);
            }
            if e.is_panic() {
                error!(namespace_id = %group, "join/leave task panicked; retried after a back-off");
            }
            self.publish();
        }
    }
}
