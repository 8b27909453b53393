//! `fleet-membership`: what merod holds, what the sidecar's state says and what MDMA assigns,
//! side by side, as JSON. An admin tool built only on `fleet_sidecar`'s promised API (the
//! snapshot in `api/`), with the crate's default features off.
//!
//! ```sh
//! cargo run -p library-alone --example fleet-membership -- \
//!     --config /etc/calimero/fleet-sidecar.toml [--status 127.0.0.1:9464]
//! ```
//!
//! What MDMA assigns comes from the running daemon's status listener (`--status`, the
//! daemon's `status_listen`): the assignments and `retain` of its latest successful poll.
//! The tool never asks MDMA itself, since a `should-join` from it would count as the node's
//! heartbeat. Without `--status`, or before the daemon's first good poll, MDMA's side is
//! `unknown`, never an empty set.
//!
//! One row per namespace that any side names: `merod` (`held` or `not held`), `state`
//! (`confirmed`, `admitted`, `joining` or `none`), `mdma` (`assigned`, `retained`,
//! `not assigned` or `unknown`). Exit 0 when every side asked for was read, 2 when one could
//! not be (the JSON is printed first, with that side `null` and the reason beside it).

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::Parser;
use fleet_sidecar::config::DEFAULT_CONFIG_PATH;
use fleet_sidecar::status::read_status;
use fleet_sidecar::{resolve_admin_url, GroupId, MerodClient, StateFile, StateStore, ToolConfig};
use serde::Serialize;

/// Prints what merod holds, what the state says and what MDMA assigns, as JSON.
#[derive(Parser, Debug)]
#[command(name = "fleet-membership")]
struct Args {
    /// The sidecar's config file (only `[merod]` and `state_file` are read).
    #[arg(long, value_name = "PATH", default_value = DEFAULT_CONFIG_PATH)]
    config: PathBuf,
    /// The running daemon's status listener (`status_listen`): MDMA's side.
    #[arg(long, value_name = "HOST:PORT")]
    status: Option<SocketAddr>,
}

/// The three sides and the rows that line them up.
#[derive(Debug, Serialize)]
pub struct Membership {
    /// merod's admin API and what it holds (`null` if it could not be read).
    pub merod: Side<BTreeSet<GroupId>>,
    /// The sidecar's state file: its path and sets (`null` if it could not be read).
    pub state: Side<StateSets>,
    /// MDMA's assignments by the daemon's latest good poll (`null` when unknown).
    pub mdma: Side<MdmaSets>,
    /// One row per namespace any side names, sorted by id.
    pub namespaces: Vec<Row>,
}

/// One side: where it was read from, what it says, or why it is unknown.
#[derive(Debug, Serialize)]
pub struct Side<T> {
    /// The URL or path it was read from.
    pub from: String,
    /// What it says; `None` when unknown.
    pub says: Option<T>,
    /// Why it is unknown.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub unknown: Option<String>,
}

impl<T> Side<T> {
    fn read<E: std::fmt::Display>(from: String, read: Result<T, E>) -> Self {
        match read {
            Ok(says) => Side {
                from,
                says: Some(says),
                unknown: None,
            },
            Err(e) => Side {
                from,
                says: None,
                unknown: Some(e.to_string()),
            },
        }
    }
}

/// The state's sets (a missing file is a state with nothing in it).
#[derive(Debug, Default, Serialize)]
pub struct StateSets {
    /// Whether the file exists.
    pub present: bool,
    /// Namespaces merod admitted.
    pub admitted: BTreeSet<GroupId>,
    /// Admitted namespaces MDMA acknowledged.
    pub confirmed: BTreeSet<GroupId>,
    /// Joins sent whose admission was not recorded yet.
    pub joining: BTreeSet<GroupId>,
}

/// MDMA's sets, by the daemon's latest successful poll.
#[derive(Debug, Serialize)]
pub struct MdmaSets {
    /// When that poll answered (Unix seconds).
    pub polled_at: f64,
    /// The assignments.
    pub assigned: BTreeSet<GroupId>,
    /// Withdrawn, but kept at MDMA's asking.
    pub retain: BTreeSet<GroupId>,
}

