//! The workloads of the instruction-count check (`scripts/cost-check.sh`, run by `.ci/run`
//! under callgrind): `cargo run --release --example cycle-cost -- SCENARIO [ROUNDS]`.
//!
//! - `idle-3`, `idle-10000`: an idle cycle (`Sidecar::cycle`) at 3 or 10,000 namespaces, all
//!   held and confirmed, MDMA repeating the same answer;
//! - `idle-10000x8`: an idle cycle at 10,000 namespaces whose assignments carry 8 admitter
//!   addresses each (about 9.5 MB), MDMA repeating the same answer: the fleet's real idle poll;
//! - `accept-10000x8`: a cycle whose answer differs from the one before (two answers of the
//!   same 10,000 assignments with 8 admitter addresses each, taking turns: each is read and
//!   validated whole), the fleet's real answer;
//! - `walk-1000`: the jobs that walk merod (the context inventory and the recovery
//!   envelopes, one walk for both: `TreeJobs`) at 1,000 namespaces of 3 members and a
//!   context each, nothing changed: a whole walk (every 15 minutes) and the pass taking it;
//! - `scan-1000`: the same between whole walks, nothing changed: one scan (merod's usage,
//!   nothing walked) and one pass;
//! - `scan-1000-one`: one namespace gained a context before the scan: it alone is walked
//!   and reported, and its 3 envelopes sealed and written.
//!
//! The daemon (or the jobs) runs on the main thread (a current-thread runtime: its loop and the jobs it
//! spawns), the in-process emulators on a runtime of their own on another thread, so only the
//! daemon's side of each HTTP call is counted (callgrind counts a thread only while it is
//! inside `measured`; work the daemon hands to blocking threads, file writes, is not). It is
//! set up and warmed up first; then ROUNDS cycles (default 5) run inside `measured`, so the
//! counts depend neither on the set-up nor on the machine's load.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use fleet_sidecar::daemon::{Sidecar, Telemetry, TreeJobs};
use fleet_sidecar::testing::mdma::{fleet_answer_for, PollReply};
use fleet_sidecar::testing::merod::ACCOUNT_ID;
use fleet_sidecar::testing::sandbox::{Sandbox, PEER_ID};
use fleet_sidecar::{GroupId, State, StateStore};
use tokio_util::sync::CancellationToken;

type Error = Box<dyn std::error::Error + Send + Sync>;

/// What MDMA answers each poll: always the same body, or two bodies taking turns.
enum Answers {
    Same(PollReply),
    Alternating([String; 2]),
}

/// The cycles counted: kept out of line so callgrind can toggle collection on its name.
#[inline(never)]
fn measured(
    rt: &tokio::runtime::Runtime,
    sb: &Sandbox,
    sidecar: &mut Sidecar,
    answers: &Answers,
    rounds: usize,
) {
    rt.block_on(async {
        for round in 0..rounds {
            if let Answers::Alternating(bodies) = answers {
                sb.mdma
                    .set_reply(PollReply::RawBody(bodies[round % 2].clone()));
            }
            std::hint::black_box(sidecar.cycle().await);
        }
    });
}

/// What is counted of the jobs that walk merod, each round.
#[derive(Clone, Copy)]
enum Walk {
    /// A whole walk, nothing changed.
    Whole,
    /// A scan between whole walks, nothing changed.
    Quiet,
    /// A scan after one namespace gained a context.
    OneChanged,
}

/// The rounds of the jobs counted: kept out of line so callgrind can toggle collection on
/// its name.
#[inline(never)]
fn measured_jobs(
    rt: &tokio::runtime::Runtime,
    sb: &Sandbox,
    jobs: &mut TreeJobs,
    ids: &[String],
    walk: Walk,
    rounds: usize,
) -> Result<(), Error> {
    rt.block_on(async {
        for (round, id) in ids.iter().enumerate().take(rounds) {
            match walk {
                Walk::Whole => jobs.walk_whole_next(),
                Walk::Quiet => {}
                Walk::OneChanged => {
                    let contexts = [format!("ctx{round}"), format!("new{round}")];
                    sb.merod.set_contexts(id, &contexts);
                }
            }
            std::hint::black_box(jobs.scan().await?);
            std::hint::black_box(jobs.pass().await?);
        }
        Ok(())
    })
}

/// The emulators on a runtime of their own (another thread), their sandbox, and the
/// current-thread runtime the counted side runs on.
fn runtimes() -> Result<(tokio::runtime::Runtime, Sandbox, tokio::runtime::Runtime), Error> {
    let emulators = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let sb = emulators.block_on(Sandbox::start(None))?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    Ok((emulators, sb, rt))
}

/// The walking jobs at `n` namespaces of 3 members: set up, first pass done (every
/// envelope written, the inventory reported in full), then `rounds` counted.
fn jobs_cost(n: usize, walk: Walk, rounds: usize) -> Result<(), Error> {
    // The emulators serve as long as their runtime lives.
    let (_emulators, sb, rt) = runtimes()?;
    let ids = sb.hold_with_members(n);
    let confirmed: BTreeSet<GroupId> = ids.iter().map(|id| id.parse()).collect::<Result<_, _>>()?;
    let cfg = sb.config("")?;
    let deps = sb.deps(&cfg)?;
    let mut jobs = TreeJobs::new(
        &cfg,
        &deps,
        PEER_ID.parse()?,
        ACCOUNT_ID.to_owned(),
        &confirmed,
    )
    .ok_or("the sandbox's deps have no inventory or recovery clients")?;
    rt.block_on(async {
        jobs.scan().await?;
        let written = jobs.pass().await?;
        if written != 3 * n {
            return Err(format!("the first pass wrote {written} envelopes, not {}", 3 * n).into());
        }
        // Warm: a quiet scan and pass, as in the steady state.
        jobs.scan().await?;
        jobs.pass().await?;
        Ok::<_, Error>(())
    })?;
    measured_jobs(&rt, &sb, &mut jobs, &ids, walk, rounds)
}

