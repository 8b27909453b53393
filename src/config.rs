//! The sidecar's configuration file (`/etc/calimero/fleet-sidecar.toml` by default).
//!
//! Two levels, as in ripgrep's low/high args: a private raw form is exactly what the TOML
//! says (unknown keys are an error that names the key), and [`Config`] is the validated form
//! with strong types (`Url`, `Duration`, paths) that the daemon runs on; [`ToolConfig`] is
//! the part a tool needs, with nothing required. Loading touches only the
//! config file itself: nothing here reads merod's files, sysfs, or the network.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;
use url::Url;

use crate::mdma::{FleetToken, MdmaClient, MdmaClientError};
use crate::mrtd::TdxConfig;
use crate::net::is_loopback;
use crate::reconcile::LeavePolicy;

/// Where the daemon looks for its config file unless `--config` says otherwise.
pub const DEFAULT_CONFIG_PATH: &str = "/etc/calimero/fleet-sidecar.toml";
/// merod's admin API when neither `[merod].admin_url` nor merod's `[server].listen` says.
pub const DEFAULT_ADMIN_URL: &str = "http://127.0.0.1:2528";

impl<'de> Deserialize<'de> for FleetToken {
    /// A string. Anything else is refused without echoing the value (an unquoted token
    /// that parses as a number must not appear in the error).
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        match toml::Value::deserialize(d)? {
            toml::Value::String(s) => Ok(FleetToken::new(s)),
            _ => Err(serde::de::Error::custom("must be a quoted string")),
        }
    }
}

/// Whether a token can be sent as an HTTP header value (no control chars, no line break).
fn header_safe(token: &str) -> bool {
    reqwest::header::HeaderValue::from_str(token).is_ok()
}

/// The config file as written, before validation. Every key is optional except
/// `mdma_url`; an unknown key is an error naming it.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawConfig {
    /// MDMA base URL; must be `https://` (plain `http://` only for a loopback host).
    pub mdma_url: Option<String>,
    /// Sent as `X-Fleet-Token` when set.
    pub fleet_token: Option<FleetToken>,
    /// A file holding the fleet token (instead of `fleet_token`); must not be group- or
    /// world-readable. Surrounding whitespace is trimmed.
    pub fleet_token_file: Option<PathBuf>,
    /// A PEM file with extra trust roots for MDMA's TLS, added to the system roots.
    pub mdma_ca_file: Option<PathBuf>,
    /// Time between polls (humantime, e.g. "1s"). Default 1 s.
    #[serde(default = "defaults::poll_interval", with = "humantime_serde")]
    pub poll_interval: Duration,
    /// The persisted confirmed/admitted sets.
    #[serde(default = "defaults::state_file")]
    pub state_file: PathBuf,
    /// Log lines are appended here as well as written to stderr.
    #[serde(default = "defaults::log_file")]
    pub log_file: PathBuf,
    /// `text` (default) or `json` log lines.
    #[serde(default)]
    pub log_format: LogFormat,
    /// `auto` (default), `journald` or `stderr`: see [`LogTarget`].
    #[serde(default)]
    pub log_target: LogTarget,
    /// Whether lines are also appended to `log_file` (default `true`).
    #[serde(default = "defaults::log_to_file")]
    pub log_to_file: bool,
    /// `host:port` of the status listener (`/healthz`, `/readyz`, `/metrics`, `/status`);
    /// off when unset.
    pub status_listen: Option<String>,
    /// `/readyz` is ready only if a poll succeeded within this (default 30 s).
    #[serde(default = "defaults::ready_max_poll_age", with = "humantime_serde")]
    pub ready_max_poll_age: Duration,
    /// Longest wait between polls while they fail (jittered exponential backoff; default 10 s).
    #[serde(default = "defaults::max_backoff", with = "humantime_serde")]
    pub max_backoff: Duration,
    /// Polls a namespace must be absent from before it is left (default 3; 1 = the reference).
    #[serde(default = "defaults::leave_after_polls")]
    pub leave_after_polls: u32,
    /// Absence the daemon must observe before a withdrawn namespace is left (default 24 h;
    /// 0 s to 30 days). Measured on the observed clock: no wall-clock step shortens it.
    #[serde(default = "defaults::leave_grace", with = "humantime_serde")]
    pub leave_grace: Duration,
    /// Withdrawals in one poll that, if also more than half of those held, hold every leave.
    #[serde(default = "defaults::mass_drop_min")]
    pub mass_drop_min: usize,
    /// How long a mass withdrawal must persist before its leaves go ahead (default 24 h).
    #[serde(default = "defaults::mass_drop_hold", with = "humantime_serde")]
    pub mass_drop_hold: Duration,
    /// Upper bound on leaves started in any 60 s window (default 10).
    #[serde(default = "defaults::max_leaves_per_minute")]
    pub max_leaves_per_minute: u32,
    /// Upper bound on leaves started in any 60 min window (default 4).
    #[serde(default = "defaults::max_leaves_per_hour")]
    pub max_leaves_per_hour: u32,
    /// Joins running at once (default 4).
    #[serde(default = "defaults::max_concurrent_joins")]
    pub max_concurrent_joins: usize,
    /// Deadline of one `fleet-join` call (default 180 s, merod's own client's bound).
    #[serde(default = "defaults::join_timeout", with = "humantime_serde")]
    pub join_timeout: Duration,
    /// Deadline of one leave call (default 60 s).
    #[serde(default = "defaults::leave_timeout", with = "humantime_serde")]
    pub leave_timeout: Duration,
    /// Whether orphans (namespaces merod holds that are neither in the state, assigned nor
    /// retained) are taken as admitted, and so left like any withdrawn namespace (default
    /// `false`: reported only). For dedicated fleet nodes.
    #[serde(default)]
    pub leave_orphans: bool,
    /// The `[merod]` table.
    #[serde(default)]
    pub merod: RawMerod,
    /// The `[tdx]` table: where the MRTD is read from.
    #[serde(default)]
    pub tdx: TdxConfig,
    /// The `[registration]` table: earn a per-node token by attested registration instead
    /// of a configured one (only when neither `fleet_token` nor `fleet_token_file` is set).
    pub registration: Option<RawRegistration>,
    /// The `[tls]` table: the certificate whose expiry every poll reports.
    #[serde(default)]
    pub tls: TlsConfig,
    /// The `[logs_token]` table: the log-shipping token whose fingerprint every poll reports.
    #[serde(default)]
    pub logs_token: LogsTokenConfig,
    /// The `[inventory]` table: the context inventory reported to MDMA.
    #[serde(default)]
    pub inventory: InventoryConfig,
    /// The `[recovery]` table: the recovery envelopes written to MDMA.
    #[serde(default)]
    pub recovery: RecoveryConfig,
    /// The `[device_login]` table: merod's node key handed to `mero-auth`.
    #[serde(default)]
    pub device_login: DeviceLoginConfig,
}

/// The `[tls]` table: the node's TLS certificate (`{dir}/cert.pem`), whose expiry every
/// poll reports as `tls_cert_not_after` so MDMA can send a certificate or a renewal.
/// Unknown keys are rejected; every key is optional.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TlsConfig {
    /// Whether polls report it (default `true`; `false` leaves the field out of the body,
    /// which MDMA reads as "not reported", not as "no certificate").
    pub report: bool,
    /// The directory holding `cert.pem` (and `key.pem`, the node's key). Default
    /// `/mnt/data/tls`.
    pub dir: PathBuf,
    /// Whether a certificate MDMA delivers (`tls_certificate`) is installed as `cert.pem`
    /// (default `true`): only over `key.pem`'s public key, then `restart_units` restarted.
    pub install: bool,
    /// The systemd units restarted after a new certificate is installed, through systemd's
    /// D-Bus API (default `["traefik.service"]`; `[]` restarts none).
    pub restart_units: Vec<String>,
    /// Whether registration sends a CSR for the relay URL's host over `key.pem` (default
    /// `true`), kept as `csr-<host>.b64` in `dir`; MDMA signs it into the certificate it
    /// delivers.
    pub csr: bool,
}

impl Default for TlsConfig {
    fn default() -> Self {
        Self {
            report: true,
            dir: PathBuf::from("/mnt/data/tls"),
            install: true,
            restart_units: vec!["traefik.service".to_owned()],
            csr: true,
        }
    }
}

impl TlsConfig {
    /// `{dir}/cert.pem`, when reported.
    pub fn cert_file(&self) -> Option<PathBuf> {
        self.report.then(|| self.dir.join("cert.pem"))
    }

    /// `{dir}/key.pem`: the node's private key, which a delivered certificate must certify.
    pub fn key_file(&self) -> PathBuf {
        self.dir.join("key.pem")
    }
}

/// The `[inventory]` table: the context inventory MDMA keeps of each node (per confirmed
/// namespace its groups, contexts, role, counts and storage), walked every 60 s and posted to
/// `POST /api/fleet/inventory` when it changed. Unknown keys are rejected.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct InventoryConfig {
    /// Whether the inventory is walked and reported (default `true`, as the fleet's images
    /// run it).
    pub enabled: bool,
}

impl Default for InventoryConfig {
    fn default() -> Self {
        Self { enabled: true }
    }
}

/// The `[recovery]` table: the recovery envelopes MDMA keeps of each member account of each
/// confirmed namespace (its groups, contexts and devices, sealed through merod to the
/// account's root key), written every 300 s when they changed
/// (`PUT /api/fleet/recovery-envelope`). Unknown keys are rejected.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RecoveryConfig {
    /// Whether the envelopes are written and removed (default `true`, as the fleet's images
    /// do).
    pub enabled: bool,
}

impl Default for RecoveryConfig {
    fn default() -> Self {
        Self { enabled: true }
    }
}

/// The `[device_login]` table: device-key login on images built with delegated access.
/// While `marker` exists, merod's node key (`GET /admin-api/identity` `publicKey`) is kept
/// in `key_file` for `mero-auth` (the login service), and `restart_units` are restarted when
/// it changes. Unknown keys are rejected; every key is optional.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DeviceLoginConfig {
    /// Whether the job runs at all (default `true`: login is handed over while `marker`
    /// exists; `false`: never, marker or not).
    pub enabled: bool,
    /// The file whose existence turns login on (the image bakes it, empty, when built with
    /// delegated access). Default `/etc/calimero/device-key-login`.
    pub marker: PathBuf,
    /// Where the key is written, as 64 lowercase hex and a newline, mode 0600, atomically.
    /// Default `/mnt/data/fleet/login-node-key` (what `mero-auth-start.sh` reads).
    pub key_file: PathBuf,
    /// The units restarted through systemd's D-Bus API when the key changed, or when one
    /// became active before the file was last written (default `["mero-auth.service"]`;
    /// `[]` restarts none).
    pub restart_units: Vec<String>,
}

