//! # fleet-sidecar
//!
//! Keeps a Calimero TEE node's namespace membership in sync with what the fleet control
//! plane (MDMA) assigns to it. Runs beside `merod` on a TDX confidential VM: it reads the
//! node's PeerId and the TD's MRTD, polls MDMA's `should-join` every second, joins newly
//! assigned namespaces through merod's admin API (TDX-attested admission), confirms each
//! admission to MDMA, and leaves namespaces MDMA withdrew — leaving is irreversible (merod
//! purges the node's keys), so it never follows a failed or malformed poll.
//!
//! The modules are a library other admin tools can reuse:
//!
//! * [`config`] — the TOML config file, validated into strong types.
//! * [`identity`] — PeerId and admin URL from merod's `config.toml`.
//! * [`mrtd`] — the TD's MRTD from sysfs, the TDREPORT ioctl, or a TD quote.
//! * [`mdma`] — the control-plane client (`should-join`, `confirm`).
//! * [`merod`] — the node's admin API client over `calimero-client`.
//! * [`reconcile`] — the pure decision of what to join and leave (no I/O, no clock).
//! * [`state`] — the persisted admitted/confirmed sets, written atomically.
//! * [`daemon`] — the loop that wires them together.
//! * [`telemetry`] — metrics and the live status the loop records.
//! * [`status`] — the optional `/healthz` `/readyz` `/metrics` `/status` listener and the
//!   `fleet-sidecar status` report.
//! * [`notify`] — systemd `Type=notify` readiness, status and watchdog.
//! * [`logging`] — text or JSON lines to stderr and the log file.
//! * [`emulator`] — loopback MDMA and merod test doubles for the demo and the tests.
//!
//! See ARCHITECTURE.md for the invariants.

#![warn(missing_docs)]

pub mod config;
pub mod daemon;
pub mod emulator;
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing;
pub mod identity;
pub mod ids;
pub mod logging;
pub mod mdma;
pub mod merod;
pub mod mrtd;
pub mod notify;
pub mod reconcile;
pub mod state;
pub mod status;
pub mod telemetry;
