//! `fleet-inspect`: an admin tool built only on `fleet_sidecar`'s promised API (the snapshot
//! in `api/`), with the crate's default features off. It compares the sidecar's state file
//! with the namespaces merod holds and prints the drift:
//!
//! - **held by merod, not in the state**: joined outside the sidecar (or by a sidecar whose
//!   state was lost); the sidecar will never leave it on its own.
//! - **joining**: a fleet-join was sent and its admission not recorded yet (under way, or
//!   the sidecar stopped first); shown with whether merod holds it. Not drift: the sidecar
//!   records it at its next join, or leaves it if MDMA withdraws it.
//! - **admitted in the state, not held by merod**: left outside the sidecar; the sidecar
//!   will re-join it while MDMA assigns it.
//! - **confirmed but not admitted**: must be impossible (the sidecar confirms only what it
//!   recorded as admitted). Flagged, with what loading the file repaired.
//! - **orphans** (with `--status HOST:PORT`, the running daemon's status listener): held by
//!   merod, not in the state, and neither assigned nor retained by the daemon's latest
//!   poll (`reconcile::orphans`). The daemon leaves them alone unless `leave_orphans = true`.
//!
//! It also says when the state file is the fleet's Bash sidecar's (a bare array: the
//! admitted ids and leave timers of the files beside it are imported, and counted here) and
//! when its directory is on a RAM filesystem (lost at reboot).
//!
//! It reads only `[merod]` and `state_file` of the sidecar's config (no MDMA keys needed, the
//! token file is never opened) and never calls MDMA: a `should-join` from a tool would count
//! as the node's heartbeat.
//!
//! ```text
//! cargo run -p library-alone --example fleet-inspect -- --config /etc/calimero/fleet-sidecar.toml [--json] [--status 127.0.0.1:9464]
//! ```
//!
//! Exit status: 0 in sync, 1 drift found (orphans included), 2 the config, the state file,
//! merod or the status listener could not be read.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::Parser;
use fleet_sidecar::reconcile::{self, Desired};
use fleet_sidecar::status::read_status;
use fleet_sidecar::{
    config::DEFAULT_CONFIG_PATH, resolve_admin_url, state::volatile, GroupId, MerodClient, Repair,
    State, StateFile, StateStore, ToolConfig,
};
use serde::Serialize;

/// Compares the sidecar's state file with the namespaces merod holds.
#[derive(Parser, Debug)]
#[command(name = "fleet-inspect")]
struct Args {
    /// The sidecar's config file (only `[merod]` and `state_file` are read).
    #[arg(long, value_name = "PATH", default_value = DEFAULT_CONFIG_PATH)]
    config: PathBuf,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
    /// The running daemon's status listener (`status_listen`), to tell orphans apart: its
    /// `/status` gives the latest poll's assignments and retains.
    #[arg(long, value_name = "HOST:PORT")]
    status: Option<String>,
}

/// What the Bash sidecar's files beside a bare-array state file brought in.
#[derive(Debug, Serialize)]
pub struct Imported {
    /// Admitted ids (the confirmed ones included).
    pub admitted: usize,
    /// Leave timers of admitted ids carried over.
    pub timers: usize,
    /// Leaves of the last hour counted against the budget.
    pub recent_leaves: usize,
}

/// What the tool found.
#[derive(Debug, Serialize)]
pub struct Drift {
    /// The state file read.
    pub state_file: PathBuf,
    /// Whether it exists (a missing file is reported, never taken for "nothing held" silently).
    pub state_file_present: bool,
    /// merod's admin URL asked.
    pub admin_url: String,
    /// Held by merod and in the state as admitted: in sync.
    pub in_sync: BTreeSet<GroupId>,
    /// Held by merod, neither admitted nor joining in the state.
    pub held_not_in_state: BTreeSet<GroupId>,
    /// Joining in the state (fleet-join sent, admission not recorded) and held by merod.
    pub joining_held: BTreeSet<GroupId>,
    /// Joining in the state and not held by merod.
    pub joining_not_held: BTreeSet<GroupId>,
    /// Admitted in the state, not held by merod.
    pub admitted_not_held: BTreeSet<GroupId>,
    /// Confirmed but not admitted in the file as written: must never happen.
    pub confirmed_not_admitted: BTreeSet<GroupId>,
    /// What loading the file repaired, in words.
    pub repairs: Vec<String>,
    /// Held by merod, not in the state, neither assigned nor retained by the daemon's latest
    /// poll; `None` without `--status` (then `held_not_in_state` may include assigned ones).
    pub orphans: Option<BTreeSet<GroupId>>,
    /// The state file is the Bash sidecar's: what its files beside it brought in.
    pub bash_import: Option<Imported>,
    /// The state file's directory is on a RAM filesystem: which (lost at reboot).
    pub state_ram_filesystem: Option<String>,
}

impl Drift {
    /// Whether anything differs.
    pub fn found(&self) -> bool {
        !(self.held_not_in_state.is_empty()
            && self.orphans.as_ref().is_none_or(BTreeSet::is_empty)
            && self.admitted_not_held.is_empty()
            && self.confirmed_not_admitted.is_empty()
            && self.repairs.is_empty())
    }
}

