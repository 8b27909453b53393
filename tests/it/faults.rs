//! Retries and the state write's guard, each fault as a kind, under tokio's paused clock
//! with in-memory MDMA and merod: join, leave and state-write retries back off (errors, `admitted: false` and
//! panicked tasks alike) and no leave starts while the state cannot be written.

use std::time::Duration;

use fleet_sidecar::StateStore;
use fleet_sidecar::{Config, GroupId};
use tokio::time::Instant;

use crate::common::*;
use crate::fakes::{Fake, Join};

/// When each fleet-join call started.
fn join_times(fake: &Fake) -> Vec<Instant> {
    fake.with(|w| w.joins.iter().map(|(_, t)| *t).collect())
}

/// Gaps between consecutive fleet-join calls.
fn gaps(joins: &[Instant]) -> Vec<Duration> {
    joins.windows(2).map(|p| p[1] - p[0]).collect()
}

/// `calls`, the start times of one action failing for 600 s, backed off: doubling from 2 s
/// to 60 s, ≥ 2+2+4+8+16+30 s for the first 6 retries, then ≥ 30 s each (jittered down to
/// half); ≤ 2+4+8+16+32 s (+1 s poll alignment each), then ≤ 61 s each.
fn backed_off_over_600_s(what: &str, calls: &[Instant]) {
    let g = gaps(calls);
    assert!(
        (10..=24).contains(&calls.len()),
        "{} {what} in 600 s: {g:?}",
        calls.len()
    );
    assert!(g[0] >= Duration::from_secs(2), "{what}: {g:?}");
    assert!(
        g[6..]
            .iter()
            .all(|d| *d >= Duration::from_secs(30) && *d <= Duration::from_secs(62)),
        "{what} capped at 60 s, jittered: {g:?}"
    );
}

