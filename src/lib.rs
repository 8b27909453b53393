//! # fleet-sidecar
//!
//! Keeps a Calimero TEE node's namespace membership in sync with what the fleet control
//! plane (MDMA) assigns to it. Runs beside `merod` on a TDX confidential VM: it reads the
//! node's PeerId and the TD's MRTD, polls MDMA's `should-join` every second, joins newly
//! assigned namespaces through merod's admin API (TDX-attested admission), confirms each
//! admission to MDMA, and leaves namespaces MDMA withdrew. Leaving is irreversible (merod
//! purges the node's keys), so it never follows a failed or malformed poll.
//!
//! ## For authors of other admin tools
//!
//! The crate is also a library. With `default-features = false` it is only the pieces below
//! (no HTTP listener, metrics, systemd notify, command line or log subscriber):
//!
//! | need | items |
//! |---|---|
//! | merod's admin API, every call with its own deadline | [`MerodClient`], [`MerodClientBuilder`], [`Admission`], [`MerodError`] |
//! | MDMA's fleet API (`should-join`, `confirm`) | [`MdmaClient`], [`ShouldJoin`], [`FleetToken`], [`PollError`] |
//! | the sidecar's state file | [`StateStore`], [`State`], [`StateFile`], [`StateReport`], [`Repair`] |
//! | the TD's MRTD, live or from saved bytes | [`read_mrtd`], [`read_saved`], [`Mrtd`], [`parse_sysfs`], [`parse_tdreport`], [`parse_quote`] |
//! | ids | [`GroupId`] (64 hex chars), [`PeerId`] |
//! | the sidecar's config | [`Config`] (the daemon's, every check), [`ToolConfig`] (`[merod]` and `state_file` only), [`resolve_admin_url`], [`read_peer_id`] |
//!
//! A tool that compares the state with what merod holds (the whole of
//! `examples/fleet-inspect.rs` is built this way):
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use std::path::Path;
//! use fleet_sidecar::{resolve_admin_url, MerodClient, StateFile, StateStore, ToolConfig};
//!
//! // Needs only [merod] and state_file: no MDMA URL, the token file is never opened.
//! let cfg = ToolConfig::load(Path::new("/etc/calimero/fleet-sidecar.toml"))?;
//! let merod = MerodClient::new(&resolve_admin_url(&cfg.merod).url)?;
//! let held = merod.list_namespaces().await?;
//! match StateStore::new(&cfg.state_file).inspect()? {
//!     StateFile::Missing => println!("no state file at {}", cfg.state_file.display()),
//!     StateFile::Present(report) => {
//!         for id in report.state.admitted.difference(&held) {
//!             println!("admitted in the state but not held by merod: {id}");
//!         }
//!         for repair in &report.repairs {
//!             println!("repaired on load: {repair}");
//!         }
//!     }
//! }
//! # Ok(()) }
//! ```
//!
//! Never send `should-join` from a tool: MDMA counts it as the node's heartbeat.
//!
//! ## Embedding the loop
//!
#![cfg_attr(
    feature = "daemon",
    doc = "With the `daemon` feature, [`daemon::run`] runs the whole loop against any
[`ControlPlane`] and [`Node`] (the real clients, or your own), and [`reconcile::plan`]
is the pure decision of what to join and leave, for a tool that wants to show what the
sidecar would do. [`cli::main`] is the `fleet-sidecar` command line itself."
)]
#![cfg_attr(
    not(feature = "daemon"),
    doc = "With the `daemon` feature, `daemon::run` runs the whole loop against any
[`ControlPlane`] and [`Node`] (the real clients, or your own), and `cli::main` is the
`fleet-sidecar` command line itself (neither is built without the feature: see
[Features](#features)). [`reconcile::plan`] is the pure decision of what to join and
leave, for a tool that wants to show what the sidecar would do."
)]
//!
//! ## Features
//!
//! * `daemon` (default): the loop, the `fleet-sidecar` binary and what only it needs.
//! * `emulator`: loopback MDMA and merod stand-ins for the demo and the tests; never in a
//!   production build.
//!
//! The contracts the code relies on are written down in `docs/` of the repository
//! (`docs/mdma.md`, `docs/merod-admin.md`, `docs/tdx.md`); ARCHITECTURE.md gives the
//! invariants.

#[cfg(feature = "daemon")]
mod backoff;
#[cfg(feature = "daemon")]
pub mod cli;
mod config;
#[cfg(feature = "daemon")]
pub mod daemon;
#[cfg(feature = "testing")]
pub mod emulator;
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing;
mod identity;
mod ids;
#[cfg(feature = "daemon")]
mod logging;
mod mdma;
mod merod;
mod mrtd;
#[cfg(feature = "daemon")]
mod notify;
pub mod reconcile;
mod state;
mod strict_json;
#[cfg(feature = "daemon")]
mod telemetry;

pub use config::{
    Config, ConfigError, LogFormat, LogTarget, MdmaCredentials, MerodConfig, ToolConfig,
    DEFAULT_ADMIN_URL, DEFAULT_CONFIG_PATH,
};
pub use identity::{
    read_peer_id, resolve_admin_url, AdminUrl, AdminUrlSource, IdentityError, ListenAddrError,
};
pub use ids::{GroupId, GroupIdError, PeerId, PeerIdError};
pub use mdma::{
    CallError, ConfirmError, ControlPlane, FleetToken, MalformedAnswer, MdmaAnswer, MdmaClient,
    MdmaClientBuilder, MdmaClientError, PollError, RequestError, ShouldJoin, MAX_POLL_BODY,
    MDMA_TIMEOUT,
};
pub use merod::{
    Admission, MerodClient, MerodClientBuilder, MerodError, MerodOp, Node, CHECK_TIMEOUT,
    JOIN_TIMEOUT, LEAVE_TIMEOUT, MEROD_CONNECT_TIMEOUT, PROBE_TIMEOUT,
};
pub use mrtd::{
    parse_quote, parse_sysfs, parse_tdreport, read_mrtd, read_mrtd_bounded, read_saved, Mrtd,
    MrtdError, MrtdReading, MrtdSource, MrtdUnavailable, SavedEvidence, TdxConfig,
    MRTD_READ_TIMEOUT, SAVED_EVIDENCE_LIMIT, TDREPORT_LEN,
};
pub use state::{
    inspect_state, Repair, State, StateError, StateFile, StateFormat, StateReport, StateStore,
    STATE_VERSION,
};

// The parsers and the state writer as pure functions, for the contract and schema tests and
// the benches (a tool uses the clients and `StateStore`): not part of the documented API.
#[doc(hidden)]
pub use mdma::parse_should_join;
#[doc(hidden)]
pub use merod::{parse_fleet_join, NoAdmitted};
#[doc(hidden)]
pub use state::{parse_state, render_state};
