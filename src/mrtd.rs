//! Reading the TD's own MRTD (the 48-byte SHA-384 measurement of the TD's initial image).
//!
//! Four sources, tried in the order the config gives (see `docs/tdx.md`):
//!
//! 1. `sysfs`: `/sys/class/misc/tdx_guest/measurements/mrtd:sha384` (Linux >= 6.16), exactly
//!    48 raw bytes (`Documentation/ABI/testing/sysfs-devices-virtual-misc-tdx_guest`).
//! 2. `sysfs-legacy`: the same attribute under `mr/` instead of `measurements/`, as some
//!    pre-release kernels named it.
//! 3. `tdreport`: the `TDX_CMD_GET_REPORT0` ioctl on `/dev/tdx_guest` (Linux >= 6.2,
//!    `include/uapi/linux/tdx-guest.h`); MRTD at bytes 528..576 of the 1024-byte TDREPORT.
//! 4. `quote`: a TD quote through configfs-tsm (Linux >= 6.7,
//!    `Documentation/ABI/testing/configfs-tsm-report`); MRTD at 184..232 (quote v4) or
//!    190..238 (quote v5).
//!
//! Every read is split into a raw read (file I/O, ioctl) and a pure parser over `&[u8]`
//! ([`parse_sysfs`], [`parse_tdreport`], [`parse_quote`]), so the parsers are tested on bytes.

use std::fmt;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use nix::errno::Errno;
use serde::{Deserialize, Serialize};

/// The daemon's bound of one MRTD read with [`read_mrtd_bounded`] (every source tried, the
/// ioctl's short retries and a configfs-tsm quote included): 10 s.
pub const MRTD_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// A 48-byte MRTD (SHA-384 measurement of the TD's initial image).
///
/// `Display`, [`Mrtd::to_hex`] and `Serialize` (a JSON string) give 96 lowercase hex chars
/// without `0x`; `FromStr` and `Deserialize` take 96 hex chars of either case (nothing else:
/// no `0x`, no whitespace).
///
/// ```
/// let mrtd = fleet_sidecar::Mrtd::from([0xab; 48]);
/// assert_eq!(mrtd.to_string(), "ab".repeat(48));
/// assert_eq!(serde_json::to_string(&mrtd).unwrap(), format!("\"{}\"", "ab".repeat(48)));
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Mrtd([u8; Mrtd::LEN]);

impl Mrtd {
    /// Length of an MRTD in bytes (SHA-384): 48.
    pub const LEN: usize = 48;

    /// Builds an MRTD from exactly 48 bytes.
    ///
    /// # Errors
    /// [`MrtdError::WrongLength`] when `b` is not 48 bytes long.
    pub fn from_bytes(b: &[u8]) -> Result<Self, MrtdError> {
        <[u8; Self::LEN]>::try_from(b)
            .map(Self)
            .map_err(|_| MrtdError::WrongLength {
                what: "MRTD",
                expected: Self::LEN,
                actual: b.len(),
            })
    }

    /// The 48 raw bytes.
    pub fn as_bytes(&self) -> &[u8; Self::LEN] {
        &self.0
    }

    /// 96 lowercase hex chars, no `0x`.
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }

    fn is_all_zero(&self) -> bool {
        self.0.iter().all(|&b| b == 0)
    }
}

impl From<[u8; Mrtd::LEN]> for Mrtd {
    fn from(bytes: [u8; Mrtd::LEN]) -> Self {
        Self(bytes)
    }
}

impl fmt::Display for Mrtd {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl fmt::Debug for Mrtd {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Mrtd({})", self.to_hex())
    }
}

impl Serialize for Mrtd {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Mrtd {
    /// A string of 96 hex chars, either case.
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

impl FromStr for Mrtd {
    type Err = MrtdError;

    /// Parses 96 hex chars (either case).
    ///
    /// # Errors
    /// [`MrtdError::BadHex`] for any other length or a non-hex char.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.len() != 2 * Self::LEN {
            return Err(MrtdError::BadHex {
                reason: format!("expected {} hex chars, got {}", 2 * Self::LEN, s.len()),
            });
        }
        let mut bytes = [0u8; Self::LEN];
        hex::decode_to_slice(s, &mut bytes).map_err(|e| MrtdError::BadHex {
            reason: e.to_string().to_lowercase(),
        })?;
        Ok(Self(bytes))
    }
}

/// Where an MRTD was read from.
///
/// serde names and `Display`: `"sysfs"`, `"sysfs-legacy"`, `"tdreport"`, `"quote"`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum MrtdSource {
    /// The sysfs attribute `measurements/mrtd:sha384` (48 raw bytes), Linux >= 6.16.
    ///
    /// Side effects: none (one read of a read-only attribute).
    Sysfs,
    /// The same attribute under `mr/`, as some pre-release kernels named it.
    ///
    /// Side effects: none (one read of a read-only attribute).
    SysfsLegacy,
    /// `TDX_CMD_GET_REPORT0` on `/dev/tdx_guest` (root only), Linux >= 6.2.
    ///
    /// Side effects: none that last. The TDX module builds a TDREPORT over 64 zero bytes of
    /// report data; nothing is written anywhere and nothing leaves the TD. The device is
    /// held open for the call (up to 5 attempts while it answers EBUSY/EINTR, 100 ms in all).
    Tdreport,
    /// A TD quote through configfs-tsm (root only), Linux >= 6.7.
    ///
    /// Side effects: **yes**. It creates a directory `fleet-sidecar-mrtd-<pid>-<n>-<ns>` under
    /// `tsm_report_dir`, writes 64 zero bytes to its `inblob`, which makes the kernel ask
    /// the host's quoting service for a signed quote (a round trip out of the TD, seconds
    /// on a busy host), reads `outblob` and removes the directory again (also when the
    /// exchange failed). Another reader of configfs-tsm at the same moment may see its
    /// `generation` move. Leave it out with [`TdxConfig::without_side_effects`].
    Quote,
}

impl MrtdSource {
    /// Every source, in the default order of [`TdxConfig::sources`].
    pub const ALL: [MrtdSource; 4] = [
        MrtdSource::Sysfs,
        MrtdSource::SysfsLegacy,
        MrtdSource::Tdreport,
        MrtdSource::Quote,
    ];

    /// Whether reading this source changes anything outside the reading process: only
    /// [`MrtdSource::Quote`] does (see each variant).
    pub fn has_side_effects(self) -> bool {
        matches!(self, MrtdSource::Quote)
    }

    /// The config/serde name: `"sysfs"`, `"sysfs-legacy"`, `"tdreport"` or `"quote"`.
    pub fn as_str(self) -> &'static str {
        match self {
            MrtdSource::Sysfs => "sysfs",
            MrtdSource::SysfsLegacy => "sysfs-legacy",
            MrtdSource::Tdreport => "tdreport",
            MrtdSource::Quote => "quote",
        }
    }
}

impl fmt::Display for MrtdSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The `[tdx]` table of the sidecar's config file.
///
/// Unknown keys are rejected; every key is optional, with the default shown on each field.
/// Call [`TdxConfig::validate`] after loading.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TdxConfig {
    /// The sysfs MRTD attribute. Default `/sys/class/misc/tdx_guest/measurements/mrtd:sha384`.
    pub mrtd_path: PathBuf,
    /// The pre-release sysfs MRTD attribute. Default `/sys/class/misc/tdx_guest/mr/mrtd:sha384`.
    pub legacy_mrtd_path: PathBuf,
    /// The TDX guest device for `TDX_CMD_GET_REPORT0`. Default `/dev/tdx_guest`.
    pub device: PathBuf,
    /// The configfs-tsm report directory. Default `/sys/kernel/config/tsm/report`.
    pub tsm_report_dir: PathBuf,
    /// Sources to try, in order; non-empty, no duplicates.
    /// Default `["sysfs", "sysfs-legacy", "tdreport", "quote"]`.
    pub sources: Vec<MrtdSource>,
}

impl Default for TdxConfig {
    fn default() -> Self {
        Self {
            mrtd_path: PathBuf::from("/sys/class/misc/tdx_guest/measurements/mrtd:sha384"),
            legacy_mrtd_path: PathBuf::from("/sys/class/misc/tdx_guest/mr/mrtd:sha384"),
            device: PathBuf::from("/dev/tdx_guest"),
            tsm_report_dir: PathBuf::from("/sys/kernel/config/tsm/report"),
            sources: MrtdSource::ALL.to_vec(),
        }
    }
}

impl TdxConfig {
    /// This table with the sources that have side effects left out (see
    /// [`MrtdSource::has_side_effects`]: the configfs-tsm `quote`), for a tool that must
    /// only look. The order of the others is kept; the result may have no source left (e.g.
    /// from `sources = ["quote"]`), which [`TdxConfig::validate`] refuses with
    /// [`MrtdError::NoSources`] and [`read_mrtd`] and [`read_mrtd_bounded`] refuse with an
    /// [`MrtdUnavailable`] of kind `no-sources` (no entry in `failures`, nothing tried).
    ///
    /// ```
    /// use fleet_sidecar::{MrtdSource, TdxConfig};
    ///
    /// let look_only = TdxConfig::default().without_side_effects();
    /// assert_eq!(look_only.sources, [MrtdSource::Sysfs, MrtdSource::SysfsLegacy, MrtdSource::Tdreport]);
    /// ```
    pub fn without_side_effects(&self) -> TdxConfig {
        let mut cfg = self.clone();
        cfg.sources.retain(|s| !s.has_side_effects());
        cfg
    }

    /// The file, device or directory `source` reads under this table.
    pub fn path_of(&self, source: MrtdSource) -> &Path {
        match source {
            MrtdSource::Sysfs => &self.mrtd_path,
            MrtdSource::SysfsLegacy => &self.legacy_mrtd_path,
            MrtdSource::Tdreport => &self.device,
            MrtdSource::Quote => &self.tsm_report_dir,
        }
    }

    /// Checks the table beyond what serde checks.
    ///
    /// # Errors
    /// [`MrtdError::NoSources`] when `sources` is empty, [`MrtdError::DuplicateSource`] when a
    /// source is listed twice.
    pub fn validate(&self) -> Result<(), MrtdError> {
        if self.sources.is_empty() {
            return Err(MrtdError::NoSources);
        }
        for (i, source) in self.sources.iter().enumerate() {
            if self.sources[..i].contains(source) {
                return Err(MrtdError::DuplicateSource(*source));
            }
        }
        Ok(())
    }
}

