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
//! ```toml
//! [dependencies]
//! fleet-sidecar = { version = "0.1", default-features = false }
//! [dev-dependencies]
//! # The loopback fakes of merod and MDMA, for your tests (still no daemon).
//! fleet-sidecar = { version = "0.1", default-features = false, features = ["testing"] }
//! ```
//!
//! The library is grouped by concern, one module for each thing a tool talks to or reads:
//! [`config`] (the config file), [`identity`] (merod's `config.toml`), [`ids`] (namespace ids
//! and PeerIds), [`merod`] (the admin API client), [`mdma`] (the control plane client),
//! [`metadata`] (the instance metadata server), [`mrtd`] (the TD's measurement), [`state`]
//! (the sidecar's state file), [`status`] (the running daemon's live status, read from its
//! listener) and [`reconcile`] (the pure decision of what to join and leave).
//! The crate root re-exports only the names nearly every tool uses (at most 40). What is
//! promised is the public API written down in `api/` of the repository (default features off,
//! and with `testing`), checked in CI; every change to it is recorded in `CHANGELOG.md`, and
//! the README says how versions follow it. The `daemon` and `cli` modules (with the `daemon`
//! feature) are the daemon's own and not promised.
//!
//! | need | items |
//! |---|---|
//! | the sidecar's config | [`ToolConfig`] (`[merod]`, `state_file`, `[tdx]`, `mdma_url`; nothing required), [`ToolConfig::mdma_credentials`] (token and CA file, the daemon's checks), [`resolve_admin_url`], [`read_peer_id`]; [`Config`] is the daemon's (every check) |
//! | merod's admin API, every call with its own deadline | [`MerodClient`] ([`MerodClient::list_namespaces`] every page, [`MerodClient::identity`], [`MerodClient::node_key`] ([`NodeKey`]: 64 hex or rc.25's base58), [`MerodClient::tee_role`], and through the [`Node`] trait `probe`, `fleet_join` with `admitterAddrs`, `leave_namespace`, `holds_namespace` on merod's own 404s), [`merod::MerodClientBuilder`], [`Admission`] with [`merod::Refusal`]s, [`TeeRole`], [`MerodError`] |
//! | MDMA, with the daemon's HTTP rules | [`MdmaClient::from_tool_config`], [`MdmaClient::post_json`] (any call, e.g. `api/fleet/inventory`) and [`MdmaAnswer`], [`CallError`]; through the [`ControlPlane`] trait `should_join` (with a [`mdma::NodeReport`]: `held_namespaces`; `should_join_if_changed`, told what the caller holds ([`mdma::Holding`]: the [`mdma::AnswerDigest`] of its answer, the namespaces joined), says [`mdma::Polled::Unchanged`] for the same bytes and leaves the joined namespaces' `admitter_addrs` out of a changed answer), `confirm` (with the role) and `join_status` ([`mdma::JoinStatus`]) |
//! | the TD's MRTD, live or from saved bytes | [`read_mrtd_bounded`] (with a deadline; [`read_mrtd_bounded_async`] from async code; [`TdxConfig::without_side_effects`] leaves out the configfs-tsm quote), [`read_saved`], [`Mrtd`], [`mrtd::parse_sysfs`], [`mrtd::parse_tdreport`], [`mrtd::parse_quote`] |
//! | attested registration (a per-node token) | [`MdmaClient::challenge`], [`MdmaClient::register`] ([`mdma::RegisterRequest`], [`mdma::Registered`], [`mdma::RegisterError`]); [`MerodClient::identity`], [`MerodClient::registration_attest`], [`MerodClient::attest`] |
//! | the sidecar's state file | [`StateStore`], [`State`], [`StateFile`], [`StateReport`], [`Repair`] |
//! | ids | [`GroupId`] (64 hex chars), [`PeerId`] |
//! | what MDMA assigns, without a heartbeat: the running daemon's sets | [`status::read_status`] (its `status_listen`), [`status::DaemonStatus`] ([`status::DaemonStatus::assigned`] is `None` before its first good poll), [`status::StatusError`] |
//! | fakes for your tests (`testing` feature) | `testing::merod::MerodEmulator`, `testing::mdma::MdmaEmulator` (see below) |
//!
//! Every type a tool prints is `Display` and `Serialize` ([`GroupId`] and [`Mrtd`] as
//! lowercase hex, [`NodeKey`] as 64 lowercase hex, [`PeerId`] as its base58 text, [`MrtdSource`] and [`state::StateFormat`] by name,
//! [`MrtdReading`], [`StateReport`] and [`StateFile`] as JSON objects), so
//! `serde_json::json!({"mrtd": reading.mrtd, "namespaces": held})` is a body to post.
//!
//! Errors have one machine-readable form. [`MrtdError`], [`MrtdUnavailable`], [`MerodError`],
//! [`StateError`] and [`IdentityError`] each have `kind()`, a stable kebab-case `&'static str`
//! naming the failure (e.g. `timeout` apart from `call` for a refused merod call, `not-present`
//! for a missing sysfs file, `no-sources` for an MRTD read with nothing left to try), and are
//! `Serialize` as `{"kind": <kind()>, "message": <Display>}` ([`MrtdUnavailable`] adds
//! `failures`, one `{"source", "kind", "message"}` per source tried).
//! [`PollError::metric_label`] is the same idea for the poll. A refusal by MDMA,
//! [`RequestError::Status`], keeps the start of MDMA's answer (its reason, never a header).
//! The daemon makes its merod and MDMA calls through these same clients.
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
//! A tool that posts an inventory to MDMA (the token from `fleet_token` or
//! `fleet_token_file`, checked as the daemon checks it):
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use std::path::Path;
//! use std::time::Duration;
//! use fleet_sidecar::{read_mrtd_bounded_async, resolve_admin_url, MdmaClient, MerodClient, ToolConfig};
//!
//! let cfg = ToolConfig::load(Path::new("/etc/calimero/fleet-sidecar.toml"))?;
//! let held = MerodClient::new(&resolve_admin_url(&cfg.merod).url)?.list_namespaces().await?;
//! // At most 5 s, off the runtime's threads; looks only (no configfs-tsm quote).
//! let mrtd = read_mrtd_bounded_async(&cfg.tdx.without_side_effects(), Duration::from_secs(5))
//!     .await
//!     .ok();
//! let body = serde_json::json!({"mrtd": mrtd.map(|r| r.mrtd), "namespaces": held});
//! let answer = MdmaClient::from_tool_config(&cfg)?
//!     .post_json("api/fleet/inventory", &body)
//!     .await?;
//! println!("MDMA answered HTTP {}", answer.status);
//! # Ok(()) }
//! ```
//!
//! Never send `should-join` from a tool: MDMA counts it as the node's heartbeat. What MDMA
//! assigns is in the running daemon's status ([`status::read_status`]).
//!
//! Two whole tools are in the repository, each built in CI with default features off on the
//! promised API alone (`library-alone/` builds them so):
//! - `examples/fleet-inspect.rs` prints the drift between the state file and merod (held
//!   but not recorded; admitted but not held; confirmed but not admitted, which must be
//!   impossible), with `--json`, exit 0 in sync, 1 drift, 2 unreadable; with
//!   `--status HOST:PORT` (the daemon's `status_listen`) it names the orphans too;
//! - `examples/fleet-membership.rs` prints what merod holds, what the state says and what
//!   MDMA assigns (by the daemon's latest good poll, with `--status`), one row per
//!   namespace, as JSON; a side it cannot read is `unknown`, never empty (exit 2).
//!
//! ```sh
//! cargo run -p library-alone --example fleet-inspect -- --config /etc/calimero/fleet-sidecar.toml
//! cargo run -p library-alone --example fleet-membership -- --config /etc/calimero/fleet-sidecar.toml [--status 127.0.0.1:9464]
//! ```
//!
//! Without the daemon feature none of axum, prometheus-client, sd-notify or
//! tracing-subscriber is built; `library-alone/` in the repository builds and tests the
//! library that way in CI (the dependency counts and binary sizes are in the repository's
//! `bench/RESULTS.md`).
//!
//! ## Testing a tool: the `testing` feature
//!
//! `testing::merod::MerodEmulator` and `testing::mdma::MdmaEmulator` are loopback fakes
//! (`127.0.0.1`, a free port, in memory) that answer with the shapes recorded from a real
//! merod 0.11 and the fleet's MDMA: the namespace listing in pages of `offset`/`limit`,
//! fleet-join, leave, membership, readiness; should-join, confirm, and any path you script.
//! They inject failures and hangs (`set_join`, `set_leave`, `set_list` (all pages, or after
//! the first n with `ListBehaviour::ErrorAfterPages`), `set_ready`;
//! `set_reply`, `fail_next_confirms`, `set_answer`) and record every call. They need a tokio
//! runtime and nothing of the daemon. A test (the whole of it; `library-alone/tests/inventory.rs`
//! in the repository goes further):
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! use fleet_sidecar::testing::mdma::{CallReply, MdmaEmulator};
//! use fleet_sidecar::testing::merod::{ListBehaviour, MerodEmulator};
//! use fleet_sidecar::{MdmaClient, MerodClient};
//!
//! let merod = MerodEmulator::start().await.unwrap();
//! for n in 0..150u32 {
//!     merod.hold(&format!("{n:064x}")); // more than one page of the listing
//! }
//! let client = MerodClient::new(&merod.url()).unwrap();
//! assert_eq!(client.list_namespaces().await.unwrap().len(), 150);
//! merod.set_list(ListBehaviour::Error { status: 500 });
//! assert!(client.list_namespaces().await.is_err());
//!
//! let mdma = MdmaEmulator::start(Some("NEVER-LOGGED-TOKEN".into())).await.unwrap();
//! mdma.set_answer("api/fleet/inventory", CallReply::Json(200, serde_json::json!({"ok": true})));
//! let posted = MdmaClient::builder(mdma.url())
//!     .token(fleet_sidecar::FleetToken::new("NEVER-LOGGED-TOKEN"))
//!     .build()
//!     .unwrap()
//!     .post_json("api/fleet/inventory", &serde_json::json!({"namespaces": []}))
//!     .await
//!     .unwrap();
//! assert_eq!(posted.status, 200);
//! assert_eq!(mdma.requests()[0].body, r#"{"namespaces":[]}"#);
//! # }
//! ```
//!
//! ## Embedding the loop
//!
#![cfg_attr(
    feature = "daemon",
    doc = "With the `daemon` feature, [`daemon::run`] runs the whole loop against any
