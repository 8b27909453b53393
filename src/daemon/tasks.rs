//! The work in flight: the join and leave tasks, their join permits and retry tables, and
//! the events the tasks send back to the loop.
//!
//! A task makes the merod and MDMA calls of one namespace, each under its deadline, and
//! reports its end as an [`Event`]. It is given its calls ([`Calls`]) and ids, never the
//! record: only the loop changes the state. Each end ([`JoinEnd`], [`LeaveEnd`]) gives its
//! metric label, whether it backs off and its log line from itself.

use std::collections::{BTreeSet, HashMap};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot, watch, Semaphore};
use tokio::task::{JoinError, JoinSet};
use tokio::time::{timeout, Instant};
use tracing::{debug, debug_span, error, info, info_span, warn, Instrument};

use crate::backoff::{Retries, RETRY_MAX};
use crate::config::Config;
use crate::ids::{GroupId, PeerId};
use crate::mdma::{ConfirmError, ControlPlane};
use crate::merod::{Admission, MerodError, Node, NodeAccount, TeeRole, CHECK_TIMEOUT};
use crate::reconcile::Desired;
use crate::telemetry::Telemetry;

use crate::jobs::account::AccountCache;
use crate::jobs::held::{ListUnread, HELD_READ_TIMEOUT};
use crate::jobs::join_status::Attempt;
use crate::jobs::limits::{IDENTITY_DEADLINE, MDMA_DEADLINE, MEMBERS_DEADLINE};
use crate::outcome::CallOutcome;

/// Why merod could not tell whether it holds a namespace
/// (`GET /admin-api/namespaces/{id}`).
#[derive(Debug, thiserror::Error)]
pub(super) enum CheckFailed {
    /// merod answered with an error, or the client's own deadline passed.
    #[error("membership check failed: {0}")]
    Error(MerodError),
    /// No answer within [`CHECK_TIMEOUT`].
    #[error("membership check gave no answer within {0:?}")]
    NoAnswer(Duration),
    /// The membership read said "not held", and merod's list of the namespaces it holds,
    /// read to cross-check that, failed or gave no answer within [`HELD_READ_TIMEOUT`].
    #[error("merod's own membership read said it does not hold it, but its namespace list could not be read to confirm that: {0}")]
    ListUnread(ListUnread),
}

impl CheckFailed {
    /// Whether it ran out of time rather than being refused.
    fn is_timeout(&self) -> bool {
        match self {
            CheckFailed::Error(e) => e.is_timeout(),
            CheckFailed::NoAnswer(_) => true,
            CheckFailed::ListUnread(_) => false,
        }
    }
}

/// Why a join failed at merod (fleet-join or the membership check after it).
#[derive(Debug, thiserror::Error)]
pub(super) enum JoinFailed {
    /// The join slots were closed (the loop is going away).
    #[error("join slots closed")]
    SlotsClosed,
    /// fleet-join gave no answer within `join_timeout`.
    #[error("no answer within {0:?} (abandoned)")]
    NoAnswer(Duration),
    /// fleet-join failed.
    #[error(transparent)]
    Merod(MerodError),
    /// Admitted, but merod could not tell whether it lists the namespace.
    #[error("admitted, but the {0}")]
    Unchecked(CheckFailed),
}

impl crate::outcome::Timed for JoinFailed {
    /// Whether it ran out of time rather than being refused.
    fn is_timeout(&self) -> bool {
        match self {
            JoinFailed::SlotsClosed => false,
            JoinFailed::NoAnswer(_) => true,
            JoinFailed::Merod(e) => e.is_timeout(),
            JoinFailed::Unchecked(c) => c.is_timeout(),
        }
    }
}

/// How a join task ended.
#[derive(Debug)]
pub(super) enum JoinEnd {
    /// Admitted, recorded and confirmed to MDMA.
    Confirmed,
    /// Assigned again while recorded as held, and merod still holds it: confirmed to MDMA
    /// without a new fleet-join.
    ConfirmedHeld,
    /// merod answered `admitted: false`.
    NotAdmitted {
        status: String,
        reasons: Vec<String>,
    },
    /// A merod call (fleet-join or the membership check) failed.
    Failed(JoinFailed),
    /// `admitted: true`, but merod does not list the namespace.
    NotHeld,
    /// The admission could not be recorded: not confirmed.
    NotPersisted,
    /// Admitted and recorded, but the node's role could not be read: not confirmed (an
    /// unknown role is not sent as none).
    RoleUnread(RoleUnread),
    /// Admitted and recorded, but the latest poll no longer assigns it: not confirmed.
    NotAssigned,
    /// The latest successful poll no longer assigns the namespace when the join got its
    /// slot: no fleet-join was sent (not a failure).
    Withdrawn,
    /// MDMA refused the confirm or gave no answer in time.
    ConfirmFailed(ConfirmError),
    /// The confirm gave no answer within the loop's deadline.
    ConfirmTimedOut(Duration),
}

