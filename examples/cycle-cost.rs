//! The workloads of the instruction-count check (`scripts/cost-check.sh`, run by `.ci/run`
//! under callgrind): `cargo run --release --example cycle-cost -- SCENARIO [ROUNDS]`.
//!
//! - `idle-3`, `idle-10000`: an idle cycle (`Sidecar::cycle`) at 3 or 10,000 namespaces, all
//!   held and confirmed, MDMA repeating the same answer;
//! - `idle-10000x8`: an idle cycle at 10,000 namespaces whose assignments carry 8 admitter
//!   addresses each (about 9.5 MB), MDMA repeating the same answer: the fleet's real idle poll;
//! - `accept-10000x8`: a cycle whose answer differs from the one before (two answers of the
//!   same 10,000 assignments with 8 admitter addresses each, taking turns: each is read and
//!   validated whole), the fleet's real answer.
//!
//! The daemon runs on the main thread (a current-thread runtime: its loop and the jobs it
//! spawns), the in-process emulators on a runtime of their own on another thread, so only the
//! daemon's side of each HTTP call is counted (callgrind counts a thread only while it is
//! inside `measured`; work the daemon hands to blocking threads, file writes, is not). It is
//! set up and warmed up first; then ROUNDS cycles (default 5) run inside `measured`, so the
//! counts depend neither on the set-up nor on the machine's load.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use fleet_sidecar::daemon::{Sidecar, Telemetry};
use fleet_sidecar::testing::mdma::{fleet_answer_for, PollReply};
use fleet_sidecar::testing::sandbox::Sandbox;
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
        .ok_or("usage: cycle-cost idle-3|idle-10000|idle-10000x8|accept-10000x8 [ROUNDS]")?;
    let rounds: usize = args.next().map(|r| r.parse()).transpose()?.unwrap_or(5);
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
    let emulators = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let sb = emulators.block_on(Sandbox::start(None))?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
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