/// Why one MRTD source (or a config value, or a hex string) failed.
///
/// Messages are one lowercase line and name the file or device involved.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MrtdError {
    /// Opening, reading, writing, creating or removing `path` failed. A missing path reads as
    /// "not present (not a TD, or kernel without this interface)".
    #[error("{}: {}", .path.display(), describe_io(.source))]
    Io {
        /// The file or directory involved.
        path: PathBuf,
        /// The OS error.
        source: io::Error,
    },
    /// `path` holds more than `limit` bytes (a wrong path, e.g. a character device).
    #[error("{}: more than {limit} bytes: not the expected file", .path.display())]
    TooLarge {
        /// The file read.
        path: PathBuf,
        /// The most bytes accepted.
        limit: usize,
    },
    /// The data read from `path` is not valid; `source` says why.
    #[error("{}: {source}", .path.display())]
    Invalid {
        /// The file or device the data came from.
        path: PathBuf,
        /// What is wrong with the data.
        source: Box<MrtdError>,
    },
    /// `what` is `actual` bytes long where exactly `expected` are required.
    #[error("{what} is {actual} bytes, expected exactly {expected}")]
    WrongLength {
        /// What was measured, e.g. "sysfs MRTD attribute".
        what: &'static str,
        /// The required length.
        expected: usize,
        /// The length found.
        actual: usize,
    },
    /// `what` is `got` bytes long where at least `need` are required.
    #[error("{what} truncated: {got} bytes, need at least {need}")]
    Truncated {
        /// What was cut short, e.g. "tdreport".
        what: &'static str,
        /// The least length that holds the MRTD.
        need: usize,
        /// The length found.
        got: usize,
    },
    /// The TDREPORT's REPORTTYPE type byte (offset 0) is not 0x81 (TDX).
    #[error("tdreport type byte is {0:#04x}, expected 0x81 (tdx)")]
    BadReportType(u8),
    /// The quote header's version (u16 LE at offset 0) is neither 4 nor 5.
    #[error("unsupported quote version {0}")]
    UnsupportedQuoteVersion(u16),
    /// The quote v5 body type (u16 LE at offset 48) is not a TD report (2 = TDX 1.0,
    /// 3 = TDX 1.5).
    #[error("unsupported quote v5 body type {0}, expected 2 or 3 (td report)")]
    UnsupportedQuoteBody(u16),
    /// The quote header's tee_type (u32 LE at offset 4) is not 0x81 (TDX).
    #[error("quote tee_type is {0:#x}, expected 0x81 (tdx)")]
    BadTeeType(u32),
    /// A real source gave an all-zero MRTD, which means a wrong read.
    #[error("all-zero MRTD: wrong read")]
    AllZero,
    /// `TDX_CMD_GET_REPORT0` on `path` failed with `errno` (after retrying EBUSY/EINTR).
    #[error("{}: TDX_CMD_GET_REPORT0 failed: {}", .path.display(), describe_errno(*.errno))]
    Ioctl {
        /// The device.
        path: PathBuf,
        /// The errno of the last attempt.
        errno: Errno,
    },
    /// The configfs-tsm `provider` file does not read `tdx_guest`.
    #[error("{}: provider is {found:?}, expected \"tdx_guest\"", .path.display())]
    TsmProvider {
        /// The `provider` file.
        path: PathBuf,
        /// Its content, without the trailing newline.
        found: String,
    },
    /// The configfs-tsm `generation` file does not read `1`: another writer raced.
    #[error(
        "{}: generation is {found:?}, expected \"1\": another writer raced",
        .path.display()
    )]
    TsmGeneration {
        /// The `generation` file.
        path: PathBuf,
        /// Its content, without the trailing newline.
        found: String,
    },
    /// A string is not 96 hex chars.
    #[error("bad MRTD hex: {reason}")]
    BadHex {
        /// What is wrong with it.
        reason: String,
    },
    /// Config: `[tdx] sources` is empty.
    #[error("[tdx] sources is empty: list at least one MRTD source")]
    NoSources,
    /// Config: `[tdx] sources` lists a source twice.
    #[error("[tdx] sources lists \"{0}\" more than once")]
    DuplicateSource(MrtdSource),
    /// [`read_mrtd_bounded`]: the source reading `path` gave no answer within `after` (a
    /// FIFO or a stalled device in place of the file). The read is abandoned, not stopped:
    /// its thread stays blocked until the kernel answers.
    #[error("{}: no answer within {after:?}", .path.display())]
    Timeout {
        /// The file, device or directory the source was reading.
        path: PathBuf,
        /// The deadline of the whole read.
        after: Duration,
    },
    /// [`read_mrtd_bounded`] could not start its reader thread, or the thread stopped without
    /// an answer.
    #[error("the MRTD reader thread {0}")]
    Reader(#[source] ReaderFailure),
}

/// How the thread (or blocking task) reading the MRTD failed, before any source answered.
#[derive(Debug, thiserror::Error)]
pub enum ReaderFailure {
    /// The thread could not be started.
    #[error("could not start: {0}")]
    Start(#[source] std::io::Error),
    /// It stopped without an answer.
    #[error("stopped without an answer")]
    Stopped,
    /// The blocking task it ran in panicked.
    #[error("ran in a blocking task that panicked")]
    Panicked,
    /// The blocking task it ran in was cancelled.
    #[error("ran in a blocking task that was cancelled")]
    Cancelled,
}

impl MrtdError {
    /// The failure's one classification, stable for a program to match (the `kind` of its
    /// `Serialize` form, `{"kind": …, "message": …}`): `not-present` (the path does not
    /// exist: not a TD, or no such interface), `permission-denied`, `io` (any other I/O
    /// error), `too-large`, `invalid` (the data read is not valid), `wrong-length`,
    /// `truncated`, `bad-report-type`, `unsupported-quote-version`, `unsupported-quote-body`,
    /// `bad-tee-type`, `all-zero`, `ioctl`, `tsm-provider`, `tsm-generation`, `bad-hex`,
    /// `no-sources`, `duplicate-source`, `timeout`, `reader`.
    pub fn kind(&self) -> &'static str {
        match self {
            MrtdError::Io { source, .. } => match source.kind() {
                io::ErrorKind::NotFound => "not-present",
                io::ErrorKind::PermissionDenied => "permission-denied",
                _ => "io",
            },
            MrtdError::TooLarge { .. } => "too-large",
            MrtdError::Invalid { .. } => "invalid",
            MrtdError::WrongLength { .. } => "wrong-length",
            MrtdError::Truncated { .. } => "truncated",
            MrtdError::BadReportType(_) => "bad-report-type",
            MrtdError::UnsupportedQuoteVersion(_) => "unsupported-quote-version",
            MrtdError::UnsupportedQuoteBody(_) => "unsupported-quote-body",
            MrtdError::BadTeeType(_) => "bad-tee-type",
            MrtdError::AllZero => "all-zero",
            MrtdError::Ioctl { .. } => "ioctl",
            MrtdError::TsmProvider { .. } => "tsm-provider",
            MrtdError::TsmGeneration { .. } => "tsm-generation",
            MrtdError::BadHex { .. } => "bad-hex",
            MrtdError::NoSources => "no-sources",
            MrtdError::DuplicateSource(_) => "duplicate-source",
            MrtdError::Timeout { .. } => "timeout",
            MrtdError::Reader(_) => "reader",
        }
    }
}

serialize_kind_and_message!(MrtdError);

fn describe_io(e: &io::Error) -> String {
    match e.kind() {
        io::ErrorKind::NotFound => {
            "not present (not a TD, or kernel without this interface)".to_owned()
        }
        io::ErrorKind::PermissionDenied => "permission denied".to_owned(),
        _ => e.to_string(),
    }
}

fn describe_errno(errno: Errno) -> String {
    match errno {
        Errno::ENOTTY => "device does not support TDX_CMD_GET_REPORT0 (ENOTTY)".to_owned(),
        Errno::EBUSY => "device still busy after retries (EBUSY)".to_owned(),
        Errno::EINTR => "still interrupted after retries (EINTR)".to_owned(),
        Errno::EINVAL | Errno::ENXIO => {
            format!("tdx module rejected the report request ({errno:?})")
        }
        Errno::EIO => "tdx module call failed (EIO)".to_owned(),
        Errno::EACCES | Errno::EPERM => format!("permission denied ({errno:?})"),
        _ => format!("{errno:?}: {}", errno.desc().to_lowercase()),
    }
}

/// A successful read: the MRTD and the source it came from.
///
/// `Serialize`: `{"mrtd": "<96 lowercase hex>", "source": "sysfs"}`. `Display`: the hex, a
/// tab and the source (what `fleet-sidecar mrtd` prints).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct MrtdReading {
    /// The 48-byte MRTD.
    pub mrtd: Mrtd,
    /// The source that gave it.
    pub source: MrtdSource,
}

impl fmt::Display for MrtdReading {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}\t{}", self.mrtd, self.source)
    }
}

/// No MRTD: every source tried failed, or there was no source to try.
///
/// `failures` has one entry per source tried, in order; it is empty exactly when the
/// configuration left no source to try ([`MrtdUnavailable::kind`] `no-sources`): `sources`
/// empty, or only sources with side effects, all left out by
/// [`TdxConfig::without_side_effects`].
///
/// `Display`: `no MRTD source worked: ` then each `source: reason`, separated by `; `, on one
/// line; with no source, `no MRTD source to try: …`. `Serialize`: `{"kind": …, "message": …,
/// "failures": [{"source": "sysfs", "kind": …, "message": …}, …]}` (see
/// [`MrtdUnavailable::kind`] and [`MrtdError::kind`]).
#[derive(Debug)]
pub struct MrtdUnavailable {
    /// Each source tried with its error, in order (empty: no source to try).
    pub failures: Vec<(MrtdSource, MrtdError)>,
}

impl MrtdUnavailable {
    /// `no-sources` (nothing was tried: see the type), `timeout` (the last source tried gave
    /// no answer within the deadline of [`read_mrtd_bounded`]) or `failed` (every source
    /// answered, with an error).
    pub fn kind(&self) -> &'static str {
        match self.failures.last() {
            None => "no-sources",
            Some((_, MrtdError::Timeout { .. })) => "timeout",
            Some(_) => "failed",
        }
    }
}

impl fmt::Display for MrtdUnavailable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.failures.is_empty() {
            return f.write_str(
                "no MRTD source to try: [tdx] sources is empty, or lists only sources with \
                 side effects and they were left out",
            );
        }
        f.write_str("no MRTD source worked: ")?;
        for (i, (source, error)) in self.failures.iter().enumerate() {
            if i > 0 {
                f.write_str("; ")?;
            }
            write!(f, "{source}: {error}")?;
        }
        Ok(())
    }
}