impl JoinEnd {
    /// The `outcome` label it is counted under in `fleet_sidecar_joins_total` (`None`: not
    /// counted there: a confirm sent is counted by the gate that sent it,
    /// [`confirm_if_assigned`], the role read as such, the state write failure as such).
    pub(super) fn metric_label(&self) -> Option<&'static str> {
        Some(match self {
            JoinEnd::NotAdmitted { .. } => "not_admitted",
            JoinEnd::Failed(f) => CallOutcome::of_error(f).label(),
            JoinEnd::NotHeld => "not_held",
            JoinEnd::Confirmed
            | JoinEnd::ConfirmedHeld
            | JoinEnd::ConfirmFailed(_)
            | JoinEnd::ConfirmTimedOut(_) => return None,
            JoinEnd::RoleUnread(_)
            | JoinEnd::NotPersisted
            | JoinEnd::NotAssigned
            | JoinEnd::Withdrawn => return None,
        })
    }

    /// Whether the join succeeded (else it backs off before the next attempt).
    pub(super) fn succeeded(&self) -> bool {
        matches!(
            self,
            JoinEnd::Confirmed | JoinEnd::ConfirmedHeld | JoinEnd::NotAssigned
        )
    }

    /// The wait MDMA asked for in its answer to the confirm (`Retry-After`), if it did.
    pub(super) fn retry_after(&self) -> Option<Duration> {
        match self {
            JoinEnd::ConfirmFailed(e) => e.retry_after(),
            _ => None,
        }
    }

    /// Whether it ended without a failure to back off from (nothing was tried).
    pub(super) fn not_tried(&self) -> bool {
        matches!(self, JoinEnd::Withdrawn)
    }

    /// Its log line, with the journal fields NAMESPACE_ID, OUTCOME and DURATION (s);
    /// `retry`: the failures in a row and the wait before the next attempt, for a failure.
    pub(super) fn log(&self, id: GroupId, duration: f64, retry: (u32, Duration)) {
        let (failures, wait) = retry;
        match self {
            JoinEnd::Confirmed => {
                info!(namespace_id = %id, outcome = "confirmed", duration, "confirmed to MDMA");
            }
            JoinEnd::ConfirmedHeld => {
                // `failures` here counts re-assignments in a row (flaps), each spaced
                // further from the last.
                info!(namespace_id = %id, outcome = "confirmed_held", duration, flaps = failures, "assigned again while merod held it throughout: confirmed to MDMA without a new fleet-join; if it flaps again, confirmed again no sooner than in {wait:?}");
            }
            JoinEnd::NotAdmitted { status, reasons } => {
                let reasons = if reasons.is_empty() {
                    "merod gave no reason".to_owned()
                } else {
                    reasons.join("; ")
                };
                // Warned at the first refusal of a streak; the retries are info.
                if failures == 1 {
                    warn!(namespace_id = %id, outcome = "not_admitted", duration, status, "not admitted (admitted: false): {reasons}; retrying in {wait:?}, backing off to {RETRY_MAX:?}");
                } else {
                    info!(namespace_id = %id, outcome = "not_admitted", duration, status, failures, "still not admitted (admitted: false): {reasons}; retrying in {wait:?}");
                }
            }
            JoinEnd::Failed(why) => {
                let outcome = CallOutcome::of_error(why).label();
                warn!(namespace_id = %id, outcome, error_kind = "join", duration, "join failed: {why}; retrying later");
            }
            JoinEnd::NotHeld => {
                warn!(namespace_id = %id, outcome = "not_held", duration, "merod said admitted: true but does not list the namespace; not recorded, retrying later");
            }
            JoinEnd::NotAssigned => {
                info!(namespace_id = %id, outcome = "not_assigned", duration, "admitted, but MDMA no longer assigns it: recorded as admitted, not confirmed; it is left after leave_grace unless assigned again");
            }
            JoinEnd::Withdrawn => {
                // Still recorded as joining, so a leave asks merod before dropping it (an
                // earlier run may have sent a fleet-join).
                info!(namespace_id = %id, outcome = "withdrawn", duration, "join not sent: the latest poll withdrew the namespace while the join waited for a slot");
            }
            JoinEnd::RoleUnread(why) => {
                warn!(namespace_id = %id, outcome = "role_unread", error_kind = "members", duration, "admitted and recorded, but {why}; not confirmed (an unknown role is not sent as none), retrying in {wait:?}");
            }
            JoinEnd::NotPersisted => {
                warn!(namespace_id = %id, outcome = "not_persisted", error_kind = "state", duration, "admission could not be persisted; not confirmed, retrying later");
            }
            JoinEnd::ConfirmFailed(e) => {
                warn!(namespace_id = %id, outcome = "confirm_failed", error_kind = "confirm", duration, "confirm failed: {e}; stays unconfirmed, retrying later");
            }
            JoinEnd::ConfirmTimedOut(limit) => {
                warn!(namespace_id = %id, outcome = "confirm_failed", error_kind = "confirm", duration, "confirm gave no answer within {limit:?}; stays unconfirmed, retrying later");
            }
        }
    }
}

/// How the leave call itself went.
#[derive(Debug)]
pub(super) enum LeaveCall {
    /// merod answered the leave.
    Answered,
    /// merod refused it (or its client timed out).
    Failed(MerodError),
    /// No answer within `leave_timeout`: outcome unknown.
    NoAnswer(Duration),
}

impl std::fmt::Display for LeaveCall {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LeaveCall::Answered => f.write_str("left"),
            LeaveCall::Failed(e) => write!(f, "{e}"),
            LeaveCall::NoAnswer(limit) => write!(f, "no answer within {limit:?}: outcome unknown"),
        }
    }
}

/// Why a leave is not done: merod still lists the namespace, or cannot tell.
#[derive(Debug, thiserror::Error)]
pub(super) enum StillHeld {
    /// Only joining, and merod could not tell whether it holds it: no leave was sent.
    #[error("before the leave, {0}")]
    NotChecked(CheckFailed),
    /// merod lists it after the leave.
    #[error("leave: {0}; merod still lists it")]
    Listed(LeaveCall),
    /// merod could not tell after the leave.
    #[error("leave: {leave}; {check}")]
    Unchecked {
        /// The leave call.
        leave: LeaveCall,
        /// The membership check after it.
        check: CheckFailed,
    },
}