/// Reads the config, the state file, merod's listing and (with `status`, a `host:port`) the
/// daemon's live status, and compares them.
///
/// Errors: a one-line description of what could not be read.
pub async fn inspect(
    config: &Path,
    status: Option<&str>,
) -> Result<Drift, Box<dyn std::error::Error>> {
    let cfg = ToolConfig::load(config)?;
    let admin_url = resolve_admin_url(&cfg.merod).url;
    let (present, admitted, joining, confirmed_not_admitted, repairs, bash_import) =
        match StateStore::new(&cfg.state_file).inspect()? {
            StateFile::Missing => (
                false,
                BTreeSet::new(),
                BTreeSet::new(),
                BTreeSet::new(),
                Vec::new(),
                None,
            ),
            StateFile::Present(report) => {
                let flagged = report
                    .repairs
                    .iter()
                    .filter_map(|r| match r {
                        Repair::ConfirmedNotAdmitted(id) => Some(*id),
                        // The other repairs are the state's own: not drift against merod.
                        _ => None,
                    })
                    .collect();
                let words = report.repairs.iter().map(ToString::to_string).collect();
                let imported = report.bash_import.map(|i| Imported {
                    admitted: i.admitted.len(),
                    timers: i.absence_observed.len(),
                    recent_leaves: i.recent_leaves_ago.len(),
                });
                (
                    true,
                    report.state.admitted,
                    report.state.joining,
                    flagged,
                    words,
                    imported,
                )
            }
        };
    let held = MerodClient::new(&admin_url)?.list_namespaces().await?;
    let orphans = match status {
        None => None,
        Some(addr) => {
            let live = read_status(addr.parse()?).await?;
            // Before the daemon's first good poll its empty assignments say nothing: every
            // held namespace would look like an orphan.
            let (Some(assigned), Some(retain)) = (live.assigned(), live.retained()) else {
                return Err(format!(
                    "the daemon at {addr} has had no successful poll yet: orphans unknown"
                )
                .into());
            };
            let desired = Desired {
                assigned: assigned.clone(),
                retain: retain.clone(),
                ..Desired::default()
            };
            let state = State {
                admitted: admitted.clone(),
                joining: joining.clone(),
                ..State::default()
            };
            Some(reconcile::orphans(&held, &state, &desired))
        }
    };
    let state_ram_filesystem = volatile::check_state_dir(&cfg.state_file)?.map(|fs| fs.to_string());
    Ok(Drift {
        state_file: cfg.state_file,
        state_file_present: present,
        admin_url: admin_url.to_string(),
        in_sync: held.intersection(&admitted).copied().collect(),
        held_not_in_state: held
            .iter()
            .filter(|id| !admitted.contains(id) && !joining.contains(id))
            .copied()
            .collect(),
        joining_held: joining.intersection(&held).copied().collect(),
        joining_not_held: joining.difference(&held).copied().collect(),
        admitted_not_held: admitted.difference(&held).copied().collect(),
        confirmed_not_admitted,
        repairs,
        orphans,
        bash_import,
        state_ram_filesystem,
    })
}

/// The drift as a table, one namespace a line.
pub fn render_text(drift: &Drift) -> String {
    let mut out = format!(
        "state file {}{}\nmerod      {}\n",
        drift.state_file.display(),
        if drift.state_file_present {
            ""
        } else {
            " (missing: read as nothing admitted)"
        },
        drift.admin_url
    );
    let rows = [
        ("in sync", &drift.in_sync),
        ("held by merod, not in state", &drift.held_not_in_state),
        ("joining, held by merod", &drift.joining_held),
        ("joining, not held by merod", &drift.joining_not_held),
        ("admitted in state, not held", &drift.admitted_not_held),
        (
            "IMPOSSIBLE: confirmed, not admitted",
            &drift.confirmed_not_admitted,
        ),
    ];
    let orphans = drift.orphans.clone().unwrap_or_default();
    for (what, ids) in rows
        .into_iter()
        .chain([("ORPHAN: held, not assigned/retained", &orphans)])
    {
        for id in ids {
            out.push_str(&format!("{what:<36} {id}\n"));
        }
    }
    if let Some(i) = &drift.bash_import {
        out.push_str(&format!(
            "Bash sidecar's files imported: {} admitted, {} leave timers, {} recent leaves (the daemon's first write turns the state into its own format)\n",
            i.admitted, i.timers, i.recent_leaves
        ));
    }
    if let Some(fs) = &drift.state_ram_filesystem {
        out.push_str(&format!(
            "ERROR: the state file's directory is on a RAM filesystem ({fs}): lost at reboot\n"
        ));
    }
    for repair in &drift.repairs {
        out.push_str(&format!("repaired on load: {repair}\n"));
    }
    out.push_str(if drift.found() {
        "drift found\n"
    } else {
        "no drift\n"
    });
    out
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let args = Args::parse();
    match inspect(&args.config, args.status.as_deref()).await {
        Ok(drift) => {
            if args.json {
                match serde_json::to_string_pretty(&drift) {
                    Ok(text) => println!("{text}"),
                    Err(e) => {
                        eprintln!("fleet-inspect: {e}");
                        return ExitCode::from(2);
                    }
                }
            } else {
                print!("{}", render_text(&drift));
            }
            ExitCode::from(u8::from(drift.found()))
        }
        Err(e) => {
            eprintln!("fleet-inspect: {e}");
            ExitCode::from(2)
        }
    }
}
