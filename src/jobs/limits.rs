//! The bounds the loop and its jobs share: how long each waits for a call beyond its
//! client's own timeout, how long shutdown waits, and the longest gap between two turns of
//! the loop.

use std::time::Duration;

use crate::mdma::MDMA_TIMEOUT;
use crate::merod::{CHECK_TIMEOUT, MEMBERS_TIMEOUT};

/// How much longer the loop waits for a call than the client's own timeout, so the client's
/// deadline, whose error names the URL, normally fires first.
pub(crate) const DEADLINE_SLACK: Duration = Duration::from_secs(1);

/// The loop's bound on a call whose client gives up after `client_timeout`:
/// `client_timeout` plus [`DEADLINE_SLACK`], saturating.
pub(crate) const fn outer_deadline(client_timeout: Duration) -> Duration {
    client_timeout.saturating_add(DEADLINE_SLACK)
}

/// The loop's bound on one MDMA call (a poll, a confirm, a join-status report): the
/// outer deadline of [`MDMA_TIMEOUT`].
pub(crate) const MDMA_DEADLINE: Duration = outer_deadline(MDMA_TIMEOUT);
/// The loop's bound on reading merod's identity: the outer deadline of [`CHECK_TIMEOUT`].
pub(crate) const IDENTITY_DEADLINE: Duration = outer_deadline(CHECK_TIMEOUT);
/// The loop's bound on reading a namespace's member list: the outer deadline of
/// [`MEMBERS_TIMEOUT`].
pub(crate) const MEMBERS_DEADLINE: Duration = outer_deadline(MEMBERS_TIMEOUT);
/// On shutdown, how long running joins and leaves may take to finish before they are cut.
pub(crate) const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);
/// At shutdown, how long the loop waits for the state writes (the one running, then the
/// final one) before it exits without them.
pub(crate) const SHUTDOWN_WRITE_WAIT: Duration = Duration::from_secs(10);
/// The longest time between two turns of the loop (the systemd watchdog's sign of life).
pub(crate) const ALIVE_TURN: Duration = Duration::from_secs(1);