[`ControlPlane`] and [`Node`] (the real clients, or your own), and [`reconcile::plan`]
is the pure decision of what to join and leave, for a tool that wants to show what the
sidecar would do. [`cli::main`] is the `fleet-sidecar` command line itself. `daemon` and
`cli` are not part of the library's promise: they change in any version."
)]
#![cfg_attr(
    not(feature = "daemon"),
    doc = "With the `daemon` feature, `daemon::run` runs the whole loop against any
[`ControlPlane`] and [`Node`] (the real clients, or your own), and `cli::main` is the
`fleet-sidecar` command line itself (neither is built without the feature: see
[Features](#features)); neither is part of the library's promise.
[`reconcile::plan`] is the pure decision of what to join and
leave, for a tool that wants to show what the sidecar would do."
)]
//!
//! ## Features
//!
//! * `daemon` (default): the loop, the `fleet-sidecar` binary and what only it needs.
//! * `testing`: the loopback fakes of merod and MDMA (the `testing` module, `testing::sandbox` aside) for tests; none of the
//!   daemon's dependencies. Never in a production build.
//! * `emulator`: `testing` plus the daemon and `testing::sandbox` (a node layout the real
//!   daemon runs in), for the demo and this crate's tests.
//!
//! The contracts the code relies on are written down in `docs/` of the repository
//! (`docs/mdma.md`, `docs/merod-admin.md`, `docs/tdx.md`); ARCHITECTURE.md gives the
//! invariants.