impl StillHeld {
    /// Whether the leave call (or, with no leave sent, the check) ran out of time.
    fn is_timeout(&self) -> bool {
        let leave = match self {
            StillHeld::NotChecked(check) => return check.is_timeout(),
            StillHeld::Listed(leave) | StillHeld::Unchecked { leave, .. } => leave,
        };
        match leave {
            LeaveCall::Answered => false,
            LeaveCall::Failed(e) => e.is_timeout(),
            LeaveCall::NoAnswer(_) => true,
        }
    }
}

/// How a leave task ended.
#[derive(Debug)]
pub(super) enum LeaveEnd {
    /// merod no longer lists it.
    Left,
    /// Only joining (no admission recorded) and merod does not hold it: no leave was sent.
    NeverHeld,
    /// Not done.
    StillHeld(StillHeld),
}

impl LeaveEnd {
    /// The `outcome` label of `fleet_sidecar_leaves_total`.
    pub(super) fn metric_label(&self) -> &'static str {
        match self {
            LeaveEnd::Left => "left",
            LeaveEnd::NeverHeld => "not_held",
            LeaveEnd::StillHeld(why) if why.is_timeout() => "timeout",
            LeaveEnd::StillHeld(_) => "failed",
        }
    }

    /// Whether merod no longer holds it (else the leave backs off before the next try).
    pub(super) fn succeeded(&self) -> bool {
        !matches!(self, LeaveEnd::StillHeld(_))
    }

    /// Its log line; `retry` as for [`JoinEnd::log`].
    pub(super) fn log(&self, id: GroupId, duration: f64, retry: (u32, Duration)) {
        let (failures, wait) = retry;
        match self {
            LeaveEnd::Left => {
                info!(namespace_id = %id, outcome = "left", duration, "left: merod no longer holds the namespace");
            }
            LeaveEnd::NeverHeld => {
                info!(namespace_id = %id, outcome = "not_held", duration, "dropped, no leave sent: merod does not hold it (its fleet-join never went through)");
            }
            LeaveEnd::StillHeld(why) => {
                warn!(namespace_id = %id, outcome = "failed", error_kind = "leave", duration, failures, "leave not done ({why}); stays a leave candidate, retrying in {wait:?}, backing off to {RETRY_MAX:?}");
            }
        }
    }
}

#[derive(Debug)]
pub(super) enum Event {
    /// merod admitted `id` and lists it; the loop answers once it is recorded, with whether
    /// to confirm it (the latest poll still assigns it).
    Admitted {
        id: GroupId,
        ack: oneshot::Sender<bool>,
    },
    JoinEnded {
        id: GroupId,
        end: JoinEnd,
        /// From the join task's start (waiting for a join slot included) to its end.
        took: Duration,
        /// How the fleet-join call ended, for join-status (`None`: none was sent); boxed,
        /// so the other events stay small.
        attempt: Option<Box<Attempt>>,
        /// The role reported in the confirm, when one was sent.
        role: Option<Option<TeeRole>>,
    },
    /// The role of a confirmed namespace was read again; `confirmed`: `Some(role)` when
    /// it differed from the one MDMA was told and a confirm with it was accepted (`None`:
    /// nothing changed, an unread role included).
    RoleChecked {
        id: GroupId,
        confirmed: Option<Option<TeeRole>>,
    },
    /// A namespace the held refresh did not find was asked about (`GET
    /// /admin-api/namespaces/{id}`): `Ok(false)` is merod saying it does not hold it.
    DriftChecked {
        id: GroupId,
        held: Result<bool, CheckFailed>,
    },
    LeaveEnded {
        id: GroupId,
        end: LeaveEnd,
        took: Duration,
    },
}

/// What a task needs to make its calls and time them.
#[derive(Clone)]
pub(super) struct Calls {
    pub(super) merod: Arc<dyn Node>,
    pub(super) mdma: Arc<dyn ControlPlane>,
    pub(super) telemetry: Arc<Telemetry>,
    /// The latest successful poll's answer: a join goes by it when it gets its slot.
    pub(super) latest_poll: watch::Receiver<Arc<Desired>>,
    /// The node's account, read once for the role in each confirm.
    pub(super) account: Arc<AccountCache>,
}

/// Why the node's role in a namespace is unknown: its account or its row of the member
/// list could not be read. Unknown is not "no role": nothing is confirmed on it.
#[derive(Debug, thiserror::Error)]
pub(super) enum RoleUnread {
    /// `GET /admin-api/identity` failed.
    #[error("the node's account could not be read: {0}")]
    Account(MerodError),
    /// `GET /admin-api/identity` gave no answer within the deadline.
    #[error("the node's account gave no answer within {0:?}")]
    AccountNoAnswer(Duration),
    /// The member list could not be read whole.
    #[error("the member list could not be read: {0}")]
    Members(MerodError),
    /// The member list gave no answer within the deadline.
    #[error("the member list gave no answer within {0:?}")]
    MembersNoAnswer(Duration),
}

impl crate::outcome::Timed for RoleUnread {
    fn is_timeout(&self) -> bool {
        match self {
            RoleUnread::Account(e) | RoleUnread::Members(e) => e.is_timeout(),
            RoleUnread::AccountNoAnswer(_) | RoleUnread::MembersNoAnswer(_) => true,
        }
    }
}

/// The node's TEE role in `id`, for the confirm: its account's row of the member list.
/// `Ok(None)` (sent as `null`) when merod has no account yet, or the row is missing or has
/// another role. Each read is bounded and counted in `fleet_sidecar_role_reads_total`.
///
/// Errors: [`RoleUnread`] when a read failed or timed out: the role is unknown, not none.
async fn read_role(calls: &Calls, id: GroupId) -> Result<Option<TeeRole>, RoleUnread> {
    let t = &calls.telemetry;
    let read = read_role_uncounted(calls, id).await;
    let label = match &read {
        Ok(_) => CallOutcome::Ok,
        Err(e) => CallOutcome::of_error(e),
    };
    Telemetry::count(&t.role_reads, label.label());
    read
}