/// One namespace, side by side.
#[derive(Debug, PartialEq, Eq, Serialize)]
pub struct Row {
    /// The namespace id (64 hex).
    pub id: GroupId,
    /// `held`, `not held` or `unknown`.
    pub merod: &'static str,
    /// `confirmed`, `admitted`, `joining`, `none` or `unknown`.
    pub state: &'static str,
    /// `assigned`, `retained`, `not assigned` or `unknown`.
    pub mdma: &'static str,
}

/// Reads the three sides: merod's listing (every page), the state file as a tool reads it,
/// and, with `status`, the daemon's live status. A side that cannot be read is unknown; only
/// an unreadable config is an error.
pub async fn membership(
    config: &Path,
    status: Option<SocketAddr>,
) -> Result<Membership, fleet_sidecar::ConfigError> {
    let cfg = ToolConfig::load(config)?;
    let admin_url = resolve_admin_url(&cfg.merod).url;
    let held = match MerodClient::new(&admin_url) {
        Ok(merod) => merod.list_namespaces().await,
        Err(e) => Err(e),
    };
    let merod = Side::read(admin_url.to_string(), held);
    let state = Side::read(
        cfg.state_file.display().to_string(),
        StateStore::new(&cfg.state_file)
            .inspect()
            .map(|file| match file {
                StateFile::Missing => StateSets::default(),
                StateFile::Present(report) => StateSets {
                    present: true,
                    admitted: report.state.admitted,
                    confirmed: report.state.confirmed,
                    joining: report.state.joining,
                },
            }),
    );
    let mdma = match status {
        None => Side::read(
            "--status".to_owned(),
            Err("no --status given: only the daemon knows MDMA's latest answer"),
        ),
        Some(addr) => Side::read(
            format!("http://{addr}/status"),
            read_status(addr)
                .await
                .map_err(|e| e.to_string())
                .and_then(
                    |live| match (live.last_ok_poll_at, live.assigned(), live.retained()) {
                        (Some(polled_at), Some(assigned), Some(retain)) => Ok(MdmaSets {
                            polled_at,
                            assigned: assigned.clone(),
                            retain: retain.clone(),
                        }),
                        _ => Err("the daemon has had no successful poll yet".to_owned()),
                    },
                ),
        ),
    };
    let namespaces = rows(merod.says.as_ref(), state.says.as_ref(), mdma.says.as_ref());
    Ok(Membership {
        merod,
        state,
        mdma,
        namespaces,
    })
}

/// The rows: every namespace any known side names, each side's word for it.
pub fn rows(
    held: Option<&BTreeSet<GroupId>>,
    state: Option<&StateSets>,
    mdma: Option<&MdmaSets>,
) -> Vec<Row> {
    let mut ids: BTreeSet<&GroupId> = BTreeSet::new();
    ids.extend(held.into_iter().flatten());
    if let Some(s) = state {
        ids.extend(s.admitted.iter().chain(&s.confirmed).chain(&s.joining));
    }
    if let Some(m) = mdma {
        ids.extend(m.assigned.iter().chain(&m.retain));
    }
    ids.into_iter()
        .map(|id| Row {
            id: *id,
            merod: match held {
                None => "unknown",
                Some(h) if h.contains(id) => "held",
                Some(_) => "not held",
            },
            state: match state {
                None => "unknown",
                Some(s) if s.confirmed.contains(id) => "confirmed",
                Some(s) if s.admitted.contains(id) => "admitted",
                Some(s) if s.joining.contains(id) => "joining",
                Some(_) => "none",
            },
            mdma: match mdma {
                None => "unknown",
                Some(m) if m.assigned.contains(id) => "assigned",
                Some(m) if m.retain.contains(id) => "retained",
                Some(_) => "not assigned",
            },
        })
        .collect()
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let args = Args::parse();
    let asked_mdma = args.status.is_some();
    match membership(&args.config, args.status).await {
        Ok(m) => {
            match serde_json::to_string_pretty(&m) {
                Ok(text) => println!("{text}"),
                Err(e) => {
                    eprintln!("fleet-membership: {e}");
                    return ExitCode::from(2);
                }
            }
            let read_all = m.merod.says.is_some()
                && m.state.says.is_some()
                && (m.mdma.says.is_some() || !asked_mdma);
            if read_all {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(2)
            }
        }
        Err(e) => {
            eprintln!("fleet-membership: {e}");
            ExitCode::from(2)
        }
    }
}