impl Default for DeviceLoginConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            marker: PathBuf::from("/etc/calimero/device-key-login"),
            key_file: PathBuf::from("/mnt/data/fleet/login-node-key"),
            restart_units: vec!["mero-auth.service".to_owned()],
        }
    }
}

/// The `[logs_token]` table: the log-shipping token MDMA delivers, whose SHA-256 every poll
/// reports as `logs_token_fp` (never the token). Unknown keys are rejected; every key is
/// optional.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LogsTokenConfig {
    /// Whether polls report it (default `true`; `false` leaves the field out).
    pub report: bool,
    /// The token's file. Default `/etc/vector/provided_token`.
    pub file: PathBuf,
    /// Whether a token MDMA delivers (`logs_token`) is installed as `file` and the log
    /// shippers configured with it (default `true`).
    pub install: bool,
    /// Where vector ships logs; unset: the instance metadata's `logs-endpoint`.
    pub logs_endpoint: Option<String>,
    /// Where vmagent ships metrics; unset: the instance metadata's `metrics-endpoint`.
    pub metrics_endpoint: Option<String>,
    /// Whether vector is configured after an install (default `true`).
    pub vector: bool,
    /// The image's script that configures vector. Default `/etc/vector/configure_vector.sh`.
    pub vector_script: PathBuf,
    /// vector's config the script fills in. Default `/etc/vector/vector_partial.yaml`.
    pub vector_config: PathBuf,
    /// The unit restarted after vector is configured. Default `vector.service`.
    pub vector_unit: String,
    /// Whether vmagent is configured after an install (default `true`; its script restarts
    /// it).
    pub vmagent: bool,
    /// The image's script that configures vmagent. Default
    /// `/etc/vmagent/configure_vmagent.sh`.
    pub vmagent_script: PathBuf,
    /// vmagent's scrape config the script fills in. Default `/etc/vmagent/scrape_config.yml`.
    pub vmagent_config: PathBuf,
}

impl Default for LogsTokenConfig {
    fn default() -> Self {
        Self {
            report: true,
            file: PathBuf::from("/etc/vector/provided_token"),
            install: true,
            logs_endpoint: None,
            metrics_endpoint: None,
            vector: true,
            vector_script: PathBuf::from("/etc/vector/configure_vector.sh"),
            vector_config: PathBuf::from("/etc/vector/vector_partial.yaml"),
            vector_unit: "vector.service".to_owned(),
            vmagent: true,
            vmagent_script: PathBuf::from("/etc/vmagent/configure_vmagent.sh"),
            vmagent_config: PathBuf::from("/etc/vmagent/scrape_config.yml"),
        }
    }
}

impl LogsTokenConfig {
    /// The token's file, when reported.
    pub fn reported_file(&self) -> Option<&Path> {
        self.report.then_some(self.file.as_path())
    }
}

/// The `[registration]` table as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawRegistration {
    /// Where the issued token is kept (required), e.g. `/mnt/data/fleet/fleet-token`.
    pub token_file: Option<PathBuf>,
    /// The GCE metadata attributes URL (default [`DEFAULT_METADATA_URL`]).
    pub metadata_url: Option<String>,
    /// A file holding the enrolment token, instead of the `enrolment-token` attribute.
    pub enrolment_token_file: Option<PathBuf>,
    /// The relay URL, instead of the `relay-url` attribute (may be `""`).
    pub relay_url: Option<String>,
    /// First retry after a failed attempt (default 30 s; 1 s to 10 min).
    #[serde(default = "defaults::retry_interval", with = "humantime_serde")]
    pub retry_interval: Duration,
}

/// The `[merod]` table as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct RawMerod {
    /// merod's home; the PeerId is read from `{home}/{node}/config.toml`.
    pub home: PathBuf,
    /// The node's name under `home`.
    pub node: String,
    /// merod's admin API base URL; default from `[server].listen[0]` of that config.toml.
    pub admin_url: Option<String>,
}

impl Default for RawMerod {
    fn default() -> Self {
        Self {
            home: PathBuf::from("/mnt/data/calimero"),
            node: "default".to_owned(),
            admin_url: None,
        }
    }
}

mod defaults {
    use std::path::PathBuf;
    use std::time::Duration;

    pub(super) fn poll_interval() -> Duration {
        Duration::from_secs(1)
    }
    pub(super) fn state_file() -> PathBuf {
        PathBuf::from("/var/lib/calimero/fleet-confirmed.json")
    }
    pub(super) fn log_file() -> PathBuf {
        PathBuf::from("/var/log/fleet-sidecar.log")
    }
    pub(super) fn leave_after_polls() -> u32 {
        3
    }
    pub(super) fn mass_drop_min() -> usize {
        3
    }
    pub(super) fn leave_grace() -> Duration {
        Duration::from_secs(24 * 3600)
    }
    pub(super) fn mass_drop_hold() -> Duration {
        Duration::from_secs(24 * 3600)
    }
    pub(super) fn max_leaves_per_minute() -> u32 {
        10
    }
    pub(super) fn max_leaves_per_hour() -> u32 {
        4
    }
    pub(super) fn max_concurrent_joins() -> usize {
        4
    }
    pub(super) fn join_timeout() -> Duration {
        crate::merod::JOIN_TIMEOUT
    }
    pub(super) fn leave_timeout() -> Duration {
        Duration::from_secs(60)
    }
    pub(super) fn ready_max_poll_age() -> Duration {
        Duration::from_secs(30)
    }
    pub(super) fn max_backoff() -> Duration {
        Duration::from_secs(10)
    }
    pub(super) fn retry_interval() -> Duration {
        Duration::from_secs(30)
    }
    pub(super) fn log_to_file() -> bool {
        true
    }
}

/// Where log events go besides the optional log file (`log_target`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogTarget {
    /// The journal, natively, when systemd connected stderr to it (`JOURNAL_STREAM` names
    /// stderr's device and inode); stderr lines otherwise.
    #[default]
    Auto,
    /// The journal, natively (structured fields, priorities), always.
    Journald,
    /// Lines on stderr (`log_format`), always.
    Stderr,
}

/// How log lines are written (`log_format`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

/// The validated configuration the daemon runs on.
#[derive(Debug, Clone)]
pub struct Config {
    /// MDMA base URL (`https://`, or `http://` to a loopback host).
    pub mdma_url: Url,
    /// The fleet token, sent as `X-Fleet-Token` (from `fleet_token` or `fleet_token_file`).
    pub fleet_token: Option<FleetToken>,
    /// `fleet_token_file`, read again on a refused poll and on SIGHUP.
    pub fleet_token_file: Option<PathBuf>,
    /// Attested registration, when `[registration]` is set (and no token is configured).
    pub registration: Option<RegistrationConfig>,
    /// Extra PEM trust roots for MDMA.
    pub mdma_ca_file: Option<PathBuf>,
    /// Time between polls.
    pub poll_interval: Duration,
    /// The persisted state document.
    pub state_file: PathBuf,
    /// The log file lines are appended to.
    pub log_file: PathBuf,
    /// Text or JSON log lines.
    pub log_format: LogFormat,
    /// The journal or stderr.
    pub log_target: LogTarget,
    /// Whether lines are also appended to `log_file`.
    pub log_to_file: bool,
    /// Where the status listener binds, if on.
    pub status_listen: Option<SocketAddr>,
    /// Readiness needs a successful poll within this.
    pub ready_max_poll_age: Duration,
    /// Cap of the backoff between failed polls.
    pub max_backoff: Duration,
    /// Plan and log only: no merod call, no confirm, no state write (`--dry-run`; not a
    /// config key).
    pub dry_run: bool,
    /// When a withdrawn namespace may be left.
    pub leave_policy: LeavePolicy,
    /// Joins running at once (≥ 1).
    pub max_concurrent_joins: usize,
    /// Deadline of one `fleet-join` call.
    pub join_timeout: Duration,
    /// Deadline of one leave call.
    pub leave_timeout: Duration,
    /// `leave_orphans`: orphans are taken as admitted (left through the grace, the guard
    /// and the budget) instead of only reported.
    pub leave_orphans: bool,
    /// merod's location.
    pub merod: MerodConfig,
    /// MRTD sources.
    pub tdx: TdxConfig,
    /// The TLS certificate whose expiry polls report (`[tls]`).
    pub tls: TlsConfig,
    /// The log-shipping token whose fingerprint polls report (`[logs_token]`).
    pub logs_token: LogsTokenConfig,
    /// The context inventory (`[inventory]`).
    pub inventory: InventoryConfig,
    /// The recovery envelopes (`[recovery]`).
    pub recovery: RecoveryConfig,
    /// Device-key login (`[device_login]`).
    pub device_login: DeviceLoginConfig,
    /// Things worth a warning that are not errors (e.g. plain `http://` to loopback); the
    /// daemon logs them once logging is up.
    pub warnings: Vec<String>,
}

/// The GCE metadata server's instance attributes, the default of
/// `[registration].metadata_url`.
pub const DEFAULT_METADATA_URL: &str =
    "http://metadata.google.internal/computeMetadata/v1/instance/attributes/";

/// The validated `[registration]` table.
#[derive(Debug, Clone)]
pub struct RegistrationConfig {
    /// Where the issued token is kept (written atomically, mode 0600, directory 0700).
    pub token_file: PathBuf,
    /// The metadata attributes URL (ends in `/`), read with `Metadata-Flavor: Google`.
    pub metadata_url: Url,
    /// The enrolment token's file, overriding the `enrolment-token` attribute.
    pub enrolment_token_file: Option<PathBuf>,
    /// The relay URL, overriding the `relay-url` attribute.
    pub relay_url: Option<String>,
    /// The first retry after a failed attempt; later ones back off up to 10 minutes.
    pub retry_interval: Duration,
}

/// The validated `[merod]` table.
#[derive(Debug, Clone)]
pub struct MerodConfig {
    /// merod's home directory.
    pub home: PathBuf,
    /// The node's name under `home`.
    pub node: String,
    /// The admin API base URL if configured; else derived from merod's config.toml.
    pub admin_url: Option<Url>,
}

impl MerodConfig {
    /// `{home}/{node}/config.toml`: merod's own config, holding `[identity].peer_id` and
    /// `[server].listen`.
    pub fn config_toml(&self) -> PathBuf {
        self.home.join(&self.node).join("config.toml")
    }
}

