//! Where an idle cycle's time and allocations go, step by step, at N namespaces all
//! confirmed: `cargo run --release --example cycle-profile -- [N] [ROUNDS]` (default 10000, 50).
//!
//! A counting global allocator records allocations and bytes per step; times are this
//! thread's CPU time (`/proc/thread-self/schedstat`, so a loaded machine does not inflate
//! them), the mean over ROUNDS (the kernel accounts it in scheduler ticks, so a single
//! round is coarse). Rows marked "before" run the code the daemon ran before the idle
//! cycle's costs were cut, for comparison. The steps are those of one idle cycle: parsing
//! MDMA's answer, `plan`, saving
//! an unchanged state, publishing the live status, and the whole `Sidecar::cycle` against the
//! in-process emulators (HTTP included, both sides of it in this process).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use fleet_sidecar::daemon::Sidecar;
use fleet_sidecar::daemon::Telemetry;
use fleet_sidecar::mdma::parse_should_join;
use fleet_sidecar::reconcile::{plan, Desired, Guard, LeavePolicy, PlanInput};
use fleet_sidecar::testing::mdma::PollReply;
use fleet_sidecar::testing::sandbox::Sandbox;
use fleet_sidecar::GroupId;
use fleet_sidecar::{state::render_state, State, StateStore};
use tokio_util::sync::CancellationToken;

struct Counting;

static ALLOCS: AtomicU64 = AtomicU64::new(0);
static BYTES: AtomicU64 = AtomicU64::new(0);
static LIVE: AtomicU64 = AtomicU64::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Relaxed);
        BYTES.fetch_add(layout.size() as u64, Relaxed);
        LIVE.fetch_add(layout.size() as u64, Relaxed);
        System.alloc(layout)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as u64, Relaxed);
        System.dealloc(ptr, layout)
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCS.fetch_add(1, Relaxed);
        BYTES.fetch_add(new_size as u64, Relaxed);
        LIVE.fetch_add(new_size as u64, Relaxed);
        LIVE.fetch_sub(layout.size() as u64, Relaxed);
        System.realloc(ptr, layout, new_size)
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// This thread's CPU time so far (Linux `/proc/thread-self/schedstat`, ns).
fn cpu_now() -> Duration {
    let text = std::fs::read_to_string("/proc/thread-self/schedstat").unwrap_or_default();
    let ns = text
        .split_whitespace()
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    Duration::from_nanos(ns)
}

/// Mean CPU time, and allocations and bytes of one round.
fn measure(rounds: usize, mut f: impl FnMut()) -> (Duration, u64, u64) {
    let (a0, b0) = (ALLOCS.load(Relaxed), BYTES.load(Relaxed));
    let t = cpu_now();
    for _ in 0..rounds {
        f();
    }
    let took = cpu_now() - t;
    let (a1, b1) = (ALLOCS.load(Relaxed), BYTES.load(Relaxed));
    let n = rounds as u64;
    (took / rounds as u32, (a1 - a0) / n, (b1 - b0) / n)
}

fn row(step: &str, (t, allocs, bytes): (Duration, u64, u64)) {
    println!(
        "| {step} | {:.3} | {allocs} | {:.1} |",
        t.as_secs_f64() * 1000.0,
        bytes as f64 / 1024.0
    );
}

fn namespace_id(i: usize) -> String {
    format!("{:016x}", 0xf1ee_0000_0000_0000u64 + i as u64).repeat(4)
}

fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let mut args = std::env::args().skip(1);
    let n: usize = args.next().map_or(Ok(10_000), |a| a.parse())?;
    let rounds: usize = args.next().map_or(Ok(50), |a| a.parse())?;
    let ids: Vec<String> = (0..n).map(namespace_id).collect();
    let body = serde_json::to_vec(&serde_json::json!({
        "assignments": ids.iter().map(|id| serde_json::json!({"group_id": id, "admitter_addrs": []})).collect::<Vec<_>>()
    }))?;
    let held: std::collections::BTreeSet<GroupId> =
        ids.iter().map(|i| i.parse()).collect::<Result<_, _>>()?;
    let state = State {
        admitted: held.clone(),
        confirmed: held.clone(),
        ..State::default()
    };

    println!(
        "N = {n} namespaces, poll answer {} KiB, mean of {rounds} rounds",
        body.len() / 1024
    );
    println!("| step | CPU ms | allocations | KiB allocated |");
    println!("|---|---|---|---|");
    row(
        "parse should-join (`mdma::parse_should_join`)",
        measure(rounds, || {
            std::hint::black_box(parse_should_join(&body).ok());
        }),
    );
    let desired = Desired::from(parse_should_join(&body)?);
    let empty = std::collections::BTreeSet::new();
    let now = tokio::time::Instant::now();
    row(
        "plan (`reconcile::plan`)",
        measure(rounds, || {
            std::hint::black_box(plan(PlanInput {
                policy: &LeavePolicy::REFERENCE,
                desired: &desired,
                state: &state,
                in_flight: &empty,
                join_backoff: &empty,
                leave_backoff: &empty,
                guard: &Guard::default(),
                now,
            }));
        }),
    );
    let dir = tempfile::tempdir()?;
    let mut store = StateStore::new(dir.path().join("state.json"));
    store.save(&state)?;
    row(
        "state save, unchanged (`StateStore::save`)",
        measure(rounds, || {
            std::hint::black_box(store.save(&state).ok());
        }),
    );
    let file = render_state(&state);
    row(
        "before: state save, unchanged (render the document, compare bytes)",
        measure(rounds, || {
            std::hint::black_box(render_state(&state) == file);
        }),
    );
    let telemetry = Telemetry::new();
    telemetry.update(|st| {
        st.desired = held.iter().copied().collect();
        st.admitted = held.iter().copied().collect();
        st.confirmed = held.iter().copied().collect();
    });
    row(
        "live status update, unchanged sets (`Telemetry::update`, lists refilled only on change, as `publish` does)",
        measure(rounds, || {
            telemetry.update(|st| {
                for (dst, src) in [
                    (&mut st.desired, &desired.assigned),
                    (&mut st.admitted, &state.admitted),
                    (&mut st.confirmed, &state.confirmed),
                ] {
                    if !dst.iter().eq(src.iter()) {
                        dst.clear();
                        dst.extend(src.iter().copied());
                    }
                }
            });
        }),
    );
    row(
        "before: live status update (rebuild every list, copy the status twice)",
        measure(rounds, || {
            let before = telemetry.snapshot();
            telemetry.update(|st| {
                st.desired = desired.assigned.iter().copied().collect();
                st.admitted = state.admitted.iter().copied().collect();
                st.confirmed = state.confirmed.iter().copied().collect();
            });
            std::hint::black_box((before, telemetry.snapshot()));
        }),
    );

    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let sb = Sandbox::start(None).await?;
        sb.mdma.set_reply(PollReply::assign(ids.clone()));
        StateStore::new(sb.state_file()).save(&state)?;
        let cfg = sb.config("")?;
        let deps = sb.deps(&cfg)?;
        let mut sidecar = Sidecar::start(cfg, deps, CancellationToken::new(), None)
            .await?
            .ok_or("shut down at start")?;
        sidecar.cycle().await;
        let live0 = LIVE.load(Relaxed);
        let (a0, b0) = (ALLOCS.load(Relaxed), BYTES.load(Relaxed));
        let t = cpu_now();
        for _ in 0..rounds {
            sidecar.cycle().await;
        }
        let took = cpu_now() - t;
        let (a1, b1) = (ALLOCS.load(Relaxed), BYTES.load(Relaxed));
        let r = rounds as u64;
        row(
            "whole idle cycle (`Sidecar::cycle`; the emulator's side of the HTTP call runs on the same thread and is included)",
            (took / rounds as u32, (a1 - a0) / r, (b1 - b0) / r),
        );
        let live1 = LIVE.load(Relaxed);
        println!(
            "live heap after the first cycle {:.1} KiB, after {rounds} more {:.1} KiB",
            live0 as f64 / 1024.0,
            live1 as f64 / 1024.0
        );
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
    })?;
    Ok(())
}
