//! Per-namespace retry state, one for joins and one for leaves: every failed join (an error,
//! `admitted: false`, an admission merod does not list, an admission or confirm that could
//! not be recorded) and every failed leave (an error, a timeout, merod still listing it)
//! waits before the next attempt, the wait doubling from [`RETRY_MIN`] to [`RETRY_MAX`] and
//! jittered so a fleet does not retry in lockstep ([`RETRY`]). [`Backoff`] is the one
//! back-off every retry of the crate uses.
//!
//! The state of a namespace survives across failures (its wait having ended does not forget
//! it), and is dropped only when the action succeeds or the namespace stops being a
//! candidate for it (no longer assigned, for a join; assigned or retained again, for a leave).

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use tokio::time::Instant;

use crate::ids::GroupId;

/// How a [`Backoff`]'s wait spreads around its base, so a fleet that failed together does
/// not retry in lockstep.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Jitter {
    /// The base exactly: for a peer on this machine (merod), which no fleet shares.
    None,
    /// Between half the base and the base, never below `first`: the mean stays under the
    /// doubling curve (joins, leaves, state writes, the poll).
    Down,
    /// Between the base and one and a half times it, never above `cap`: never sooner than
    /// `first`, for an interval an operator set as the shortest wait (registration).
    Up,
}

/// One exponential back-off: after the `n`-th failure in a row (1-based) the base wait is
/// `min(cap, first · 2^(n-1))`, spread by [`Jitter`]. Every retry in the crate (joins,
/// leaves, state writes, the poll cadence, the readiness probe of merod, registration) is one
/// of these; what differs between them is these three parameters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Backoff {
    first: Duration,
    cap: Duration,
    jitter: Jitter,
}

impl Backoff {
    /// Waits doubling from `first` up to `cap` (a `cap` below `first` is `first`).
    pub(crate) const fn new(first: Duration, cap: Duration, jitter: Jitter) -> Self {
        Self { first, cap, jitter }
    }

    /// The unjittered wait after the `failures`-th failure in a row (1-based; 0 counts as 1):
    /// `min(cap, first · 2^(failures-1))`, saturating.
    pub(crate) fn base(&self, failures: u32) -> Duration {
        let factor = 2u32.saturating_pow(failures.saturating_sub(1));
        self.first
            .saturating_mul(factor)
            .min(self.cap.max(self.first))
    }

    /// The wait after the `failures`-th failure in a row, for `jitter` in `[0, 1)` (clamped;
    /// ignored by [`Jitter::None`]): always within `[first, max(cap, first)]`.
    pub(crate) fn wait(&self, failures: u32, jitter: f64) -> Duration {
        let base = self.base(failures);
        let jitter = jitter.clamp(0.0, 1.0);
        match self.jitter {
            Jitter::None => base,
            Jitter::Down => base.mul_f64((1.0 + jitter) / 2.0).max(self.first),
            Jitter::Up => base
                .mul_f64(1.0 + jitter / 2.0)
                .min(self.cap.max(self.first)),
        }
    }
}

/// First wait before retrying a failed join or leave of a namespace, or a failed state
/// write (doubles, up to [`RETRY_MAX`]).
pub(crate) const RETRY_MIN: Duration = Duration::from_secs(2);
/// Longest wait before retrying a failing join, leave or state write.
pub(crate) const RETRY_MAX: Duration = Duration::from_secs(60);
/// The back-off of a failing join, leave or state write: [`RETRY_MIN`] doubling to
/// [`RETRY_MAX`], each wait between half its base and its base (never below [`RETRY_MIN`]).
pub(crate) const RETRY: Backoff = Backoff::new(RETRY_MIN, RETRY_MAX, Jitter::Down);

/// The longest wait a `Retry-After` imposes on a request the daemon repeats (the poll, a
/// confirm, a join-status report, a registration attempt). The poll is the node's heartbeat
/// and MDMA treats a node that stops polling as gone: MDMA may ask for fewer requests, never
/// for a silence longer than this (the back-off cap of joins, leaves and confirms too).
pub(crate) const RETRY_AFTER_MAX: Duration = RETRY_MAX;

/// The wait a `Retry-After` of `asked` imposes: `asked`, at most [`RETRY_AFTER_MAX`]; none
/// when nothing was asked. A back-off waits at least this.
pub(crate) fn asked_wait(asked: Option<Duration>) -> Duration {
    asked.map_or(Duration::ZERO, |d| d.min(RETRY_AFTER_MAX))
}

#[derive(Clone, Copy, Debug)]
struct Entry {
    failures: u32,
    until: Instant,
}

/// The retry state of every namespace whose last attempt (of one kind: join or leave) failed.
#[derive(Debug, Default)]
pub(crate) struct Retries {
    entries: BTreeMap<GroupId, Entry>,
}

impl Retries {
    /// Records a failed attempt on `id` at `now`, whose answer asked for `asked`
    /// (`Retry-After`); returns the failures in a row (1 for the first) and the wait before
    /// the next attempt: the back-off's, or what was asked if longer (see [`asked_wait`]).
    pub(crate) fn fail(
        &mut self,
        id: GroupId,
        now: Instant,
        jitter: f64,
        asked: Option<Duration>,
    ) -> (u32, Duration) {
        let failures = self
            .entries
            .get(&id)
            .map_or(1, |e| e.failures.saturating_add(1));
        let wait = RETRY.wait(failures, jitter).max(asked_wait(asked));
        self.entries.insert(
            id,
            Entry {
                failures,
                until: now + wait,
            },
        );
        (failures, wait)
    }

