//! Criterion benches of an idle cycle's parts: the should-join parser and `plan`
//! at 10 / 1,000 / 10,000 namespaces, a state save when unchanged and when changed, and one
//! whole idle cycle (`Sidecar::cycle`) against the in-process emulators at 3 and 10,000
//! namespaces, every namespace already admitted and confirmed.
//!
//! `cargo bench --locked --bench cycle` (add `-- --quick` for a short run); figures and
//! targets in `bench/RESULTS.md`.

// `criterion_main!` writes an undocumented `main`.
#![allow(missing_docs)]

use std::collections::BTreeSet;
use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use fleet_sidecar::daemon::Sidecar;
use fleet_sidecar::mdma::parse_should_join;
use fleet_sidecar::reconcile::{plan, Desired, Guard, LeavePolicy, PlanInput};
use fleet_sidecar::testing::mdma::PollReply;
use fleet_sidecar::testing::sandbox::Sandbox;
use fleet_sidecar::GroupId;
use fleet_sidecar::{State, StateStore};
use tokio_util::sync::CancellationToken;

const SIZES: [usize; 3] = [10, 1_000, 10_000];

/// The `n`th namespace id (64 hex digits).
fn namespace_id(i: usize) -> String {
    format!("{:016x}", 0xf1ee_0000_0000_0000u64 + i as u64).repeat(4)
}

fn ids(n: usize) -> Vec<String> {
    (0..n).map(namespace_id).collect()
}

/// MDMA's should-join answer assigning these ids.
fn answer(ids: &[String]) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "assignments": ids
            .iter()
            .map(|id| serde_json::json!({"group_id": id, "admitter_addrs": []}))
            .collect::<Vec<_>>()
    }))
    .expect("a JSON value serialises")
}

/// A state holding every id admitted and confirmed.
fn held(ids: &[String]) -> State {
    let set: BTreeSet<GroupId> = ids
        .iter()
        .map(|i| i.parse().expect("generated ids are valid"))
        .collect();
    State {
        admitted: set.clone(),
        confirmed: set,
        ..State::default()
    }
}

fn parser(c: &mut Criterion) {
    let mut g = c.benchmark_group("parse_should_join");
    for n in SIZES {
        let body = answer(&ids(n));
        g.bench_with_input(BenchmarkId::from_parameter(n), &body, |b, body| {
            b.iter(|| black_box(parse_should_join(black_box(body)).ok()));
        });
    }
    g.finish();
}

fn planning(c: &mut Criterion) {
    let mut g = c.benchmark_group("plan_idle");
    for n in SIZES {
        let ids = ids(n);
        let desired = Desired::from(parse_should_join(&answer(&ids)).expect("valid answer"));
        let state = held(&ids);
        let empty = BTreeSet::new();
        let guard = Guard::default();
        g.bench_function(BenchmarkId::from_parameter(n), |b| {
            b.iter(|| {
                black_box(plan(PlanInput {
                    policy: &LeavePolicy::REFERENCE,
                    desired: black_box(&desired),
                    state: &state,
                    in_flight: &empty,
                    join_backoff: &empty,
                    leave_backoff: &empty,
                    guard: &guard,
                    now: tokio::time::Instant::now(),
                }))
            });
        });
    }
    g.finish();
}

fn state_save(c: &mut Criterion) {
    let mut g = c.benchmark_group("state_save");
    for n in SIZES {
        let dir = tempfile::tempdir().expect("temp dir");
        let mut store = StateStore::new(dir.path().join("state.json"));
        let ids = ids(n + 1);
        let a = held(&ids[..n]);
        let b_state = held(&ids[1..]);
        store.save(&a).expect("first save");
        g.bench_function(BenchmarkId::new("unchanged", n), |b| {
            b.iter(|| black_box(store.save(black_box(&a)).expect("save")));
        });
        // Every save differs from the one before it: rendered and written (atomically).
        let mut flip = false;
        g.bench_function(BenchmarkId::new("changed", n), |b| {
            b.iter(|| {
                flip = !flip;
                let s = if flip { &b_state } else { &a };
                black_box(store.save(s).expect("save"))
            });
        });
    }
    g.finish();
}

fn whole_cycle(c: &mut Criterion) {
    let mut g = c.benchmark_group("idle_cycle");
    g.sample_size(20);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    for n in [3, 10_000] {
        let ids = ids(n);
        let (sandbox, mut sidecar) = rt.block_on(async {
            let sb = Sandbox::start(None).await.expect("emulators start");
            sb.mdma.set_reply(PollReply::assign(ids.clone()));
            StateStore::new(sb.state_file())
                .save(&held(&ids))
                .expect("state written");
            let cfg = sb.config("").expect("sandbox config");
            let deps = sb.deps(&cfg).expect("clients");
            let sidecar = Sidecar::start(cfg, deps, CancellationToken::new(), None)
                .await
                .expect("sidecar starts")
                .expect("not shut down");
            (sb, sidecar)
        });
        rt.block_on(sidecar.cycle());
        g.bench_function(BenchmarkId::from_parameter(n), |b| {
            b.iter(|| black_box(rt.block_on(sidecar.cycle())));
        });
        drop(sidecar);
        sandbox.mdma.shutdown();
    }
    g.finish();
}

criterion_group!(benches, parser, planning, state_save, whole_cycle);
criterion_main!(benches);