impl Serialize for MrtdUnavailable {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        #[derive(Serialize)]
        struct Failure {
            source: MrtdSource,
            kind: &'static str,
            message: String,
        }
        let failures: Vec<Failure> = self
            .failures
            .iter()
            .map(|(source, e)| Failure {
                source: *source,
                kind: e.kind(),
                message: e.to_string(),
            })
            .collect();
        let mut out = s.serialize_struct("MrtdUnavailable", 3)?;
        out.serialize_field("kind", self.kind())?;
        out.serialize_field("message", &self.to_string())?;
        out.serialize_field("failures", &failures)?;
        out.end()
    }
}

impl std::error::Error for MrtdUnavailable {}

/// Tries `cfg.sources` in order; the first source that yields a valid MRTD wins.
///
/// Blocking (file I/O, ioctl with short sleeps between retries) and without a deadline: a
/// FIFO in place of a sysfs file blocks it until a writer comes. Tools and the daemon use
/// [`read_mrtd_bounded`]; see [`MrtdSource`] for what each source does to the machine.
///
/// # Errors
/// [`MrtdUnavailable`] with one `(source, error)` per source tried when none worked; of kind
/// `no-sources`, with no entry, when `cfg.sources` is empty.
pub fn read_mrtd(cfg: &TdxConfig) -> Result<MrtdReading, MrtdUnavailable> {
    let mut failures = Vec::new();
    for &source in &cfg.sources {
        match read_source(cfg, source) {
            Ok(mrtd) => return Ok(MrtdReading { mrtd, source }),
            Err(e) => failures.push((source, e)),
        }
    }
    Err(MrtdUnavailable { failures })
}

/// [`read_mrtd`] with a deadline: tries `cfg.sources` in order on a thread of its own and
/// waits at most `within` in all (the daemon reads with [`MRTD_READ_TIMEOUT`], 10 s). A source still reading when
/// the time is up is reported as [`MrtdError::Timeout`] naming its path, after the failures
/// of the sources before it; the sources after it are not tried. What reading each source
/// does to the machine is on its [`MrtdSource`] variant: pass
/// [`TdxConfig::without_side_effects`] to leave out the ones that change anything.
///
/// Blocks the calling thread for at most `within` (plus the thread's start); from async
/// code, use [`read_mrtd_bounded_async`]. A source that never answers (a FIFO in
/// place of the sysfs file, a wedged device) keeps its thread blocked in the kernel after
/// this returns: nothing can interrupt a blocked `read(2)` from outside.
///
/// ```
/// use std::time::Duration;
/// use fleet_sidecar::{read_mrtd_bounded, MrtdSource, TdxConfig};
///
/// let dir = tempfile::tempdir().unwrap();
/// let cfg = TdxConfig {
///     mrtd_path: dir.path().join("mrtd"),
///     sources: vec![MrtdSource::Sysfs],
///     ..TdxConfig::default()
/// };
/// std::fs::write(&cfg.mrtd_path, [7u8; 48]).unwrap();
/// let reading = read_mrtd_bounded(&cfg.without_side_effects(), Duration::from_secs(2)).unwrap();
/// assert_eq!(reading.source, MrtdSource::Sysfs);
/// assert_eq!(reading.mrtd.to_hex(), "07".repeat(48));
/// ```
///
/// # Errors
/// [`MrtdUnavailable`] with one `(source, error)` per source tried, in order, the last one
/// [`MrtdError::Timeout`] when the deadline passed ([`MrtdError::Reader`] when the thread
/// could not start); of kind `no-sources`, with no entry and no thread started, when
/// `cfg.sources` is empty (as [`TdxConfig::without_side_effects`] leaves `sources = ["quote"]`).
pub fn read_mrtd_bounded(
    cfg: &TdxConfig,
    within: Duration,
) -> Result<MrtdReading, MrtdUnavailable> {
    if cfg.sources.is_empty() {
        return Err(MrtdUnavailable {
            failures: Vec::new(),
        });
    }
    let started = Instant::now();
    let (tx, rx) = mpsc::channel();
    let reader_cfg = cfg.clone();
    let spawned = std::thread::Builder::new()
        .name("mrtd-read".to_owned())
        .spawn(move || {
            for &source in &reader_cfg.sources {
                let result = read_source(&reader_cfg, source);
                let found = result.is_ok();
                // The receiver is gone once the deadline passed: nobody waits any more.
                if tx.send((source, result)).is_err() || found {
                    return;
                }
            }
        });
    let mut failures = Vec::new();
    if let Err(e) = spawned {
        if let Some(&first) = cfg.sources.first() {
            failures.push((first, MrtdError::Reader(ReaderFailure::Start(e))));
        }
        return Err(MrtdUnavailable { failures });
    }
    for &source in &cfg.sources {
        let left = within.saturating_sub(started.elapsed());
        match rx.recv_timeout(left) {
            Ok((source, Ok(mrtd))) => return Ok(MrtdReading { mrtd, source }),
            Ok((source, Err(e))) => failures.push((source, e)),
            Err(mpsc::RecvTimeoutError::Timeout) => {
                let path = cfg.path_of(source).to_path_buf();
                failures.push((
                    source,
                    MrtdError::Timeout {
                        path,
                        after: within,
                    },
                ));
                break;
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                let stopped = MrtdError::Reader(ReaderFailure::Stopped);
                failures.push((source, stopped));
                break;
            }
        }
    }
    Err(MrtdUnavailable { failures })
}

/// [`read_mrtd_bounded`] from async code: runs it under `tokio::task::spawn_blocking`, so the
/// runtime's worker threads never block (needs a tokio runtime). Returns after at most
/// `within` plus the start of the blocking task.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// use std::time::Duration;
/// use fleet_sidecar::{read_mrtd_bounded_async, MrtdSource, TdxConfig};
///
/// let cfg = TdxConfig { sources: vec![MrtdSource::Quote], ..TdxConfig::default() };
/// let e = read_mrtd_bounded_async(&cfg.without_side_effects(), Duration::from_secs(2))
///     .await
///     .unwrap_err();
/// assert_eq!(e.kind(), "no-sources");
/// # }
/// ```
///
/// # Errors
/// As [`read_mrtd_bounded`]; a blocking task that panicked or was cancelled (the runtime
/// shutting down) is an entry [`MrtdError::Reader`] for the first source.
pub async fn read_mrtd_bounded_async(
    cfg: &TdxConfig,
    within: Duration,
) -> Result<MrtdReading, MrtdUnavailable> {
    let owned = cfg.clone();
    match tokio::task::spawn_blocking(move || read_mrtd_bounded(&owned, within)).await {
        Ok(result) => result,
        Err(e) => Err(reader_task_failed(cfg, &e)),
    }
}

/// The error of a blocking read task that ended without an answer: an entry
/// [`MrtdError::Reader`] for the first source (none when there is no source).
fn reader_task_failed(cfg: &TdxConfig, e: &tokio::task::JoinError) -> MrtdUnavailable {
    let what = if e.is_panic() {
        ReaderFailure::Panicked
    } else {
        ReaderFailure::Cancelled
    };
    MrtdUnavailable {
        failures: cfg
            .sources
            .first()
            .map(|&first| (first, MrtdError::Reader(what)))
            .into_iter()
            .collect(),
    }
}

/// Reads one source: a raw read of the path `cfg` gives for it, then the pure parser.
///
/// Blocking. `Sysfs` reads `cfg.mrtd_path`, `SysfsLegacy` reads `cfg.legacy_mrtd_path`,
/// `Tdreport` calls `TDX_CMD_GET_REPORT0` on `cfg.device` (retrying EBUSY/EINTR up to 5 times),
/// `Quote` makes (and always removes) an entry under `cfg.tsm_report_dir`.
///
/// # Errors
/// [`MrtdError::Io`] for a missing/unreadable path, [`MrtdError::TooLarge`],
/// [`MrtdError::Ioctl`], [`MrtdError::TsmProvider`], [`MrtdError::TsmGeneration`], and
/// [`MrtdError::Invalid`] (naming the path) wrapping a parser error.
pub(crate) fn read_source(cfg: &TdxConfig, source: MrtdSource) -> Result<Mrtd, MrtdError> {
    match source {
        MrtdSource::Sysfs => read_sysfs(&cfg.mrtd_path),
        MrtdSource::SysfsLegacy => read_sysfs(&cfg.legacy_mrtd_path),
        MrtdSource::Tdreport => read_tdreport(&cfg.device),
        MrtdSource::Quote => read_quote(&cfg.tsm_report_dir),
    }
}

/// Parses the sysfs `mrtd:sha384` attribute: exactly 48 raw bytes (not hex, no newline).
///
/// # Errors
/// [`MrtdError::WrongLength`] for any other length (never padded or trimmed),
/// [`MrtdError::AllZero`] for 48 zero bytes.
pub fn parse_sysfs(bytes: &[u8]) -> Result<Mrtd, MrtdError> {
    if bytes.len() != Mrtd::LEN {
        return Err(MrtdError::WrongLength {
            what: "sysfs MRTD attribute",
            expected: Mrtd::LEN,
            actual: bytes.len(),
        });
    }
    non_zero(Mrtd::from_bytes(bytes)?)
}

/// Size of a TDREPORT (`TDREPORT_STRUCT`): 1024 bytes.
pub const TDREPORT_LEN: usize = 1024;
/// REPORTTYPE type byte (offset 0 of a TDREPORT) of a TDX report: 0x81.
pub(crate) const TDX_REPORT_TYPE: u8 = 0x81;
/// Offset of MRTD in a TDREPORT (TDINFO at 512 + ATTRIBUTES 8 + XFAM 8): 528..576.
pub(crate) const TDREPORT_MRTD_OFFSET: usize = 528;

/// Parses a TDREPORT (1024 bytes, as `TDX_CMD_GET_REPORT0` returns it).
///
/// Requires at least 1024 bytes and REPORTTYPE type byte 0x81 at offset 0; MRTD is 528..576.
///
/// # Errors
/// [`MrtdError::Truncated`] below 1024 bytes, [`MrtdError::BadReportType`],
/// [`MrtdError::AllZero`].
pub fn parse_tdreport(bytes: &[u8]) -> Result<Mrtd, MrtdError> {
    if bytes.len() < TDREPORT_LEN {
        return Err(MrtdError::Truncated {
            what: "tdreport",
            need: TDREPORT_LEN,
            got: bytes.len(),
        });
    }
    if bytes[0] != TDX_REPORT_TYPE {
        return Err(MrtdError::BadReportType(bytes[0]));
    }
    non_zero(Mrtd::from_bytes(
        &bytes[TDREPORT_MRTD_OFFSET..TDREPORT_MRTD_OFFSET + Mrtd::LEN],
    )?)
}