/// The allowed range of each duration key, inclusive (docs/operator/configuration.md).
///
/// | key | min | max |
/// |---|---|---|
/// | `poll_interval` | 1 s | 10 min |
/// | `max_backoff` | 1 s | 1 h |
/// | `ready_max_poll_age` | 2 s | 1 h |
/// | `leave_grace` | 0 s | 30 days |
/// | `mass_drop_hold` | 1 s | 7 days |
/// | `join_timeout` | 10 s | 1 h |
/// | `leave_timeout` | 1 s | 1 h |
/// | `registration.retry_interval` | 1 s | 10 min |
pub(crate) fn duration_bounds(key: &str) -> (Duration, Duration) {
    const S: u64 = 1;
    const MIN: u64 = 60;
    const H: u64 = 3600;
    let (lo, hi) = match key {
        "poll_interval" | "registration.retry_interval" => (S, 10 * MIN),
        "ready_max_poll_age" => (2 * S, H),
        "leave_grace" => (0, 30 * 24 * H),
        "mass_drop_hold" => (S, 7 * 24 * H),
        "join_timeout" => (10 * S, H),
        _ => (S, H),
    };
    (Duration::from_secs(lo), Duration::from_secs(hi))
}

/// A whole number of seconds as `"90s"`, `"10m"`, `"1h"` or `"7d"`.
fn human(d: Duration) -> String {
    let s = d.as_secs();
    match s {
        0 => "0s".to_owned(),
        s if s % 86_400 == 0 => format!("{}d", s / 86_400),
        s if s % 3600 == 0 => format!("{}h", s / 3600),
        s if s % 60 == 0 => format!("{}m", s / 60),
        s => format!("{s}s"),
    }
}

/// Why the config cannot be used. Each names the file and, where one is at fault, the key.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config file {path}: {source}")]
    Read {
        /// The config file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The file is not valid TOML for this schema (includes unknown keys, by name). Only the
    /// parser's message and the line are kept, never the offending line's text: it could be
    /// the token's line.
    #[error("config file {path}, line {line}: {message}")]
    Parse {
        /// The config file.
        path: PathBuf,
        /// 1-based line of the fault (0 when the parser gave no position).
        line: usize,
        /// The parser's message, naming the key.
        message: String,
    },
    /// `mdma_url` is missing or empty (the daemon's check: [`Config::load`]).
    #[error("config file {path}: mdma_url is not set (the sidecar cannot poll without it)")]
    MissingMdmaUrl {
        /// The config file.
        path: PathBuf,
    },
    /// [`MdmaClient::from_tool_config`]: `mdma_url` is missing or empty (the tool's wording of
    /// [`ConfigError::MissingMdmaUrl`], which is the daemon's).
    #[error("config file {path}: mdma_url is not set, so there is no MDMA to call")]
    NoMdmaUrl {
        /// The config file.
        path: PathBuf,
    },
    /// [`MdmaClient::from_tool_config`]: the MDMA client cannot be built from the config
    /// (`mdma_ca_file` unreadable or without a usable certificate, the TLS backend).
    #[error("config file {path}: {source}")]
    MdmaClient {
        /// The config file.
        path: PathBuf,
        /// Why the client could not be built (boxed: it is large, and rare).
        #[source]
        source: Box<MdmaClientError>,
    },
    /// A key holds a value that cannot be used.
    #[error("config file {path}: {key} = {value:?} is invalid: {reason}")]
    Invalid {
        /// The config file.
        path: PathBuf,
        /// The key, e.g. `mdma_url` or `merod.admin_url`.
        key: &'static str,
        /// The value as written (never a secret).
        value: String,
        /// What is wrong with it.
        reason: String,
    },
}

impl Config {
    /// Reads and validates the config file at `path`.
    ///
    /// Errors: [`ConfigError`] naming the file, and the key when one is at fault.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        Self::from_toml(&read_text(path)?, path)
    }

    /// Parses and validates config text; `path` is only used in error messages.
    ///
    /// Errors: [`ConfigError::Parse`], [`ConfigError::MissingMdmaUrl`],
    /// [`ConfigError::Invalid`].
    pub fn from_toml(text: &str, path: &Path) -> Result<Self, ConfigError> {
        parse_raw(text, path)?.validate(path)
    }
}

/// [`ConfigError::Invalid`] for `key` of the file at `path`.
fn invalid_key(path: &Path, key: &'static str, value: String, reason: String) -> ConfigError {
    ConfigError::Invalid {
        path: path.to_owned(),
        key,
        value,
        reason,
    }
}

/// The config file's text: what [`Config::load`] and [`ToolConfig::load`] both parse.
///
/// Errors: [`ConfigError::Read`].
fn read_text(path: &Path) -> Result<String, ConfigError> {
    std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_owned(),
        source,
    })
}

/// The TOML text as written, with the daemon's whole schema (unknown keys are errors).
fn parse_raw(text: &str, path: &Path) -> Result<RawConfig, ConfigError> {
    toml::from_str(text).map_err(|e| {
        let before = e.span().and_then(|span| text.get(..span.start));
        let line = before.map_or(0, |b| b.matches('\n').count() + 1);
        // The key of the faulty line (never its value: it could be the token).
        let key = line
            .checked_sub(1)
            .and_then(|i| text.lines().nth(i))
            .and_then(|l| l.split_once('='))
            .map(|(k, _)| k.trim())
            .filter(|k| !k.is_empty() && !k.starts_with('#'));
        let message = match key {
            Some(k) => format!("{k}: {}", e.message()),
            None => e.message().to_owned(),
        };
        ConfigError::Parse {
            path: path.to_owned(),
            line,
            message,
        }
    })
}

/// What an admin tool that works beside the sidecar needs from the sidecar's config file:
/// where merod is (`[merod]`), where the state is (`state_file`), where the MRTD is read from
/// (`[tdx]`) and, for a tool that posts to MDMA, `mdma_url` and the credentials.
///
/// Read from the same TOML file as [`Config`], with the same schema (an unknown or mistyped
/// key is still an error naming it), but nothing else is required or touched: `mdma_url`
/// may be absent, and `fleet_token_file` is not opened until
/// [`ToolConfig::mdma_credentials`] asks for it, so a tool that only talks to merod and reads
/// the state works on a node whose token it must not (or cannot) read.
///
/// ```
/// use std::path::Path;
/// use fleet_sidecar::{MrtdSource, ToolConfig};
///
/// let text = "state_file = \"/tmp/state.json\"\n[tdx]\nsources = [\"sysfs\", \"quote\"]\n";
/// let cfg = ToolConfig::from_toml(text, Path::new("fleet-sidecar.toml")).unwrap();
/// assert_eq!(cfg.tdx.sources, [MrtdSource::Sysfs, MrtdSource::Quote]);
/// assert!(cfg.mdma_url.is_none());
/// let credentials = cfg.mdma_credentials().unwrap();
/// assert!(credentials.token.is_none() && credentials.ca_file.is_none());
/// ```
#[derive(Debug, Clone)]
pub struct ToolConfig {
    /// The config file it was read from (named in errors).
    pub path: PathBuf,
    /// The validated `[merod]` table (see [`crate::identity::resolve_admin_url`] for the
    /// admin URL the daemon would use).
    pub merod: MerodConfig,
    /// `state_file`: the sidecar's state (default `/var/lib/calimero/fleet-confirmed.json`).
    pub state_file: PathBuf,
    /// The validated `[tdx]` table (`sources` non-empty, no duplicates): read the MRTD with
    /// [`crate::read_mrtd_bounded`].
    pub tdx: TdxConfig,
    /// `mdma_url` when set, checked as the daemon checks it (`https://`, plain `http://` only
    /// for a loopback host; ends in `/`).
    pub mdma_url: Option<Url>,
    /// `mdma_ca_file`: extra PEM trust roots for MDMA (not opened here).
    pub mdma_ca_file: Option<PathBuf>,
    fleet_token: Option<FleetToken>,
    fleet_token_file: Option<PathBuf>,
    /// `[registration].token_file`: where the daemon keeps the token it earned.
    registration_token_file: Option<PathBuf>,
}

/// What a tool sends MDMA to be recognised as this node's: the fleet token and the extra
/// trust roots. `Debug` never shows the token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MdmaCredentials {
    /// The token to send as `X-Fleet-Token`, if the config has one.
    pub token: Option<FleetToken>,
    /// `mdma_ca_file`, if set (read when the client is built).
    pub ca_file: Option<PathBuf>,
}

impl ToolConfig {
    /// Reads the config file at `path` and keeps what a tool needs.
    ///
    /// Errors: [`ConfigError::Read`], [`ConfigError::Parse`], and [`ConfigError::Invalid`]
    /// for `merod.*`, `state_file`, `tdx.sources` or a set `mdma_url`; never
    /// [`ConfigError::MissingMdmaUrl`], and nothing about the token (see
    /// [`ToolConfig::mdma_credentials`]).
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        Self::from_toml(&read_text(path)?, path)
    }

    /// Parses config text as [`ToolConfig::load`] does; `path` only names the file in errors.
    ///
    /// Errors: as [`ToolConfig::load`], without [`ConfigError::Read`].
    pub fn from_toml(text: &str, path: &Path) -> Result<Self, ConfigError> {
        let raw = parse_raw(text, path)?;
        check_file_path(path, "state_file", &raw.state_file)?;
        check_tdx(path, &raw.tdx)?;
        check_absolute_paths(
            path,
            [
                ("fleet_token_file", raw.fleet_token_file.as_deref()),
                ("mdma_ca_file", raw.mdma_ca_file.as_deref()),
                (
                    "registration.token_file",
                    raw.registration
                        .as_ref()
                        .and_then(|r| r.token_file.as_deref()),
                ),
            ],
        )?;
        let mdma_url = match raw.mdma_url.as_deref().map(str::trim) {
            Some(s) if !s.is_empty() => Some(check_mdma_url(s, path, &mut Vec::new())?),
            _ => None,
        };
        Ok(Self {
            path: path.to_owned(),
            merod: raw.merod.validate(path)?,
            state_file: raw.state_file,
            tdx: raw.tdx,
            mdma_url,
            mdma_ca_file: raw.mdma_ca_file,
            fleet_token: raw.fleet_token,
            fleet_token_file: raw.fleet_token_file,
            registration_token_file: raw.registration.and_then(|r| r.token_file),
        })
    }

    /// The token and CA file for MDMA, with the daemon's checks: `fleet_token` (non-empty,
    /// header-safe) or `fleet_token_file` (a regular file neither group nor others may read,
    /// holding a non-empty header-safe token, surrounding whitespace trimmed), never both.
    /// Opens the token file, nothing else. [`MdmaClient::from_tool_config`] builds the client
    /// from it.
    ///
    /// Errors: [`ConfigError::Invalid`] naming `fleet_token` or `fleet_token_file` (never
    /// the token itself).
    ///
    /// With neither key but a `[registration]` table, the token is the one the daemon
    /// earned by attested registration, read from `[registration].token_file` with the same
    /// checks; a file not there yet (the node has not registered) gives no token. Errors for
    /// that file name `registration.token_file`.
    pub fn mdma_credentials(&self) -> Result<MdmaCredentials, ConfigError> {
        let token = match (
            &self.fleet_token,
            &self.fleet_token_file,
            &self.registration_token_file,
        ) {
            (None, None, Some(file)) => match std::fs::symlink_metadata(file) {
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
                _ => Some(read_token_file(file).map_err(|reason| {
                    invalid_key(
                        &self.path,
                        "registration.token_file",
                        file.display().to_string(),
                        reason.to_string(),
                    )
                })?),
            },
            _ => resolve_token(
                self.fleet_token.clone(),
                self.fleet_token_file.as_deref(),
                &self.path,
            )?,
        };
        Ok(MdmaCredentials {
            token,
            ca_file: self.mdma_ca_file.clone(),
        })
    }
}

