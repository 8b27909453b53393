//! What merod holds: the `held_namespaces` refresh, a job on the crate's job harness
//! (`jobs`). It reads every page of `GET /admin-api/namespaces` every [`HELD_REFRESH`] (and
//! at once when asked: after each join or leave outcome), each read bounded, and publishes
//! the latest read. Nothing waits for it: a poll takes whatever was
//! last published ([`HeldView::poll_field`]), so a slow or hanging merod never delays the
//! heartbeat.
//!
//! The same reads find drift: a namespace the state records as held that merod no longer
//! lists ([`missing`]; the loop asks merod about it before it drops anything).

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::backoff::{Backoff, Jitter};
use crate::ids::GroupId;
use crate::jobs::{self, Job, JobHandle, Latest, Schedule};
use crate::mdma::MAX_HELD_REPORTED;
use crate::merod::{MerodError, Node, CHECK_TIMEOUT};
use crate::telemetry::{unix_now, HeldStatus, Telemetry};

/// How often merod's namespaces are read (from the start of one read to the next).
pub(crate) const HELD_REFRESH: Duration = Duration::from_secs(60);
/// Past this age a read is not reported any more (`held_namespaces` absent).
pub(crate) const HELD_MAX_AGE: Duration = Duration::from_secs(180);
/// Shortest gap between the starts of two reads: reads asked for by a burst of join
/// outcomes are merged.
pub(crate) const HELD_MIN_GAP: Duration = Duration::from_secs(5);
/// Most namespaces asked about after one read (the rest after the next reads).
pub(crate) const MAX_DRIFT_CHECKS: usize = 64;
/// Bound of one whole read (every page), around the client's own deadline.
pub(crate) const HELD_READ_TIMEOUT: Duration = CHECK_TIMEOUT.saturating_add(Duration::from_secs(5));

/// The latest outcome of the refresh: a good read, or none known (not yet, or the latest
/// read failed: an older list is not used). A good read is everything merod listed (no
/// cap), sorted and unique (a slice: a third of a set's memory at 10,000 namespaces), with
/// when the read started (its age counts from there) and its generation.
pub(crate) type HeldLatest = Latest<Arc<[GroupId]>>;

/// Why merod's list of the namespaces it holds could not be read.
#[derive(Clone, Debug, thiserror::Error)]
pub(crate) enum ListUnread {
    /// merod answered with an error, or the client's own deadline passed (shared: the
    /// latest outcome is handed to every reader).
    #[error(transparent)]
    Error(Arc<MerodError>),
    /// No answer within the bound.
    #[error("no answer within {0:?}")]
    NoAnswer(Duration),
}

/// What a poll sends as `held_namespaces` at `now`: the latest read, if it worked, is at
/// most [`HELD_MAX_AGE`] old and holds at most [`MAX_HELD_REPORTED`] ids; otherwise
/// nothing (the field is left out, never `[]` or an older list).
pub(crate) fn poll_field(latest: &HeldLatest, now: Instant) -> Option<Arc<[GroupId]>> {
    latest
        .fresh(now, HELD_MAX_AGE)
        .filter(|r| r.value.len() <= MAX_HELD_REPORTED)
        .map(|r| Arc::clone(&r.value))
}

/// The namespaces `recorded` as held that `read` (sorted) does not list.
pub(crate) fn missing(recorded: &BTreeSet<GroupId>, read: &[GroupId]) -> BTreeSet<GroupId> {
    recorded
        .iter()
        .filter(|id| read.binary_search(id).is_err())
        .copied()
        .collect()
}

/// merod's holdings as the loop knows them between two reads: the latest read, shared with
/// the refresh (not copied: 320 KB at 10,000 namespaces), and the admissions and leaves the
/// loop saw since.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Holdings {
    /// The read (sorted, unique).
    read: Arc<[GroupId]>,
    /// Admitted since, not in `read`.
    added: BTreeSet<GroupId>,
    /// Left since, in `read`.
    removed: BTreeSet<GroupId>,
}

impl Holdings {
    /// What `read` (sorted, unique: a good [`HeldLatest`]'s value) lists.
    pub(crate) fn new(read: Arc<[GroupId]>) -> Self {
        Self {
            read,
            added: BTreeSet::new(),
            removed: BTreeSet::new(),
        }
    }