    /// The attempt on `id` succeeded: its next failure starts again at [`RETRY_MIN`].
    pub(crate) fn succeed(&mut self, id: GroupId) {
        self.entries.remove(&id);
    }

    /// Forgets every namespace for which `candidate` is false once its wait ended at `now`
    /// more than `linger` ago (it becoming a candidate again later starts afresh). A wait
    /// still running is kept whatever `candidate` says: a namespace that stops and starts
    /// being a candidate (flapping assignments) waits it out rather than starting afresh
    /// at every flip.
    pub(crate) fn keep_only(
        &mut self,
        now: Instant,
        linger: Duration,
        mut candidate: impl FnMut(&GroupId) -> bool,
    ) {
        self.entries
            .retain(|id, e| candidate(id) || now < e.until + linger);
    }

    /// The namespaces still waiting at `now` (not to be joined this cycle).
    pub(crate) fn waiting(&self, now: Instant) -> BTreeSet<GroupId> {
        self.entries
            .iter()
            .filter(|(_, e)| e.until > now)
            .map(|(id, _)| *id)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_wait_doubles_from_2_s_to_60_s_jittered() {
        for (failures, base) in [
            (1, 2.0),
            (2, 4.0),
            (3, 8.0),
            (5, 32.0),
            (6, 60.0),
            (60, 60.0),
        ] {
            let lo = RETRY.wait(failures, 0.0).as_secs_f64();
            let hi = RETRY.wait(failures, 0.999_999).as_secs_f64();
            assert!(
                (lo - (base / 2.0_f64).max(2.0)).abs() < 1e-6,
                "{failures}: {lo}"
            );
            assert!((hi - base).abs() < 1e-3, "{failures}: {hi}");
        }
        assert_eq!(RETRY.wait(u32::MAX, 7.0), RETRY_MAX);
    }

    #[test]
    fn every_jitter_stays_within_first_and_cap() {
        let s = Duration::from_secs(1);
        let none = Backoff::new(s, 5 * s, Jitter::None);
        let waits: Vec<u64> = (0..=6).map(|n| none.wait(n, 0.9).as_secs()).collect();
        assert_eq!(waits, [1, 1, 2, 4, 5, 5, 5]);
        let up = Backoff::new(10 * s, 600 * s, Jitter::Up);
        assert_eq!(up.wait(1, 0.0), 10 * s);
        assert_eq!(up.wait(1, 0.999).as_millis(), 14_995);
        assert_eq!(up.wait(7, 0.999), 600 * s);
        // A cap below first is first.
        let inverted = Backoff::new(5 * s, s, Jitter::Down);
        for n in [0, 1, 2, u32::MAX] {
            for j in [-1.0, 0.0, 0.5, 7.0] {
                assert_eq!(inverted.wait(n, j), 5 * s, "{n} {j}");
            }
        }
        for b in [none, up, RETRY] {
            for n in [0, 1, 3, 9, u32::MAX] {
                for j in [-1.0, 0.0, 0.5, 0.999, 7.0] {
                    let w = b.wait(n, j);
                    assert!(
                        w >= b.first && w <= b.cap.max(b.first),
                        "{b:?} {n} {j}: {w:?}"
                    );
                }
            }
        }
    }

    #[tokio::test(start_paused = true)]
    async fn state_survives_the_wait_and_resets_on_success_or_withdrawal() {
        let a = GroupId::from_bytes([1; 32]);
        let mut r = Retries::default();
        let t0 = Instant::now();
        assert_eq!(r.fail(a, t0, 0.999_999, None).0, 1);
        assert!(r.waiting(t0).contains(&a));
        // Long after the wait ended, the next failure still doubles.
        let later = t0 + Duration::from_secs(600);
        assert!(r.waiting(later).is_empty());
        assert_eq!(r.fail(a, later, 0.999_999, None).0, 2);
        r.succeed(a);
        assert_eq!(r.fail(a, later, 0.0, None).0, 1);
        // No longer a candidate, but its wait (2 s: jitter 0) runs: kept, and so is its
        // count; once it ended, forgotten.
        let s = Duration::from_secs;
        r.keep_only(later + s(1), Duration::ZERO, |_| false);
        assert!(r.waiting(later + s(1)).contains(&a));
        r.keep_only(later + s(2), Duration::ZERO, |_| false);
        assert_eq!(r.fail(a, later + s(2), 0.0, None).0, 1, "forgotten");
        // With a linger of 10 s: kept until 10 s after its wait (to +4 s) ended.
        r.keep_only(later + s(13), s(10), |_| false);
        assert_eq!(r.fail(a, later + s(13), 0.0, None).0, 2, "kept");
        r.keep_only(later + s(25), s(10), |_| false);
        assert_eq!(r.fail(a, later + s(25), 0.0, None).0, 1, "forgotten");
    }
}