impl MdmaClient {
    /// A client for the MDMA a tool's config names: `mdma_url`, the token
    /// ([`ToolConfig::mdma_credentials`]: `fleet_token`, `fleet_token_file` or the registration
    /// `token_file`, with the
    /// daemon's checks) and `mdma_ca_file`, with the daemon's HTTP rules and timeout.
    ///
    /// Errors: [`ConfigError::NoMdmaUrl`] when `mdma_url` is not set,
    /// [`ConfigError::Invalid`] for a token that cannot be used, [`ConfigError::MdmaClient`]
    /// when the client cannot be built (the CA file).
    pub fn from_tool_config(cfg: &ToolConfig) -> Result<Self, ConfigError> {
        let url = cfg.mdma_url.clone().ok_or_else(|| ConfigError::NoMdmaUrl {
            path: cfg.path.clone(),
        })?;
        let credentials = cfg.mdma_credentials()?;
        let mut builder = Self::builder(url);
        if let Some(token) = credentials.token {
            builder = builder.token(token);
        }
        if let Some(ca) = credentials.ca_file {
            builder = builder.ca_file(ca);
        }
        builder.build().map_err(|source| ConfigError::MdmaClient {
            path: cfg.path.clone(),
            source: Box::new(source),
        })
    }
}

/// Checks `[tdx]` as the daemon does; errors name `tdx.sources`, or the path key that is not
/// absolute.
fn check_tdx(path: &Path, tdx: &TdxConfig) -> Result<(), ConfigError> {
    check_absolute_paths(
        path,
        [
            ("tdx.mrtd_path", Some(tdx.mrtd_path.as_path())),
            ("tdx.legacy_mrtd_path", Some(tdx.legacy_mrtd_path.as_path())),
            ("tdx.device", Some(tdx.device.as_path())),
            ("tdx.tsm_report_dir", Some(tdx.tsm_report_dir.as_path())),
        ],
    )?;
    tdx.validate().map_err(|e| {
        let names: Vec<&str> = tdx.sources.iter().map(|s| s.as_str()).collect();
        invalid_key(path, "tdx.sources", names.join(", "), e.to_string())
    })
}

/// Checks a set `mdma_url`: a base URL, `https://` or plain `http://` to a loopback host
/// (which adds a warning). Errors: [`ConfigError::Invalid`] naming `mdma_url`.
fn check_mdma_url(raw: &str, path: &Path, warnings: &mut Vec<String>) -> Result<Url, ConfigError> {
    let invalid = |reason: String| invalid_key(path, "mdma_url", raw.to_owned(), reason);
    let mdma_url = parse_base_url(raw).map_err(|reason| invalid(reason.to_string()))?;
    match mdma_url.scheme() {
        "https" => {}
        "http" if is_loopback(&mdma_url) => warnings.push(format!(
            "mdma_url {mdma_url} is plain http: accepted only because the host is loopback"
        )),
        "http" => {
            return Err(invalid(
                "must be https:// (plain http:// is accepted only for a loopback host)".to_owned(),
            ))
        }
        other => return Err(invalid(format!("scheme {other:?} is not https"))),
    }
    if let Some(tld) = placeholder_domain(&mdma_url) {
        return Err(invalid(format!(
            "the host is in the reserved .{tld} domain, a placeholder that never resolves: set the fleet's MDMA URL"
        )));
    }
    Ok(mdma_url)
}

/// The fleet token from `fleet_token` or `fleet_token_file` (read here), with every check.
/// Errors: [`ConfigError::Invalid`] naming the key, never holding the token.
fn resolve_token(
    token: Option<FleetToken>,
    file: Option<&Path>,
    path: &Path,
) -> Result<Option<FleetToken>, ConfigError> {
    let invalid = |key, value, reason| invalid_key(path, key, value, reason);
    if token.as_ref().is_some_and(|t| t.expose().is_empty()) {
        return Err(invalid(
            "fleet_token",
            String::new(),
            "is empty: leave the key out to send no token".to_owned(),
        ));
    }
    if token.as_ref().is_some_and(|t| !header_safe(t.expose())) {
        return Err(invalid(
            "fleet_token",
            String::new(),
            "holds characters not allowed in an HTTP header (a control char or line break)"
                .to_owned(),
        ));
    }
    match (token, file) {
        (Some(_), Some(file)) => Err(invalid(
            "fleet_token_file",
            file.display().to_string(),
            "set together with fleet_token: keep one".to_owned(),
        )),
        (token, None) => Ok(token),
        (None, Some(file)) => read_token_file(file).map(Some).map_err(|reason| {
            invalid(
                "fleet_token_file",
                file.display().to_string(),
                reason.to_string(),
            )
        }),
    }
}

/// A systemd unit name: 1–255 of `[A-Za-z0-9:_.\\@-]`, a name before the suffix, ending in
/// a unit type systemd restarts (`.service`, `.socket`, `.target`, `.path`, `.timer`).
fn is_unit_name(name: &str) -> bool {
    let suffix_ok = [".service", ".socket", ".target", ".path", ".timer"]
        .iter()
        .any(|s| name.len() > s.len() && name.ends_with(s));
    suffix_ok
        && name.len() <= 255
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b":_.\\@-".contains(&b))
}

/// Whether `path` is a regular file someone may execute (a script a key names).
#[cfg(feature = "daemon")] // the daemon's alone: a tool's build leaves it out
pub(crate) fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// A path key must be absolute: a relative one would be taken from wherever the daemon (or
/// a tool) happened to be started, and name another file each time.
fn check_absolute(path: &Path, key: &'static str, value: &Path) -> Result<(), ConfigError> {
    if value.is_absolute() {
        return Ok(());
    }
    Err(invalid_key(
        path,
        key,
        value.display().to_string(),
        "must be an absolute path (a relative one would depend on the directory the daemon was started in)".to_owned(),
    ))
}

/// A path key must name a file (not be empty or end in `..`/`/`), by an absolute path.
fn check_file_path(path: &Path, key: &'static str, value: &Path) -> Result<(), ConfigError> {
    // `Path::file_name` ignores a final `/` (`/etc/vector/` names `vector`), so it is
    // looked for in the bytes: such a path names a directory.
    let names_a_directory = {
        use std::os::unix::ffi::OsStrExt;
        value.as_os_str().as_bytes().ends_with(b"/")
    };
    if value.as_os_str().is_empty() || value.file_name().is_none() || names_a_directory {
        return Err(invalid_key(
            path,
            key,
            value.display().to_string(),
            "must be a file path".to_owned(),
        ));
    }
    check_absolute(path, key, value)
}

/// The keys that name files or directories beside those [`check_file_path`] checks where
/// they are read: each must be absolute. `None` values are not set.
fn check_absolute_paths<'a>(
    path: &Path,
    keys: impl IntoIterator<Item = (&'static str, Option<&'a Path>)>,
) -> Result<(), ConfigError> {
    for (key, value) in keys {
        if let Some(value) = value {
            check_absolute(path, key, value)?;
        }
    }
    Ok(())
}

impl RawMerod {
    /// Checks `[merod]`; `path` names the config file in errors.
    fn validate(self, path: &Path) -> Result<MerodConfig, ConfigError> {
        let invalid = |key, value, reason: &str| invalid_key(path, key, value, reason.to_owned());
        let admin_url = match self.admin_url {
            None => None,
            Some(raw) => {
                let url = parse_base_url(&raw).map_err(|reason| {
                    invalid("merod.admin_url", raw.clone(), &reason.to_string())
                })?;
                if !matches!(url.scheme(), "http" | "https") {
                    return Err(invalid(
                        "merod.admin_url",
                        raw,
                        "must be http:// or https://",
                    ));
                }
                Some(url)
            }
        };
        check_absolute(path, "merod.home", &self.home)?;
        if self.node.is_empty() || self.node.contains('/') {
            return Err(invalid(
                "merod.node",
                self.node,
                "must be a plain directory name",
            ));
        }
        Ok(MerodConfig {
            home: self.home,
            node: self.node,
            admin_url,
        })
    }
}

impl RawConfig {
    /// Checks every value and builds the [`Config`]; `path` names the file in errors.
    ///
    /// Errors: [`ConfigError::MissingMdmaUrl`] and [`ConfigError::Invalid`].
    pub(crate) fn validate(self, path: &Path) -> Result<Config, ConfigError> {
        let invalid = |key, value, reason| invalid_key(path, key, value, reason);
        let mut warnings = Vec::new();

        let mdma_raw = match self.mdma_url.as_deref().map(str::trim) {
            Some(s) if !s.is_empty() => s.to_owned(),
            _ => {
                return Err(ConfigError::MissingMdmaUrl {
                    path: path.to_owned(),
                })
            }
        };
        let mdma_url = check_mdma_url(&mdma_raw, path, &mut warnings)?;
        if self.fleet_token.is_some() {
            if let Some(mode) = group_or_world_readable(path) {
                warnings.push(format!(
                    "config file {} holds fleet_token and is readable by group or others (mode {mode:04o}): chmod 600 it, or use fleet_token_file",
                    path.display()
                ));
            }
        }
        if self.registration.is_some() {
            if let Some(key) = [
                ("fleet_token", self.fleet_token.is_some()),
                ("fleet_token_file", self.fleet_token_file.is_some()),
            ]
            .into_iter()
            .find_map(|(key, set)| set.then_some(key))
            {
                return Err(invalid(
                    "registration",
                    String::new(),
                    format!("set together with {key}: keep one way of getting the fleet token (a configured token, or [registration])"),
                ));
            }
        }
        // Before anything is read from them (the token file is read next).
        self.check_absolute_paths(path)?;
        self.check_files_and_units(path)?;
        self.check_counts(path)?;
        let fleet_token = resolve_token(self.fleet_token, self.fleet_token_file.as_deref(), path)?;
        let status_listen = match &self.status_listen {
            None => None,
            Some(raw) => Some(raw.parse::<SocketAddr>().map_err(|e| {
                invalid(
                    "status_listen",
                    raw.clone(),
                    format!("{e} (expected host:port, e.g. 127.0.0.1:9464)"),
                )
            })?),
        };
        if let Some(addr) = status_listen.filter(|a| !a.ip().is_loopback()) {
            warnings.push(format!(
                "status_listen {addr} is not a loopback address: the listener has no authentication"
            ));
        }
        let merod = self.merod.validate(path)?;

        // Every duration is bounded: a typo such as "1ms" for "1m" must not turn the node
        // into a load generator, nor "100d" silence it.
        let bounded = |key: &'static str, d: Duration| {
            let (min, max) = duration_bounds(key);
            if d < min || d > max {
                Err(invalid(
                    key,
                    format!("{d:?}"),
                    format!("must be between {} and {}", human(min), human(max)),
                ))
            } else {
                Ok(d)
            }
        };
        let poll_interval = bounded("poll_interval", self.poll_interval)?;
        let join_timeout = bounded("join_timeout", self.join_timeout)?;
        let leave_timeout = bounded("leave_timeout", self.leave_timeout)?;
        let ready_max_poll_age = bounded("ready_max_poll_age", self.ready_max_poll_age)?;
        let max_backoff = bounded("max_backoff", self.max_backoff)?;
        bounded("mass_drop_hold", self.mass_drop_hold)?;
        bounded("leave_grace", self.leave_grace)?;
        let registration = match self.registration {
            None => None,
            Some(raw) => Some(raw.validate(path, &bounded)?),
        };
        check_tdx(path, &self.tdx)?;