    /// merod admitted `id`: it holds it.
    pub(crate) fn insert(&mut self, id: GroupId) {
        self.removed.remove(&id);
        if self.read.binary_search(&id).is_err() {
            self.added.insert(id);
        }
    }

    /// `id` was left: merod no longer holds it.
    pub(crate) fn remove(&mut self, id: &GroupId) {
        self.added.remove(id);
        if self.read.binary_search(id).is_ok() {
            self.removed.insert(*id);
        }
    }

    /// Every namespace held, ascending.
    pub(crate) fn iter(&self) -> impl Iterator<Item = &GroupId> + '_ {
        let mut read = self
            .read
            .iter()
            .filter(|id| !self.removed.contains(id))
            .peekable();
        let mut added = self.added.iter().peekable();
        // `added` and `read` are disjoint: a merge of two ascending lists.
        std::iter::from_fn(move || match (read.peek(), added.peek()) {
            (Some(r), Some(a)) if a < r => added.next(),
            (Some(_), _) => read.next(),
            (None, _) => added.next(),
        })
    }
}

/// A reader of the refresh's latest outcome, for the loop and for any other consumer (it
/// is cheap to clone; reading copies only `Arc`s).
#[derive(Clone, Debug)]
pub(crate) struct HeldView(JobHandle<Arc<[GroupId]>>);

impl HeldView {
    /// The latest outcome of the refresh.
    pub(crate) fn latest(&self) -> HeldLatest {
        self.0.latest()
    }

    /// What a poll sends as `held_namespaces` now (see [`poll_field`]).
    pub(crate) fn poll_field(&self, now: Instant) -> Option<Arc<[GroupId]>> {
        self.0.with_latest(|latest| poll_field(latest, now))
    }

    /// Asks for a read now (after a join or leave outcome); returns at once.
    pub(crate) fn refresh_soon(&self) {
        self.0.run_soon();
    }

    /// A view that never reads (dry runs, which call no merod): nothing is reported.
    pub(crate) fn idle() -> Self {
        Self(JobHandle::idle())
    }

    /// Waits until a read finishes (good or not), at most `limit`.
    pub(crate) async fn first_read(&mut self, limit: Duration) {
        self.0.first_outcome(limit).await;
    }
}

/// Starts the refresh job ([`HeldRefresh`] on the job harness): its first read at once,
/// then every [`HELD_REFRESH`] or when asked, until `shutdown`.
pub(crate) fn spawn(
    merod: Arc<dyn Node>,
    telemetry: Arc<Telemetry>,
    shutdown: CancellationToken,
) -> HeldView {
    let job = HeldRefresh {
        merod,
        telemetry: Arc::clone(&telemetry),
        over_cap: false,
    };
    HeldView(jobs::spawn(job, telemetry, shutdown))
}

/// The held refresh, a job: one run reads every page of merod's namespace list.
struct HeldRefresh {
    merod: Arc<dyn Node>,
    telemetry: Arc<Telemetry>,
    /// Above [`MAX_HELD_REPORTED`] in the latest read (logged on the rising edge).
    over_cap: bool,
}

impl Job for HeldRefresh {
    type Output = Arc<[GroupId]>;
    type Error = MerodError;
    const NAME: &'static str = "held";
    const FAILING: &'static str = "cannot read what merod holds";
    const EFFECT: &'static str = "polls leave held_namespaces out until a read works";
    const RECOVERED: &'static str = "merod's namespaces readable again";

    fn schedule(&self) -> Schedule {
        // A failing read is tried again at the refresh's own pace (or when asked).
        Schedule::every(HELD_REFRESH, HELD_READ_TIMEOUT)
            .min_gap(HELD_MIN_GAP)
            .backoff(Backoff::new(HELD_REFRESH, HELD_REFRESH, Jitter::None))
    }

