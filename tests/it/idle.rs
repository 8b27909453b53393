//! The idle daemon as shipped (the binary on its own runtime, every namespace confirmed):
//! how often it wakes. An idle poll's CPU was measured to be mostly wake-ups around the
//! poll, not the poll's work; this pins their count, not a time.

use std::time::Duration;

use fleet_sidecar::testing::mdma::PollReply;
use fleet_sidecar::testing::sandbox::Sandbox;

use crate::common::*;

const LIMIT: Duration = Duration::from_secs(20);
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
    assert!(sb.mdma.wait_for_polls(2, LIMIT).await, "the daemon polls");
    let (_, before) = threads_and_wake_ups(pid);
    let from = sb.mdma.polls().len();
    tokio::time::sleep(Duration::from_secs(6)).await;
    let (_, after) = threads_and_wake_ups(pid);
    let polls = sb.mdma.polls().len() - from;
    // The threads are counted once the start-up's blocking work has aged out: the jobs
    // that start with the daemon (the MRTD read, each job's first look at its files) may
    // each take a blocking-pool thread at once, and an idle one lingers for tokio's keep-
    // alive (10 s). Later, one idle pool thread serves them all in turn.
    tokio::time::sleep(BLOCKING_KEEP_ALIVE.saturating_sub(spawned.elapsed())).await;
    let (threads, _) = threads_and_wake_ups(pid);
    let _ = child.kill();
    let _ = child.wait();
    assert!(polls >= 4, "{polls} polls in 6 s");
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
