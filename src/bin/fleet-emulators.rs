//! The loopback MDMA and merod emulators as a standalone process, for benchmarks that drive
//! the release daemon (or the Bash reference loop) against them from the outside
//! (`scripts/bench-vs-reference.sh`).
//!
//! `fleet-emulators [--namespaces N] [--admitters K]` starts both emulators in a temp
//! sandbox, assigns N generated namespace ids (64 hex; each assignment with K admitter
//! addresses of the longest common form when K > 0, the fleet's real answer), makes merod hold them, writes the daemon's state file
//! with all N admitted and confirmed (and the reference's confirmed set, a bare JSON array,
//! to `{dir}/reference-confirmed.json`), so a daemon started on it is idle from its first
//! poll. It prints `KEY=value` lines (`CONFIG`, `STATE`, `REF_STATE`, `DIR`, `MDMA_URL`,
//! `MEROD_URL`, `PEER_ID`, `MRTD`), then `READY`, and reads commands from stdin, one a line:
//!
//! - `assign ID`: add ID to the assignments; prints `JOINED ID <ms>` once merod receives a
//!   `fleet-join` of it (ms since the assignment changed).
//! - `withdraw ID`: drop ID from the assignments; prints `LEFT ID <ms>` once merod receives
//!   its leave.
//! - `hang ID`: merod's `fleet-join` of ID never answers.
//! - `polls`: prints `POLLS <n>`, the should-join polls answered so far.
//!
//! Stops at end of input or on SIGINT.

use std::collections::BTreeSet;
use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fleet_sidecar::testing::mdma::{fleet_answer_for, PollReply};
use fleet_sidecar::testing::merod::{JoinBehaviour, MerodEmulator};
use fleet_sidecar::testing::sandbox::{Sandbox, MRTD_HEX, PEER_ID};
use fleet_sidecar::GroupId;
use fleet_sidecar::{State, StateStore};
use std::time::Instant;
use tokio::io::{AsyncBufReadExt, BufReader};

/// The i-th generated namespace id (64 hex, never all zeros).
fn namespace_id(i: usize) -> String {
    format!("{:016x}", 0xf1ee_0000_0000_0000u64 + i as u64).repeat(4)
}

fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

/// Waits until merod records a call whose path ends with `path_suffix` and whose path or
/// body names `id`, arriving after `since`; prints `{label} {id} {ms}`.
async fn report_call(
    merod: MerodEmulator,
    path_suffix: &'static str,
    id: String,
    since: Instant,
    label: &'static str,
) {
    loop {
        let hit = merod.calls().into_iter().find(|c| {
            c.at >= since
                && c.path.ends_with(path_suffix)
                && (c.path.contains(&id) || c.body.contains(&id))
        });
        if let Some(call) = hit {
            let ms = call.at.duration_since(since).as_secs_f64() * 1000.0;
            say(&format!("{label} {id} {ms:.1}"));
            return;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut n = 3usize;
    let mut admitters = 0usize;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--namespaces" => {
                n = args.next().ok_or("--namespaces needs a number")?.parse()?;
            }
            "--admitters" => {
                admitters = args.next().ok_or("--admitters needs a number")?.parse()?;
            }
            other => return Err(format!("unknown argument {other:?}").into()),
        }
    }
    let ids: Vec<String> = (0..n).map(namespace_id).collect();
    let sb = Sandbox::start(None).await?;
    let assigned = Arc::new(Mutex::new(ids.iter().cloned().collect::<BTreeSet<_>>()));
    // The answer for the assigned set: with admitter addresses, the fleet's own form.
    let reply = move |set: &BTreeSet<String>| {
        if admitters == 0 {
            PollReply::assign(set.iter().cloned())
        } else {
            PollReply::RawBody(fleet_answer_for(&set.iter().collect::<Vec<_>>(), admitters))
        }
    };
    sb.mdma.set_reply(reply(&ids.iter().cloned().collect()));
    let mut held = BTreeSet::new();
    for id in &ids {
        sb.merod.hold(id);
        held.insert(id.parse::<GroupId>()?);
    }
    let state = State {
        admitted: held.clone(),
        confirmed: held,
        ..State::default()
    };
    StateStore::new(sb.state_file()).save(&state)?;
    let ref_state = sb.dir().join("reference-confirmed.json");
    std::fs::write(&ref_state, serde_json::to_vec(&ids)?)?;
    let config = sb.write_config("")?;

    say(&format!("CONFIG={}", config.display()));
    say(&format!("STATE={}", sb.state_file().display()));
    say(&format!("REF_STATE={}", ref_state.display()));
    say(&format!("DIR={}", sb.dir().display()));
    say(&format!("MDMA_URL={}", sb.mdma.url()));
    say(&format!("MEROD_URL={}", sb.merod.url()));
    say(&format!("PEER_ID={PEER_ID}"));
    say(&format!("MRTD={MRTD_HEX}"));
    say("READY");

    let mut lines = BufReader::new(tokio::io::stdin()).lines();
    loop {
        let line = tokio::select! {
            line = lines.next_line() => line?,
            _ = tokio::signal::ctrl_c() => None,
        };
        let Some(line) = line else { break };
        let mut words = line.split_whitespace();
        let (cmd, id) = (words.next(), words.next().map(str::to_owned));
        match (cmd, id) {
            (Some("assign"), Some(id)) => {
                let since = Instant::now();
                let mut set = assigned.lock().unwrap_or_else(|p| p.into_inner());
                set.insert(id.clone());
                sb.mdma.set_reply(reply(&set));
                drop(set);
                let merod = sb.merod.clone();
                tokio::spawn(report_call(merod, "fleet-join", id, since, "JOINED"));
            }
            (Some("withdraw"), Some(id)) => {
                let since = Instant::now();
                let mut set = assigned.lock().unwrap_or_else(|p| p.into_inner());
                set.remove(&id);
                sb.mdma.set_reply(reply(&set));
                drop(set);
                let merod = sb.merod.clone();
                tokio::spawn(report_call(merod, "/leave", id, since, "LEFT"));
            }
            (Some("hang"), Some(id)) => sb.merod.set_join(&id, JoinBehaviour::Hang),
            (Some("polls"), None) => say(&format!("POLLS {}", sb.mdma.polls().len())),
            _ => say(&format!("ERROR unknown command {line:?}")),
        }
    }
    Ok(())
}