    async fn run(&mut self) -> Result<Arc<[GroupId]>, MerodError> {
        let started = Instant::now();
        let ids = self.merod.list_namespaces().await?;
        let telemetry = &self.telemetry;
        telemetry.observe("namespaces_list", started.elapsed());
        let over_cap = ids.len() > MAX_HELD_REPORTED;
        if over_cap && !self.over_cap {
            warn!(
                held = ids.len(),
                "merod holds more than {MAX_HELD_REPORTED} namespaces: polls leave held_namespaces out (MDMA cannot tell a cut list from a whole one)"
            );
        }
        self.over_cap = over_cap;
        let count = ids.len();
        telemetry
            .held_namespaces
            .set(i64::try_from(count).unwrap_or(i64::MAX));
        let read_at = unix_now() - started.elapsed().as_secs_f64();
        telemetry.update(|st| {
            st.held_namespaces = Some(HeldStatus {
                count,
                read_at,
                reported: !over_cap,
            });
        });
        Ok(ids.into_iter().collect())
    }

    fn failed(&mut self, _why: &str) {
        self.telemetry.held_namespaces.set(-1);
        self.telemetry.update(|st| st.held_namespaces = None);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::jobs::Published;

    fn id(n: u16) -> GroupId {
        let mut b = [0u8; 32];
        b[30..].copy_from_slice(&n.to_be_bytes());
        GroupId::from_bytes(b)
    }

    fn read(n: u16, started: Instant) -> HeldLatest {
        Latest::Good(Published {
            value: (0..n).map(id).collect(),
            started,
            generation: 1,
        })
    }

    #[test]
    fn a_fresh_good_read_is_reported_sorted_and_empty_means_nothing_held() {
        let t0 = Instant::now();
        let field = poll_field(&read(3, t0), t0 + Duration::from_secs(1)).unwrap();
        assert_eq!(&*field, &[id(0), id(1), id(2)]);
        let empty = poll_field(&read(0, t0), t0).unwrap();
        assert!(empty.is_empty(), "[] is reported: merod holds nothing");
    }

    #[test]
    fn nothing_is_reported_without_a_fresh_whole_read() {
        let t0 = Instant::now();
        assert_eq!(poll_field(&Latest::NotYet, t0), None);
        assert_eq!(poll_field(&Latest::Failed, t0), None);
        // Older than 3 minutes: absent, never the old list.
        assert!(poll_field(&read(3, t0), t0 + HELD_MAX_AGE).is_some());
        assert_eq!(
            poll_field(&read(3, t0), t0 + HELD_MAX_AGE + Duration::from_millis(1)),
            None
        );
        // More than 512: absent (a cut list would read as "holds only these").
        assert!(poll_field(&read(512, t0), t0).is_some());
        assert_eq!(poll_field(&read(513, t0), t0), None);
        // ...but the whole read stays available to other consumers.
        assert_eq!(
            read(513, t0).fresh(t0, HELD_MAX_AGE).unwrap().value.len(),
            513
        );
    }

    proptest::proptest! {
        /// Holdings, after any admissions and leaves on top of a read, list what a set
        /// given the same changes holds, in ascending order.
        #[test]
        fn holdings_follow_admissions_and_leaves_in_order(
            read in proptest::collection::btree_set(0u16..64, 0..40),
            changes in proptest::collection::vec((proptest::bool::ANY, 0u16..64), 0..60),
        ) {
            let mut model: BTreeSet<GroupId> = read.iter().map(|n| id(*n)).collect();
            let mut h = Holdings::new(model.iter().copied().collect());
            for (admit, n) in changes {
                if admit {
                    model.insert(id(n));
                    h.insert(id(n));
                } else {
                    model.remove(&id(n));
                    h.remove(&id(n));
                }
            }
            let got: Vec<GroupId> = h.iter().copied().collect();
            let want: Vec<GroupId> = model.into_iter().collect();
            proptest::prop_assert_eq!(got, want);
        }
    }

    #[test]
    fn missing_is_what_the_state_records_and_merod_does_not_list() {
        let recorded: BTreeSet<GroupId> = [id(1), id(2), id(3)].into();
        assert_eq!(missing(&recorded, &[id(2), id(9)]), [id(1), id(3)].into());
        let all: Vec<GroupId> = recorded.iter().copied().collect();
        assert!(missing(&recorded, &all).is_empty());
    }
}