/// [`read_role`] without its count.
async fn read_role_uncounted(calls: &Calls, id: GroupId) -> Result<Option<TeeRole>, RoleUnread> {
    let t = &calls.telemetry;
    let account = match calls.account.get() {
        Some(a) => a,
        None => match timed(t, "identity", IDENTITY_DEADLINE, calls.merod.identity()).await {
            Some(Ok(NodeAccount::Account(a))) => {
                calls.account.set(a.clone());
                a
            }
            Some(Ok(NodeAccount::NotMinted)) => return Ok(None),
            Some(Err(e)) => return Err(RoleUnread::Account(e)),
            None => return Err(RoleUnread::AccountNoAnswer(IDENTITY_DEADLINE)),
        },
    };
    match timed(
        t,
        "members",
        MEMBERS_DEADLINE,
        calls.merod.tee_role(id, &account),
    )
    .await
    {
        Some(Ok(role)) => Ok(role),
        Some(Err(e)) => Err(RoleUnread::Members(e)),
        None => Err(RoleUnread::MembersNoAnswer(MEMBERS_DEADLINE)),
    }
}

/// How a confirm through [`confirm_if_assigned`] went.
#[derive(Debug)]
pub(super) enum Confirm {
    /// MDMA accepted it.
    Accepted,
    /// Not sent: the latest successful poll does not assign the namespace.
    NotAssigned,
    /// MDMA refused it, or the client gave up.
    Failed(ConfirmError),
    /// No answer within the loop's deadline.
    NoAnswer(Duration),
}

/// The one way a confirm reaches MDMA (after a join, after a role check, on any later
/// path): sent only while the latest successful poll assigns `id`, checked at the moment of
/// sending, so a slow read before it (the role) cannot carry a confirm past a withdrawal.
/// Bounded by [`MDMA_DEADLINE`]; every confirm sent is timed as `confirm` and counted in
/// `fleet_sidecar_confirms_total` (ok, error, timeout), here and nowhere else.
async fn confirm_if_assigned(
    calls: &Calls,
    peer_id: &PeerId,
    id: GroupId,
    role: Option<TeeRole>,
) -> Confirm {
    if !calls.latest_poll.borrow().assigned.contains(&id) {
        return Confirm::NotAssigned;
    }
    let t = &calls.telemetry;
    let sent = calls.mdma.confirm(peer_id, id, role);
    let result = timed(t, "confirm", MDMA_DEADLINE, sent).await;
    Telemetry::count(
        &t.confirms,
        CallOutcome::of_bounded(result.as_ref()).label(),
    );
    match result {
        Some(Ok(())) => Confirm::Accepted,
        Some(Err(e)) => Confirm::Failed(e),
        None => Confirm::NoAnswer(MDMA_DEADLINE),
    }
}

/// What a join task sends back: its end, the fleet-join's outcome (if one was sent) and
/// the role confirmed (if a confirm was sent).
struct JoinRun {
    end: JoinEnd,
    attempt: Option<Attempt>,
    role: Option<Option<TeeRole>>,
}