        Ok(Config {
            mdma_url,
            fleet_token,
            fleet_token_file: self.fleet_token_file,
            registration,
            mdma_ca_file: self.mdma_ca_file,
            poll_interval,
            state_file: self.state_file,
            log_file: self.log_file,
            log_format: self.log_format,
            log_target: self.log_target,
            log_to_file: self.log_to_file,
            status_listen,
            ready_max_poll_age,
            max_backoff,
            dry_run: false,
            leave_policy: LeavePolicy {
                leave_after_polls: self.leave_after_polls,
                leave_grace: self.leave_grace,
                mass_drop_min: self.mass_drop_min,
                mass_drop_hold: self.mass_drop_hold,
                max_leaves_per_minute: self.max_leaves_per_minute,
                max_leaves_per_hour: self.max_leaves_per_hour,
            },
            max_concurrent_joins: self.max_concurrent_joins,
            join_timeout,
            leave_timeout,
            leave_orphans: self.leave_orphans,
            merod,
            tdx: self.tdx,
            tls: self.tls,
            logs_token: self.logs_token,
            inventory: self.inventory,
            recovery: self.recovery,
            device_login: self.device_login,
            warnings,
        })
    }
    /// The paths that must be absolute are: checked before anything is read from them.
    fn check_absolute_paths(&self, path: &Path) -> Result<(), ConfigError> {
        check_absolute_paths(
            path,
            [
                ("fleet_token_file", self.fleet_token_file.as_deref()),
                ("mdma_ca_file", self.mdma_ca_file.as_deref()),
                ("tls.dir", Some(self.tls.dir.as_path())),
                (
                    "logs_token.vector_script",
                    Some(self.logs_token.vector_script.as_path()),
                ),
                (
                    "logs_token.vector_config",
                    Some(self.logs_token.vector_config.as_path()),
                ),
                (
                    "logs_token.vmagent_script",
                    Some(self.logs_token.vmagent_script.as_path()),
                ),
                (
                    "logs_token.vmagent_config",
                    Some(self.logs_token.vmagent_config.as_path()),
                ),
            ],
        )?;
        Ok(())
    }

    /// The files, unit names and endpoints the node's jobs use.
    fn check_files_and_units(&self, path: &Path) -> Result<(), ConfigError> {
        let invalid = |key, value, reason| invalid_key(path, key, value, reason);
        for (key, p) in [
            ("state_file", &self.state_file),
            ("log_file", &self.log_file),
            ("logs_token.file", &self.logs_token.file),
        ] {
            check_file_path(path, key, p)?;
        }
        // An empty dir would look for `cert.pem` in the daemon's working directory.
        if self.tls.dir.as_os_str().is_empty() {
            return Err(invalid(
                "tls.dir",
                String::new(),
                "must be a directory path".to_owned(),
            ));
        }

        if !is_unit_name(&self.logs_token.vector_unit) {
            return Err(invalid(
                "logs_token.vector_unit",
                self.logs_token.vector_unit.escape_debug().to_string(),
                "must be a systemd unit name such as \"vector.service\"".to_owned(),
            ));
        }
        for (key, endpoint) in [
            ("logs_token.logs_endpoint", &self.logs_token.logs_endpoint),
            (
                "logs_token.metrics_endpoint",
                &self.logs_token.metrics_endpoint,
            ),
        ] {
            // Handed to a script as one argument: no line break or other control.
            if let Some(e) = endpoint
                .as_deref()
                .filter(|e| e.chars().any(char::is_control))
            {
                return Err(invalid(
                    key,
                    e.escape_debug().to_string(),
                    "must not hold control characters".to_owned(),
                ));
            }
        }
        for (key, units) in [
            ("tls.restart_units", &self.tls.restart_units),
            (
                "device_login.restart_units",
                &self.device_login.restart_units,
            ),
        ] {
            if let Some(unit) = units.iter().find(|u| !is_unit_name(u)) {
                return Err(invalid(
                    key,
                    unit.escape_debug().to_string(),
                    "must be a systemd unit name such as \"traefik.service\"".to_owned(),
                ));
            }
        }
        check_file_path(path, "device_login.marker", &self.device_login.marker)?;
        check_file_path(path, "device_login.key_file", &self.device_login.key_file)?;
        Ok(())
    }

    /// The counts that must be at least 1.
    fn check_counts(&self, path: &Path) -> Result<(), ConfigError> {
        let invalid = |key, value, reason| invalid_key(path, key, value, reason);
        for (key, value, why) in [
            ("leave_after_polls", self.leave_after_polls as usize, ""),
            (
                "max_leaves_per_minute",
                self.max_leaves_per_minute as usize,
                " (0 would block every leave forever)",
            ),
            (
                "max_leaves_per_hour",
                self.max_leaves_per_hour as usize,
                " (0 would block every leave forever)",
            ),
            ("max_concurrent_joins", self.max_concurrent_joins, ""),
            ("mass_drop_min", self.mass_drop_min, ""),
        ] {
            if value == 0 {
                return Err(invalid(
                    key,
                    "0".to_owned(),
                    format!("must be at least 1{why}"),
                ));
            }
        }
        Ok(())
    }
}

impl RawRegistration {
    /// Checks `[registration]`; `bounded` checks a duration against its bounds.
    fn validate(
        self,
        path: &Path,
        bounded: &dyn Fn(&'static str, Duration) -> Result<Duration, ConfigError>,
    ) -> Result<RegistrationConfig, ConfigError> {
        let invalid = |key, value, reason| invalid_key(path, key, value, reason);
        let token_file = self.token_file.ok_or_else(|| {
            invalid(
                "registration.token_file",
                String::new(),
                "is required in [registration]: where the issued token is kept".to_owned(),
            )
        })?;
        check_file_path(path, "registration.token_file", &token_file)?;
        if let Some(file) = &self.enrolment_token_file {
            check_file_path(path, "registration.enrolment_token_file", file)?;
        }
        let raw_url = self
            .metadata_url
            .unwrap_or_else(|| DEFAULT_METADATA_URL.to_owned());
        let metadata_url = parse_base_url(&raw_url).map_err(|reason| {
            invalid(
                "registration.metadata_url",
                raw_url.clone(),
                reason.to_string(),
            )
        })?;
        if !matches!(metadata_url.scheme(), "http" | "https") {
            return Err(invalid(
                "registration.metadata_url",
                raw_url,
                "must be http:// or https://".to_owned(),
            ));
        }
        if let Some(relay) = &self.relay_url {
            if relay.contains(['\r', '\n']) || relay.trim() != relay {
                return Err(invalid(
                    "registration.relay_url",
                    relay.escape_debug().to_string(),
                    "must be one line without surrounding whitespace".to_owned(),
                ));
            }
        }
        Ok(RegistrationConfig {
            token_file,
            metadata_url,
            enrolment_token_file: self.enrolment_token_file,
            relay_url: self.relay_url,
            retry_interval: bounded("registration.retry_interval", self.retry_interval)?,
        })
    }
}

/// Why a token file cannot be used (never holds the token).
#[derive(Debug, thiserror::Error)]
pub(crate) enum TokenFileProblem {
    #[error("cannot read it: {0}")]
    Unreadable(#[source] std::io::Error),
    #[error("is not a regular file")]
    NotRegular,
    #[error("is readable by group or others (mode {0:04o}): chmod 600 it")]
    Readable(u32),
    #[error("is empty")]
    Empty,
    #[error("holds characters not allowed in an HTTP header (a control char, or a second line)")]
    NotHeaderSafe,
}

/// Reads the token file: it must be a regular file that neither group nor others may read
/// (mode `0600` or stricter) and hold a non-empty token; surrounding whitespace is trimmed.
/// Errors: [`TokenFileProblem`] (never the token).
pub(crate) fn read_token_file(path: &Path) -> Result<FleetToken, TokenFileProblem> {
    use std::os::unix::fs::PermissionsExt;
    let meta = std::fs::metadata(path).map_err(TokenFileProblem::Unreadable)?;
    if !meta.is_file() {
        return Err(TokenFileProblem::NotRegular);
    }
    let mode = meta.permissions().mode() & 0o777;
    if mode & 0o077 != 0 {
        return Err(TokenFileProblem::Readable(mode));
    }
    let text = std::fs::read_to_string(path).map_err(TokenFileProblem::Unreadable)?;
    let token = text.trim();
    if token.is_empty() {
        return Err(TokenFileProblem::Empty);
    }
    if !header_safe(token) {
        return Err(TokenFileProblem::NotHeaderSafe);
    }
    Ok(FleetToken::new(token))
}

/// The file's mode if group or others may read it; `None` if private or not readable.
fn group_or_world_readable(path: &Path) -> Option<u32> {
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(path).ok()?.permissions().mode() & 0o777;
    (mode & 0o044 != 0).then_some(mode)
}

/// Why a base URL cannot be used.
#[derive(Debug, thiserror::Error)]
enum UrlProblem {
    #[error("{0}")]
    Parse(#[from] url::ParseError),
    #[error("has no host")]
    NoHost,
    #[error("must not carry a query or fragment")]
    QueryOrFragment,
    #[error("must not carry credentials (use fleet_token)")]
    Credentials,
}

/// Parses a base URL and makes sure its path ends in `/`, so joining `api/fleet/...` keeps
/// any path prefix. Errors: [`UrlProblem`].
fn parse_base_url(raw: &str) -> Result<Url, UrlProblem> {
    let mut url = Url::parse(raw)?;
    if url.host_str().is_none_or(str::is_empty) {
        return Err(UrlProblem::NoHost);
    }
    if url.query().is_some() || url.fragment().is_some() {
        return Err(UrlProblem::QueryOrFragment);
    }
    if !url.username().is_empty() || url.password().is_some() {
        return Err(UrlProblem::Credentials);
    }
    if !url.path().ends_with('/') {
        let path = format!("{}/", url.path());
        url.set_path(&path);
    }
    Ok(url)
}

/// The reserved top-level domain (`example`, `invalid` or `test`; RFC 2606, RFC 6761) the
/// URL's host is in, if it is: a placeholder, never a real MDMA. Case and a trailing dot
/// do not matter.
fn placeholder_domain(url: &Url) -> Option<&'static str> {
    let Some(url::Host::Domain(host)) = url.host() else {
        return None;
    };
    let tld = host.trim_end_matches('.').rsplit('.').next()?;
    ["example", "invalid", "test"]
        .into_iter()
        .find(|reserved| tld.eq_ignore_ascii_case(reserved))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(text: &str) -> Result<Config, ConfigError> {
        Config::from_toml(text, Path::new("/etc/calimero/fleet-sidecar.toml"))
    }

