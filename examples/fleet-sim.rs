//! The fleet at scale, simulated: N sidecar loops in one process, each through
//! the library's own entry point (`daemon::run`) with its own PeerId, state file, MDMA
//! client and merod stand-in, against ONE MDMA emulator over real HTTP on loopback.
//!
//! `cargo run --release --locked --example fleet-sim -- [N] [STEADY_S] [OUTAGE_S] [RECOVERY_S]`
//! (default 1000 30 60 30). Every node already holds 3 namespaces, admitted and confirmed,
//! and MDMA keeps assigning them (idle polling, 1 s `poll_interval`, default `max_backoff`).
//! After `STEADY_S` seconds MDMA answers every poll 503 for `OUTAGE_S` seconds, then
//! answers again for `RECOVERY_S` seconds. From the emulator's poll records (arrival times)
//! it prints:
//!
//! - the first polls of a fleet started at the same instant, as a histogram of 100 ms
//!   windows from the start (lock-step: one window holding most of the fleet);
//! - MDMA requests per second in steady state (the second half of `STEADY_S`), and the
//!   largest count in any (sliding) 100 ms window there;
//! - after the outage ends, the largest count in any 100 ms window, as a multiple of the
//!   steady-state mean per 100 ms (target ≤ 2×);
//! - wall time, process CPU time and peak RSS.
//!
//! The merod stand-in answers in-process (no HTTP): the figure of interest is MDMA's load.