/// A join that keeps failing (an error or an `admitted: false` answered at once) is retried
/// 2 s, 4 s, 8 s … up to 60 s apart (jittered down to half), not every poll.
async fn a_failing_join_backs_off(answer: Join) {
    let node = NodeDir::new();
    let fake = Fake::default();
    let c = gid(C);
    fake.with(|w| {
        w.join_script = vec![answer];
        w.assignments.insert(c);
    });
    let running = fake.run(node.config(""));
    tokio::time::sleep(Duration::from_secs(600)).await;
    backed_off_over_600_s("fleet-joins", &join_times(&fake));

    // Withdrawn for 5 s and assigned again (flapping): the back-off is kept, so no retries
    // 2 s apart follow.
    fake.with(|w| w.assignments.clear());
    tokio::time::sleep(Duration::from_secs(5)).await;
    fake.with(|w| {
        w.assignments.insert(c);
        w.joins.clear();
    });
    tokio::time::sleep(Duration::from_secs(8)).await;
    let kept = join_times(&fake);
    assert!(kept.len() <= 1, "kept across a flip: {kept:?}");

    // Not assigned for a minute past its wait (≤ 60 s): the retry state is dropped, and a
    // new assignment starts at 2 s.
    fake.with(|w| w.assignments.clear());
    tokio::time::sleep(Duration::from_secs(125)).await;
    fake.with(|w| {
        w.assignments.insert(c);
        w.joins.clear();
    });
    tokio::time::sleep(Duration::from_secs(8)).await;
    let again = join_times(&fake);
    assert!(again.len() >= 2, "restarted at 2 s: {:?}", gaps(&again));
    assert!(
        gaps(&again)[0] <= Duration::from_secs(3),
        "{:?}",
        gaps(&again)
    );

    // A success resets it too: the state is gone, so the next failure waits 2 s again.
    fake.with(|w| w.join_script = vec![Join::Admitted]);
    tokio::time::sleep(Duration::from_secs(70)).await;
    assert!(fake.with(|w| w.held.contains(&c)));
    running.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_join_failing_with_an_error_backs_off_to_60_s() {
    a_failing_join_backs_off(Join::Error).await;
}

#[tokio::test(start_paused = true)]
async fn admitted_false_answered_at_once_backs_off_the_same_way() {
    a_failing_join_backs_off(Join::NotAdmitted).await;
}

/// A join task that dies without an outcome (it panicked) is a failed attempt too.
#[tokio::test(start_paused = true)]
async fn a_join_task_that_panics_backs_off_the_same_way() {
    a_failing_join_backs_off(Join::Panic).await;
}

/// Replaces the state file's directory by a regular file (root cannot create a file under a
/// regular file either), returning where the directory went.
fn break_state_dir(dir: &std::path::Path) -> std::path::PathBuf {
    let aside = dir.with_extension("aside");
    std::fs::rename(dir, &aside).unwrap();
    std::fs::write(dir, b"not a directory").unwrap();
    aside
}

fn mend_state_dir(dir: &std::path::Path, aside: &std::path::Path) {
    std::fs::remove_file(dir).unwrap();
    std::fs::rename(aside, dir).unwrap();
}

/// A daemon 3 s into running with A assigned, held and confirmed, its state file alone in
/// a directory of its own (so the directory can be broken); returns that directory.
async fn holding_a_with_its_own_state_dir(node: &NodeDir) -> (Fake, Running, std::path::PathBuf) {
    let state_dir = node.dir.path().join("state");
    std::fs::create_dir(&state_dir).unwrap();
    let state_file = state_dir.join("state.json");
    let a = gid(A);
    save_state(&state_file, &[a].into(), &[a].into());
    let fake = Fake::default();
    fake.with(|w| {
        w.held.insert(a);
        w.assignments.insert(a);
    });
    let cfg = Config {
        state_file,
        ..node.config(REFERENCE)
    };
    let running = fake.run(cfg);
    tokio::time::sleep(Duration::from_secs(3)).await;
    (fake, running, state_dir)
}

#[tokio::test(start_paused = true)]
async fn no_leave_starts_while_the_state_cannot_be_written_and_readyz_says_so() {
    let node = NodeDir::new();
    let (fake, running, state_dir) = holding_a_with_its_own_state_dir(&node).await;
    let state_file = state_dir.join("state.json");
    let a = gid(A);
    let ready = || {
        running
            .telemetry
            .snapshot()
            .readiness(fleet_sidecar::daemon::unix_now(), Duration::from_secs(30))
    };
    assert_eq!(ready(), Ok(()));

    let aside = break_state_dir(&state_dir);
    fake.with(|w| w.assignments.clear());
    tokio::time::sleep(Duration::from_secs(20)).await;
    assert!(
        fake.with(|w| w.leaves.is_empty()),
        "no irreversible leave while its outcome cannot be recorded"
    );
    let why = ready().unwrap_err();
    assert!(why.to_string().contains("state file"), "{why}");

    mend_state_dir(&state_dir, &aside);
    // The failing write is tried again with back-off: after 20 s of failures the next try
    // comes at most 60 s (+ a poll) later.
    tokio::time::sleep(Duration::from_secs(62)).await;
    assert_eq!(
        fake.with(|w| w.leaves.iter().map(|(g, _)| *g).collect::<Vec<_>>()),
        vec![a],
        "the leave proceeds once it can be recorded"
    );
    assert_eq!(ready(), Ok(()));
    running.stop().await;
    let state = StateStore::new(&state_file).load().unwrap().unwrap();
    assert!(state.admitted.is_empty(), "{state:?}");
}

/// `fleet_sidecar_{family}_total{outcome}` as the daemon exports it.
fn counter(running: &Running, family: &str, outcome: &str) -> u64 {
    let series = format!("fleet_sidecar_{family}_total{{outcome=\"{outcome}\"}}");
    metric(&running.telemetry.encode_metrics(), &series) as u64
}

/// A state write that keeps failing is tried again 2 s, 4 s, 8 s … up to 60 s apart
/// (jittered down to half), not every poll; the first write after the disk mends is
/// counted as ok and the held leave goes ahead.
#[tokio::test(start_paused = true)]
async fn a_failing_state_write_backs_off_to_60_s() {
    let node = NodeDir::new();
    let (fake, running, state_dir) = holding_a_with_its_own_state_dir(&node).await;
    let a = gid(A);
    assert_eq!(counter(&running, "state_writes", "error"), 0);

    // The withdrawal changes the state (absence counts) every poll; none of it can be written.
    let aside = break_state_dir(&state_dir);
    fake.with(|w| w.assignments.clear());
    tokio::time::sleep(Duration::from_secs(600)).await;
    let failed = counter(&running, "state_writes", "error");
    // ≥ 2+2+4+8+16 s then ≤ 60 s apart: ≥ 10 tries; ≤ 2+4+8+16+32 s then ≥ 30 s: ≤ 24.
    assert!(
        (10..=24).contains(&failed),
        "{failed} failed state writes in 600 s (one a poll would be 600)"
    );
    assert!(fake.with(|w| w.leaves.is_empty()));

    let ok_before = counter(&running, "state_writes", "ok");
    mend_state_dir(&state_dir, &aside);
    tokio::time::sleep(Duration::from_secs(62)).await;
    assert!(counter(&running, "state_writes", "ok") > ok_before);
    assert_eq!(
        counter(&running, "state_writes", "error"),
        failed,
        "no failure once mended"
    );
    assert_eq!(
        fake.with(|w| w.leaves.iter().map(|(g, _)| *g).collect::<Vec<_>>()),
        vec![a]
    );
    running.stop().await;
}

/// A leave that keeps failing (merod errs and still lists the namespace) is retried 2 s,
/// 4 s, 8 s … up to 60 s apart, not every poll; the status says it is backing off; MDMA
/// assigning it again for a minute past the wait drops the retry state (a brief
/// re-assignment does not), and a leave that finally succeeds is recorded.
#[tokio::test(start_paused = true)]
async fn a_failing_leave_backs_off_to_60_s() {
    let node = NodeDir::new();
    // B stays assigned, so withdrawing A is not a withdrawal of everything held (a mass
    // withdrawal, held whatever the count).
    let (a, b) = (gid(A), gid(B));
    save_state(&node.state_file(), &[a, b].into(), &[a, b].into());
    let fake = Fake::default();
    fake.with(|w| {
        w.held.extend([a, b]);
        w.assignments.insert(b);
        w.leave_script = vec![false];
    });
    let running = fake.run(node.config(REFERENCE));
    let leave_times = || fake.with(|w| w.leaves.iter().map(|(_, t)| *t).collect::<Vec<_>>());
    tokio::time::sleep(Duration::from_secs(600)).await;
    backed_off_over_600_s("leaves", &leave_times());
    // The status shows it backing off, or its leave running (when a retry started in the
    // very cycle of this instant: then it is in `leaving`, not among the pending leaves).
    let status = running.telemetry.snapshot();
    let why = status.pending_leaves.get(&a);
    assert!(
        why.is_some_and(|w| w.contains("back-off") || w.contains("running"))
            || status.leaving.contains(&a),
        "{:?} {:?}",
        status.pending_leaves,
        status.leaving
    );

    // Assigned again for 5 s, then withdrawn again (flapping): the back-off is kept, so
    // no retries 2 s apart follow.
    fake.with(|w| w.assignments.insert(a));
    tokio::time::sleep(Duration::from_secs(5)).await;
    fake.with(|w| {
        w.assignments.remove(&a);
        w.leaves.clear();
    });
    tokio::time::sleep(Duration::from_secs(8)).await;
    let kept = leave_times();
    assert!(kept.len() <= 1, "kept across a flip: {kept:?}");

    // Assigned again for a minute past its wait (≤ 60 s), then withdrawn again: the retry
    // state was dropped, so the first retry comes 2–3 s after the first failure again.
    fake.with(|w| w.assignments.insert(a));
    tokio::time::sleep(Duration::from_secs(125)).await;
    fake.with(|w| {
        w.assignments.remove(&a);
        w.leaves.clear();
    });
    tokio::time::sleep(Duration::from_secs(8)).await;
    let again = leave_times();
    assert!(again.len() >= 2, "restarted at 2 s: {:?}", gaps(&again));
    assert!(
        gaps(&again)[0] <= Duration::from_secs(3),
        "{:?}",
        gaps(&again)
    );

    fake.with(|w| w.leave_script = vec![true]);
    tokio::time::sleep(Duration::from_secs(70)).await;
    assert!(fake.with(|w| !w.held.contains(&a) && w.violations.is_empty()));
    running.stop().await;
    let state = StateStore::new(node.state_file()).load().unwrap().unwrap();
    assert_eq!(state.admitted, [b].into(), "{state:?}");
}

/// The crash window between merod admitting a namespace and the state recording it: a join
/// is recorded (`joining`) before it is sent, so whatever happens next the namespace is
/// known. Here a join hangs (merod may admit it meanwhile) and the daemon stops; the next
/// start finds it joining, and once MDMA withdraws it, leaves it if merod holds it and
/// drops it without a leave call if merod does not.
#[tokio::test(start_paused = true)]
async fn a_join_whose_outcome_was_never_recorded_is_left_when_withdrawn() {
    for merod_holds in [true, false] {
        let node = NodeDir::new();
        let (c, d) = (gid(C), gid(D));
        let fake = Fake::default();
        fake.with(|w| {
            w.assignments.insert(c);
            w.join_script = vec![Join::Hang];
        });
        let running = fake.run(node.config(REFERENCE));
        tokio::time::sleep(Duration::from_secs(8)).await;
        assert_eq!(fake.with(|w| w.joins.len()), 1, "the join hangs");
        let on_disk = || StateStore::new(node.state_file()).load().unwrap().unwrap();
        assert_eq!(on_disk().joining, [c].into(), "recorded before it was sent");
        assert!(on_disk().admitted.is_empty());
        running.stop().await;
        assert_eq!(
            on_disk().joining,
            [c].into(),
            "a join cut at shutdown stays joining"
        );

        // merod went on and admitted it (or not); MDMA now wants D instead.
        let fake = Fake::default();
        fake.with(|w| {
            if merod_holds {
                w.held.insert(c);
            }
            w.assignments.insert(d);
        });
        let running = fake.run(node.config(REFERENCE));
        tokio::time::sleep(Duration::from_secs(8)).await;
        let left: Vec<GroupId> = fake.with(|w| w.leaves.iter().map(|(g, _)| *g).collect());
        if merod_holds {
            assert_eq!(left, vec![c], "withdrawn while merod may hold it: left");
        } else {
            assert!(
                left.is_empty(),
                "merod never held it: no leave call, {left:?}"
            );
        }
        let (held, not_held) = (u64::from(merod_holds), u64::from(!merod_holds));
        assert_eq!(counter(&running, "leaves", "left"), held);
        assert_eq!(counter(&running, "leaves", "not_held"), not_held);
        assert!(fake.with(|w| !w.held.contains(&c) && w.violations.is_empty()));
        running.stop().await;
        let state = on_disk();
        assert!(state.joining.is_empty(), "{state:?}");
        assert_eq!(state.admitted, [d].into(), "{state:?}");
        assert_eq!(state.confirmed, [d].into(), "{state:?}");
    }
}

/// merod admits a namespace but its membership answer lags (merod's own 404 while its list
/// has it), and MDMA withdraws it meanwhile: the namespace is still left, not dropped from
/// the state without a leave while merod holds it (its keys would never be purged).
#[tokio::test(start_paused = true)]
async fn a_withdrawn_join_whose_membership_answer_lags_is_left_not_forgotten() {
    let node = NodeDir::new();
    let (b, c) = (gid(B), gid(C));
    save_state(&node.state_file(), &[b].into(), &[b].into());
    let fake = Fake::default();
    fake.with(|w| {
        w.held.insert(b);
        w.assignments.extend([b, c]);
        w.membership_lags.insert(c);
    });
    let running = fake.run(node.config(REFERENCE));
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert!(fake.with(|w| w.held.contains(&c)), "merod admitted it");
    let on_disk = || StateStore::new(node.state_file()).load().unwrap().unwrap();
    assert_eq!(
        on_disk().joining,
        [c].into(),
        "not admitted by the loop yet"
    );
    fake.with(|w| w.assignments.remove(&c));
    tokio::time::sleep(Duration::from_secs(10)).await;
    let left: Vec<GroupId> = fake.with(|w| w.leaves.iter().map(|(g, _)| *g).collect());
    assert_eq!(left, vec![c], "merod holds it: a leave is sent");
    assert!(fake.with(|w| !w.held.contains(&c) && w.violations.is_empty()));
    assert_eq!(counter(&running, "leaves", "not_held"), 0);
    running.stop().await;
    let state = on_disk();
    assert!(state.joining.is_empty(), "{state:?}");
    assert_eq!(state.admitted, [b].into(), "{state:?}");
}
