//! Integration tests: the real loop, clients and binary against the loopback emulators
//! (one test binary, modules by theme).

mod check_config;
mod cli;
mod common;
mod contract;
mod crash;
mod deb;
mod fakes;
mod faults;
mod heartbeat;
mod history;
mod idle;
mod inspect;
mod journald;
mod monitoring;
mod operability;
mod packaging;
mod paused;
mod poll_gate;
mod proto;
mod reconcile_loop;
mod schema;
mod soak;
mod tls;
mod transport;
mod watchdog;