/// Waits (at most 3 minutes) until merod's namespaces have been read whole and no read
/// has touched their list for [`QUIET`]. At start-up the refresh reads at once and again
/// when the readiness watch first sees merod answer, at least 5 s (`HELD_MIN_GAP`) after the
/// first read started; under valgrind, which runs one thread at a time, a read of 10,000
/// takes seconds, so a fixed sleep let part of the second land in the counted cycles, by a
/// share that moved from run to run.
async fn settle_held_reads(sb: &Sandbox, telemetry: &Telemetry, n: usize) -> Result<(), Error> {
    const QUIET: Duration = Duration::from_secs(8);
    let give_up = Instant::now() + Duration::from_secs(180);
    loop {
        let read_whole = telemetry
            .snapshot()
            .held_namespaces
            .is_some_and(|held| held.count == n);
        let last_list = sb
            .merod
            .calls()
            .iter()
            .filter(|c| c.path == "/admin-api/namespaces")
            .map(|c| c.at)
            .max();
        if read_whole && last_list.is_some_and(|at| at.elapsed() >= QUIET) {
            return Ok(());
        }
        if Instant::now() > give_up {
            return Err("merod's namespaces were not read and quiet within 3 minutes".into());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn main() -> Result<(), Error> {
    let mut args = std::env::args().skip(1);
    let scenario = args
        .next()
        .ok_or("usage: cycle-cost idle-3|idle-10000|idle-10000x8|accept-10000x8|walk-1000|scan-1000|scan-1000-one [ROUNDS]")?;
    let rounds: usize = args.next().map(|r| r.parse()).transpose()?.unwrap_or(5);
    let walk = match scenario.as_str() {
        "walk-1000" => Some(Walk::Whole),
        "scan-1000" => Some(Walk::Quiet),
        "scan-1000-one" => Some(Walk::OneChanged),
        _ => None,
    };
    if let Some(walk) = walk {
        jobs_cost(1000, walk, rounds)?;
        println!("{scenario}: {rounds} rounds");
        return Ok(());
    }
    let (n, admitters, alternate) = match scenario.as_str() {
        "idle-3" => (3, 0, false),
        "idle-10000" => (10_000, 0, false),
        "idle-10000x8" => (10_000, 8, false),
        "accept-10000x8" => (10_000, 8, true),
        other => return Err(format!("unknown scenario {other:?}").into()),
    };
    let ids: Vec<String> = (0..n)
        .map(|i| format!("{:064x}", 0xf1ee_u128 << 64 | i as u128))
        .collect();
    let held: BTreeSet<GroupId> = ids.iter().map(|id| id.parse()).collect::<Result<_, _>>()?;
    let answers = if admitters == 0 {
        Answers::Same(PollReply::assign(ids.clone()))
    } else if !alternate {
        Answers::Same(PollReply::RawBody(fleet_answer_for(&ids, admitters)))
    } else {
        // The same assignments; the second answer also retains nothing explicitly, a
        // byte-level change the gate reads whole.
        let body = fleet_answer_for(&ids, admitters);
        let other = body.replacen(r#""retain":[]"#, r#""retain":[],"note":1"#, 1);
        Answers::Alternating([body, other])
    };
    // The emulators serve as long as their runtime lives.
    let (_emulators, sb, rt) = runtimes()?;
    let mut sidecar = rt.block_on(async {
        for id in &ids {
            sb.merod.hold(id);
        }
        match &answers {
            Answers::Same(reply) => sb.mdma.set_reply(reply.clone()),
            Answers::Alternating(bodies) => {
                sb.mdma.set_reply(PollReply::RawBody(bodies[1].clone()))
            }
        }
        let state = State {
            admitted: held.clone(),
            confirmed: held,
            ..State::default()
        };
        StateStore::new(sb.state_file()).save(&state)?;
        // The jobs beside the loop that walk merod (inventory, recovery envelopes) are
        // measured on their own: here their runs would land in some counted cycles and not
        // in others.
        let cfg = sb.config("[inventory]\nenabled = false\n\n[recovery]\nenabled = false\n")?;
        let deps = sb.deps(&cfg)?;
        let telemetry = Arc::clone(&deps.telemetry);
        let mut sidecar = Sidecar::start(cfg, deps, CancellationToken::new(), None)
            .await?
            .ok_or("shut down at start")?;
        // Warm up: connections are open, and the held refresh is done with its start-up
        // reads, so the counted cycles plan against merod's holdings (orphans included)
        // as a running daemon does, and no read lands in them (the next is a minute away).
        for _ in 0..3 {
            sidecar.cycle().await;
        }
        settle_held_reads(&sb, &telemetry, n).await?;
        sidecar.cycle().await;
        Ok::<_, Error>(sidecar)
    })?;
    measured(&rt, &sb, &mut sidecar, &answers, rounds);
    println!("{scenario}: {rounds} cycles");
    Ok(())
}
