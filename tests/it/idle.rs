//! The idle daemon as shipped (the binary on its own runtime, every namespace confirmed):
//! how often it wakes. An idle poll's CPU was measured to be mostly wake-ups around the
//! poll, not the poll's work; this pins their count, not a time.

use std::time::Duration;

use fleet_sidecar::testing::mdma::PollReply;
use fleet_sidecar::testing::sandbox::Sandbox;

use crate::common::*;

const LIMIT: Duration = Duration::from_secs(20);
/// Poll cycles counted (1 s each: the sandbox's `poll_interval`).
const POLLS: usize = 12;
/// Half the sandbox's `poll_interval`.
const HALF_A_CYCLE: Duration = Duration::from_millis(500);
/// Past tokio's keep-alive of an idle blocking-pool thread (10 s), with a margin.
const BLOCKING_KEEP_ALIVE: Duration = Duration::from_secs(12);

/// The process's threads and the times they blocked (voluntary context switches), summed
/// over `/proc/PID/task/*/status`.
fn threads_and_wake_ups(pid: u32) -> (usize, u64) {
    let mut threads = 0;
    let mut switches = 0;
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).expect("the daemon runs") {
        let Ok(status) = std::fs::read_to_string(task.expect("task").path().join("status")) else {
            continue; // a thread that just ended
        };
        threads += 1;
        switches += status
            .lines()
            .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))
            .and_then(|v| v.trim().parse::<u64>().ok())
            .expect("voluntary_ctxt_switches in /proc/PID/task/TID/status");
    }
    (threads, switches)
}

/// One thread sleeps between polls and wakes for the poll's timer and its answer: about
/// three wake-ups a poll (the multi-thread runtime took ~14, a separate liveness timer 2
/// more), whatever the load, since a count of blocking waits does not depend on speed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_idle_binary_wakes_about_three_times_a_poll() {
    let sb = Sandbox::start(None).await.unwrap();
    sb.merod.hold(C);
    seed(&sb, &[C], &[C]);
    sb.mdma.set_reply(PollReply::assign([C]));
    let cfg = sb.write_config("").unwrap();
    let spawned = std::time::Instant::now();
    let mut child = spawn_daemon(&cfg, false, &[]);
    let pid = child.id();
    // Counted over whole poll cycles: each edge half a cycle after MDMA saw a poll, when
    // the daemon sleeps, so no poll's wake-ups are cut in two at either edge (a window of a
    // fixed time, ending anywhere in a cycle, moved the figure by a poll's worth).
    let quiet_after = |polls: usize| {
        let mdma = &sb.mdma;
        async move {
            assert!(mdma.wait_for_polls(polls, LIMIT).await, "the daemon polls");
            tokio::time::sleep(HALF_A_CYCLE).await;
            threads_and_wake_ups(pid).1
        }
    };
    let before = quiet_after(2).await;
    let after = quiet_after(2 + POLLS).await;
    // The threads are counted once the start-up's blocking work has aged out: the jobs
    // that start with the daemon (the MRTD read, each job's first look at its files) may
    // each take a blocking-pool thread at once, and an idle one lingers for tokio's keep-
    // alive (10 s). Later, one idle pool thread serves them all in turn.
    tokio::time::sleep(BLOCKING_KEEP_ALIVE.saturating_sub(spawned.elapsed())).await;
    let (threads, _) = threads_and_wake_ups(pid);
    let _ = child.kill();
    let _ = child.wait();
    let polls = POLLS;
    let per_poll = (after - before) as f64 / polls as f64;
    assert!(
        per_poll <= 4.5,
        "{per_poll:.1} wake-ups a poll ({} over {polls} polls)",
        after - before
    );
    // The runtime's thread, the blocking pool's if the MRTD read's is still idling, and
    // the log writers of stderr and the log file (asleep while nothing is logged: their
    // wake-ups are in the count above).
    assert!(threads <= 4, "{threads} threads");
}