    #[test]
    fn the_issue_schema_parses_with_its_values() {
        let cfg = load(
            r#"
mdma_url = "https://mdma.fleet.internal"
fleet_token = "s3cret"
mdma_ca_file = "/etc/calimero/mdma-ca.pem"
poll_interval = "1s"
state_file = "/var/lib/calimero/fleet-confirmed.json"
log_file = "/var/log/fleet-sidecar.log"
[merod]
home = "/mnt/data/calimero"
node = "default"
admin_url = "http://127.0.0.1:2528"
[tdx]
mrtd_path = "/sys/class/misc/tdx_guest/measurements/mrtd:sha384"
"#,
        )
        .unwrap();
        assert_eq!(cfg.mdma_url.as_str(), "https://mdma.fleet.internal/");
        assert_eq!(cfg.fleet_token.as_ref().unwrap().expose(), "s3cret");
        assert_eq!(cfg.poll_interval, Duration::from_secs(1));
        assert_eq!(
            cfg.merod.admin_url.as_ref().unwrap().as_str(),
            "http://127.0.0.1:2528/"
        );
        assert_eq!(
            cfg.merod.config_toml(),
            PathBuf::from("/mnt/data/calimero/default/config.toml")
        );
        assert!(cfg.warnings.is_empty());
    }

    #[test]
    fn defaults_are_the_deployed_node_paths() {
        let cfg = load(r#"mdma_url = "https://mdma.fleet.internal/base""#).unwrap();
        assert_eq!(cfg.mdma_url.as_str(), "https://mdma.fleet.internal/base/");
        assert!(cfg.fleet_token.is_none());
        assert_eq!(
            cfg.state_file,
            PathBuf::from("/var/lib/calimero/fleet-confirmed.json")
        );
        assert_eq!(cfg.log_file, PathBuf::from("/var/log/fleet-sidecar.log"));
        assert_eq!(cfg.poll_interval, Duration::from_secs(1));
        assert_eq!(cfg.merod.home, PathBuf::from("/mnt/data/calimero"));
        assert_eq!(cfg.merod.node, "default");
        assert!(cfg.merod.admin_url.is_none());
        assert_eq!(
            cfg.tdx.mrtd_path,
            PathBuf::from("/sys/class/misc/tdx_guest/measurements/mrtd:sha384")
        );
        assert_eq!(cfg.leave_policy.leave_after_polls, 3);
        assert_eq!(cfg.leave_policy.mass_drop_min, 3);
        assert_eq!(cfg.leave_policy.mass_drop_hold, Duration::from_secs(86_400));
        assert_eq!(cfg.leave_policy.max_leaves_per_minute, 10);
        // At least as strict as the fleet's current sidecar: 24 h of absence, 4 an hour.
        assert_eq!(cfg.leave_policy.leave_grace, Duration::from_secs(86_400));
        assert_eq!(cfg.leave_policy.max_leaves_per_hour, 4);
        assert_eq!(cfg.max_concurrent_joins, 4);
        assert_eq!(cfg.join_timeout, Duration::from_secs(180));
        assert_eq!(cfg.leave_timeout, Duration::from_secs(60));
    }

    #[test]
    fn missing_or_empty_mdma_url_is_a_clear_error() {
        for text in ["", "mdma_url = \"\"", "mdma_url = \"  \""] {
            let err = load(text).unwrap_err();
            assert!(matches!(err, ConfigError::MissingMdmaUrl { .. }), "{err}");
            assert!(err.to_string().contains("mdma_url is not set"));
        }
    }

    #[test]
    fn plain_http_only_for_loopback_with_a_warning() {
        for ok in [
            "http://127.0.0.1:8080",
            "http://127.9.9.9",
            "http://localhost:1",
            "http://[::1]:9",
        ] {
            let cfg = load(&format!("mdma_url = \"{ok}\"")).unwrap();
            assert_eq!(cfg.warnings.len(), 1, "{ok}");
        }
        for bad in [
            "http://mdma.example",
            "http://10.0.0.1",
            "ftp://mdma.example",
            "not a url",
            "https://user:pw@mdma.example",
            "https://mdma.example/?a=b",
        ] {
            let err = load(&format!("mdma_url = \"{bad}\"")).unwrap_err();
            assert!(
                matches!(
                    err,
                    ConfigError::Invalid {
                        key: "mdma_url",
                        ..
                    }
                ),
                "{bad}: {err}"
            );
        }
    }

    #[test]
    fn every_duration_is_bounded_and_the_error_names_the_key() {
        for key in [
            "poll_interval",
            "max_backoff",
            "ready_max_poll_age",
            "mass_drop_hold",
            "join_timeout",
            "leave_timeout",
        ] {
            let (min, max) = duration_bounds(key);
            for (value, ok) in [
                ("1ms".to_owned(), false),
                ("0s".to_owned(), false),
                (human(min), true),
                (human(max), true),
                (format!("{}s", max.as_secs() + 1), false),
                ("100d".to_owned(), false),
            ] {
                let got = load(&format!("mdma_url = \"https://m\"\n{key} = \"{value}\""));
                match (ok, got) {
                    (true, Ok(_)) => {}
                    (false, Err(e @ ConfigError::Invalid { key: k, .. })) => {
                        assert_eq!(k, key);
                        assert!(e.to_string().contains(key), "{e}");
                        assert!(e.to_string().contains("must be between"), "{e}");
                    }
                    (ok, got) => panic!("{key} = {value}: expected ok={ok}, got {got:?}"),
                }
            }
        }
    }

    #[test]
    fn leave_grace_is_bounded_from_zero_to_thirty_days() {
        for (value, ok) in [
            ("0s", true),
            ("12s", true),
            ("30d", true),
            ("2592001s", false),
            ("100d", false),
        ] {
            let got = load(&format!(
                "mdma_url = \"https://m\"\nleave_grace = \"{value}\""
            ));
            match (ok, got) {
                (true, Ok(cfg)) => assert_eq!(
                    cfg.leave_policy.leave_grace,
                    humantime_serde::re::humantime::parse_duration(value).unwrap()
                ),
                (
                    false,
                    Err(
                        e @ ConfigError::Invalid {
                            key: "leave_grace", ..
                        },
                    ),
                ) => {
                    assert!(e.to_string().contains("between 0s and 30d"), "{e}");
                }
                (ok, got) => panic!("leave_grace = {value}: expected ok={ok}, got {got:?}"),
            }
        }
        let err = load("mdma_url = \"https://m\"\nmax_leaves_per_hour = 0").unwrap_err();
        assert!(err.to_string().contains("max_leaves_per_hour"), "{err}");
    }

    #[test]
    fn unknown_keys_are_named() {
        let err = load("mdma_url = \"https://m\"\npoll_intervall = \"2s\"").unwrap_err();
        assert!(err.to_string().contains("poll_intervall"), "{err}");
        let err = load("mdma_url = \"https://m\"\n[merod]\nhomedir = \"/x\"").unwrap_err();
        assert!(err.to_string().contains("homedir"), "{err}");
        let err = load("mdma_url = \"https://m\"\n[tdx]\nmrtd = \"/x\"").unwrap_err();
        assert!(err.to_string().contains("mrtd"), "{err}");
    }

    #[test]
    fn bad_values_name_their_key() {
        for (text, key) in [
            ("poll_interval = \"0s\"", "poll_interval"),
            ("leave_after_polls = 0", "leave_after_polls"),
            ("max_leaves_per_minute = 0", "max_leaves_per_minute"),
            ("max_concurrent_joins = 0", "max_concurrent_joins"),
            ("mass_drop_min = 0", "mass_drop_min"),
            ("max_backoff = \"0s\"", "max_backoff"),
            ("ready_max_poll_age = \"0s\"", "ready_max_poll_age"),
            ("join_timeout = \"0s\"", "join_timeout"),
            ("fleet_token = \"\"", "fleet_token"),
            ("[merod]\nadmin_url = \"unix:/x\"", "merod.admin_url"),
            ("[merod]\nnode = \"a/b\"", "merod.node"),
            ("[tdx]\nsources = []", "tdx.sources"),
            (
                "[tdx]\nsources = [\"sysfs\", \"sysfs\"]",
                "\"sysfs, sysfs\"",
            ),
            ("state_file = \"\"", "state_file"),
            ("log_file = \"\"", "log_file"),
        ] {
            let err = load(&format!("mdma_url = \"https://m\"\n{text}")).unwrap_err();
            assert!(err.to_string().contains(key), "{text}: {err}");
        }
        let err = load("mdma_url = \"https://m\"\npoll_interval = \"soon\"").unwrap_err();
        assert!(err.to_string().contains("poll_interval"), "{err}");
    }

    #[test]
    fn a_malformed_token_line_is_not_echoed() {
        let err = load("mdma_url = \"https://m\"\nfleet_token = hunter2-token").unwrap_err();
        let text = err.to_string();
        assert!(!text.contains("hunter2"), "{text}");
        assert!(text.contains("line 2"), "{text}");
    }

    /// The shipped config is refused until mdma_url is filled in: as shipped (the key is
    /// commented out), and with its example line merely uncommented (a placeholder host);
    /// once filled in, every other value it shows is the default.
    #[test]
    fn the_shipped_config_is_refused_until_mdma_url_is_filled_in_and_else_all_defaults() {
        let text = include_str!("../packaging/fleet-sidecar.toml");
        let err = load(text).unwrap_err();
        assert!(matches!(err, ConfigError::MissingMdmaUrl { .. }), "{err}");
        let example = text
            .lines()
            .find(|l| l.starts_with("#mdma_url = "))
            .expect("the shipped config shows mdma_url, commented out");
        let uncommented = text.replace(example, &example[1..]);
        let err = load(&uncommented).unwrap_err();
        assert!(
            matches!(err, ConfigError::Invalid { key: "mdma_url", ref reason, .. } if reason.contains("placeholder")),
            "{err}"
        );
        let url = "mdma_url = \"https://mdma.fleet.internal\"";
        let cfg = load(&text.replace(example, url)).unwrap();
        let defaults = load(url).unwrap();
        assert_eq!(format!("{cfg:?}"), format!("{defaults:?}"));
    }

    #[test]
    fn a_placeholder_host_of_a_reserved_domain_is_refused_naming_the_key() {
        for bad in [
            "https://mdma.example",
            "https://MDMA.Example./base",
            "https://example",
            "https://fleet.invalid:8443",
            "https://mdma.test",
        ] {
            let err = load(&format!("mdma_url = \"{bad}\"")).unwrap_err();
            assert!(
                matches!(
                    err,
                    ConfigError::Invalid {
                        key: "mdma_url",
                        ..
                    }
                ),
                "{bad}: {err}"
            );
            let text = err.to_string();
            assert!(
                text.contains("mdma_url") && text.contains("placeholder"),
                "{text}"
            );
        }
        // Only the top-level domain counts.
        for ok in [
            "https://example.fleet.internal",
            "https://mdma.test.calimero.network",
            "https://mdma.examples",
        ] {
            load(&format!("mdma_url = \"{ok}\"")).unwrap();
        }
    }

    #[test]
    fn the_token_can_come_from_a_private_file() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("token");
        std::fs::write(&file, "file-token-xyz\n").unwrap();
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
        let text = format!(
            "mdma_url = \"https://m\"\nfleet_token_file = \"{}\"",
            file.display()
        );
        let cfg = load(&text).unwrap();
        assert_eq!(cfg.fleet_token.unwrap().expose(), "file-token-xyz");

        for mode in [0o640, 0o604, 0o644] {
            std::fs::set_permissions(&file, std::fs::Permissions::from_mode(mode)).unwrap();
            let err = load(&text).unwrap_err().to_string();
            assert!(
                err.contains("fleet_token_file") && err.contains("group or others"),
                "{err}"
            );
            assert!(!err.contains("file-token-xyz"), "{err}");
        }
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
        let both = format!("{text}\nfleet_token = \"inline\"");
        assert!(load(&both).unwrap_err().to_string().contains("keep one"));
        std::fs::write(&file, " \n").unwrap();
        assert!(load(&text).unwrap_err().to_string().contains("is empty"));
        let missing = "mdma_url = \"https://m\"\nfleet_token_file = \"/nonexistent/token\"";
        assert!(load(missing)
            .unwrap_err()
            .to_string()
            .contains("/nonexistent/token"));
    }

