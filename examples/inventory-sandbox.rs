//! The loopback emulators holding N namespaces already confirmed (merod holds them, each with
//! a subgroup and three contexts; the state file records them confirmed; MDMA assigns them),
//! for measuring the context inventory's walk at fleet scale. Writes the config (with
//! `[inventory] enabled` as the second argument says), prints `CONFIG=` and `STATE=`, and
//! serves until killed. Used by `scripts/inventory-cost.sh`.
//!
//! ```text
//! cargo run --release --example inventory-sandbox -- 10000 true
//! ```

use std::collections::BTreeSet;

use fleet_sidecar::testing::mdma::PollReply;
use fleet_sidecar::testing::sandbox::Sandbox;
use fleet_sidecar::{GroupId, State, StateStore};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let n: usize = args.next().as_deref().unwrap_or("10000").parse()?;
    let enabled: bool = args.next().as_deref().unwrap_or("true").parse()?;
    let sb = Sandbox::start(None).await?;
    let ids: Vec<String> = (0..n).map(|i| format!("{:064x}", i + 1)).collect();
    for (i, id) in ids.iter().enumerate() {
        let sub = format!("{:064x}", n + i + 1);
        sb.merod.hold(id);
        sb.merod.set_subgroups(id, &[&sub]);
        sb.merod
            .set_contexts(id, &[format!("ctx{i}a"), format!("ctx{i}b")]);
        sb.merod.set_contexts(&sub, &[format!("ctx{i}c")]);
    }
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
            "{}\n[inventory]\nenabled = {enabled}\n",
            std::fs::read_to_string(&config)?
        ),
    )?;
    println!("CONFIG={}", config.display());
    println!("STATE={}", sb.state_file().display());
    tokio::signal::ctrl_c().await?;
    Ok(())
}