impl From<JoinEnd> for JoinRun {
    fn from(end: JoinEnd) -> Self {
        JoinRun {
            end,
            attempt: None,
            role: None,
        }
    }
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
/// [`CHECK_TIMEOUT`]). Errors: [`CheckFailed`], why it could not tell.
async fn check_held(
    telemetry: &Telemetry,
    merod: &dyn Node,
    id: GroupId,
) -> Result<bool, CheckFailed> {
    match timed(
        telemetry,
        "namespace_get",
        CHECK_TIMEOUT,
        merod.holds_namespace(id),
    )
    .await
    {
        Some(Ok(held)) => Ok(held),
        Some(Err(e)) => Err(CheckFailed::Error(e)),
        None => Err(CheckFailed::NoAnswer(CHECK_TIMEOUT)),
    }
}

/// Whether merod may still hold `id`, for a decision that forgets it: `false` only when its
/// membership read says "not held" in merod's own words *and* a full read of its namespace
/// list, started after that answer, does not list it either. merod's membership answer can
/// lag an admission by tens of seconds (404 `No namespace identity found` while its list
/// already has it); forgetting a namespace merod holds would leave its keys on the node for
/// good, so one read alone never does.
///
/// Errors: [`CheckFailed`], why it could not tell (a failed list read included).
async fn held_or_listed(
    telemetry: &Telemetry,
    merod: &dyn Node,
    id: GroupId,
) -> Result<bool, CheckFailed> {
    if check_held(telemetry, merod, id).await? {
        return Ok(true);
    }
    match timed(
        telemetry,
        "namespaces_list",
        HELD_READ_TIMEOUT,
        merod.list_namespaces(),
    )
    .await
    {
        Some(Ok(listed)) => Ok(listed.contains(&id)),
        Some(Err(e)) => Err(CheckFailed::ListUnread(ListUnread::Error(Arc::new(e)))),
        None => Err(CheckFailed::ListUnread(ListUnread::NoAnswer(
            HELD_READ_TIMEOUT,
        ))),
    }
}

/// One join: fleet-join (with the assignment's `admitter_addrs`) → `admitted: true` → merod
/// lists it → the loop records it → the role is read → confirm with it.
async fn join_task(
    id: GroupId,
    calls: &Calls,
    peer_id: PeerId,
    permits: Arc<Semaphore>,
    join: JoinArgs,
    events: &mpsc::UnboundedSender<Event>,
) -> JoinRun {
    let Ok(_permit) = permits.acquire_owned().await else {
        return JoinEnd::Failed(JoinFailed::SlotsClosed).into();
    };
    // A join may wait long for a slot (max_concurrent_joins): it goes by the latest
    // successful poll, not the one that started it.
    if !calls.latest_poll.borrow().assigned.contains(&id) {
        return JoinEnd::Withdrawn.into();
    }
    // Assigned again while recorded as held (a withdrawal that did not last, two MDMA
    // replicas that disagree): merod's own answer decides. Held: confirmed again, with no
    // attested fleet-join. Not held, or unknown: joined as ever (joining is idempotent).
    if join.recorded_held
        && check_held(&calls.telemetry, calls.merod.as_ref(), id)
            .await
            .is_ok_and(|held| held)
    {
        let (end, role) = confirm_with_role(id, calls, &peer_id).await;
        let end = match end {
            JoinEnd::Confirmed => JoinEnd::ConfirmedHeld,
            other => other,
        };
        return JoinRun {
            end,
            attempt: None,
            role,
        };
    }
    let (admission, attempt) = match send_fleet_join(id, calls, &join).await {
        Ok(answered) => answered,
        Err(failed) => return failed,
    };
    let (end, role) = if admission.admitted {
        after_admission(id, calls, &peer_id, events).await
    } else {
        let status = admission.status;
        let reasons = admission.reasons;
        (JoinEnd::NotAdmitted { status, reasons }, None)
    };
    JoinRun {
        end,
        attempt: Some(attempt),
        role,
    }
}

/// The fleet-join of `id` (with the assignment's `admitter_addrs`, bounded by its
/// timeout): merod's answer and its outcome for join-status. Errors: the run of a join
/// that failed there (no answer, or merod's error).
async fn send_fleet_join(
    id: GroupId,
    calls: &Calls,
    join: &JoinArgs,
) -> Result<(Admission, Attempt), JoinRun> {
    let limit = join.timeout;
    let sent = calls.merod.fleet_join(id, &join.admitter_addrs);
    let (end, failure) = match timed(&calls.telemetry, "fleet_join", limit, sent).await {
        Some(Ok(a)) => {
            let attempt = Attempt::of(Ok(&a));
            return Ok((a, attempt));
        }
        None => (
            JoinFailed::NoAnswer(limit),
            format!("fleet-join timed out after {limit:?}"),
        ),
        Some(Err(e)) => {
            let failure = e.to_string();
            (JoinFailed::Merod(e), failure)
        }
    };
    Err(JoinRun {
        end: JoinEnd::Failed(end),
        attempt: Some(Attempt::of(Err(&failure))),
        role: None,
    })
}

/// After `admitted: true`: merod must list `id`, the loop records the admission (and says
/// whether the latest poll still assigns it), the role is read, and the confirm passes the
/// gate. The join's end, and the role confirmed when a confirm was sent.
async fn after_admission(
    id: GroupId,
    calls: &Calls,
    peer_id: &PeerId,
    events: &mpsc::UnboundedSender<Event>,
) -> (JoinEnd, Option<Option<TeeRole>>) {
    match check_held(&calls.telemetry, calls.merod.as_ref(), id).await {
        Ok(true) => {}
        Ok(false) => return (JoinEnd::NotHeld, None),
        Err(why) => return (JoinEnd::Failed(JoinFailed::Unchecked(why)), None),
    }
    let (ack, acked) = oneshot::channel();
    if events.send(Event::Admitted { id, ack }).is_err() {
        return (JoinEnd::NotPersisted, None);
    }
    match acked.await {
        Ok(true) => {}
        Ok(false) => return (JoinEnd::NotAssigned, None),
        Err(_) => return (JoinEnd::NotPersisted, None),
    }
    confirm_with_role(id, calls, peer_id).await
}

/// A namespace merod holds and the state records: the role is read, and the confirm with
/// it passes the gate. The join's end, and the role confirmed when a confirm was sent.
async fn confirm_with_role(
    id: GroupId,
    calls: &Calls,
    peer_id: &PeerId,
) -> (JoinEnd, Option<Option<TeeRole>>) {
    let role = match read_role(calls, id).await {
        Ok(role) => role,
        Err(why) => return (JoinEnd::RoleUnread(why), None),
    };
    let end = match confirm_if_assigned(calls, peer_id, id, role).await {
        Confirm::Accepted => JoinEnd::Confirmed,
        Confirm::NotAssigned => return (JoinEnd::NotAssigned, None),
        Confirm::Failed(e) => JoinEnd::ConfirmFailed(e),
        Confirm::NoAnswer(limit) => JoinEnd::ConfirmTimedOut(limit),
    };
    (end, Some(role))
}

/// A role check of the confirmed namespace `id`: its role read again, and confirmed again
/// through [`confirm_if_assigned`] when it differs from `told` (see `roles`). `Some(role)`:
/// a confirm with `role` was accepted. A read that failed changes nothing: the role MDMA
/// was last told stands, and it is read again at its next turn.
async fn role_check(
    calls: &Calls,
    peer_id: &PeerId,
    id: GroupId,
    told: Option<Option<TeeRole>>,
) -> Option<Option<TeeRole>> {
    let role = match read_role(calls, id).await {
        Ok(role) => role,
        Err(why) => {
            warn!(namespace_id = %id, "cannot read the node's role ({why}); nothing confirmed, the role MDMA was told stands; read again at its next turn");
            return None;
        }
    };
    if !super::roles::needs_confirm(told, role) {
        return None;
    }
    match confirm_if_assigned(calls, peer_id, id, role).await {
        Confirm::Accepted => Some(role),
        Confirm::NotAssigned => {
            debug!(namespace_id = %id, "role read, but the latest poll no longer assigns the namespace: not confirmed");
            None
        }
        Confirm::Failed(e) => {
            warn!(namespace_id = %id, "confirm with the node's role failed ({e}); tried again at its next turn");
            None
        }
        Confirm::NoAnswer(limit) => {
            warn!(namespace_id = %id, "confirm with the node's role gave no answer within {limit:?}; tried again at its next turn");
            None
        }
    }
}

/// What a join is sent with.
struct JoinArgs {
    /// The state records merod holding it (it was admitted, and assigned again since).
    recorded_held: bool,
    /// Bound of the fleet-join.
    timeout: Duration,
    /// The assignment's `admitter_addrs` (empty: broadcast only).
    admitter_addrs: Arc<[String]>,
}

/// Leaves `id` and checks merod no longer holds it. `maybe_held`: only a fleet-join was
/// recorded, not its admission; merod is asked first, and the leave is sent unless it does
/// not hold the namespace (nothing irreversible for a join that never went through).
/// Before and after the leave, "not held" is [`held_or_listed`]: the membership read and
/// the list agree. Whatever the leave call answered (a 500, a typed 403, 409 or 503
/// refusal, no answer), only that decides whether the namespace is gone.
async fn leave_task(
    id: GroupId,
    merod: &Arc<dyn Node>,
    telemetry: &Telemetry,
    leave_timeout: Duration,
    maybe_held: bool,
) -> LeaveEnd {
    if maybe_held {
        match held_or_listed(telemetry, merod.as_ref(), id).await {
            Ok(false) => return LeaveEnd::NeverHeld,
            Ok(true) => {}
            Err(why) => return LeaveEnd::StillHeld(StillHeld::NotChecked(why)),
        }
    }
    let leave = match timed(telemetry, "leave", leave_timeout, merod.leave_namespace(id)).await {
        Some(Ok(())) => LeaveCall::Answered,
        Some(Err(e)) => LeaveCall::Failed(e),
        None => LeaveCall::NoAnswer(leave_timeout),
    };
    match held_or_listed(telemetry, merod.as_ref(), id).await {
        Ok(false) => LeaveEnd::Left,
        Ok(true) => LeaveEnd::StillHeld(StillHeld::Listed(leave)),
        Err(check) => LeaveEnd::StillHeld(StillHeld::Unchecked { leave, check }),
    }
}

/// What [`InFlight::next`] brings.
pub(super) enum Next {
    /// A task sent an event.
    Event(Event),
    /// A task ended (its events, if any, were sent before).
    Ended(Result<(tokio::task::Id, ()), JoinError>),
}

/// The joins and leaves in flight: at most one task per namespace, at most
/// `max_concurrent_joins` joins at merod at once, and the back-off of every namespace whose
/// last join or leave failed.
pub(super) struct InFlight {
    /// The running tasks.
    tasks: JoinSet<()>,
    /// The namespace of each running task (to account for one that ends without an event).
    task_ids: HashMap<tokio::task::Id, GroupId>,
    /// Namespaces with a join task running.
    joining: BTreeSet<GroupId>,
    /// Namespaces with a leave task running.
    leaving: BTreeSet<GroupId>,
    /// Namespaces being asked about after a held read (drift and role checks).
    checking: BTreeSet<GroupId>,
    /// One permit per join at merod (`max_concurrent_joins`).
    join_permits: Arc<Semaphore>,
    /// Back-off of failed joins.
    join_retry: Retries,
    /// Back-off of failed leaves.
    leave_retry: Retries,
    /// Re-assignments in a row of namespaces merod held throughout (flapping assignments),
    /// each confirmed again no sooner than the back-off of joins allows; forgotten
    /// [`RETRY_MAX`] after the last wait ended.
    flaps: Retries,
    /// What the tasks send the loop.
    events_tx: mpsc::UnboundedSender<Event>,
    events_rx: mpsc::UnboundedReceiver<Event>,
    /// `join_timeout`.
    join_timeout: Duration,
    /// `leave_timeout`.
    leave_timeout: Duration,
}

impl InFlight {
    /// Nothing in flight yet, with the limits of `cfg`.
    pub(super) fn new(cfg: &Config) -> Self {
        let (events_tx, events_rx) = mpsc::unbounded_channel();
        Self {
            tasks: JoinSet::new(),
            task_ids: HashMap::new(),
            joining: BTreeSet::new(),
            leaving: BTreeSet::new(),
            checking: BTreeSet::new(),
            join_permits: Arc::new(Semaphore::new(cfg.max_concurrent_joins)),
            join_retry: Retries::default(),
            leave_retry: Retries::default(),
            flaps: Retries::default(),
            events_tx,
            events_rx,
            join_timeout: cfg.join_timeout,
            leave_timeout: cfg.leave_timeout,
        }
    }