use std::collections::{BTreeSet, HashMap};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use fleet_sidecar::daemon::{self, Deps};
use fleet_sidecar::testing::mdma::{MdmaEmulator, PollReply};
use fleet_sidecar::Config;
use fleet_sidecar::GroupId;
use fleet_sidecar::MdmaClient;
use fleet_sidecar::{
    merod::NetworkStatus, merod::NodeAccount, Admission, MerodError, Node, TeeRole,
};
use fleet_sidecar::{State, StateStore};
use tokio_util::sync::CancellationToken;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A merod that is up, admits every join and holds every namespace (it lists the ones the
/// node starts with).
struct StandIn(BTreeSet<GroupId>);

#[async_trait]
impl Node for StandIn {
    async fn probe(&self) -> Result<(), MerodError> {
        Ok(())
    }
    async fn fleet_join(
        &self,
        _group_id: GroupId,
        _admitter_addrs: &[String],
    ) -> Result<Admission, MerodError> {
        Ok(Admission {
            admitted: true,
            status: "joined".into(),
            reasons: Vec::new(),
            refusals: Vec::new(),
            admitted_by: None,
        })
    }
    async fn leave_namespace(&self, _group_id: GroupId) -> Result<(), MerodError> {
        Ok(())
    }
    async fn holds_namespace(&self, _group_id: GroupId) -> Result<bool, MerodError> {
        Ok(true)
    }
    async fn list_namespaces(&self) -> Result<BTreeSet<GroupId>, MerodError> {
        Ok(self.0.clone())
    }
    async fn identity(&self) -> Result<NodeAccount, MerodError> {
        Ok(NodeAccount::NotMinted)
    }
    async fn network_status(&self) -> Result<NetworkStatus, MerodError> {
        Ok(NetworkStatus::default())
    }
    async fn tee_role(
        &self,
        _group_id: GroupId,
        _account: &str,
    ) -> Result<Option<TeeRole>, MerodError> {
        Ok(None)
    }
}

/// A distinct, well-formed PeerId per node: `12D3KooW` and `i` in base58, padded to 52 chars.
fn peer_id(mut i: usize) -> String {
    const B58: &[u8] = b"123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz";
    let mut tail = Vec::new();
    loop {
        tail.push(B58[i % 58]);
        i /= 58;
        if i == 0 {
            break;
        }
    }
    let tail: String = tail.iter().rev().map(|&b| b as char).collect();
    format!("12D3KooW{tail:1>44}")
}

/// Lays out node `i` under `root` (merod's config.toml, the state) and returns its config.
fn node_config(root: &Path, i: usize, mdma: &url::Url, state: &State) -> Result<Config, BoxError> {
    let dir = root.join(format!("node-{i}"));
    let node_dir = dir.join("calimero").join("default");
    std::fs::create_dir_all(&node_dir)?;
    std::fs::write(
        node_dir.join("config.toml"),
        format!(
            "[identity]\npeer_id = \"{}\"\n\n[server]\nlisten = [\"/ip4/127.0.0.1/tcp/2428\"]\n",
            peer_id(i)
        ),
    )?;
    StateStore::new(dir.join("state.json")).save(state)?;
    let text = format!(
        "mdma_url = \"{mdma}\"\npoll_interval = \"1s\"\nstate_file = \"{state}\"\nlog_file = \"{log}\"\n\n[merod]\nhome = \"{home}\"\nnode = \"default\"\n\n[tdx]\nmrtd_path = \"{mrtd}\"\nsources = [\"sysfs\"]\n",
        state = dir.join("state.json").display(),
        log = dir.join("fleet-sidecar.log").display(),
        home = dir.join("calimero").display(),
        mrtd = root.join("mrtd-sha384").display(),
    );
    Ok(Config::from_toml(&text, &dir.join("fleet-sidecar.toml"))?)
}

/// The largest number of `times` (sorted) within any window of `width`.
fn max_in_window(times: &[Duration], width: Duration) -> usize {
    let mut best = 0;
    let mut lo = 0;
    for hi in 0..times.len() {
        while times[hi] - times[lo] >= width {
            lo += 1;
        }
        best = best.max(hi - lo + 1);
    }
    best
}

/// This process's CPU time (user + system) from `/proc/self/stat`, in clock ticks of 10 ms.
fn process_cpu() -> Duration {
    let text = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let after = text.rsplit_once(')').map_or("", |(_, rest)| rest);
    let fields: Vec<&str> = after.split_whitespace().collect();
    let ticks: u64 = [11, 12]
        .iter()
        .filter_map(|&k| fields.get(k).and_then(|f| f.parse::<u64>().ok()))
        .sum();
    Duration::from_millis(ticks * 10)
}

/// `VmHWM` from `/proc/self/status`.
fn peak_rss() -> String {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .map_or_else(|| "?".into(), |l| l["VmHWM:".len()..].trim().to_owned())
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let mut args = std::env::args().skip(1);
    let mut next = |default: u64| -> Result<u64, BoxError> {
        Ok(args.next().map_or(Ok(default), |a| a.parse())?)
    };
    let n = usize::try_from(next(1000)?)?;
    let steady = Duration::from_secs(next(30)?);
    let outage = Duration::from_secs(next(60)?);
    let recovery = Duration::from_secs(next(30)?);

    let root = tempfile::Builder::new().prefix("fleet-sim-").tempdir()?;
    std::fs::write(
        root.path().join("mrtd-sha384"),
        (0u8..48).collect::<Vec<u8>>(),
    )?;
    let namespaces: Vec<String> = (0..3u64)
        .map(|i| format!("{:016x}", 0xf1ee_0000_0000_0000u64 + i).repeat(4))
        .collect();
    let held: BTreeSet<GroupId> = namespaces
        .iter()
        .map(|s| s.parse())
        .collect::<Result<_, _>>()?;
    let state = State {
        admitted: held.clone(),
        confirmed: held.clone(),
        ..State::default()
    };
    let mdma = MdmaEmulator::start(None).await?;
    mdma.set_reply(PollReply::assign(namespaces.clone()));

    let mut fleet = Vec::with_capacity(n);
    for i in 0..n {
        let cfg = node_config(root.path(), i, &mdma.url(), &state)?;
        let client = MdmaClient::new(&cfg.mdma_url, cfg.fleet_token.clone(), None)?;
        fleet.push((
            cfg,
            Deps::new(Arc::new(client), Arc::new(StandIn(held.clone()))),
        ));
    }
    println!(
        "fleet-sim: N = {n}, steady {steady:?}, outage {outage:?}, recovery {recovery:?}; {} cores",
        std::thread::available_parallelism().map_or(0, |p| p.get())
    );

    // The whole fleet starts at the same instant.
    let shutdown = CancellationToken::new();
    let cpu0 = process_cpu();
    let t0 = Instant::now();
    let tasks: Vec<_> = fleet
        .into_iter()
        .map(|(cfg, deps)| tokio::spawn(daemon::run(cfg, deps, shutdown.child_token())))
        .collect();

    tokio::time::sleep_until((t0 + steady).into()).await;
    mdma.set_reply(PollReply::Status(503));
    tokio::time::sleep_until((t0 + steady + outage).into()).await;
    mdma.set_reply(PollReply::assign(namespaces));
    tokio::time::sleep_until((t0 + steady + outage + recovery).into()).await;
    shutdown.cancel();
    for t in tasks {
        t.await??;
    }
    let wall = t0.elapsed();
    let cpu = process_cpu() - cpu0;

    let polls = mdma.polls();
    let mut times: Vec<Duration> = polls
        .iter()
        .map(|p| p.at.saturating_duration_since(t0))
        .collect();
    times.sort();
    let mut first: HashMap<&str, Duration> = HashMap::new();
    for p in &polls {
        if let Some(id) = p.peer_id.as_deref() {
            let at = p.at.saturating_duration_since(t0);
            first
                .entry(id)
                .and_modify(|t| *t = (*t).min(at))
                .or_insert(at);
        }
    }
    let between = |from: Duration, to: Duration| -> Vec<Duration> {
        times
            .iter()
            .copied()
            .filter(|t| *t >= from && *t < to)
            .collect()
    };
    let window = Duration::from_millis(100);

    println!(
        "\nfirst poll of each node ({} nodes polled), 100 ms windows from the start:",
        first.len()
    );
    let mut hist: Vec<usize> = Vec::new();
    for t in first.values() {
        let w = usize::try_from(t.as_millis() / 100).unwrap_or(usize::MAX);
        if hist.len() <= w {
            hist.resize(w + 1, 0);
        }
        hist[w] += 1;
    }
    for (w, count) in hist.iter().enumerate() {
        println!("  {:>5}–{:>5} ms: {count}", w * 100, (w + 1) * 100);
    }
    let busiest = hist.iter().copied().max().unwrap_or(0);
    println!(
        "  busiest window: {busiest} of {} first polls ({:.0} %)",
        first.len(),
        busiest as f64 * 100.0 / first.len().max(1) as f64
    );

    let steady_from = steady / 2;
    let steady_polls = between(steady_from, steady);
    let rps = steady_polls.len() as f64 / (steady - steady_from).as_secs_f64();
    let steady_peak = max_in_window(&steady_polls, window);
    println!("\nsteady state ({steady_from:?}..{steady:?}): {rps:.1} requests/s, mean {:.1} per 100 ms, largest 100 ms window {steady_peak}", rps / 10.0);

    let during = between(steady, steady + outage);
    println!(
        "outage ({steady:?}..{:?}): {} requests ({:.1}/s), largest 100 ms window {}",
        steady + outage,
        during.len(),
        during.len() as f64 / outage.as_secs_f64(),
        max_in_window(&during, window)
    );
    let after = between(steady + outage, steady + outage + recovery);
    let after_peak = max_in_window(&after, window);
    println!(
        "after the outage ({:?}..): largest 100 ms window {after_peak} = {:.2}× the steady-state mean per 100 ms ({:.2}× the steady-state largest window); {} requests in the first 10 s",
        steady + outage,
        after_peak as f64 / (rps / 10.0),
        after_peak as f64 / steady_peak.max(1) as f64,
        between(steady + outage, steady + outage + Duration::from_secs(10)).len()
    );
    let statuses = polls.iter().filter(|p| p.status == 200).count();
    println!(
        "\n{} polls in all ({statuses} answered 200); wall {:.1} s, process CPU {:.1} s ({:.1} % of one core), peak RSS {}",
        polls.len(),
        wall.as_secs_f64(),
        cpu.as_secs_f64(),
        cpu.as_secs_f64() * 100.0 / wall.as_secs_f64(),
        peak_rss()
    );
    Ok(())
}