/// Size of a quote header: 48 bytes.
const QUOTE_HEADER_LEN: usize = 48;
/// tee_type of a TDX quote: 0x81.
const QUOTE_TEE_TYPE_TDX: u32 = 0x81;
/// MRTD offset in a quote v4 (header 48 + TEE_TCB_SVN 16 + MRSEAM 48 + MRSIGNERSEAM 48 +
/// SEAMATTRIBUTES 8 + TDATTRIBUTES 8 + XFAM 8).
const QUOTE_V4_MRTD_OFFSET: usize = 184;
/// MRTD offset in a quote v5 (as v4, plus u16 body type and u32 body size before the body).
const QUOTE_V5_MRTD_OFFSET: usize = 190;

/// Parses a TD quote (v4 or v5, as configfs-tsm's `outblob` gives it).
///
/// Header: u16 LE version at 0, u32 LE tee_type at 4 (must be 0x81). v4: MRTD at 184..232.
/// v5: u16 LE body type at 48 (2 or 3: TD report), MRTD at 190..238. Only the bytes up to the
/// MRTD are required: signature data and trailing zero padding are ignored.
///
/// # Errors
/// [`MrtdError::Truncated`], [`MrtdError::UnsupportedQuoteVersion`] (neither 4 nor 5),
/// [`MrtdError::BadTeeType`], [`MrtdError::UnsupportedQuoteBody`], [`MrtdError::AllZero`].
pub fn parse_quote(bytes: &[u8]) -> Result<Mrtd, MrtdError> {
    let header = bytes.get(..QUOTE_HEADER_LEN).ok_or(MrtdError::Truncated {
        what: "quote header",
        need: QUOTE_HEADER_LEN,
        got: bytes.len(),
    })?;
    let version = u16::from_le_bytes([header[0], header[1]]);
    let tee_type = u32::from_le_bytes([header[4], header[5], header[6], header[7]]);
    let (what, offset) = match version {
        4 => ("quote v4", QUOTE_V4_MRTD_OFFSET),
        5 => ("quote v5", QUOTE_V5_MRTD_OFFSET),
        other => return Err(MrtdError::UnsupportedQuoteVersion(other)),
    };
    if tee_type != QUOTE_TEE_TYPE_TDX {
        return Err(MrtdError::BadTeeType(tee_type));
    }
    let end = offset + Mrtd::LEN;
    let mrtd = bytes.get(offset..end).ok_or(MrtdError::Truncated {
        what,
        need: end,
        got: bytes.len(),
    })?;
    if version == 5 {
        let body_type = u16::from_le_bytes([bytes[48], bytes[49]]);
        if body_type != 2 && body_type != 3 {
            return Err(MrtdError::UnsupportedQuoteBody(body_type));
        }
    }
    non_zero(Mrtd::from_bytes(mrtd)?)
}

/// Largest saved TDREPORT or quote [`read_saved`] reads (real quotes are a few KiB): 1 MiB.
pub const SAVED_EVIDENCE_LIMIT: usize = 1 << 20;

/// What a file given to [`read_saved`] holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SavedEvidence {
    /// A TDREPORT as `TDX_CMD_GET_REPORT0` returns it: exactly [`TDREPORT_LEN`] (1024) bytes.
    TdReport,
    /// A TD quote, version 4 or 5.
    Quote,
}

/// Reads the MRTD from a saved TDREPORT or quote at `path`, offline (e.g. evidence copied
/// off a node). Reads at most [`SAVED_EVIDENCE_LIMIT`] bytes.
///
/// Errors: [`MrtdError::Io`], [`MrtdError::TooLarge`], and [`MrtdError::Invalid`] naming
/// `path` around the parser's error ([`MrtdError::WrongLength`] for a TDREPORT that is not
/// 1024 bytes, or what [`parse_tdreport`] / [`parse_quote`] say).
pub fn read_saved(path: &Path, kind: SavedEvidence) -> Result<Mrtd, MrtdError> {
    let bytes = read_limited(path, SAVED_EVIDENCE_LIMIT)?;
    let parsed = match kind {
        SavedEvidence::TdReport if bytes.len() != TDREPORT_LEN => Err(MrtdError::WrongLength {
            what: "saved tdreport",
            expected: TDREPORT_LEN,
            actual: bytes.len(),
        }),
        SavedEvidence::TdReport => parse_tdreport(&bytes),
        SavedEvidence::Quote => parse_quote(&bytes),
    };
    parsed.map_err(|e| invalid(path, e))
}

fn non_zero(mrtd: Mrtd) -> Result<Mrtd, MrtdError> {
    if mrtd.is_all_zero() {
        Err(MrtdError::AllZero)
    } else {
        Ok(mrtd)
    }
}

fn io_error(path: &Path, source: io::Error) -> MrtdError {
    MrtdError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn invalid(path: &Path, source: MrtdError) -> MrtdError {
    MrtdError::Invalid {
        path: path.to_path_buf(),
        source: Box::new(source),
    }
}

/// Reads at most `limit` bytes of `path`; more is [`MrtdError::TooLarge`].
fn read_limited(path: &Path, limit: usize) -> Result<Vec<u8>, MrtdError> {
    let file = File::open(path).map_err(|e| io_error(path, e))?;
    let mut bytes = Vec::new();
    let cap = u64::try_from(limit).unwrap_or(u64::MAX).saturating_add(1);
    file.take(cap)
        .read_to_end(&mut bytes)
        .map_err(|e| io_error(path, e))?;
    if bytes.len() > limit {
        return Err(MrtdError::TooLarge {
            path: path.to_path_buf(),
            limit,
        });
    }
    Ok(bytes)
}

/// Largest sysfs attribute or configfs-tsm text file accepted.
const SMALL_FILE_LIMIT: usize = 4096;
/// Largest quote accepted (real ones are a few KiB, with a certificate chain under 16 KiB).
const QUOTE_LIMIT: usize = 1 << 20;

fn read_sysfs(path: &Path) -> Result<Mrtd, MrtdError> {
    let bytes = read_limited(path, SMALL_FILE_LIMIT)?;
    parse_sysfs(&bytes).map_err(|e| invalid(path, e))
}

/// `TDX_CMD_GET_REPORT0 = _IOWR('T', 1, struct tdx_report_req)` (`include/uapi/linux/tdx-guest.h`).
pub(crate) const TDX_CMD_GET_REPORT0: u64 = 0xC440_5401;

/// `struct tdx_report_req` of `include/uapi/linux/tdx-guest.h`: 1088 bytes, no padding.
#[derive(Clone, Debug)]
#[repr(C)]
pub(crate) struct TdxReportReq {
    /// User data bound into the report (64 bytes); all zero is fine for reading MRTD.
    pub reportdata: [u8; 64],
    /// The TDREPORT the kernel writes back (1024 bytes).
    pub tdreport: [u8; TDREPORT_LEN],
}

impl TdxReportReq {
    /// A request with all-zero `reportdata` and `tdreport`.
    pub(crate) fn zeroed() -> Self {
        Self {
            reportdata: [0; 64],
            tdreport: [0; TDREPORT_LEN],
        }
    }
}

const _: () = assert!(std::mem::size_of::<TdxReportReq>() == 1088);
const _: () = assert!(
    nix::request_code_readwrite!(b'T', 1, std::mem::size_of::<TdxReportReq>()) as u32 as u64
        == TDX_CMD_GET_REPORT0
);

mod ioctl {
    nix::ioctl_readwrite!(tdx_get_report0, b'T', 1, super::TdxReportReq);
}

/// Attempts made at `TDX_CMD_GET_REPORT0` while it fails with EBUSY or EINTR.
const TRANSIENT_ATTEMPTS: u32 = 5;
/// Sleep before retry n (1-based) is n times this: 10, 20, 30, 40 ms.
const TRANSIENT_BACKOFF: Duration = Duration::from_millis(10);

/// Calls `f` up to `attempts` times (at least once) while it fails with EBUSY or EINTR,
/// sleeping `backoff * n` before retry n. Any other errno, or the last transient one, is
/// returned as is.
fn with_transient_retry<T, F>(mut f: F, attempts: u32, backoff: Duration) -> Result<T, Errno>
where
    F: FnMut() -> Result<T, Errno>,
{
    let mut attempt = 1;
    loop {
        match f() {
            Err(Errno::EBUSY | Errno::EINTR) if attempt < attempts => {
                std::thread::sleep(backoff.saturating_mul(attempt));
                attempt += 1;
            }
            result => return result,
        }
    }
}

fn get_report0(device: &File, req: &mut TdxReportReq) -> Result<(), Errno> {
    // SAFETY: `device` is an open file for the whole call and `req` is an exclusive reference
    // to a #[repr(C)] struct of exactly the size encoded in the request code, which the kernel
    // reads (reportdata) and writes (tdreport) within those bounds.
    unsafe { ioctl::tdx_get_report0(device.as_raw_fd(), req) }.map(drop)
}

fn read_tdreport(device: &Path) -> Result<Mrtd, MrtdError> {
    let file = File::open(device).map_err(|e| io_error(device, e))?;
    let mut req = TdxReportReq::zeroed();
    with_transient_retry(
        || get_report0(&file, &mut req),
        TRANSIENT_ATTEMPTS,
        TRANSIENT_BACKOFF,
    )
    .map_err(|errno| MrtdError::Ioctl {
        path: device.to_path_buf(),
        errno,
    })?;
    parse_tdreport(&req.tdreport).map_err(|e| invalid(device, e))
}

/// A configfs-tsm entry name no other reader of this process or another one uses.
fn unique_entry_name() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!("fleet-sidecar-mrtd-{}-{n}-{nanos}", std::process::id())
}

/// Reads a small text file, without its trailing newline.
fn read_text(path: &Path) -> Result<String, MrtdError> {
    let bytes = read_limited(path, SMALL_FILE_LIMIT)?;
    Ok(String::from_utf8_lossy(&bytes).trim_end().to_owned())
}

/// The configfs-tsm exchange on an existing `entry`: check `provider`, write 64 zero bytes to
/// `inblob`, read `outblob`, check `generation` is 1. Returns the raw quote.
fn tsm_exchange(entry: &Path) -> Result<Vec<u8>, MrtdError> {
    let provider_path = entry.join("provider");
    let provider = read_text(&provider_path)?;
    if provider != "tdx_guest" {
        return Err(MrtdError::TsmProvider {
            path: provider_path,
            found: provider,
        });
    }
    let inblob_path = entry.join("inblob");
    OpenOptions::new()
        .write(true)
        .open(&inblob_path)
        .and_then(|mut f| f.write_all(&[0u8; 64]))
        .map_err(|e| io_error(&inblob_path, e))?;
    let outblob = read_limited(&entry.join("outblob"), QUOTE_LIMIT)?;
    let generation_path = entry.join("generation");
    let generation = read_text(&generation_path)?;
    if generation != "1" {
        return Err(MrtdError::TsmGeneration {
            path: generation_path,
            found: generation,
        });
    }
    Ok(outblob)
}