    #[test]
    fn registration_takes_its_table_with_defaults_and_bounds() {
        let cfg = load("mdma_url = \"https://m\"\n[registration]\ntoken_file = \"/mnt/data/fleet/fleet-token\"\n").unwrap();
        let reg = cfg.registration.unwrap();
        assert_eq!(reg.token_file, Path::new("/mnt/data/fleet/fleet-token"));
        assert_eq!(reg.metadata_url.as_str(), DEFAULT_METADATA_URL);
        assert_eq!(reg.retry_interval, Duration::from_secs(30));
        assert!(reg.enrolment_token_file.is_none() && reg.relay_url.is_none());
        assert!(cfg.fleet_token.is_none());

        let cfg = load("mdma_url = \"https://m\"\n[registration]\ntoken_file = \"/t/tok\"\nmetadata_url = \"http://127.0.0.1:8080/attrs\"\nenrolment_token_file = \"/t/enrol\"\nrelay_url = \"\"\nretry_interval = \"10m\"\n").unwrap();
        let reg = cfg.registration.unwrap();
        assert_eq!(reg.metadata_url.as_str(), "http://127.0.0.1:8080/attrs/");
        assert_eq!(reg.relay_url.as_deref(), Some(""));
        assert_eq!(
            reg.enrolment_token_file.as_deref(),
            Some(Path::new("/t/enrol"))
        );
        assert_eq!(reg.retry_interval, Duration::from_secs(600));

        // retry_interval: 1 s to 10 min, the error naming the key.
        for (value, ok) in [
            ("1s", true),
            ("999ms", false),
            ("10m", true),
            ("601s", false),
        ] {
            let got = load(&format!("mdma_url = \"https://m\"\n[registration]\ntoken_file = \"/t/tok\"\nretry_interval = \"{value}\"\n"));
            match (ok, got) {
                (true, Ok(_)) => {}
                (
                    false,
                    Err(
                        e @ ConfigError::Invalid {
                            key: "registration.retry_interval",
                            ..
                        },
                    ),
                ) => {
                    assert!(e.to_string().contains("must be between 1s and 10m"), "{e}");
                }
                (ok, got) => panic!("{value}: expected ok={ok}, got {got:?}"),
            }
        }
        // token_file is required; unknown keys are named; a bad metadata URL names its key.
        let err = load("mdma_url = \"https://m\"\n[registration]\n").unwrap_err();
        assert!(err.to_string().contains("registration.token_file"), "{err}");
        let err = load(
            "mdma_url = \"https://m\"\n[registration]\ntoken_file = \"/t/tok\"\ntoken = \"x\"\n",
        )
        .unwrap_err();
        assert!(err.to_string().contains("token"), "{err}");
        let err = load("mdma_url = \"https://m\"\n[registration]\ntoken_file = \"/t/tok\"\nmetadata_url = \"ftp://h/\"\n").unwrap_err();
        assert!(
            err.to_string().contains("registration.metadata_url"),
            "{err}"
        );
        let err = load("mdma_url = \"https://m\"\n[registration]\ntoken_file = \"/t/tok\"\nrelay_url = \"https://r\\nX\"\n").unwrap_err();
        assert!(err.to_string().contains("registration.relay_url"), "{err}");
    }

    #[test]
    fn the_node_files_default_to_the_images_paths_and_an_empty_one_is_refused() {
        let cfg = load("mdma_url = \"https://m\"\n").unwrap();
        assert_eq!(
            cfg.tls.cert_file().as_deref(),
            Some(Path::new("/mnt/data/tls/cert.pem"))
        );
        assert_eq!(cfg.logs_token.file, Path::new("/etc/vector/provided_token"));
        assert!(cfg.tls.install);
        assert_eq!(cfg.tls.restart_units, ["traefik.service"]);
        let cfg = load("mdma_url = \"https://m\"\n[tls]\nreport = false\ninstall = false\nrestart_units = [\"traefik.service\", \"nginx@edge.service\"]\n").unwrap();
        assert_eq!(cfg.tls.cert_file(), None);
        assert!(!cfg.tls.install);
        assert_eq!(cfg.tls.restart_units.len(), 2);
        let cfg = load("mdma_url = \"https://m\"\n[tls]\nrestart_units = []\n").unwrap();
        assert!(cfg.tls.restart_units.is_empty());
        for (text, key) in [
            ("[tls]\ndir = \"\"\n", "tls.dir"),
            ("[logs_token]\nfile = \"\"\n", "logs_token.file"),
            ("[logs_token]\nfile = \"/etc/vector/\"\n", "logs_token.file"),
            (
                "[tls]\nrestart_units = [\"traefik\"]\n",
                "tls.restart_units",
            ),
            (
                "[tls]\nrestart_units = [\"../x.service\"]\n",
                "tls.restart_units",
            ),
            (
                "[tls]\nrestart_units = [\".service\"]\n",
                "tls.restart_units",
            ),
            (
                "[tls]\nrestart_units = [\"a b.service\"]\n",
                "tls.restart_units",
            ),
            (
                "[logs_token]\nvector_unit = \"vector\"\n",
                "logs_token.vector_unit",
            ),
            (
                "[logs_token]\nlogs_endpoint = \"https://l\\n--x\"\n",
                "logs_token.logs_endpoint",
            ),
            // The same rule for every file key: a final `/` names a directory.
            ("state_file = \"/var/lib/calimero/\"\n", "state_file"),
            (
                "[device_login]\nrestart_units = [\"mero-auth\"]\n",
                "device_login.restart_units",
            ),
            ("[device_login]\nmarker = \"\"\n", "device_login.marker"),
            (
                "[device_login]\nkey_file = \"/mnt/data/fleet/\"\n",
                "device_login.key_file",
            ),
        ] {
            let err = load(&format!("mdma_url = \"https://m\"\n{text}")).unwrap_err();
            assert!(
                matches!(&err, ConfigError::Invalid { key: k, .. } if *k == key),
                "{text}: {err}"
            );
        }
        let cfg = load("mdma_url = \"https://m\"\n").unwrap();
        assert_eq!(cfg.device_login, DeviceLoginConfig::default());
        assert!(cfg.device_login.enabled);
        assert_eq!(cfg.device_login.restart_units, ["mero-auth.service"]);
        let cfg = load("mdma_url = \"https://m\"\n[device_login]\nenabled = false\nmarker = \"/run/x\"\nkey_file = \"/run/k\"\nrestart_units = []\n").unwrap();
        assert!(!cfg.device_login.enabled);
        assert_eq!(cfg.device_login.key_file, PathBuf::from("/run/k"));
        assert!(cfg.device_login.restart_units.is_empty());
        let err = load("mdma_url = \"https://m\"\n[tls]\ndirectory = \"/x\"\n").unwrap_err();
        assert!(err.to_string().contains("directory"), "{err}");
    }

    #[test]
    fn a_configured_token_and_registration_together_are_refused_naming_the_keys() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("token");
        std::fs::write(&file, "NEVER-LOGGED-TOKEN-file").unwrap();
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
        let table = "[registration]\ntoken_file = \"/t/tok\"\n";
        for (line, key) in [
            (
                "fleet_token = \"NEVER-LOGGED-TOKEN-inline\"".to_owned(),
                "fleet_token",
            ),
            (
                format!("fleet_token_file = \"{}\"", file.display()),
                "fleet_token_file",
            ),
        ] {
            let err = load(&format!("mdma_url = \"https://m\"\n{line}\n{table}")).unwrap_err();
            let text = err.to_string();
            assert!(
                matches!(
                    err,
                    ConfigError::Invalid {
                        key: "registration",
                        ..
                    }
                ),
                "{text}"
            );
            assert!(
                text.contains(key) && text.contains("[registration]"),
                "{text}"
            );
            assert!(!text.contains("NEVER-LOGGED-TOKEN"), "{text}");
        }
        // fleet_token_file is kept, to be read again on a refused poll and on SIGHUP.
        let cfg = load(&format!(
            "mdma_url = \"https://m\"\nfleet_token_file = \"{}\"",
            file.display()
        ))
        .unwrap();
        assert_eq!(cfg.fleet_token_file.as_deref(), Some(file.as_path()));
        assert!(cfg.registration.is_none());
    }

