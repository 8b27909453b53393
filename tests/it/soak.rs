//! Soak: the real loop (`daemon::run`, real HTTP clients) against the emulators for many
//! cycles with faults injected at random (failed and hung polls, failing and hanging joins,
//! refused admissions, failing leaves and confirms), watching the daemon's memory and file
//! descriptors.
//!
//! The daemon runs in a child process (this test binary re-run with `FLEET_SOAK_CHILD` set,
//! executing only [`soak_child`]) so that its RSS (`/proc/PID/status` VmRSS) and fd count
//! (`/proc/PID/fd`) are its own, not the emulators' growing call records. The child takes
//! its config from the file like the binary, then shortens `poll_interval` and
//! `max_backoff` to 1 ms so that cycles follow each other at HTTP speed; a cycle is one
//! poll MDMA received.
//!
//! Checked: RSS sampled every 1,000 cycles does not grow by more than 1 MiB after warm-up
//! (the first 20% of the run, at least 1,000 cycles); the fd count, at its busiest and at
//! rest after the run, stays within a few of the warm-up's (connections in flight); no leave
//! of an assigned namespace (as in the crash test), the state file parses with
//! `confirmed ⊆ admitted`, and the node converges to MDMA's final assignment.
//!
//! `FLEET_SOAK_CYCLES` sets the cycle count (default 2,000 for CI; `scripts/soak.sh` runs
//! 100,000 and plots the curve); `FLEET_SOAK_CSV` names a file for the samples
//! (cycle, seconds, rss_kib, fds); `FLEET_SOAK_SEED` replays a run.

use std::collections::BTreeSet;
use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use fleet_sidecar::daemon::{self, Deps};
use fleet_sidecar::testing::mdma::PollReply;
use fleet_sidecar::testing::merod::{JoinBehaviour, LeaveBehaviour};
use fleet_sidecar::testing::sandbox::Sandbox;
use fleet_sidecar::Config;
use fleet_sidecar::MdmaClient;
use fleet_sidecar::MerodClient;
use tokio_util::sync::CancellationToken;

use crate::common::*;
use crate::crash::{calm, check_leaves, check_state_file, env_num, switch_reply, Phases};

const IDS: [&str; 4] = [A, B, C, D];
const SAMPLE_EVERY: usize = 1_000;

/// VmRSS of `pid` in KiB.
fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS line")
}

fn fd_count(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("proc fd")
        .count()
}

/// The daemon side: runs only as the child the soak test starts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the soak test's child process; runs only under it"]
async fn soak_child() {
    let (Ok(config), Ok(merod)) = (
        std::env::var("FLEET_SOAK_CHILD"),
        std::env::var("FLEET_SOAK_MEROD"),
    ) else {
        return;
    };
    let mut cfg = Config::load(config.as_ref()).expect("soak config");
    // Below the config file's bounds on purpose, set on the struct: 100,000 cycles in minutes.
    cfg.poll_interval = Duration::from_millis(1);
    cfg.max_backoff = Duration::from_millis(1);
    cfg.join_timeout = Duration::from_secs(1);
    let mdma = MdmaClient::new(&cfg.mdma_url, None, None).expect("MDMA client");
    let merod = MerodClient::new(&merod.parse().expect("merod URL")).expect("merod client");
    let deps = Deps::new(Arc::new(mdma), Arc::new(merod));
    daemon::run(cfg, deps, CancellationToken::new())
        .await
        .expect("the daemon runs until killed");
}

/// One random fault (or the clearing of faults, or a new assignment) for the next stretch.
fn inject(sb: &Sandbox, rng: &mut fastrand::Rng, phases: &Phases) {
    let pick = |rng: &mut fastrand::Rng| IDS[rng.usize(..IDS.len())];
    let mut reply = None;
    match rng.u32(..1000) {
        // A hung poll costs the daemon its 11 s poll deadline: rare.
        0..=2 => sb.mdma.queue_replies([PollReply::Hang]),
        3..=99 => reply = Some(PollReply::Status(if rng.bool() { 503 } else { 500 })),
        100..=199 => sb.merod.set_join(
            pick(rng),
            JoinBehaviour::Error {
                status: 500,
                message: "Failed to generate attestation".to_owned(),
            },
        ),
        200..=249 => sb.merod.set_join(pick(rng), JoinBehaviour::Hang),
        250..=299 => sb.merod.set_join(
            pick(rng),
            JoinBehaviour::RefuseThenAdmit {
                refusals: rng.u32(1..3),
                delay: Duration::ZERO,
            },
        ),
        300..=399 => sb
            .merod
            .set_default_leave(LeaveBehaviour::Error { status: 500 }),
        400..=499 => sb.mdma.fail_next_confirms(pick(rng), rng.u32(1..4)),
        500..=599 => {
            for id in IDS {
                sb.merod.set_join(id, JoinBehaviour::default());
            }
            sb.merod.set_default_leave(LeaveBehaviour::default());
        }
        _ => {
            let assigned: Vec<&str> = IDS.iter().copied().filter(|_| rng.bool()).collect();
            reply = Some(PollReply::assign(assigned));
        }
    }
    if let Some(reply) = reply {
        switch_reply(sb, phases, reply);
    }
}

