//! Per-namespace retry state, one for joins and one for leaves: every failed join (an error,
//! `admitted: false`, an admission merod does not list, an admission or confirm that could
//! not be recorded) and every failed leave (an error, a timeout, merod still listing it)
//! waits before the next attempt, the wait doubling from [`RETRY_MIN`] to [`RETRY_MAX`] and
//! jittered so a fleet does not retry in lockstep.
//!
//! The state of a namespace survives across failures (its wait having ended does not forget
//! it), and is dropped only when the action succeeds or the namespace stops being a
//! candidate for it (no longer assigned, for a join; assigned or retained again, for a leave).

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use tokio::time::Instant;

use crate::ids::GroupId;

/// First wait before retrying a failed join or leave of a namespace, or a failed state
/// write (doubles, up to [`RETRY_MAX`]).
pub(crate) const RETRY_MIN: Duration = Duration::from_secs(2);
/// Longest wait before retrying a failing join, leave or state write.
pub(crate) const RETRY_MAX: Duration = Duration::from_secs(60);

/// The wait after the `failures`-th failure in a row (1-based), for `jitter` in `[0, 1)`:
/// `base = min(RETRY_MAX, RETRY_MIN · 2^(failures-1))`, wait
/// `base · (1 + jitter) / 2`, never below [`RETRY_MIN`].
pub(crate) fn retry_delay(failures: u32, jitter: f64) -> Duration {
    let factor = 2u32.saturating_pow(failures.saturating_sub(1));
    let base = RETRY_MIN.saturating_mul(factor).min(RETRY_MAX);
    base.mul_f64((1.0 + jitter.clamp(0.0, 1.0)) / 2.0)
        .max(RETRY_MIN)
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
    /// Records a failed attempt on `id` at `now`; returns the failures in a row (1 for the
    /// first) and the wait before the next attempt.
    pub(crate) fn fail(&mut self, id: GroupId, now: Instant, jitter: f64) -> (u32, Duration) {
        let failures = self
            .entries
            .get(&id)
            .map_or(1, |e| e.failures.saturating_add(1));
        let wait = retry_delay(failures, jitter);
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

    /// Forgets every namespace for which `candidate` is false (it becoming a candidate
    /// again later starts afresh).
    pub(crate) fn keep_only(&mut self, mut candidate: impl FnMut(&GroupId) -> bool) {
        self.entries.retain(|id, _| candidate(id));
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
            let lo = retry_delay(failures, 0.0).as_secs_f64();
            let hi = retry_delay(failures, 0.999_999).as_secs_f64();
            assert!(
                (lo - (base / 2.0_f64).max(2.0)).abs() < 1e-6,
                "{failures}: {lo}"
            );
            assert!((hi - base).abs() < 1e-3, "{failures}: {hi}");
        }
        assert_eq!(retry_delay(u32::MAX, 7.0), RETRY_MAX);
    }

    #[tokio::test(start_paused = true)]
    async fn state_survives_the_wait_and_resets_on_success_or_withdrawal() {
        let a = GroupId::from_bytes([1; 32]);
        let mut r = Retries::default();
        let t0 = Instant::now();
        assert_eq!(r.fail(a, t0, 0.999_999).0, 1);
        assert!(r.waiting(t0).contains(&a));
        // Long after the wait ended, the next failure still doubles.
        let later = t0 + Duration::from_secs(600);
        assert!(r.waiting(later).is_empty());
        assert_eq!(r.fail(a, later, 0.999_999).0, 2);
        r.succeed(a);
        assert_eq!(r.fail(a, later, 0.0).0, 1);
        r.keep_only(|_| false);
        assert_eq!(r.fail(a, later, 0.0).0, 1);
    }
}