    /// The namespaces with a task running.
    pub(super) fn in_flight(&self) -> BTreeSet<GroupId> {
        self.joining
            .iter()
            .chain(&self.leaving)
            .chain(&self.checking)
            .copied()
            .collect()
    }

    /// How many tasks run.
    pub(super) fn running(&self) -> usize {
        self.tasks.len()
    }

    /// The next event of a task, or the next task to end (events first); pending while
    /// nothing runs and nothing was sent.
    pub(super) async fn next(&mut self) -> Next {
        tokio::select! {
            biased;
            Some(event) = self.events_rx.recv() => Next::Event(event),
            Some(done) = self.tasks.join_next_with_id(), if !self.tasks.is_empty() => {
                Next::Ended(done)
            }
            else => std::future::pending().await,
        }
    }

    /// An event already sent, if any.
    pub(super) fn try_event(&mut self) -> Option<Event> {
        self.events_rx.try_recv().ok()
    }

    /// Cuts every running task.
    pub(super) async fn cut(&mut self) {
        self.tasks.shutdown().await;
    }

    fn spawn<F>(&mut self, id: GroupId, fut: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let handle = self.tasks.spawn(fut);
        self.task_ids.insert(handle.id(), id);
    }

    /// Starts the join of `id` (fleet-join, check, the admission recorded by the loop,
    /// confirm) as `peer_id`.
    pub(super) fn spawn_join(
        &mut self,
        id: GroupId,
        calls: &Calls,
        peer_id: &PeerId,
        admitter_addrs: Arc<[String]>,
        recorded_held: bool,
    ) {
        if recorded_held {
            info!(namespace_id = %id, "assigned again while recorded as held: confirming (a fleet-join only if merod no longer holds it)");
        } else if admitter_addrs.is_empty() {
            info!(namespace_id = %id, "joining (fleet-join)");
        } else {
            info!(namespace_id = %id, admitters = admitter_addrs.len(), "joining (fleet-join, direct admission by the admitting nodes MDMA named)");
        }
        let calls = calls.clone();
        let peer_id = peer_id.clone();
        let permits = Arc::clone(&self.join_permits);
        let events = self.events_tx.clone();
        let join = JoinArgs {
            recorded_held,
            timeout: self.join_timeout,
            admitter_addrs,
        };
        self.joining.insert(id);
        let task = async move {
            let started = Instant::now();
            let run = join_task(id, &calls, peer_id, permits, join, &events).await;
            let took = started.elapsed();
            // The loop owns the receiver for the life of every task.
            let _ = events.send(Event::JoinEnded {
                id,
                end: run.end,
                took,
                attempt: run.attempt.map(Box::new),
                role: run.role,
            });
        };
        self.spawn(id, task.instrument(info_span!("join", namespace_id = %id)));
    }

