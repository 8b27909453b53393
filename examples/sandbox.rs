//! Starts the loopback MDMA and merod emulators in a temp sandbox, assigns the namespaces
//! given as arguments (64-hex ids; default: two fixed ones), writes a config file pointing
//! the real `fleet-sidecar` binary at them, prints `CONFIG=<path>` and serves until killed.
//!
//! Used by `scripts/idle-footprint.sh`, and handy for trying the binary by hand:
//!
//! ```text
//! cargo run --example sandbox &      # prints CONFIG=/tmp/fleet-sidecar-XXXX/fleet-sidecar.toml
//! cargo run -- --config /tmp/fleet-sidecar-XXXX/fleet-sidecar.toml run
//! ```

use fleet_sidecar::testing::mdma::PollReply;
use fleet_sidecar::testing::sandbox::Sandbox;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut ids: Vec<String> = std::env::args().skip(1).collect();
    if ids.is_empty() {
        ids = vec![
            "38069a4cc4285c4245c84587ac60084ba53502a8b91c9b108bca40f10ec4d3df".to_owned(),
            "abababababababababababababababababababababababababababababababab".to_owned(),
        ];
    }
    let sb = Sandbox::start(None).await?;
    sb.mdma.set_reply(PollReply::assign(ids));
    let config = sb.write_config("")?;
    println!("CONFIG={}", config.display());
    println!("STATE={}", sb.state_file().display());
    tokio::signal::ctrl_c().await?;
    Ok(())
}
