//! Integration tests: the real loop, clients and binary against the loopback emulators
//! (one test binary, modules by theme).

mod cli;
mod common;
mod contract;
mod crash;
mod heartbeat;
mod history;
mod operability;
mod packaging;
mod paused;
mod poll_gate;
mod proto;
mod reconcile_loop;
mod soak;
mod tls;