// Not in the default run: at the 2,000 cycles CI could afford, the RSS window is allocator
// warm-up rather than a leak signal (+1.8 MiB between cycles 1,000 and 2,000 in one run), and
// at a 1 ms cadence a leave in flight can reach merod after a newer poll re-assigned the
// namespace, which the leave check counts against it. `scripts/soak.sh` runs it at 100,000
// cycles (RELIABILITY.md).
#[ignore = "long soak: run by scripts/soak.sh (RELIABILITY.md)"]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn soak_the_loop_with_random_faults() {
    let cycles = env_num("FLEET_SOAK_CYCLES").unwrap_or(2_000) as usize;
    let seed = env_num("FLEET_SOAK_SEED").unwrap_or_else(|| fastrand::u64(..));
    eprintln!("soak: {cycles} cycles, FLEET_SOAK_SEED={seed}");
    let mut csv = std::env::var("FLEET_SOAK_CSV").ok().map(|p| {
        let mut f = std::fs::File::create(p).expect("CSV file");
        writeln!(f, "cycle,seconds,rss_kib,fds").unwrap();
        f
    });
    let sb = Sandbox::start(None).await.unwrap();
    let cfg = sb
        .write_config("leave_after_polls = 2\nleave_grace = \"0s\"\nmass_drop_min = 1000\nmass_drop_hold = \"1s\"\nmax_leaves_per_minute = 1000\nmax_leaves_per_hour = 1000\njoin_timeout = \"10s\"\nleave_timeout = \"1s\"")
        .unwrap();
    let phases: Phases = Arc::new(Mutex::new(vec![(Instant::now(), Some(BTreeSet::new()))]));
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["soak::soak_child", "--exact", "--ignored", "--quiet"])
        .env("FLEET_SOAK_CHILD", &cfg)
        .env("FLEET_SOAK_MEROD", sb.merod.url().as_str())
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("the soak child starts");
    let pid = child.id();

    let mut rng = fastrand::Rng::with_seed(seed);
    let started = Instant::now();
    let warm_up = (cycles / 5).max(SAMPLE_EVERY);
    let mut samples: Vec<(usize, u64, usize)> = Vec::new();
    let mut done = 0;
    while done < cycles {
        // A new fault every 10–100 cycles.
        let next = (done + rng.usize(10..100)).min(cycles);
        assert!(
            sb.mdma.wait_for_polls(next, Duration::from_secs(60)).await,
            "the loop stalled before cycle {next}"
        );
        if next / SAMPLE_EVERY > done / SAMPLE_EVERY || next == cycles {
            let sample = (next, rss_kib(pid), fd_count(pid));
            if let Some(f) = csv.as_mut() {
                writeln!(
                    f,
                    "{},{:.1},{},{}",
                    sample.0,
                    started.elapsed().as_secs_f64(),
                    sample.1,
                    sample.2
                )
                .unwrap();
            }
            samples.push(sample);
        }
        done = next;
        inject(&sb, &mut rng, &phases);
    }
    let elapsed = started.elapsed();

    // Calm: faults cleared, MDMA settles on {B, D}; the node must converge to it (a
    // namespace whose joins or leaves kept failing may first wait out a backoff of up to 60 s).
    calm(&sb, &phases, &[B, D]);
    eventually(
        "the node holds, admits and confirms exactly {B, D}",
        Duration::from_secs(180),
        || {
            let state = load(&sb);
            sb.merod.held() == strings(&[B, D])
                && state.admitted == set(&[B, D])
                && state.confirmed == set(&[B, D])
        },
    )
    .await;
    // Open fds at rest (no join or leave in flight; idle pooled connections may remain).
    let rest_fds = fd_count(pid);
    let _ = child.kill();
    let _ = child.wait();
    check_state_file(&sb);
    check_leaves(&sb, &phases);

    let after: Vec<_> = samples.iter().filter(|s| s.0 >= warm_up).collect();
    let base = after.first().expect("samples after warm-up");
    let max_rss = after.iter().map(|s| s.1).max().unwrap();
    let max_fds = after.iter().map(|s| s.2).max().unwrap();
    let warm_up_fds = samples
        .iter()
        .filter(|s| s.0 < warm_up)
        .map(|s| s.2)
        .max()
        .unwrap_or(base.2);
    let calls = sb.merod.calls();
    let count = |suffix: &str| calls.iter().filter(|c| c.path.ends_with(suffix)).count();
    let failed_polls = sb.mdma.polls().iter().filter(|p| p.status != 200).count();
    eprintln!(
        "soak: {cycles} cycles in {:.1} s; RSS {} KiB at cycle {} -> max {} KiB after warm-up (+{} KiB), final {} KiB; fds {} -> max {}, {rest_fds} at rest (warm-up max {warm_up_fds}); {failed_polls} failed polls, {} fleet-joins, {} leaves, {} confirms",
        elapsed.as_secs_f64(),
        base.1,
        base.0,
        max_rss,
        max_rss - base.1,
        samples.last().unwrap().1,
        base.2,
        max_fds,
        count("/fleet-join"),
        count("/leave"),
        sb.mdma.confirms().len(),
    );
    assert!(
        max_rss <= base.1 + 1024,
        "RSS grew by {} KiB after warm-up: {samples:?}",
        max_rss - base.1
    );
    // In-flight joins and leaves hold connections (up to max_concurrent_joins hung joins
    // and a leave or two), so the count moves with the faults; a leak shows as growth at
    // rest and beyond the busiest warm-up moment plus that headroom.
    assert!(
        rest_fds <= warm_up_fds + 2 && max_fds <= warm_up_fds + 6,
        "fds: {rest_fds} at rest, {max_fds} at most after warm-up, {warm_up_fds} at most during it: {samples:?}"
    );
}