    /// Starts the leave of `id`; `maybe_held`: its admission was never recorded (merod is
    /// asked first, see `leave_task`).
    pub(super) fn spawn_leave(&mut self, id: GroupId, calls: &Calls, maybe_held: bool) {
        if maybe_held {
            warn!(namespace_id = %id, "leaving if merod holds it: withdrawn by MDMA after a fleet-join whose admission was never recorded (irreversible: merod purges this namespace's keys)");
        } else {
            warn!(namespace_id = %id, "leaving: withdrawn by MDMA (irreversible: merod purges this namespace's keys)");
        }
        let merod = Arc::clone(&calls.merod);
        let telemetry = Arc::clone(&calls.telemetry);
        let events = self.events_tx.clone();
        let leave_timeout = self.leave_timeout;
        self.leaving.insert(id);
        let task = async move {
            let started = Instant::now();
            let end = leave_task(id, &merod, &telemetry, leave_timeout, maybe_held).await;
            let took = started.elapsed();
            let _ = events.send(Event::LeaveEnded { id, end, took });
        };
        self.spawn(id, task.instrument(info_span!("leave", namespace_id = %id)));
    }

    /// Reads the role of the confirmed namespace `id` again and confirms it again if it
    /// differs from `told` (see `roles`); the outcome comes back as [`Event::RoleChecked`].
    pub(super) fn spawn_role_check(
        &mut self,
        id: GroupId,
        calls: &Calls,
        peer_id: &PeerId,
        told: Option<Option<TeeRole>>,
    ) {
        let calls = calls.clone();
        let peer_id = peer_id.clone();
        let events = self.events_tx.clone();
        self.checking.insert(id);
        let task = async move {
            let confirmed = role_check(&calls, &peer_id, id, told).await;
            let _ = events.send(Event::RoleChecked { id, confirmed });
        };
        // Debug spans: a quiet background check opens no span at the default level.
        self.spawn(
            id,
            task.instrument(debug_span!("role_check", namespace_id = %id)),
        );
    }

    /// Asks merod whether it holds `id`, which the state records as held but the held
    /// refresh no longer found; the answer comes back as [`Event::DriftChecked`].
    pub(super) fn spawn_drift_check(&mut self, id: GroupId, calls: &Calls) {
        let merod = Arc::clone(&calls.merod);
        let telemetry = Arc::clone(&calls.telemetry);
        let events = self.events_tx.clone();
        self.checking.insert(id);
        let task = async move {
            let held = check_held(&telemetry, merod.as_ref(), id).await;
            let _ = events.send(Event::DriftChecked { id, held });
        };
        self.spawn(
            id,
            task.instrument(debug_span!("drift_check", namespace_id = %id)),
        );
    }

    /// Records a failed join, whose last answer asked for `asked` (a confirm's
    /// `Retry-After`); returns the failures in a row and the wait before the next.
    fn back_off_join(&mut self, id: GroupId, asked: Option<Duration>) -> (u32, Duration) {
        self.join_retry
            .fail(id, Instant::now(), fastrand::f64(), asked)
    }

    /// Records a failed leave; returns the failures in a row and the wait before the next.
    fn back_off_leave(&mut self, id: GroupId) -> (u32, Duration) {
        self.leave_retry
            .fail(id, Instant::now(), fastrand::f64(), None)
    }

    /// The namespaces with a join task running.
    pub(super) fn joining(&self) -> &BTreeSet<GroupId> {
        &self.joining
    }

    /// The namespaces with a leave task running.
    pub(super) fn leaving(&self) -> &BTreeSet<GroupId> {
        &self.leaving
    }

    /// Whether a join or leave of `id` runs.
    pub(super) fn joins_or_leaves(&self, id: &GroupId) -> bool {
        self.joining.contains(id) || self.leaving.contains(id)
    }

    /// Whether any task of `id` runs (a join, a leave or a check).
    pub(super) fn busy(&self, id: &GroupId) -> bool {
        self.joins_or_leaves(id) || self.checking.contains(id)
    }

