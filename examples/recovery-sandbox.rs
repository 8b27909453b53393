//! The loopback emulators holding N namespaces already confirmed, each with three member
//! accounts (the node's own and two others, one device each) and a context, merod with its
//! seal route, for measuring the recovery envelopes' first full pass and the steady state
//! after it. Writes the config (the inventory off unless the second argument is `all`, so
//! the disk writes measured are the recovery job's and the log's), prints `CONFIG=` and
//! `STATE=`, then every 100 ms `REQUESTS merod=M mdma=N` (the requests each emulator got
//! so far), and serves until killed. Used by `scripts/recovery-writes.sh` and
//! `scripts/node-cost.sh`.
//!
//! ```text
//! cargo run --release --example recovery-sandbox -- 1000 [all]
//! ```

use std::collections::BTreeSet;

use fleet_sidecar::testing::mdma::PollReply;
use fleet_sidecar::testing::sandbox::Sandbox;
use fleet_sidecar::{GroupId, State, StateStore};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let n: usize = args.next().as_deref().unwrap_or("1000").parse()?;
    let every_job = args.next().as_deref() == Some("all");
    let sb = Sandbox::start(None).await?;
    let ids = sb.hold_with_members(n);
    let confirmed: BTreeSet<GroupId> = ids.iter().map(|i| i.parse()).collect::<Result<_, _>>()?;
    StateStore::new(sb.state_file()).save(&State {
        admitted: confirmed.clone(),
        confirmed,
        ..State::default()
    })?;
    sb.mdma.set_reply(PollReply::assign(ids));
    let config = sb.write_config("")?;
    std::fs::write(
        &config,
        format!(
            "{}\n[inventory]\nenabled = {every_job}\n",
            std::fs::read_to_string(&config)?
        ),
    )?;
    println!("CONFIG={}", config.display());
    println!("STATE={}", sb.state_file().display());
    let mut every = tokio::time::interval(std::time::Duration::from_millis(100));
    loop {
        tokio::select! {
            _ = every.tick() => {
                println!(
                    "REQUESTS merod={} mdma={}",
                    sb.merod.call_count(),
                    sb.mdma.received()
                );
            }
            done = tokio::signal::ctrl_c() => return Ok(done?),
        }
    }
}
