//! Fuzzing entry points (cargo feature `fuzzing`, off by default): one function per parser
//! of outside input, each feeding raw bytes to the real parser and dropping the result.
//! Used by the `cargo fuzz` targets in `fuzz/` and by the corpus-replay test
//! (`tests/fuzz_corpus.rs`), which runs every committed corpus on stable. Not an API.

use std::path::Path;

use crate::ids::GroupId;

/// The group id the membership target asks about (the corpus holds answers naming it).
const ASKED: &str = "38069a4cc4285c4245c84587ac60084ba53502a8b91c9b108bca40f10ec4d3df";

/// MDMA's `should-join` 200 body ([`crate::mdma::parse_should_join`]).
pub fn should_join(data: &[u8]) {
    let _ = crate::mdma::parse_should_join(data);
}

/// merod's `fleet-join` answer: the body as JSON (as the client decodes it), then
/// [`crate::merod::parse_fleet_join`].
pub fn fleet_join(data: &[u8]) {
    if let Ok(answer) = serde_json::from_slice::<serde_json::Value>(data) {
        let _ = crate::merod::parse_fleet_join(&answer);
    }
}

/// merod's `GET /admin-api/namespaces/{id}` answer: the first two bytes pick the HTTP
/// status (big-endian), the rest is the body, decoded as the client does (not JSON → null),
/// then `merod::parse_namespace_get`.
pub fn namespace_get(data: &[u8]) {
    let (status, body) = match data {
        [hi, lo, rest @ ..] => (u16::from_be_bytes([*hi, *lo]), rest),
        _ => return,
    };
    let body = serde_json::from_slice(body).unwrap_or(serde_json::Value::Null);
    if let Ok(asked) = ASKED.parse::<GroupId>() {
        let _ = crate::merod::parse_namespace_get(status, &body, asked);
    }
}

/// The state file ([`crate::state::parse_state`]).
pub fn state_file(data: &[u8]) {
    let _ = crate::state::parse_state(data, Path::new("fuzz-state.json"));
}

/// The sidecar's TOML config ([`crate::config::Config::from_toml`]); bytes that are not
/// UTF-8 are refused before it, as [`crate::config::Config::load`] does.
pub fn sidecar_config(data: &[u8]) {
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = crate::config::Config::from_toml(text, Path::new("fuzz.toml"));
    }
}

/// merod's `config.toml`, through what the two public readers
/// ([`crate::identity::read_peer_id`], the admin URL reader of `identity`) do once
/// the file is read; bytes that are not UTF-8 end there as a read error, as from a file.
pub fn merod_config(data: &[u8]) {
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = crate::identity::parse_text(text);
    }
}

/// The sysfs MRTD attribute ([`crate::mrtd::parse_sysfs`]).
pub fn sysfs_mrtd(data: &[u8]) {
    let _ = crate::mrtd::parse_sysfs(data);
}

/// A TDREPORT ([`crate::mrtd::parse_tdreport`]).
pub fn tdreport(data: &[u8]) {
    let _ = crate::mrtd::parse_tdreport(data);
}

/// A TD quote ([`crate::mrtd::parse_quote`]).
pub fn quote(data: &[u8]) {
    let _ = crate::mrtd::parse_quote(data);
}

/// A fuzz target: raw bytes in, result dropped.
pub type Target = fn(&[u8]);

/// Every target by name, for the corpus-replay test.
pub const TARGETS: &[(&str, Target)] = &[
    ("should_join", should_join),
    ("fleet_join", fleet_join),
    ("namespace_get", namespace_get),
    ("state_file", state_file),
    ("sidecar_config", sidecar_config),
    ("merod_config", merod_config),
    ("sysfs_mrtd", sysfs_mrtd),
    ("tdreport", tdreport),
    ("quote", quote),
];