fn read_quote(tsm_report_dir: &Path) -> Result<Mrtd, MrtdError> {
    let entry = tsm_report_dir.join(unique_entry_name());
    fs::create_dir(&entry).map_err(|e| io_error(&entry, e))?;
    let exchanged = tsm_exchange(&entry);
    let removed = fs::remove_dir(&entry).map_err(|e| io_error(&entry, e));
    let outblob = exchanged?;
    removed?;
    parse_quote(&outblob).map_err(|e| invalid(&entry.join("outblob"), e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    const A: [u8; 48] = [0xa5; 48];
    const B: [u8; 48] = [0x3c; 48];

    fn counting(n: u8) -> [u8; 48] {
        let mut m = [0u8; 48];
        for (i, b) in m.iter_mut().enumerate() {
            *b = n.wrapping_add(i as u8);
        }
        m
    }

    fn build_tdreport(mrtd: [u8; 48]) -> Vec<u8> {
        let mut r = vec![0u8; TDREPORT_LEN];
        r[..4].copy_from_slice(&[0x81, 0x00, 0x01, 0x00]);
        // Something non-zero around MRTD so a wrong offset shows.
        r[512..528].fill(0x11);
        r[576..720].fill(0x22);
        r[528..576].copy_from_slice(&mrtd);
        r
    }

    fn quote_header(version: u16, tee_type: u32) -> Vec<u8> {
        let mut q = vec![0u8; QUOTE_HEADER_LEN];
        q[0..2].copy_from_slice(&version.to_le_bytes());
        q[2..4].copy_from_slice(&2u16.to_le_bytes());
        q[4..8].copy_from_slice(&tee_type.to_le_bytes());
        q
    }

    /// Header + 584-byte TD 1.0 body + 4-byte (empty) signature data length.
    fn build_quote_v4(mrtd: [u8; 48]) -> Vec<u8> {
        let mut q = quote_header(4, 0x81);
        let mut body = vec![0x33u8; 584];
        body[136..184].copy_from_slice(&mrtd);
        q.extend_from_slice(&body);
        q.extend_from_slice(&0u32.to_le_bytes());
        q
    }

    /// Header + body type 3 + body size + 648-byte TD 1.5 body + signature data length.
    fn build_quote_v5(mrtd: [u8; 48]) -> Vec<u8> {
        let mut q = quote_header(5, 0x81);
        q.extend_from_slice(&3u16.to_le_bytes());
        q.extend_from_slice(&648u32.to_le_bytes());
        let mut body = vec![0x44u8; 648];
        body[136..184].copy_from_slice(&mrtd);
        q.extend_from_slice(&body);
        q.extend_from_slice(&0u32.to_le_bytes());
        q
    }

    /// The parser error inside `Invalid { .. }`, or the error itself.
    fn inner(e: &MrtdError) -> &MrtdError {
        match e {
            MrtdError::Invalid { source, .. } => source,
            other => other,
        }
    }

    // ---- Mrtd ----

    #[test]
    fn mrtd_from_bytes_requires_48() {
        assert_eq!(Mrtd::from_bytes(&A).map(|m| *m.as_bytes()).ok(), Some(A));
        for len in [0, 47, 49, 96] {
            assert!(matches!(
                Mrtd::from_bytes(&vec![1u8; len]),
                Err(MrtdError::WrongLength { expected: 48, actual, .. }) if actual == len
            ));
        }
    }

    #[test]
    fn mrtd_hex_display_debug() {
        let m = Mrtd::from(counting(0xf0));
        let hex = m.to_hex();
        assert_eq!(hex.len(), 96);
        assert!(hex.starts_with("f0f1f2"));
        assert_eq!(hex, hex.to_lowercase());
        assert_eq!(m.to_string(), hex);
        assert!(format!("{m:?}").contains(&hex));
    }

    #[test]
    fn mrtd_from_str() {
        let m = Mrtd::from(counting(0xaa));
        assert_eq!(m.to_hex().parse::<Mrtd>().ok(), Some(m));
        assert_eq!(m.to_hex().to_uppercase().parse::<Mrtd>().ok(), Some(m));
        let hex = m.to_hex();
        for bad in [
            String::new(),
            hex[..94].to_owned(),
            format!("{hex}00"),
            format!("0x{}", &hex[..94]),
            format!("{}zz", &hex[..94]),
            format!(" {}", &hex[..95]),
        ] {
            assert!(
                matches!(bad.parse::<Mrtd>(), Err(MrtdError::BadHex { .. })),
                "{bad:?}"
            );
        }
    }

    // ---- sysfs parser ----

    #[test]
    fn sysfs_exactly_48_raw_bytes() {
        assert_eq!(parse_sysfs(&A).map(|m| *m.as_bytes()).ok(), Some(A));
        for len in [47, 49] {
            assert!(matches!(
                parse_sysfs(&vec![0xa5; len]),
                Err(MrtdError::WrongLength { expected: 48, actual, .. }) if actual == len
            ));
        }
        let mut with_newline = A.to_vec();
        with_newline.push(b'\n');
        assert!(parse_sysfs(&with_newline).is_err());
    }

    #[test]
    fn sysfs_hex_text_is_rejected() {
        let hex = Mrtd::from(A).to_hex();
        assert!(matches!(
            parse_sysfs(hex.as_bytes()),
            Err(MrtdError::WrongLength { actual: 96, .. })
        ));
    }

    #[test]
    fn sysfs_all_zero_is_rejected() {
        assert!(matches!(parse_sysfs(&[0u8; 48]), Err(MrtdError::AllZero)));
    }

    // ---- tdreport parser ----

    #[test]
    fn tdreport_good() {
        let m = parse_tdreport(&build_tdreport(counting(7)));
        assert_eq!(m.map(|m| *m.as_bytes()).ok(), Some(counting(7)));
    }

    #[test]
    fn tdreport_wrong_type_byte() {
        let mut r = build_tdreport(A);
        r[0] = 0x00;
        assert!(matches!(
            parse_tdreport(&r),
            Err(MrtdError::BadReportType(0x00))
        ));
        r[0] = 0x82;
        let e = parse_tdreport(&r);
        assert!(matches!(e, Err(MrtdError::BadReportType(0x82))));
        assert!(e
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default()
            .contains("0x82"));
    }

    #[test]
    fn tdreport_truncated() {
        let r = build_tdreport(A);
        for len in [0, 575, 576, 1023] {
            assert!(matches!(
                parse_tdreport(&r[..len]),
                Err(MrtdError::Truncated { need: 1024, got, .. }) if got == len
            ));
        }
    }

    #[test]
    fn tdreport_all_zero_mrtd() {
        assert!(matches!(
            parse_tdreport(&build_tdreport([0; 48])),
            Err(MrtdError::AllZero)
        ));
    }

    // ---- quote parser ----

    #[test]
    fn quote_v4_and_v5() {
        // (builder, the MRTD's offset in the quote)
        type QuoteBuilder = fn([u8; 48]) -> Vec<u8>;
        let versions: [(QuoteBuilder, usize); 2] = [(build_quote_v4, 184), (build_quote_v5, 190)];
        for (n, (build, at)) in (1u8..).zip(versions) {
            let q = build(counting(n));
            assert_eq!(&q[at..at + 48], &counting(n), "version {}", n + 3);
            let m = parse_quote(&q);
            assert_eq!(m.map(|m| *m.as_bytes()).ok(), Some(counting(n)));
        }
    }

    #[test]
    fn quote_v5_sgx_body_rejected() {
        let mut q = build_quote_v5(A);
        q[48..50].copy_from_slice(&1u16.to_le_bytes());
        assert!(matches!(
            parse_quote(&q),
            Err(MrtdError::UnsupportedQuoteBody(1))
        ));
    }

    #[test]
    fn quote_v4_trailing_zero_padding() {
        let mut q = build_quote_v4(B);
        q.resize(8000, 0);
        assert_eq!(parse_quote(&q).map(|m| *m.as_bytes()).ok(), Some(B));
    }

    #[test]
    fn quote_only_needs_bytes_up_to_mrtd() {
        let q = build_quote_v4(B);
        assert_eq!(parse_quote(&q[..232]).map(|m| *m.as_bytes()).ok(), Some(B));
        let q = build_quote_v5(B);
        assert_eq!(parse_quote(&q[..238]).map(|m| *m.as_bytes()).ok(), Some(B));
    }

    #[test]
    fn quote_truncated() {
        let q = build_quote_v4(A);
        for len in [0, 7, 47] {
            assert!(matches!(
                parse_quote(&q[..len]),
                Err(MrtdError::Truncated { need: 48, got, .. }) if got == len
            ));
        }
        for len in [48, 200, 231] {
            assert!(matches!(
                parse_quote(&q[..len]),
                Err(MrtdError::Truncated { need: 232, got, .. }) if got == len
            ));
        }
        let q = build_quote_v5(A);
        assert!(matches!(
            parse_quote(&q[..237]),
            Err(MrtdError::Truncated {
                need: 238,
                got: 237,
                ..
            })
        ));
    }

    #[test]
    fn quote_wrong_version() {
        for version in [0u16, 3, 6, 0xffff] {
            let mut q = build_quote_v4(A);
            q[0..2].copy_from_slice(&version.to_le_bytes());
            let e = parse_quote(&q);
            assert!(
                matches!(e, Err(MrtdError::UnsupportedQuoteVersion(v)) if v == version),
                "{version}"
            );
            let text = e.err().map(|e| e.to_string()).unwrap_or_default();
            assert_eq!(text, format!("unsupported quote version {version}"));
        }
    }

    #[test]
    fn quote_wrong_tee_type() {
        for tee_type in [0u32, 0x80, 0x8100] {
            let mut q = build_quote_v4(A);
            q[4..8].copy_from_slice(&tee_type.to_le_bytes());
            assert!(matches!(
                parse_quote(&q),
                Err(MrtdError::BadTeeType(t)) if t == tee_type
            ));
        }
        let mut q = build_quote_v5(A);
        q[4..8].copy_from_slice(&0u32.to_le_bytes());
        assert!(matches!(parse_quote(&q), Err(MrtdError::BadTeeType(0))));
    }

    #[test]
    fn quote_all_zero_mrtd() {
        assert!(matches!(
            parse_quote(&build_quote_v4([0; 48])),
            Err(MrtdError::AllZero)
        ));
        assert!(matches!(
            parse_quote(&build_quote_v5([0; 48])),
            Err(MrtdError::AllZero)
        ));
    }

    // ---- public vectors in fixtures/tdx (provenance: fixtures/tdx/README.md) ----

    fn vectors_dir() -> PathBuf {
        PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/fixtures/tdx"))
    }

    fn read_vector(dir: &Path, name: &str) -> Vec<u8> {
        let path = dir.join(name);
        match fs::read(&path) {
            Ok(bytes) => bytes,
            Err(e) => panic!("{}: {e}", path.display()),
        }
    }

    #[test]
    fn public_tdreport_vector() {
        let dir = vectors_dir();
        let bytes = read_vector(&dir, "tdreport-guest-components.bin");
        assert_eq!(bytes.len(), 1024);
        let mrtd = parse_tdreport(&bytes).map(|m| m.to_hex());
        assert_eq!(
            mrtd.ok().as_deref(),
            Some(
                "98bbc39e3e27b4cb27ed6d21870b187738f64ec44b9f3f93d603b35a84e610dc\
                 b45f1b6d79c648c7bf8e68f7a37b8ab5"
            )
        );
    }

    #[test]
    fn public_quote_vectors() {
        let dir = vectors_dir();
        let cases = [
            (
                "quote-v4-go-tdx-guest.dat",
                4u16,
                "6363b8043668a3ad953278e10389574d326c6749fb78aa810ecd9336923db86f\
                 22fc00b8dcd404bc10d5e119d7215cbb",
            ),
            (
                "quote-v5-go-tdx-guest.dat",
                5,
                "7348651a34b2d2d3462822e3a750ec6110125f36757c78480bbfc69cc0d21fb0\
                 01a1ced3ee19747dda8f750c3bc8f876",
            ),
            (
                "quote-v4-padded-go-tdx-guest.dat",
                4,
                "dae67181d3d65e073ad8f95b7907d5e927bfe9761c9ff3e9b89734a45d8954db\
                 a41394c7717cb2735396c1d04231f94a",
            ),
            (
                "quote-v4-dcap-qvl.dat",
                4,
                "91eb2b44d141d4ece09f0c75c2c53d247a3c68edd7fafe8a3520c942a604a407\
                 de03ae6dc5f87f27428b2538873118b7",
            ),
        ];
        for (name, version, want) in cases {
            let bytes = read_vector(&dir, name);
            assert_eq!(u16::from_le_bytes([bytes[0], bytes[1]]), version, "{name}");
            let got = parse_quote(&bytes).map(|m| m.to_hex());
            assert_eq!(got.as_deref().ok(), Some(want), "{name}: {got:?}");
            // The same MRTD parsed back from the stated hex.
            assert_eq!(
                want.parse::<Mrtd>().ok().map(|m| m.to_hex()).as_deref(),
                Some(want)
            );
        }
    }

    // ---- ioctl ABI and retry policy ----

    #[test]
    fn ioctl_request_code_and_struct_size() {
        assert_eq!(std::mem::size_of::<TdxReportReq>(), 1088);
        assert_eq!(TDX_CMD_GET_REPORT0, 0xC440_5401);
        let code = nix::request_code_readwrite!(b'T', 1, std::mem::size_of::<TdxReportReq>());
        assert_eq!(code as u32 as u64, TDX_CMD_GET_REPORT0);
        let req = TdxReportReq::zeroed();
        assert!(req.reportdata.iter().chain(&req.tdreport).all(|&b| b == 0));
    }

    fn fake(script: Vec<Result<u32, Errno>>) -> (impl FnMut() -> Result<u32, Errno>, Calls) {
        let calls = Calls::default();
        let counter = std::rc::Rc::clone(&calls);
        let mut script = script.into_iter();
        let f = move || {
            counter.set(counter.get() + 1);
            script.next().unwrap_or(Err(Errno::EBUSY))
        };
        (f, calls)
    }
    type Calls = std::rc::Rc<std::cell::Cell<u32>>;

    #[test]
    fn retry_succeeds_after_transient_errors() {
        let (f, calls) = fake(vec![Err(Errno::EBUSY), Err(Errno::EINTR), Ok(7)]);
        assert_eq!(with_transient_retry(f, 5, Duration::ZERO), Ok(7));
        assert_eq!(calls.get(), 3);
    }

    #[test]
    fn retry_gives_up_after_attempts() {
        let (f, calls) = fake(vec![]);
        assert_eq!(
            with_transient_retry(f, 5, Duration::ZERO),
            Err(Errno::EBUSY)
        );
        assert_eq!(calls.get(), 5);
        let (f, calls) = fake(vec![Err(Errno::EINTR); 10]);
        assert_eq!(
            with_transient_retry(f, 3, Duration::ZERO),
            Err(Errno::EINTR)
        );
        assert_eq!(calls.get(), 3);
    }

    #[test]
    fn retry_calls_at_least_once() {
        let (f, calls) = fake(vec![Ok(1)]);
        assert_eq!(with_transient_retry(f, 0, Duration::ZERO), Ok(1));
        assert_eq!(calls.get(), 1);
    }

    #[test]
    fn retry_does_not_retry_other_errnos() {
        for errno in [
            Errno::ENXIO,
            Errno::EINVAL,
            Errno::EIO,
            Errno::ENOTTY,
            Errno::EACCES,
            Errno::ENOENT,
        ] {
            let (f, calls) = fake(vec![Err(errno), Ok(1)]);
            assert_eq!(with_transient_retry(f, 5, Duration::ZERO), Err(errno));
            assert_eq!(calls.get(), 1, "{errno:?}");
        }
    }

    #[test]
    fn retry_backoff_grows() {
        let (f, _calls) = fake(vec![Err(Errno::EBUSY), Err(Errno::EBUSY), Ok(0)]);
        let start = std::time::Instant::now();
        assert_eq!(with_transient_retry(f, 5, Duration::from_millis(5)), Ok(0));
        // 5 ms before retry 1, 10 ms before retry 2.
        assert!(start.elapsed() >= Duration::from_millis(15));
    }

    #[test]
    fn ioctl_error_messages() {
        let e = MrtdError::Ioctl {
            path: PathBuf::from("/dev/tdx_guest"),
            errno: Errno::ENOTTY,
        };
        let text = e.to_string();
        assert!(text.starts_with("/dev/tdx_guest: "), "{text}");
        assert!(
            text.contains("device does not support TDX_CMD_GET_REPORT0"),
            "{text}"
        );
        for errno in [Errno::EBUSY, Errno::EIO, Errno::EINVAL, Errno::ENODEV] {
            let text = MrtdError::Ioctl {
                path: PathBuf::from("/dev/x"),
                errno,
            }
            .to_string();
            assert!(text.contains(&format!("{errno:?}")), "{text}");
            assert!(!text.contains('\n'));
        }
    }

    #[test]
    fn io_error_messages() {
        let not_found = io_error(Path::new("/x/y"), io::ErrorKind::NotFound.into());
        assert_eq!(
            not_found.to_string(),
            "/x/y: not present (not a TD, or kernel without this interface)"
        );
        let denied = io_error(Path::new("/x/y"), io::ErrorKind::PermissionDenied.into());
        assert_eq!(denied.to_string(), "/x/y: permission denied");
    }

    // ---- config ----

    #[test]
    fn config_defaults() {
        let cfg: TdxConfig = match toml::from_str("") {
            Ok(c) => c,
            Err(e) => panic!("{e}"),
        };
        assert_eq!(cfg, TdxConfig::default());
        assert_eq!(
            cfg.mrtd_path,
            Path::new("/sys/class/misc/tdx_guest/measurements/mrtd:sha384")
        );
        assert_eq!(
            cfg.legacy_mrtd_path,
            Path::new("/sys/class/misc/tdx_guest/mr/mrtd:sha384")
        );
        assert_eq!(cfg.device, Path::new("/dev/tdx_guest"));
        assert_eq!(
            cfg.tsm_report_dir,
            Path::new("/sys/kernel/config/tsm/report")
        );
        assert_eq!(cfg.sources, MrtdSource::ALL.to_vec());
        assert!(cfg.validate().is_ok());
    }

    #[test]
    fn config_parses_and_rejects_unknown() {
        let cfg: Result<TdxConfig, _> = toml::from_str(
            "device = \"/dev/other\"\nsources = [\"quote\", \"sysfs-legacy\", \"tdreport\", \"sysfs\"]\n",
        );
        let cfg = match cfg {
            Ok(c) => c,
            Err(e) => panic!("{e}"),
        };
        assert_eq!(cfg.device, Path::new("/dev/other"));
        assert_eq!(
            cfg.sources,
            vec![
                MrtdSource::Quote,
                MrtdSource::SysfsLegacy,
                MrtdSource::Tdreport,
                MrtdSource::Sysfs
            ]
        );
        assert_eq!(cfg.mrtd_path, TdxConfig::default().mrtd_path);
        assert!(toml::from_str::<TdxConfig>("mrtd = \"/x\"").is_err());
        assert!(toml::from_str::<TdxConfig>("sources = [\"sysfs_legacy\"]").is_err());
        assert!(toml::from_str::<TdxConfig>("sources = [\"Sysfs\"]").is_err());
    }

    #[test]
    fn config_validate() {
        let mut cfg = TdxConfig {
            sources: vec![],
            ..TdxConfig::default()
        };
        assert!(matches!(cfg.validate(), Err(MrtdError::NoSources)));
        cfg.sources = vec![MrtdSource::Sysfs, MrtdSource::Quote, MrtdSource::Sysfs];
        let e = cfg.validate();
        assert!(matches!(
            e,
            Err(MrtdError::DuplicateSource(MrtdSource::Sysfs))
        ));
        assert!(e
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default()
            .contains("\"sysfs\""));
        cfg.sources = vec![MrtdSource::Tdreport];
        assert!(cfg.validate().is_ok());
    }

    #[test]
    fn source_names() {
        for (source, name) in
            MrtdSource::ALL
                .into_iter()
                .zip(["sysfs", "sysfs-legacy", "tdreport", "quote"])
        {
            assert_eq!(source.to_string(), name);
            assert_eq!(source.as_str(), name);
            #[derive(Deserialize, Serialize)]
            struct W {
                s: MrtdSource,
            }
            let text = toml::to_string(&W { s: source }).unwrap_or_default();
            assert_eq!(text.trim(), format!("s = \"{name}\""));
            let back: Result<W, _> = toml::from_str(&text);
            assert_eq!(back.map(|w| w.s).ok(), Some(source));
        }
    }

    // ---- source chain on fake trees ----

    struct Tree {
        dir: tempfile::TempDir,
        cfg: TdxConfig,
    }

    fn tree() -> Tree {
        let dir = match tempfile::tempdir() {
            Ok(d) => d,
            Err(e) => panic!("{e}"),
        };
        let root = dir.path();
        let tsm = root.join("tsm-report");
        mkdir(&tsm);
        let cfg = TdxConfig {
            mrtd_path: root.join("measurements/mrtd:sha384"),
            legacy_mrtd_path: root.join("mr/mrtd:sha384"),
            device: root.join("tdx_guest"),
            tsm_report_dir: tsm,
            sources: MrtdSource::ALL.to_vec(),
        };
        Tree { dir, cfg }
    }

    fn mkdir(p: &Path) {
        if let Err(e) = fs::create_dir_all(p) {
            panic!("{}: {e}", p.display());
        }
    }

    fn write(p: &Path, bytes: &[u8]) {
        if let Some(parent) = p.parent() {
            mkdir(parent);
        }
        if let Err(e) = fs::write(p, bytes) {
            panic!("{}: {e}", p.display());
        }
    }

    fn entries(p: &Path) -> Vec<PathBuf> {
        match fs::read_dir(p) {
            Ok(rd) => rd.filter_map(|e| e.ok().map(|e| e.path())).collect(),
            Err(e) => panic!("{}: {e}", p.display()),
        }
    }

    fn is_not_found(e: &MrtdError, path: &Path) -> bool {
        matches!(e, MrtdError::Io { path: p, source } if p == path && source.kind() == io::ErrorKind::NotFound)
    }

    #[test]
    fn chain_all_missing_lists_every_failure_in_order() {
        let t = tree();
        let Err(e) = read_mrtd(&t.cfg) else {
            panic!("expected failure")
        };
        let sources: Vec<_> = e.failures.iter().map(|(s, _)| *s).collect();
        assert_eq!(sources, MrtdSource::ALL.to_vec());
        assert!(is_not_found(&e.failures[0].1, &t.cfg.mrtd_path));
        assert!(is_not_found(&e.failures[1].1, &t.cfg.legacy_mrtd_path));
        assert!(is_not_found(&e.failures[2].1, &t.cfg.device));
        assert!(matches!(&e.failures[3].1, MrtdError::Io { path, source }
            if path.starts_with(&t.cfg.tsm_report_dir)
                && path.ends_with("provider")
                && source.kind() == io::ErrorKind::NotFound));
        assert!(entries(&t.cfg.tsm_report_dir).is_empty());
        let text = e.to_string();
        assert!(!text.contains('\n'));
        let parts: Vec<_> = text.split("; ").collect();
        assert_eq!(parts.len(), 4, "{text}");
        assert!(
            parts[0].starts_with("no MRTD source worked: sysfs: "),
            "{text}"
        );
        assert!(parts[1].starts_with("sysfs-legacy: "), "{text}");
        assert!(parts[2].starts_with("tdreport: "), "{text}");
        assert!(parts[3].starts_with("quote: "), "{text}");
        assert!(parts[0].contains(&t.cfg.mrtd_path.display().to_string()));
        assert!(parts[0].contains("not present"));
    }

    #[test]
    fn chain_sysfs_wins() {
        let t = tree();
        write(&t.cfg.mrtd_path, &A);
        write(&t.cfg.legacy_mrtd_path, &B);
        let r = read_mrtd(&t.cfg).ok().map(|r| (r.source, r.mrtd));
        assert_eq!(r, Some((MrtdSource::Sysfs, Mrtd::from(A))));
    }

    #[test]
    fn chain_missing_sysfs_falls_through_to_legacy() {
        let t = tree();
        write(&t.cfg.legacy_mrtd_path, &B);
        let r = read_mrtd(&t.cfg).ok().map(|r| (r.source, r.mrtd));
        assert_eq!(r, Some((MrtdSource::SysfsLegacy, Mrtd::from(B))));
    }

    #[test]
    fn chain_wrong_length_falls_through() {
        for bad in [
            &A[..47],
            &[0xa5; 49][..],
            Mrtd::from(A).to_hex().as_bytes(),
            &[][..],
        ] {
            let t = tree();
            write(&t.cfg.mrtd_path, bad);
            write(&t.cfg.legacy_mrtd_path, &B);
            let r = read_mrtd(&t.cfg).ok().map(|r| (r.source, r.mrtd));
            assert_eq!(r, Some((MrtdSource::SysfsLegacy, Mrtd::from(B))));
            let e = read_source(&t.cfg, MrtdSource::Sysfs);
            assert!(matches!(
                e.as_ref().map_err(inner),
                Err(MrtdError::WrongLength { expected: 48, actual, .. }) if *actual == bad.len()
            ));
            let text = e.err().map(|e| e.to_string()).unwrap_or_default();
            assert!(
                text.starts_with(&t.cfg.mrtd_path.display().to_string()),
                "{text}"
            );
        }
    }

    #[test]
    fn chain_all_zero_falls_through() {
        let t = tree();
        write(&t.cfg.mrtd_path, &[0u8; 48]);
        write(&t.cfg.legacy_mrtd_path, &B);
        let r = read_mrtd(&t.cfg).ok().map(|r| r.source);
        assert_eq!(r, Some(MrtdSource::SysfsLegacy));
        let e = read_source(&t.cfg, MrtdSource::Sysfs);
        assert!(matches!(e.as_ref().map_err(inner), Err(MrtdError::AllZero)));
    }

    #[test]
    fn chain_directory_at_sysfs_path_falls_through() {
        let t = tree();
        mkdir(&t.cfg.mrtd_path);
        write(&t.cfg.legacy_mrtd_path, &B);
        let r = read_mrtd(&t.cfg).ok().map(|r| r.source);
        assert_eq!(r, Some(MrtdSource::SysfsLegacy));
    }

    #[test]
    fn chain_oversized_file_is_rejected() {
        let t = tree();
        write(&t.cfg.mrtd_path, &vec![1u8; SMALL_FILE_LIMIT + 1]);
        assert!(matches!(
            read_source(&t.cfg, MrtdSource::Sysfs),
            Err(MrtdError::TooLarge { .. })
        ));
    }

    #[test]
    fn chain_unreadable_falls_through() {
        if nix::unistd::geteuid().is_root() {
            eprintln!("skipping: running as root, chmod 000 does not stop reads");
            return;
        }
        let t = tree();
        write(&t.cfg.mrtd_path, &A);
        write(&t.cfg.legacy_mrtd_path, &B);
        if let Err(e) = fs::set_permissions(&t.cfg.mrtd_path, fs::Permissions::from_mode(0o000)) {
            panic!("{e}");
        }
        let r = read_mrtd(&t.cfg).ok().map(|r| (r.source, r.mrtd));
        assert_eq!(r, Some((MrtdSource::SysfsLegacy, Mrtd::from(B))));
        let e = read_source(&t.cfg, MrtdSource::Sysfs);
        assert!(matches!(&e, Err(MrtdError::Io { source, .. })
            if source.kind() == io::ErrorKind::PermissionDenied));
        let text = e.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(text.ends_with("permission denied"), "{text}");
    }

    #[test]
    fn chain_order_follows_config() {
        let mut t = tree();
        write(&t.cfg.mrtd_path, &A);
        write(&t.cfg.legacy_mrtd_path, &B);
        t.cfg.sources = vec![MrtdSource::SysfsLegacy, MrtdSource::Sysfs];
        let r = read_mrtd(&t.cfg).ok().map(|r| (r.source, r.mrtd));
        assert_eq!(r, Some((MrtdSource::SysfsLegacy, Mrtd::from(B))));

        t.cfg.sources = vec![MrtdSource::Quote, MrtdSource::Tdreport];
        let Err(e) = read_mrtd(&t.cfg) else {
            panic!("expected failure")
        };
        let sources: Vec<_> = e.failures.iter().map(|(s, _)| *s).collect();
        assert_eq!(sources, vec![MrtdSource::Quote, MrtdSource::Tdreport]);
    }

    #[test]
    fn look_only_on_quote_alone_is_an_explicit_no_sources_error() {
        let cfg = TdxConfig {
            sources: vec![MrtdSource::Quote],
            ..TdxConfig::default()
        }
        .without_side_effects();
        let e = read_mrtd_bounded(&cfg, Duration::from_secs(1)).unwrap_err();
        assert_eq!(e.kind(), "no-sources");
        let json = serde_json::to_value(&e).unwrap();
        assert_eq!(json["kind"], "no-sources");
        assert_eq!(json["message"], e.to_string());
        assert!(e.to_string().contains("side effects"), "{e}");
        assert_eq!(json["failures"], serde_json::json!([]));
        assert_eq!(read_mrtd(&cfg).unwrap_err().kind(), "no-sources");
    }

    #[test]
    fn errors_have_a_kind_and_serialize_as_kind_and_message() {
        let mut t = tree();
        t.cfg.sources = vec![MrtdSource::SysfsLegacy, MrtdSource::Sysfs];
        write(&t.cfg.mrtd_path, &[0u8; 48]);
        let e = read_mrtd(&t.cfg).unwrap_err();
        assert_eq!(e.kind(), "failed");
        let json = serde_json::to_value(&e).unwrap();
        assert_eq!(json["kind"], "failed");
        assert_eq!(json["failures"][0]["source"], "sysfs-legacy");
        assert_eq!(json["failures"][0]["kind"], "not-present");
        assert_eq!(json["failures"][1]["source"], "sysfs");
        assert_eq!(json["failures"][1]["kind"], "invalid");
        assert_eq!(json["failures"][1]["message"], e.failures[1].1.to_string());
        let timeout = MrtdUnavailable {
            failures: vec![(
                MrtdSource::Sysfs,
                MrtdError::Timeout {
                    path: t.cfg.mrtd_path.clone(),
                    after: Duration::from_secs(1),
                },
            )],
        };
        assert_eq!(timeout.kind(), "timeout");
        let one = serde_json::to_value(MrtdError::AllZero).unwrap();
        assert_eq!(
            one,
            serde_json::json!({"kind": "all-zero", "message": "all-zero MRTD: wrong read"})
        );
    }

    #[tokio::test]
    async fn the_async_read_reads_and_names_a_failed_task() {
        let t = tree();
        let mut cfg = t.cfg.clone();
        cfg.sources = vec![MrtdSource::Sysfs];
        write(&cfg.mrtd_path, &[7u8; 48]);
        let reading = read_mrtd_bounded_async(&cfg, Duration::from_secs(2))
            .await
            .unwrap();
        assert_eq!(reading.source, MrtdSource::Sysfs);
        let panicked = tokio::task::spawn_blocking(|| panic!("reader")).await;
        let e = reader_task_failed(&cfg, &panicked.unwrap_err());
        assert!(
            matches!(
                &e.failures[..],
                [(
                    MrtdSource::Sysfs,
                    MrtdError::Reader(ReaderFailure::Panicked)
                )]
            ),
            "{e}"
        );
        assert_eq!(e.failures[0].1.kind(), "reader");
    }

    #[test]
    fn chain_empty_sources() {
        let mut t = tree();
        t.cfg.sources.clear();
        let Err(e) = read_mrtd(&t.cfg) else {
            panic!("expected failure")
        };
        assert!(e.failures.is_empty());
        assert_eq!(e.kind(), "no-sources");
        assert!(e.to_string().starts_with("no MRTD source to try: "), "{e}");
    }

    #[test]
    fn chain_every_source_failing_differently() {
        let t = tree();
        write(&t.cfg.mrtd_path, &A[..47]);
        write(&t.cfg.legacy_mrtd_path, &[0xa5; 49]);
        // A regular file: the ioctl fails with ENOTTY.
        write(&t.cfg.device, &[0u8; 16]);
        let Err(e) = read_mrtd(&t.cfg) else {
            panic!("expected failure")
        };
        assert_eq!(e.failures.len(), 4);
        assert!(matches!(
            inner(&e.failures[0].1),
            MrtdError::WrongLength { actual: 47, .. }
        ));
        assert!(matches!(
            inner(&e.failures[1].1),
            MrtdError::WrongLength { actual: 49, .. }
        ));
        assert!(
            matches!(&e.failures[2].1, MrtdError::Ioctl { path, errno: Errno::ENOTTY }
            if path == &t.cfg.device)
        );
        assert!(matches!(&e.failures[3].1, MrtdError::Io { source, .. }
            if source.kind() == io::ErrorKind::NotFound));
        let text = e.to_string();
        assert!(
            text.contains("tdreport: ")
                && text.contains("device does not support TDX_CMD_GET_REPORT0"),
            "{text}"
        );
        assert!(entries(&t.cfg.tsm_report_dir).is_empty());
    }

    #[test]
    fn tdreport_device_missing_or_directory() {
        let t = tree();
        let e = read_source(&t.cfg, MrtdSource::Tdreport);
        assert!(e.as_ref().is_err_and(|e| is_not_found(e, &t.cfg.device)));
        mkdir(&t.cfg.device);
        // A directory opens read-only; the ioctl on it is not a TDX device.
        let e = read_source(&t.cfg, MrtdSource::Tdreport);
        assert!(matches!(e, Err(MrtdError::Ioctl { .. })));
    }

    // ---- configfs-tsm ----

    #[test]
    fn quote_tsm_dir_missing() {
        let mut t = tree();
        t.cfg.tsm_report_dir = t.dir.path().join("no-tsm");
        let e = read_source(&t.cfg, MrtdSource::Quote);
        assert!(matches!(e, Err(MrtdError::Io { path, source })
            if path.starts_with(&t.cfg.tsm_report_dir)
                && source.kind() == io::ErrorKind::NotFound));
    }

    #[test]
    fn quote_entry_is_removed_after_error() {
        let t = tree();
        for _ in 0..3 {
            let e = read_source(&t.cfg, MrtdSource::Quote);
            assert!(e.is_err());
            assert!(entries(&t.cfg.tsm_report_dir).is_empty());
        }
    }

    #[test]
    fn quote_entry_names_are_unique() {
        let a = unique_entry_name();
        let b = unique_entry_name();
        assert_ne!(a, b);
        assert!(a.starts_with("fleet-sidecar-mrtd-"));
    }

    /// An existing entry dir imitating configfs-tsm's files.
    fn tsm_entry(provider: &[u8], outblob: &[u8], generation: &[u8]) -> tempfile::TempDir {
        let dir = match tempfile::tempdir() {
            Ok(d) => d,
            Err(e) => panic!("{e}"),
        };
        write(&dir.path().join("provider"), provider);
        write(&dir.path().join("inblob"), b"");
        write(&dir.path().join("outblob"), outblob);
        write(&dir.path().join("generation"), generation);
        dir
    }

    #[test]
    fn tsm_exchange_good() {
        let mut quote = build_quote_v5(A);
        quote.resize(6000, 0);
        let entry = tsm_entry(b"tdx_guest\n", &quote, b"1\n");
        let out = tsm_exchange(entry.path());
        assert_eq!(out.as_deref().ok(), Some(&quote[..]));
        assert_eq!(
            fs::read(entry.path().join("inblob")).ok(),
            Some(vec![0u8; 64])
        );
        let mrtd = out.and_then(|q| parse_quote(&q)).map(|m| *m.as_bytes());
        assert_eq!(mrtd.ok(), Some(A));
    }

    #[test]
    fn tsm_exchange_wrong_provider() {
        let entry = tsm_entry(b"sev_guest\n", &build_quote_v4(A), b"1\n");
        let e = tsm_exchange(entry.path());
        assert!(matches!(&e, Err(MrtdError::TsmProvider { found, .. }) if found == "sev_guest"));
        let text = e.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(
            text.contains("provider") && text.contains("sev_guest"),
            "{text}"
        );
        // Nothing was written when the provider is wrong.
        assert_eq!(fs::read(entry.path().join("inblob")).ok(), Some(vec![]));
    }

    #[test]
    fn tsm_exchange_generation_raced() {
        let entry = tsm_entry(b"tdx_guest\n", &build_quote_v4(A), b"2\n");
        let e = tsm_exchange(entry.path());
        assert!(matches!(&e, Err(MrtdError::TsmGeneration { found, .. }) if found == "2"));
        let text = e.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(text.contains("another writer raced"), "{text}");
    }

    #[test]
    fn tsm_exchange_missing_inblob() {
        let entry = tsm_entry(b"tdx_guest\n", &build_quote_v4(A), b"1\n");
        let inblob = entry.path().join("inblob");
        if let Err(e) = fs::remove_file(&inblob) {
            panic!("{e}");
        }
        let e = tsm_exchange(entry.path());
        assert!(e.as_ref().is_err_and(|e| is_not_found(e, &inblob)));
    }

    /// A FIFO at `path` (what a broken image or a hostile bind mount can leave in place of
    /// a sysfs attribute): opening it for reading blocks until a writer comes.
    fn mkfifo(path: &Path) {
        mkdir(path.parent().unwrap());
        let status = std::process::Command::new("mkfifo")
            .arg(path)
            .status()
            .unwrap();
        assert!(status.success(), "mkfifo {}", path.display());
    }

    /// Lets a reader blocked on the FIFO go (a writer opens and closes it), so the test
    /// leaves no thread blocked behind.
    fn release(path: &Path) {
        drop(OpenOptions::new().write(true).open(path));
    }

    #[test]
    fn a_fifo_in_place_of_the_sysfs_file_does_not_hang_the_bounded_read() {
        let mut t = tree();
        mkfifo(&t.cfg.mrtd_path);
        t.cfg.sources = vec![
            MrtdSource::SysfsLegacy,
            MrtdSource::Sysfs,
            MrtdSource::Tdreport,
        ];
        let start = Instant::now();
        let e = read_mrtd_bounded(&t.cfg, Duration::from_millis(300)).unwrap_err();
        let took = start.elapsed();
        release(&t.cfg.mrtd_path);
        assert!(took < Duration::from_secs(5), "took {took:?}");
        // The failure before the hang is kept, the hang names its path, nothing after it
        // is tried.
        assert_eq!(e.failures.len(), 2, "{e}");
        assert!(
            is_not_found(&e.failures[0].1, &t.cfg.legacy_mrtd_path),
            "{e}"
        );
        assert!(
            matches!(&e.failures[1], (MrtdSource::Sysfs, MrtdError::Timeout { path, after })
            if *path == t.cfg.mrtd_path && *after == Duration::from_millis(300)),
            "{e}"
        );
        assert!(e.to_string().contains("no answer within 300ms"), "{e}");
    }

    #[test]
    fn the_bounded_read_gives_what_the_unbounded_one_gives() {
        let mut t = tree();
        write(&t.cfg.legacy_mrtd_path, &A);
        let unbounded = read_mrtd(&t.cfg).unwrap();
        let bounded = read_mrtd_bounded(&t.cfg, Duration::from_secs(5)).unwrap();
        assert_eq!(bounded, unbounded);
        assert_eq!(bounded.source, MrtdSource::SysfsLegacy);
        t.cfg.sources.clear();
        assert!(read_mrtd_bounded(&t.cfg, Duration::from_secs(5))
            .unwrap_err()
            .failures
            .is_empty());
    }

    #[test]
    fn leaving_out_side_effects_never_tries_the_quote() {
        let t = tree();
        assert!(MrtdSource::ALL
            .iter()
            .all(|s| s.has_side_effects() == (*s == MrtdSource::Quote)));
        let e =
            read_mrtd_bounded(&t.cfg.without_side_effects(), Duration::from_secs(5)).unwrap_err();
        let tried: Vec<MrtdSource> = e.failures.iter().map(|(s, _)| *s).collect();
        assert_eq!(
            tried,
            [
                MrtdSource::Sysfs,
                MrtdSource::SysfsLegacy,
                MrtdSource::Tdreport
            ]
        );
        // With it, the quote is tried (and fails here: no configfs-tsm provider).
        let e = read_mrtd_bounded(&t.cfg, Duration::from_secs(5)).unwrap_err();
        assert_eq!(e.failures.last().map(|(s, _)| *s), Some(MrtdSource::Quote));
    }

    #[test]
    fn an_mrtd_and_a_reading_serialize_as_lowercase_hex() {
        let reading = MrtdReading {
            mrtd: Mrtd::from([0xAB; 48]),
            source: MrtdSource::SysfsLegacy,
        };
        let json = serde_json::to_value(reading).unwrap();
        assert_eq!(
            json,
            serde_json::json!({"mrtd": "ab".repeat(48), "source": "sysfs-legacy"})
        );
        assert_eq!(
            reading.to_string(),
            format!("{}\tsysfs-legacy", "ab".repeat(48))
        );
        let back: Mrtd = serde_json::from_value(json["mrtd"].clone()).unwrap();
        assert_eq!(back, reading.mrtd);
        assert!(serde_json::from_str::<Mrtd>("\"abc\"").is_err());
    }
}
