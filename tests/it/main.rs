//! Integration tests: the real loop, clients and binary against the loopback emulators
//! (one test binary, modules by theme).

// A test binary has no audience: its helpers are `pub` for the modules beside them, which
// the crate's `unreachable_pub` lint (Cargo.toml) would otherwise ask to spell `pub(crate)`.
#![allow(unreachable_pub)]

mod check_config;
mod cli;
mod clock_step;
mod common;
mod confirm_gate;
mod contract;
mod crash;
mod deliveries;
mod device_login;
mod fakes;
mod faults;
mod heartbeat;
mod held;
mod idle;
mod inspect;
mod inventory;
mod jobs;
mod journald;
mod leave_policy;
mod loop_properties;
mod migration;
mod monitoring;
mod node_report;
mod operability;
mod packaging;
mod poll_gate;
mod proto;
mod reconcile_loop;
mod recovery;
mod registration;
mod reliability;
mod schema;
mod soak;
mod storms;
mod time_rules;
mod tls;
mod transport;
mod watchdog;