    /// A systemd credential (`LoadCredential=`, the recommended delivery) is a 0400 file in
    /// a 0500 directory, as tests/systemd sees under a real systemd: accepted as it is.
    #[test]
    fn a_systemd_credential_is_accepted_as_a_token_file() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let creds = dir.path().join("credentials");
        std::fs::create_dir(&creds).unwrap();
        let file = creds.join("fleet-token");
        std::fs::write(&file, "credential-token\n").unwrap();
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o400)).unwrap();
        std::fs::set_permissions(&creds, std::fs::Permissions::from_mode(0o500)).unwrap();
        let text = format!(
            "mdma_url = \"https://m\"\nfleet_token_file = \"{}\"",
            file.display()
        );
        let token = load(&text).map(|c| c.fleet_token.map(|t| t.expose().to_owned()));
        std::fs::set_permissions(&creds, std::fs::Permissions::from_mode(0o700)).unwrap();
        assert_eq!(token.unwrap().as_deref(), Some("credential-token"));
    }

    #[test]
    fn operability_keys() {
        let cfg = load(
            "mdma_url = \"https://m\"\nstatus_listen = \"127.0.0.1:9464\"\nlog_format = \"json\"\nmax_backoff = \"20s\"\nready_max_poll_age = \"1m\"",
        )
        .unwrap();
        assert_eq!(cfg.status_listen, Some("127.0.0.1:9464".parse().unwrap()));
        assert_eq!(cfg.log_format, LogFormat::Json);
        assert_eq!(cfg.max_backoff, Duration::from_secs(20));
        assert_eq!(cfg.ready_max_poll_age, Duration::from_secs(60));
        let d = load("mdma_url = \"https://m\"").unwrap();
        assert_eq!((d.status_listen, d.log_format), (None, LogFormat::Text));
        assert_eq!(d.max_backoff, Duration::from_secs(10));
        assert!(!d.dry_run);
        let err = load("mdma_url = \"https://m\"\nstatus_listen = \"localhost\"").unwrap_err();
        assert!(err.to_string().contains("status_listen"), "{err}");
        let err = load("mdma_url = \"https://m\"\nlog_format = \"xml\"").unwrap_err();
        assert!(err.to_string().contains("log_format"), "{err}");
    }

    #[test]
    fn an_unsendable_or_unquoted_token_is_refused_without_echo() {
        for (line, want) in [
            ("fleet_token = \"SUPER\\nSECRET\"", "HTTP header"),
            ("fleet_token = 123456789", "quoted string"),
            ("fleet_token = 1500.25", "quoted string"),
        ] {
            let err = load(&format!("mdma_url = \"https://m\"\n{line}"))
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("fleet_token") && err.contains(want),
                "{line}: {err}"
            );
            for secret in ["SUPER", "SECRET", "123456789", "1500"] {
                assert!(!err.contains(secret), "{line}: {err}");
            }
        }
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("token");
        std::fs::write(&file, "LINE1\nLINE2\n").unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
        let text = format!(
            "mdma_url = \"https://m\"\nfleet_token_file = \"{}\"",
            file.display()
        );
        let err = load(&text).unwrap_err().to_string();
        assert!(
            err.contains("second line") && !err.contains("LINE1"),
            "{err}"
        );
    }

    #[test]
    fn warnings_for_a_readable_config_with_a_token_and_a_public_listener() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.toml");
        std::fs::write(
            &path,
            "mdma_url = \"https://m\"\nfleet_token = \"t\"\nstatus_listen = \"0.0.0.0:9464\"",
        )
        .unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let cfg = Config::load(&path).unwrap();
        assert!(
            cfg.warnings.iter().any(|w| w.contains("chmod 600")),
            "{:?}",
            cfg.warnings
        );
        assert!(
            cfg.warnings.iter().any(|w| w.contains("not a loopback")),
            "{:?}",
            cfg.warnings
        );
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        let cfg = Config::load(&path).unwrap();
        assert!(
            !cfg.warnings.iter().any(|w| w.contains("chmod 600")),
            "{:?}",
            cfg.warnings
        );
    }

    #[test]
    fn the_token_never_shows_in_debug() {
        let cfg = load("mdma_url = \"https://m\"\nfleet_token = \"hunter2-token\"").unwrap();
        let debug = format!("{cfg:?}");
        assert!(!debug.contains("hunter2-token"));
        assert!(debug.contains("[redacted]"));
    }

    #[test]
    fn a_tool_needs_only_merod_and_state_file() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        // A token file the tool has no business reading, readable by all: the daemon refuses
        // it, the tool's view never opens it.
        let token = dir.path().join("token");
        std::fs::write(&token, "NEVER-LOGGED-TOKEN-tool\n").unwrap();
        std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o644)).unwrap();
        let text = format!(
            "state_file = \"/x/state.json\"\nfleet_token_file = \"{}\"\n[merod]\nhome = \"/h\"\nnode = \"n1\"\n",
            token.display()
        );
        let path = Path::new("/etc/x.toml");
        assert!(matches!(
            Config::from_toml(&text, path),
            Err(ConfigError::MissingMdmaUrl { .. })
        ));
        let tool = ToolConfig::from_toml(&text, path).unwrap();
        assert_eq!(tool.state_file, PathBuf::from("/x/state.json"));
        assert_eq!(tool.merod.config_toml(), PathBuf::from("/h/n1/config.toml"));
        assert!(tool.merod.admin_url.is_none());
        // Same schema: a mistyped key is named, a bad merod key too.
        let err = ToolConfig::from_toml("statefile = \"/x\"\n", path).unwrap_err();
        assert!(err.to_string().contains("statefile"), "{err}");
        let err = ToolConfig::from_toml("[merod]\nnode = \"a/b\"\n", path).unwrap_err();
        assert!(
            matches!(
                err,
                ConfigError::Invalid {
                    key: "merod.node",
                    ..
                }
            ),
            "{err}"
        );
        let err = ToolConfig::from_toml("state_file = \"/x/..\"\n", path).unwrap_err();
        assert!(
            matches!(
                err,
                ConfigError::Invalid {
                    key: "state_file",
                    ..
                }
            ),
            "{err}"
        );
        // Defaults are the daemon's.
        let tool = ToolConfig::from_toml("", path).unwrap();
        assert_eq!(
            tool.state_file,
            PathBuf::from("/var/lib/calimero/fleet-confirmed.json")
        );
    }

    #[test]
    fn a_tool_reads_the_token_registration_earned_with_the_same_checks() {
        use std::os::unix::fs::PermissionsExt;
        let path = Path::new("/etc/calimero/fleet-sidecar.toml");
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("fleet").join("fleet-token");
        let text = format!("[registration]\ntoken_file = \"{}\"\n", file.display());
        let tool = ToolConfig::from_toml(&text, path).unwrap();
        // Not registered yet: no token, no error.
        assert!(tool.mdma_credentials().unwrap().token.is_none());
        std::fs::create_dir_all(file.parent().unwrap()).unwrap();
        std::fs::write(&file, "NEVER-LOGGED-TOKEN-earned").unwrap();
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(
            tool.mdma_credentials().unwrap().token.unwrap().expose(),
            "NEVER-LOGGED-TOKEN-earned"
        );
        // Readable by others: refused as the daemon refuses fleet_token_file, naming the key.
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
        let err = tool.mdma_credentials().unwrap_err().to_string();
        assert!(err.contains("registration.token_file"), "{err}");
        assert!(!err.contains("NEVER-LOGGED-TOKEN"), "{err}");
    }

    #[test]
    fn a_tool_gets_tdx_mdma_url_and_the_credentials_with_the_daemons_checks() {
        use std::os::unix::fs::PermissionsExt;
        let path = Path::new("/etc/calimero/fleet-sidecar.toml");
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("token");
        std::fs::write(&file, "  NEVER-LOGGED-TOKEN-tool\n").unwrap();
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
        let text = format!(
            "mdma_url = \"https://mdma.fleet.internal/fleet\"\nfleet_token_file = \"{}\"\n\
             mdma_ca_file = \"/etc/ca.pem\"\n[tdx]\nsources = [\"tdreport\"]\n",
            file.display()
        );
        // Loading never opens the token file: a readable one is refused only when asked for.
        let tool = ToolConfig::from_toml(&text, path).unwrap();
        assert_eq!(tool.tdx.sources, [crate::mrtd::MrtdSource::Tdreport]);
        assert_eq!(
            tool.mdma_url.as_ref().map(Url::as_str),
            Some("https://mdma.fleet.internal/fleet/")
        );
        let err = tool.mdma_credentials().unwrap_err().to_string();
        assert!(
            err.contains("fleet_token_file") && err.contains("chmod 600"),
            "{err}"
        );
        assert!(!err.contains("NEVER-LOGGED-TOKEN"), "{err}");
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
        let credentials = tool.mdma_credentials().unwrap();
        assert_eq!(
            credentials.token.as_ref().map(FleetToken::expose),
            Some("NEVER-LOGGED-TOKEN-tool")
        );
        assert_eq!(
            credentials.ca_file.as_deref(),
            Some(Path::new("/etc/ca.pem"))
        );
        assert!(!format!("{credentials:?}").contains("NEVER-LOGGED-TOKEN"));
        // The daemon's other checks: one of the two keys, a usable inline token, a bad
        // mdma_url or [tdx] refused at load.
        let both = format!(
            "fleet_token = \"a\"\nfleet_token_file = \"{}\"",
            file.display()
        );
        let err = ToolConfig::from_toml(&both, path)
            .unwrap()
            .mdma_credentials();
        assert!(err.unwrap_err().to_string().contains("keep one"));
        let inline = ToolConfig::from_toml("fleet_token = \"NEVER-LOGGED-TOKEN-x\"", path).unwrap();
        assert_eq!(
            inline.mdma_credentials().unwrap().token.unwrap().expose(),
            "NEVER-LOGGED-TOKEN-x"
        );
        let empty = ToolConfig::from_toml("fleet_token = \"\"", path).unwrap();
        assert!(empty.mdma_credentials().is_err());
        for (text, key) in [
            ("mdma_url = \"http://mdma.example\"", "mdma_url"),
            // A tool refuses the placeholder host as the daemon does (one check for both).
            ("mdma_url = \"https://mdma.example\"", "mdma_url"),
            ("[tdx]\nsources = []", "tdx.sources"),
            ("[tdx]\nsources = [\"sysfs\", \"sysfs\"]", "tdx.sources"),
        ] {
            let err = ToolConfig::from_toml(text, path).unwrap_err();
            assert!(
                matches!(&err, ConfigError::Invalid { key: k, .. } if *k == key),
                "{text}: {err}"
            );
        }
        let loopback = ToolConfig::from_toml("mdma_url = \"http://127.0.0.1:9/\"", path).unwrap();
        assert!(loopback.mdma_url.is_some());
    }
}