/// `Serialize` for an error type with a `kind()`: `{"kind": <kind()>, "message": <Display>}`
/// (the one JSON form of the library's errors; see the front page).
macro_rules! serialize_kind_and_message {
    ($ty:ty) => {
        impl serde::Serialize for $ty {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                use serde::ser::SerializeStruct;
                let mut out = s.serialize_struct(stringify!($ty), 2)?;
                out.serialize_field("kind", self.kind())?;
                out.serialize_field("message", &self.to_string())?;
                out.end()
            }
        }
    };
}

#[cfg(feature = "daemon")]
mod backoff;
#[cfg(feature = "daemon")]
pub mod cli;
pub mod config;
#[cfg(feature = "daemon")]
pub mod daemon;
#[cfg(feature = "daemon")]
mod dropped;
mod durable;
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing;
pub mod identity;
pub mod ids;
#[cfg(feature = "daemon")]
mod jobs;
#[cfg(feature = "daemon")]
mod logging;
pub mod mdma;
pub mod merod;
pub mod metadata;
pub mod mrtd;
mod net;
#[cfg(feature = "daemon")]
mod node_tls;
#[cfg(feature = "daemon")]
mod notify;
#[cfg(feature = "daemon")]
mod outcome;
pub mod reconcile;
#[cfg(feature = "daemon")]
mod registration;
pub mod state;
pub mod status;
mod strict_json;
#[cfg(feature = "daemon")]
mod telemetry;
#[cfg(feature = "testing")]
pub mod testing;

// The names nearly every tool uses; everything else is at its module's path.
pub use config::{Config, ConfigError, ToolConfig};
pub use identity::{read_peer_id, resolve_admin_url, IdentityError};
pub use ids::{GroupId, PeerId};
pub use mdma::{
    CallError, ControlPlane, FleetToken, MdmaAnswer, MdmaClient, PollError, RequestError,
};
pub use merod::{Admission, MerodClient, MerodError, Node, NodeKey, TeeRole};
pub use mrtd::{
    read_mrtd_bounded, read_mrtd_bounded_async, read_saved, Mrtd, MrtdError, MrtdReading,
    MrtdSource, MrtdUnavailable, TdxConfig,
};
pub use state::{Repair, State, StateError, StateFile, StateReport, StateStore};