    /// The namespaces whose joins (and re-confirms of flapping ones) and whose leaves back
    /// off at `now`, for planning. The back-offs of joins `desired` no longer assigns, and
    /// of leaves of namespaces it assigns or retains again, are forgotten first once their
    /// wait ended [`RETRY_MAX`] ago: a namespace assigned, withdrawn and assigned again
    /// (flapping) keeps its back-off across the flips rather than being tried at each.
    pub(super) fn backoffs(
        &mut self,
        desired: &Desired,
        now: Instant,
    ) -> (BTreeSet<GroupId>, BTreeSet<GroupId>) {
        self.join_retry
            .keep_only(now, RETRY_MAX, |id| desired.assigned.contains(id));
        self.leave_retry.keep_only(now, RETRY_MAX, |id| {
            !desired.assigned.contains(id) && !desired.retain.contains(id)
        });
        self.flaps.keep_only(now, RETRY_MAX, |_| false);
        let mut joins = self.join_retry.waiting(now);
        joins.extend(self.flaps.waiting(now));
        (joins, self.leave_retry.waiting(now))
    }

    /// A check (drift or role) of `id` ended.
    pub(super) fn check_ended(&mut self, id: GroupId) {
        self.checking.remove(&id);
    }

    /// The join of `id` ended with `end`: its back-off ends with a success and grows with a
    /// failure. Returns the failures in a row and the wait before the next attempt, for its
    /// log line (`(0, 0)` unless it failed).
    pub(super) fn join_ended(&mut self, id: GroupId, end: &JoinEnd) -> (u32, Duration) {
        self.joining.remove(&id);
        if end.not_tried() {
            (0, Duration::ZERO)
        } else if end.succeeded() {
            self.join_retry.succeed(id);
            if matches!(end, JoinEnd::ConfirmedHeld) {
                return self.flaps.fail(id, Instant::now(), fastrand::f64(), None);
            }
            (0, Duration::ZERO)
        } else {
            self.back_off_join(id, end.retry_after())
        }
    }

    /// The leave of `id` ended with `end`; as [`InFlight::join_ended`].
    pub(super) fn leave_ended(&mut self, id: GroupId, end: &LeaveEnd) -> (u32, Duration) {
        self.leaving.remove(&id);
        if end.succeeded() {
            self.leave_retry.succeed(id);
            (0, Duration::ZERO)
        } else {
            self.back_off_leave(id)
        }
    }

    /// merod was found not to hold `id` (drift): no leave of it is backing off any more.
    pub(super) fn not_held(&mut self, id: GroupId) {
        self.leave_retry.succeed(id);
    }

    /// Accounts for a task that ended: one that ended without its outcome (a panic, or cut
    /// at shutdown) is a failed attempt, backed off like any other. `true`: the sets
    /// changed.
    pub(super) fn on_task_done(&mut self, done: Result<(tokio::task::Id, ()), JoinError>) -> bool {
        let task_id = match &done {
            Ok((id, ())) => *id,
            Err(e) => e.id(),
        };
        let Some(group) = self.task_ids.remove(&task_id) else {
            return false;
        };
        let Err(e) = done else {
            return false;
        };
        if self.joining.remove(&group) {
            self.back_off_join(group, None);
        }
        if self.leaving.remove(&group) {
            self.back_off_leave(group);
        }
        self.checking.remove(&group);
        if e.is_panic() {
            error!(namespace_id = %group, "join/leave task panicked; retried after a back-off");
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEN: Duration = Duration::from_secs(10);

    #[test]
    fn a_join_end_is_labelled_by_itself_a_timeout_apart_from_an_error() {
        let unchecked = JoinEnd::Failed(JoinFailed::Unchecked(CheckFailed::NoAnswer(TEN)));
        assert_eq!(unchecked.metric_label(), Some("timeout"));
        let closed = JoinEnd::Failed(JoinFailed::SlotsClosed);
        assert_eq!(closed.metric_label(), Some("error"));
        // A confirm is counted by the gate that sent it, not by the join's end.
        assert_eq!(JoinEnd::ConfirmTimedOut(TEN).metric_label(), None);
        assert_eq!(JoinEnd::Confirmed.metric_label(), None);
        assert_eq!(JoinEnd::NotPersisted.metric_label(), None);
        assert!(JoinEnd::Confirmed.succeeded() && !JoinEnd::NotHeld.succeeded());
        // The typed causes say what the strings said.
        let JoinEnd::Failed(why) = unchecked else {
            unreachable!()
        };
        assert_eq!(
            why.to_string(),
            "admitted, but the membership check gave no answer within 10s"
        );
    }

    #[test]
    fn a_leave_not_done_is_a_timeout_only_when_its_own_call_ran_out_of_time() {
        // No leave sent: the check's timeout is the leave's.
        let before = LeaveEnd::StillHeld(StillHeld::NotChecked(CheckFailed::NoAnswer(TEN)));
        assert_eq!(before.metric_label(), "timeout");
        // Leave answered, the check after it timed out: a failed leave, not a timeout.
        let after = StillHeld::Unchecked {
            leave: LeaveCall::Answered,
            check: CheckFailed::NoAnswer(TEN),
        };
        assert_eq!(
            after.to_string(),
            "leave: left; membership check gave no answer within 10s"
        );
        assert_eq!(LeaveEnd::StillHeld(after).metric_label(), "failed");
        let hung = StillHeld::Listed(LeaveCall::NoAnswer(TEN));
        assert_eq!(
            hung.to_string(),
            "leave: no answer within 10s: outcome unknown; merod still lists it"
        );
        assert_eq!(LeaveEnd::StillHeld(hung).metric_label(), "timeout");
        assert_eq!(LeaveEnd::NeverHeld.metric_label(), "not_held");
        assert!(LeaveEnd::NeverHeld.succeeded() && LeaveEnd::Left.succeeded());
    }
}
