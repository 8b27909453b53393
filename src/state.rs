//! The persisted state: which namespaces merod admitted, which of those MDMA acknowledged
//! (confirmed), which a fleet-join was sent for without its admission recorded yet
//! (joining), how long each withdrawn one has been seen absent, and when the last hour's
//! leaves started.
//!
//! File: `/var/lib/calimero/fleet-confirmed.json` by default. A versioned JSON document:
//!
//! ```json
//! {"version": 4,
//!  "admitted":  ["<64 hex>", ...],
//!  "confirmed": ["<64 hex>", ...],
//!  "joining":   ["<64 hex>", ...],
//!  "observed_ms": 93600000,
//!  "absent": {"<64 hex>": {"polls": 3, "since_ms": 7200000}},
//!  "recent_leaves_ms": [92000000]}
//! ```
//!
//! Time is read on the *observed clock*, `observed_ms`: the monotonic time between the
//! daemon's successful polls, summed over all its runs (the time it was down is not in
//! it). `absent.since_ms` and `recent_leaves_ms` are readings of that clock, so the absence
//! observed so far is `observed_ms − since_ms` and a leave's age `observed_ms − t`: no
//! wall-clock step reaches them, and a restart resumes them. What the file holds lags
//! what the daemon knows by at most a minute (time-only changes are written once a
//! minute), which only makes absences shorter and leaves younger: the safe side.
//!
//! Also read (never written): version 3 (`absent_polls: {id: polls}` instead of `absent`,
//! no clock: each absence loads as observed for 0 s), version 2 (version 3 without
//! `joining`), version 1, `{"version": 1, "confirmed": [...]}`, and a bare JSON array of ids
//! (the Bash sidecar's confirmed set); the last two load with `admitted = confirmed`.
//! A bare array read from a file ([`StateStore::load`], [`StateStore::inspect`]) brings in
//! the Bash sidecar's files beside it too ([`bash_import`]): its admitted ids join `admitted`.
//!
//! Writes are atomic — temp file in the same directory, fsync, rename, fsync the directory —
//! and happen only when the document changed. A missing file is a first start (empty
//! state); an unreadable or corrupt one is an error that names the file: it never turns
//! into an empty set, because that would silently stop every future leave.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::durable::{self, parent_dir};
use crate::ids::GroupId;

pub mod bash_import;
pub mod volatile;

use bash_import::{BashImport, ImportError};

/// The version [`StateStore::save`] writes.
pub const STATE_VERSION: u32 = 4;

/// While only time changes (the observed clock, absence poll counts), the daemon writes the
/// state at most this often: see [`StateStore::is_recorded`].
pub(crate) const TIME_ONLY_WRITE_INTERVAL: Duration = Duration::from_secs(60);

/// How long a withdrawn namespace has been seen absent.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Absence {
    /// Consecutive successful polls it has been absent from.
    pub polls: u32,
    /// The observed clock ([`State::observed_ms`]) at the first successful poll that showed
    /// it absent.
    pub since_ms: u64,
}

/// The sets the reconciler keeps between cycles and across restarts.
///
/// Invariants (restored on load): `confirmed ⊆ admitted`, `joining` and `admitted` are
/// disjoint, every key of `absent` is in `admitted` or `joining`, and no clock reading
/// (`absent.since_ms`, `recent_leaves_ms`) is after `observed_ms`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct State {
    /// Namespaces merod admitted (`admitted: true`, verified) and has not been seen to leave.
    #[serde(deserialize_with = "compact_set")]
    pub admitted: BTreeSet<GroupId>,
    /// Admitted namespaces whose admission MDMA acknowledged (`/api/fleet/confirm` 2xx).
    #[serde(deserialize_with = "compact_set")]
    pub confirmed: BTreeSet<GroupId>,
    /// Namespaces a fleet-join was sent for (recorded before it is sent) whose admission is
    /// not recorded: merod may hold them (a crash, or a join that timed out here but went
    /// through there), so a withdrawn one is left like an admitted one. An admission moves
    /// the id to `admitted`; a leave (merod holding nothing counts) drops it.
    #[serde(default, deserialize_with = "compact_set")]
    pub joining: BTreeSet<GroupId>,
    /// The observed clock, in milliseconds: monotonic time between successful polls with
    /// no failed poll between them, summed over every run of the daemon (downtime and MDMA
    /// outages excluded; see the module docs).
    #[serde(default)]
    pub observed_ms: u64,
    /// For admitted or joining namespaces missing from the latest successful polls: how
    /// many consecutive successful polls they have been absent from, and since when.
    #[serde(default)]
    pub absent: BTreeMap<GroupId, Absence>,
    /// The observed clock when each leave of the last hour started, oldest first (the
    /// `max_leaves_per_minute` and `max_leaves_per_hour` budgets).
    #[serde(default)]
    pub recent_leaves_ms: Vec<u64>,
}

/// A set of ids read as a list, then built at once (sorted, duplicates dropped, as a set
/// read element by element would): built one insert at a time in the file's ascending
/// order, a B-tree's nodes stay half full, and every clone of the state (one per write)
/// copies that shape (620 KB per 10,000 ids instead of 330 KB).
fn compact_set<'de, D>(deserializer: D) -> Result<BTreeSet<GroupId>, D::Error>
where
    D: serde::Deserializer<'de>,
{
    Vec::<GroupId>::deserialize(deserializer).map(BTreeSet::from_iter)
}

impl State {
    /// The absence of `id` observed so far (`None` when it is not absent).
    pub fn absence_observed(&self, id: &GroupId) -> Option<Duration> {
        self.absent
            .get(id)
            .map(|a| Duration::from_millis(self.observed_ms.saturating_sub(a.since_ms)))
    }

    /// Whether `self` and `other` differ at most in what time alone changes: the observed
    /// clock and the poll counts of the same absences.
    pub fn same_but_time(&self, other: &State) -> bool {
        self.same_sets(other) && self.same_timed_but_time(other)
    }

    /// Whether `admitted`, `confirmed` and `joining` agree (a walk of every id).
    fn same_sets(&self, other: &State) -> bool {
        self.admitted == other.admitted
            && self.confirmed == other.confirmed
            && self.joining == other.joining
    }

    /// [`State::same_but_time`] but for the sets: the leave stamps and the absences.
    fn same_timed_but_time(&self, other: &State) -> bool {
        self.recent_leaves_ms == other.recent_leaves_ms
            && self.absent.len() == other.absent.len()
            && self
                .absent
                .iter()
                .zip(&other.absent)
                .all(|((a, x), (b, y))| a == b && x.since_ms == y.since_ms)
    }

    /// Whether anything reads the observed clock (an absence or a recent leave): if not,
    /// its advance alone need never be written.
    fn time_matters(&self) -> bool {
        !self.absent.is_empty() || !self.recent_leaves_ms.is_empty()
    }

    /// Restores the invariants, returning what had to change.
    fn repair(&mut self) -> Vec<Repair> {
        let mut repairs: Vec<Repair> = self
            .confirmed
            .difference(&self.admitted)
            .map(|&id| Repair::ConfirmedNotAdmitted(id))
            .collect();
        self.admitted.extend(self.confirmed.iter().copied());
        repairs.extend(
            self.joining
                .intersection(&self.admitted)
                .map(|&id| Repair::JoiningAdmitted(id)),
        );
        let admitted = &self.admitted;
        self.joining.retain(|id| !admitted.contains(id));
        let held = |id: &GroupId| admitted.contains(id) || self.joining.contains(id);
        repairs.extend(
            self.absent
                .keys()
                .filter(|id| !held(id))
                .map(|&id| Repair::AbsentNotAdmitted(id)),
        );
        self.absent.retain(|id, _| held(id));
        // A reading after the clock (a hand-edited file): read as "now", which makes the
        // absence shorter and the leave younger, never the reverse.
        let clock = self.observed_ms;
        let ahead = self.absent.values().filter(|a| a.since_ms > clock).count()
            + self.recent_leaves_ms.iter().filter(|t| **t > clock).count();
        if ahead > 0 {
            repairs.push(Repair::ReadingAfterClock(ahead));
        }
        for a in self.absent.values_mut() {
            a.since_ms = a.since_ms.min(clock);
        }
        for t in &mut self.recent_leaves_ms {
            *t = (*t).min(clock);
        }
        if !self.recent_leaves_ms.is_sorted() {
            self.recent_leaves_ms.sort_unstable();
        }
        repairs
    }
}

/// Which document format a state file holds.
///
/// `Display` and `Serialize` (a JSON string): `bare-array`, `v1`, `v2`, `v3`, `v4`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum StateFormat {
    /// A bare JSON array of 64-hex ids: the Bash sidecar's confirmed set.
    BareArray,
    /// `{"version": 1, "confirmed": [...]}`.
    V1,
    /// `{"version": 2, "admitted": [...], "confirmed": [...], "absent_polls": {...}}`.
    V2,
    /// Version 2 plus `"joining": [...]`.
    V3,
    /// The observed clock, `absent` and `recent_leaves_ms`: what [`StateStore::save`] writes.
    V4,
}

impl StateFormat {
    /// The name `Display` and `Serialize` give: `bare-array`, `v1`, `v2`, `v3`, `v4`.
    pub fn as_str(self) -> &'static str {
        match self {
            StateFormat::BareArray => "bare-array",
            StateFormat::V1 => "v1",
            StateFormat::V2 => "v2",
            StateFormat::V3 => "v3",
            StateFormat::V4 => "v4",
        }
    }
}

impl std::fmt::Display for StateFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Something loading had to change to restore the invariants of [`State`].
///
/// `Display`: one sentence naming the id and what loading did. `Serialize`:
/// `{"kind": "confirmed-not-admitted" | "absent-not-admitted" | "joining-admitted" |
/// "reading-after-clock", "group_id": "<64 lowercase hex>" (null for
/// `reading-after-clock`), "text": "<the Display sentence>"}`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Repair {
    /// Listed as confirmed but not as admitted (a v2 document only: the older formats have
    /// no admitted set). Must never happen; loading adds it to `admitted`, so the namespace
    /// stays protected from a leave that only `admitted` would allow.
    ConfirmedNotAdmitted(GroupId),
    /// An absence (`absent`, or v3's `absent_polls`) for a namespace neither admitted nor
    /// joining; loading drops it.
    AbsentNotAdmitted(GroupId),
    /// This many clock readings (`absent.since_ms`, `recent_leaves_ms`) were after
    /// `observed_ms`; loading sets them to `observed_ms` (absences shorter, leaves younger).
    ReadingAfterClock(usize),
    /// Listed as both joining and admitted: the recorded admission wins, loading drops it
    /// from `joining`.
    JoiningAdmitted(GroupId),
}

impl Repair {
    /// The repair's kind as `Serialize` names it, e.g. `confirmed-not-admitted`.
    pub fn kind(&self) -> &'static str {
        match self {
            Repair::ConfirmedNotAdmitted(_) => "confirmed-not-admitted",
            Repair::AbsentNotAdmitted(_) => "absent-not-admitted",
            Repair::JoiningAdmitted(_) => "joining-admitted",
            Repair::ReadingAfterClock(_) => "reading-after-clock",
        }
    }

    /// The namespace the repair is about (`None` for [`Repair::ReadingAfterClock`], which
    /// is about the clock readings of the file).
    pub fn group_id(&self) -> Option<GroupId> {
        match self {
            Repair::ConfirmedNotAdmitted(id)
            | Repair::AbsentNotAdmitted(id)
            | Repair::JoiningAdmitted(id) => Some(*id),
            Repair::ReadingAfterClock(_) => None,
        }
    }
}

impl Serialize for Repair {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        #[derive(Serialize)]
        struct Out {
            kind: &'static str,
            group_id: Option<GroupId>,
            text: String,
        }
        Out {
            kind: self.kind(),
            group_id: self.group_id(),
            text: self.to_string(),
        }
        .serialize(s)
    }
}

impl std::fmt::Display for Repair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Repair::ConfirmedNotAdmitted(id) => {
                write!(
                    f,
                    "{id} is confirmed but was not admitted: added to admitted"
                )
            }
            Repair::AbsentNotAdmitted(id) => {
                write!(
                    f,
                    "{id} has an absence recorded but is neither admitted nor joining: dropped"
                )
            }
            Repair::ReadingAfterClock(n) => {
                write!(
                    f,
                    "{n} clock readings were after observed_ms: set to observed_ms"
                )
            }
            Repair::JoiningAdmitted(id) => {
                write!(f, "{id} is both joining and admitted: dropped from joining")
            }
        }
    }
}

/// What [`inspect_state`] found in a state document.
///
/// `Serialize`: `{"format": "v3", "on_disk": {...}, "state": {...}, "repairs": [...]}`, the
/// two states as the v3 document writes its sets (ids as 64 lowercase hex), each repair as
/// [`Repair`] serializes it. `Display`: a few lines for a person (the format, the size of
/// each set the daemon runs on, then one `repaired on load:` line per repair).
///
/// ```
/// let text = br#"{"version": 1, "confirmed": []}"#;
/// let report = fleet_sidecar::state::inspect_state(text, std::path::Path::new("state.json")).unwrap();
/// assert_eq!(serde_json::to_value(&report).unwrap()["format"], "v1");
/// assert!(report.to_string().starts_with("format v1\n"));
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct StateReport {
    /// The document's format.
    pub format: StateFormat,
    /// The sets exactly as the file holds them. The bare and v1 formats hold no
    /// `admitted` set (it is empty here) and no absences.
    pub on_disk: State,
    /// What the daemon runs on: the bare and v1 formats read with `admitted = confirmed`,
    /// then [`StateReport::repairs`] applied.
    pub state: State,
    /// What loading changed to restore the invariants (empty for a sound file).
    pub repairs: Vec<Repair>,
    /// For a bare array read from a file: what the Bash sidecar's files beside it brought
    /// in (already in [`StateReport::state`]). `None` for every other format, and from
    /// [`inspect_state`], which reads bytes only. Serialized only when present.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bash_import: Option<BashImport>,
}

/// What a state file path holds: [`StateStore::inspect`] tells "no file" apart from a file.
///
/// `Serialize`: `{"present": false}`, or `{"present": true, "report": <the StateReport>}`.
#[derive(Clone, Debug, PartialEq, Eq)]
// Built once per read by a tool, never in a loop: not boxed, so a match takes it apart.
#[allow(clippy::large_enum_variant)]
pub enum StateFile {
    /// No file at the path: a node that never confirmed anything, or a mistyped path.
    Missing,
    /// A readable state document.
    Present(StateReport),
}

impl std::fmt::Display for StateReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = &self.state;
        writeln!(f, "format {}", self.format)?;
        writeln!(
            f,
            "admitted {}, confirmed {}, joining {}, absent from polls {}",
            s.admitted.len(),
            s.confirmed.len(),
            s.joining.len(),
            s.absent.len()
        )?;
        for repair in &self.repairs {
            writeln!(f, "repaired on load: {repair}")?;
        }
        if let Some(i) = &self.bash_import {
            writeln!(
                f,
                "imported from the Bash sidecar's files: admitted {}, leave timers {}, recent leaves {}",
                i.admitted.len(),
                i.absence_observed.len(),
                i.recent_leaves_ago.len()
            )?;
        }
        Ok(())
    }
}

impl Serialize for StateFile {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = s.serialize_map(None)?;
        match self {
            StateFile::Missing => map.serialize_entry("present", &false)?,
            StateFile::Present(report) => {
                map.serialize_entry("present", &true)?;
                map.serialize_entry("report", report)?;
            }
        }
        map.end()
    }
}

#[derive(Serialize)]
struct DocumentOut<'a> {
    version: u32,
    #[serde(flatten)]
    state: &'a State,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum DocumentIn {
    Bare(BTreeSet<GroupId>),
    Versioned(serde_json::Map<String, serde_json::Value>),
}

/// Version 3: absences as poll counts, no clock.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct V3 {
    admitted: BTreeSet<GroupId>,
    confirmed: BTreeSet<GroupId>,
    #[serde(default)]
    joining: BTreeSet<GroupId>,
    #[serde(default)]
    absent_polls: BTreeMap<GroupId, u32>,
}

impl From<V3> for State {
    fn from(v3: V3) -> Self {
        State {
            admitted: v3.admitted,
            confirmed: v3.confirmed,
            joining: v3.joining,
            absent: absences_from_polls(v3.absent_polls),
            ..State::default()
        }
    }
}

/// An older document's poll counts as absences observed for 0 s: the grace starts at the
/// upgrade (the older formats kept no time).
fn absences_from_polls(absent_polls: BTreeMap<GroupId, u32>) -> BTreeMap<GroupId, Absence> {
    absent_polls
        .into_iter()
        .map(|(id, polls)| (id, Absence { polls, since_ms: 0 }))
        .collect()
}

/// Version 2: version 3 without `joining` (its own schema, so a `joining` key is refused as
/// any unknown key is).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct V2 {
    admitted: BTreeSet<GroupId>,
    confirmed: BTreeSet<GroupId>,
    #[serde(default)]
    absent_polls: BTreeMap<GroupId, u32>,
}

impl From<V2> for State {
    fn from(v2: V2) -> Self {
        V3 {
            admitted: v2.admitted,
            confirmed: v2.confirmed,
            joining: BTreeSet::new(),
            absent_polls: v2.absent_polls,
        }
        .into()
    }
}

/// Version 1: the confirmed set only (the reference's semantics).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct V1 {
    confirmed: BTreeSet<GroupId>,
}

impl From<V1> for State {
    fn from(v1: V1) -> Self {
        State {
            confirmed: v1.confirmed,
            ..State::default()
        }
    }
}

/// Why the state file could not be used. Each names the file.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StateError {
    /// The file exists but could not be read.
    #[error("cannot read state file {path}: {source}")]
    Read {
        /// The state file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The file is not a state document this version understands.
    #[error("state file {path} is corrupt: {reason} (fix or move it aside; the sidecar will not guess the confirmed set)")]
    Corrupt {
        /// The state file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The file says a version this build does not know (written by a newer sidecar?).
    #[error("state file {path} has version {version}, this sidecar reads versions 1 to 4")]
    UnsupportedVersion {
        /// The state file.
        path: PathBuf,
        /// The version found.
        version: u64,
    },
    /// A Bash sidecar file beside a bare-array state file is unreadable or corrupt.
    #[error(transparent)]
    Import(#[from] ImportError),
    /// Writing the new document failed; the previous file is untouched.
    #[error("cannot write state file {path} ({step}): {source}")]
    Write {
        /// The state file.
        path: PathBuf,
        /// The step that failed: create temp file, write, fsync, rename, fsync directory.
        step: &'static str,
        /// The I/O error.
        source: std::io::Error,
    },
}

serialize_kind_and_message!(StateError);

impl StateError {
    /// The failure's one classification, stable for a program to match (the `kind` of its
    /// `Serialize` form, `{"kind": …, "message": …}`): `read`, `corrupt`,
    /// `unsupported-version`, `import` (a Bash sidecar file beside it), `write`.
    pub fn kind(&self) -> &'static str {
        match self {
            StateError::Read { .. } => "read",
            StateError::Corrupt { .. } => "corrupt",
            StateError::UnsupportedVersion { .. } => "unsupported-version",
            StateError::Import(_) => "import",
            StateError::Write { .. } => "write",
        }
    }

    /// A key that stays the same while the same fault repeats (variant, step, OS error),
    /// unlike the message, which may name a random temp file: for logging a fault once.
    pub fn stable_key(&self) -> String {
        match self {
            StateError::Read { source, .. } => format!("read:{:?}", source.kind()),
            StateError::Corrupt { reason, .. } => format!("corrupt:{reason}"),
            StateError::UnsupportedVersion { version, .. } => format!("version:{version}"),
            StateError::Import(e) => format!("import:{e}"),
            StateError::Write { step, source, .. } => format!(
                "write:{step}:{:?}:{:?}",
                source.kind(),
                source.raw_os_error()
            ),
        }
    }
}

/// Parses a state document (any supported version) into the state the daemon runs on.
///
/// Errors: [`StateError::Corrupt`], [`StateError::UnsupportedVersion`]; `path` only names
/// the file in them.
// A pure entry point for the contract and schema tests, the fuzzers and the benches;
// not part of the library's promise.
#[doc(hidden)]
pub fn parse_state(bytes: &[u8], path: &Path) -> Result<State, StateError> {
    inspect_state(bytes, path).map(|report| report.state)
}

/// Parses a state document (any supported version) and reports what it holds as written,
/// what loading made of it, and what had to be repaired.
///
/// Errors: [`StateError::Corrupt`], [`StateError::UnsupportedVersion`]; `path` only names
/// the file in them.
pub fn inspect_state(bytes: &[u8], path: &Path) -> Result<StateReport, StateError> {
    let (format, on_disk) = parse_document(bytes, path)?;
    let mut state = on_disk.clone();
    if matches!(format, StateFormat::BareArray | StateFormat::V1) {
        state.admitted = state.confirmed.clone();
    }
    let repairs = state.repair();
    Ok(StateReport {
        format,
        on_disk,
        state,
        repairs,
        bash_import: None,
    })
}

/// For a bare-array state file at `path`: reads the Bash sidecar's files beside it and adds
/// what they hold to `report.state` (admitted ids), keeping the import in
/// `report.bash_import`. Other formats are left as they are. `now_unix` dates the timers.
///
/// Errors: [`StateError::Import`] naming a side file that is there but unreadable or corrupt.
fn import_bash_files(
    report: &mut StateReport,
    path: &Path,
    now_unix: u64,
) -> Result<(), StateError> {
    if report.format != StateFormat::BareArray {
        return Ok(());
    }
    let files = bash_import::read_beside(path)?;
    let import = bash_import::map_import(&report.on_disk.confirmed, &files, now_unix);
    // The bare format has no joining set and no clock: adding admitted ids, their
    // absences and the leaves (all readings at most the new clock) keeps every invariant.
    report
        .state
        .admitted
        .extend(import.admitted.iter().copied());
    carry_timers(&mut report.state, &import);
    report.bash_import = Some(import);
    Ok(())
}

/// Carries the Bash sidecar's timers onto the observed clock: the clock starts at the
/// longest of them, so each imported absence reads as observed for as long as that sidecar
/// saw it (at most `IMPORTED_ABSENCE_MAX`, an hour: the rest of a grace is observed here)
/// and each leave of its last hour
/// counts against the budgets for what is left of its hour. Poll counts start at 0: the
/// stability rule (`leave_after_polls`) is still met on this sidecar's own polls.
fn carry_timers(state: &mut State, import: &BashImport) {
    let ms = |d: &Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
    let base = import
        .absence_observed
        .values()
        .chain(&import.recent_leaves_ago)
        .map(ms)
        .max()
        .unwrap_or(0)
        .max(state.observed_ms);
    state.observed_ms = base;
    for (id, observed) in &import.absence_observed {
        state.absent.entry(*id).or_insert(Absence {
            polls: 0,
            since_ms: base.saturating_sub(ms(observed)),
        });
    }
    let mut leaves: Vec<u64> = import
        .recent_leaves_ago
        .iter()
        .map(|ago| base.saturating_sub(ms(ago)))
        .collect();
    leaves.sort_unstable();
    state.recent_leaves_ms = leaves;
}

/// The wall-clock time in Unix seconds (0 before 1970: every Bash timer then observes
/// nothing, which only delays a leave).
fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The document's format and its sets as written.
fn parse_document(bytes: &[u8], path: &Path) -> Result<(StateFormat, State), StateError> {
    let corrupt = |reason: String| StateError::Corrupt {
        path: path.to_owned(),
        reason,
    };
    // An object naming a key twice is ambiguous (which `confirmed` is meant?): corrupt.
    if let Err(e) = crate::strict_json::reject_duplicate_keys(bytes) {
        if !e.is_syntax() && !e.is_eof() {
            return Err(corrupt(format!("ambiguous: {e}")));
        }
    }
    if let Some(state) = parse_current(bytes) {
        return Ok((StateFormat::V4, state));
    }
    let doc: DocumentIn = match serde_json::from_slice(bytes) {
        Ok(doc) => doc,
        Err(e) => {
            let detail = match serde_json::from_slice::<serde_json::Value>(bytes) {
                Err(json) => format!("not JSON ({json})"),
                Ok(serde_json::Value::Array(_)) => "an array, but not of 64-hex ids".to_owned(),
                Ok(other) => format!("a JSON {} ({e})", json_kind(&other)),
            };
            return Err(corrupt(format!(
                "expected an object with \"version\" or an array of 64-hex ids, found {detail}"
            )));
        }
    };
    let mut map = match doc {
        DocumentIn::Bare(confirmed) => {
            return Ok((
                StateFormat::BareArray,
                State {
                    confirmed,
                    ..State::default()
                },
            ))
        }
        DocumentIn::Versioned(map) => map,
    };
    let version = map
        .remove("version")
        .ok_or_else(|| corrupt("no \"version\" key".to_owned()))?
        .as_u64()
        .ok_or_else(|| corrupt("\"version\" is not a whole number".to_owned()))?;
    let value = serde_json::Value::Object(map);
    // Each version is read with its own schema, then taken as today's sets.
    fn read<V: serde::de::DeserializeOwned + Into<State>>(
        value: serde_json::Value,
    ) -> Result<State, serde_json::Error> {
        serde_json::from_value::<V>(value).map(Into::into)
    }
    let (format, read) = match version {
        1 => (StateFormat::V1, read::<V1>(value)),
        2 => (StateFormat::V2, read::<V2>(value)),
        3 => (StateFormat::V3, read::<V3>(value)),
        4 => (StateFormat::V4, read::<State>(value)),
        version => {
            return Err(StateError::UnsupportedVersion {
                path: path.to_owned(),
                version,
            })
        }
    };
    Ok((format, read.map_err(|e| corrupt(e.to_string()))?))
}

/// A document of the current version, read straight into the sets (no JSON tree; the form
/// the daemon writes, so what every start reads). `None` for anything else: older forms
/// and faults take the general path, which names what is wrong. Repeated keys are refused
/// before this.
fn parse_current(bytes: &[u8]) -> Option<State> {
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Current {
        version: u64,
        admitted: BTreeSet<GroupId>,
        confirmed: BTreeSet<GroupId>,
        #[serde(default)]
        joining: BTreeSet<GroupId>,
        #[serde(default)]
        observed_ms: u64,
        #[serde(default)]
        absent: BTreeMap<GroupId, Absence>,
        #[serde(default)]
        recent_leaves_ms: Vec<u64>,
    }
    // An object only: a derived reader would also take an array, in field order.
    if bytes.iter().find(|b| !b" \t\r\n".contains(b)) != Some(&b'{') {
        return None;
    }
    let doc: Current = serde_json::from_slice(bytes).ok()?;
    (doc.version == u64::from(STATE_VERSION)).then_some(State {
        admitted: doc.admitted,
        confirmed: doc.confirmed,
        joining: doc.joining,
        observed_ms: doc.observed_ms,
        absent: doc.absent,
        recent_leaves_ms: doc.recent_leaves_ms,
    })
}

/// Whether [`render_state`] of `state` is exactly `bytes`, compared as it is rendered
/// (nothing allocated; stops at the first difference).
fn renders_as(state: &State, bytes: &[u8]) -> bool {
    /// Compares what is written with the rest of `expected`.
    struct Compare<'a> {
        expected: &'a [u8],
    }
    impl Write for Compare<'_> {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            match self.expected.strip_prefix(buf) {
                Some(rest) => {
                    self.expected = rest;
                    Ok(buf.len())
                }
                None => Err(std::io::ErrorKind::InvalidData.into()),
            }
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let doc = DocumentOut {
        version: STATE_VERSION,
        state,
    };
    let mut rest = Compare { expected: bytes };
    serde_json::to_writer_pretty(&mut rest, &doc).is_ok() && rest.expected == b"\n"
}

fn json_kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "boolean",
        serde_json::Value::Number(_) => "number",
        serde_json::Value::String(_) => "string",
        serde_json::Value::Array(_) => "array",
        serde_json::Value::Object(_) => "object",
    }
}

/// Renders the current-version document (pretty JSON, trailing newline).
// A pure entry point for the contract and schema tests, the fuzzers and the benches;
// not part of the library's promise.
#[doc(hidden)]
pub fn render_state(state: &State) -> Vec<u8> {
    let doc = DocumentOut {
        version: STATE_VERSION,
        state,
    };
    // Serializing sets of ids and integers into a Vec cannot fail.
    let mut out = serde_json::to_vec_pretty(&doc).unwrap_or_default();
    out.push(b'\n');
    out
}

/// The state file: loads it and writes it back atomically when it changed.
#[derive(Debug)]
pub struct StateStore {
    path: PathBuf,
    /// The state the file holds in the current version's form, once known: an unchanged
    /// state is recognised by comparing sets, without rendering the document again.
    last_written: Option<State>,
    /// The caller's version of the sets (`admitted`, `confirmed`, `joining`) of
    /// `last_written`, when it gave one ([`StateStore::mark_written`]): the same version
    /// again means the same sets, so [`StateStore::is_recorded_at`] need not walk them.
    written_sets: Option<u64>,
    /// When this store last wrote the file (monotonic; `None` before its first write).
    written_at: Option<tokio::time::Instant>,
}

impl StateStore {
    /// A store for the file at `path` (nothing is read yet).
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self {
            path: path.into(),
            last_written: None,
            written_sets: None,
            written_at: None,
        }
    }

    /// The state file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Reads the state. `Ok(None)` when the file does not exist (first start).
    ///
    /// Errors: [`StateError::Read`], [`StateError::Corrupt`],
    /// [`StateError::UnsupportedVersion`].
    pub fn load(&mut self) -> Result<Option<State>, StateError> {
        let bytes = match std::fs::read(&self.path) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(source) => {
                return Err(StateError::Read {
                    path: self.path.clone(),
                    source,
                })
            }
        };
        let mut report = inspect_state(&bytes, &self.path)?;
        import_bash_files(&mut report, &self.path, unix_now())?;
        if let Some(import) = &report.bash_import {
            tracing::info!(
                path = %self.path.display(),
                admitted = import.admitted.len(),
                timers = import.absence_observed.len(),
                recent_leaves = import.recent_leaves_ago.len(),
                "state file in the Bash sidecar's format: its files beside it imported; the first write turns it into this sidecar's format and leaves them as they are"
            );
        }
        for repair in &report.repairs {
            tracing::warn!(path = %self.path.display(), "state file repaired on load: {repair}");
        }
        // A file in an older form (or not normalized) is rewritten at the first save.
        self.last_written = renders_as(&report.state, &bytes).then(|| report.state.clone());
        self.written_sets = None;
        Ok(Some(report.state))
    }

    /// Reads the state file without adopting it, telling a missing file apart from a
    /// present one and reporting what loading would repair (for tools; the daemon uses
    /// [`StateStore::load`]).
    ///
    /// Errors: [`StateError::Read`], [`StateError::Corrupt`],
    /// [`StateError::UnsupportedVersion`].
    pub fn inspect(&self) -> Result<StateFile, StateError> {
        match std::fs::read(&self.path) {
            Ok(bytes) => {
                let mut report = inspect_state(&bytes, &self.path)?;
                import_bash_files(&mut report, &self.path, unix_now())?;
                Ok(StateFile::Present(report))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(StateFile::Missing),
            Err(source) => Err(StateError::Read {
                path: self.path.clone(),
                source,
            }),
        }
    }

    /// Removes temp files a write interrupted by a crash or `SIGKILL` left beside the state
    /// file (every temp file this crate's durable writes create, and the
    /// `.fleet-confirmed.*.tmp` / `.probe` of older releases); the state file itself is never
    /// touched (writes are atomic renames). Run at start, before any write. Returns how many
    /// were removed; a directory that cannot be listed counts as none.
    pub fn remove_stale_temp_files(&self) -> usize {
        durable::remove_stale_temp_files(parent_dir(&self.path))
    }

    /// Checks that the state can be written: the directory exists (it is created if
    /// missing) and a file can be created in it. Run before anything is joined, so a
    /// read-only or wrong `state_file` stops the daemon instead of admissions that can never
    /// be recorded.
    ///
    /// Errors: [`StateError::Write`] naming the failed step.
    pub fn check_writable(&self) -> Result<(), StateError> {
        Ok(durable::check_writable(&self.path, STATE_MODE)?)
    }

    /// Forgets what was last written, so the next [`StateStore::save`] writes even an
    /// unchanged document (used to retry after a failed write).
    pub fn forget_written(&mut self) {
        self.last_written = None;
        self.written_sets = None;
    }

    /// Tells the store that `state`'s sets are version `sets` of the caller's count (one
    /// that moves with every change of `admitted`, `confirmed` or `joining`), if the file
    /// holds `state` exactly ([`StateStore::is_saved`]): e.g. the state just loaded.
    #[cfg(feature = "daemon")] // the daemon's alone: a tool's build leaves it out
    pub(crate) fn adopt_sets_version(&mut self, state: &State, sets: u64) {
        if self.is_saved(state) {
            self.written_sets = Some(sets);
        }
    }

    /// Whether the file holds `state` as far as this store knows (it loaded or last wrote
    /// it, and [`StateStore::forget_written`] was not called since): [`StateStore::save`]
    /// would then write nothing.
    pub fn is_saved(&self, state: &State) -> bool {
        self.last_written.as_ref() == Some(state)
    }

    /// Whether the file records `state` well enough that the daemon need not write now
    /// (`now`: monotonic). Exactly as saved: yes. Differing only in time
    /// ([`State::same_but_time`]): yes while nothing reads the clock, or while the last
    /// write is younger than a minute — so a pending leave, a failing
    /// leave or a running grace costs one write a minute, not one a poll, and what the file
    /// holds only lags (absences shorter, leaves younger). Any other change: no.
    pub fn is_recorded(&self, state: &State, now: tokio::time::Instant) -> bool {
        self.is_recorded_at(state, None, now)
    }

    /// [`StateStore::is_recorded`], told the version of `state`'s sets (`sets`, the count
    /// given to [`StateStore::mark_written`]): when it is the version last written, the
    /// sets are not walked. At 10,000 namespaces that walk, every poll, cost an idle cycle
    /// more than anything else.
    pub(crate) fn is_recorded_at(
        &self,
        state: &State,
        sets: Option<u64>,
        now: tokio::time::Instant,
    ) -> bool {
        let Some(last) = &self.last_written else {
            return false;
        };
        let sets_as_written = sets.is_some() && sets == self.written_sets;
        if !(sets_as_written || last.same_sets(state)) || !last.same_timed_but_time(state) {
            return false;
        }
        // The sets agree. With the same clock and counts too, it is exactly as saved.
        let exactly = last.observed_ms == state.observed_ms && last.absent == state.absent;
        exactly
            || (!state.time_matters()
                || self
                    .written_at
                    .is_some_and(|at| now.saturating_duration_since(at) < TIME_ONLY_WRITE_INTERVAL))
    }

    /// Writes `state` if its document differs from what the file holds; returns whether it
    /// wrote. Atomic: a crash at any point leaves either the old or the new document.
    /// Blocks for the write and its fsyncs (the daemon's loop runs its writes off its
    /// thread).
    ///
    /// Errors: [`StateError::Write`] naming the failed step; the old file is then intact.
    pub fn save(&mut self, state: &State) -> Result<bool, StateError> {
        if self.is_saved(state) {
            return Ok(false);
        }
        write_atomically(&self.path, &render_state(state))?;
        self.mark_written(state.clone(), None, tokio::time::Instant::now());
        Ok(true)
    }

    /// A write of `state` to this store's file, to run anywhere ([`PendingWrite::run`]
    /// blocks); once it succeeded, [`StateStore::mark_written`] tells the store.
    #[cfg(feature = "daemon")] // the daemon's alone: a tool's build leaves it out
    pub(crate) fn prepare_write(&self, state: State) -> PendingWrite {
        PendingWrite {
            path: self.path.clone(),
            state,
        }
    }

    /// Tells the store that its file holds `state` since `at` (monotonic), written by a
    /// [`PendingWrite`] that succeeded; `sets`: the caller's version of its sets (see
    /// [`StateStore::adopt_sets_version`]), if it counts them.
    pub(crate) fn mark_written(
        &mut self,
        state: State,
        sets: Option<u64>,
        at: tokio::time::Instant,
    ) {
        self.written_at = Some(at);
        self.last_written = Some(state);
        self.written_sets = sets;
    }
}

/// A state write prepared by [`StateStore::prepare_write`]: the file's path and the state
/// to write. Rendered and written by [`PendingWrite::run`], which blocks (a write, two
/// fsyncs and a rename), so the daemon runs it on a blocking thread, never on its loop.
#[derive(Debug)]
#[cfg(feature = "daemon")] // the daemon's alone: a tool's build leaves it out
pub(crate) struct PendingWrite {
    path: PathBuf,
    state: State,
}

#[cfg(feature = "daemon")] // the daemon's alone: a tool's build leaves it out
impl PendingWrite {
    /// Writes the state atomically (as [`StateStore::save`] does); with `probe`, then checks
    /// that a file can still be created beside it ([`StateStore::check_writable`]). Gives
    /// the state back with the write's outcome and the probe's.
    ///
    /// Errors: [`StateError::Write`] naming the failed step; the old file is then intact.
    pub(crate) fn run(self, probe: bool) -> WriteOutcome {
        let written = write_atomically(&self.path, &render_state(&self.state));
        let probed =
            (probe && written.is_ok()).then(|| StateStore::new(&self.path).check_writable());
        WriteOutcome {
            state: self.state,
            written,
            probed,
        }
    }
}

/// What a [`PendingWrite`] did.
#[derive(Debug)]
#[cfg(feature = "daemon")] // the daemon's alone: a tool's build leaves it out
pub(crate) struct WriteOutcome {
    /// The state it wrote (or tried to).
    pub(crate) state: State,
    /// Whether the file holds it now.
    pub(crate) written: Result<(), StateError>,
    /// The writability probe after a successful write, when one was asked for.
    pub(crate) probed: Option<Result<(), StateError>>,
}

/// The state holds no secret: readable (0644) for `fleet-sidecar status` and operators, as
/// the Bash sidecar's file was.
pub(crate) const STATE_MODE: u32 = 0o644;

/// Writes a state document (or a file beside it) to `path` with [`durable::write_atomically`],
/// readable by all ([`STATE_MODE`]).
///
/// Errors: [`StateError::Write`] naming the failed step; the old file is then intact.
pub(crate) fn write_atomically(path: &Path, bytes: &[u8]) -> Result<(), StateError> {
    Ok(durable::write_atomically(path, bytes, STATE_MODE)?)
}

impl From<durable::WriteError> for StateError {
    fn from(e: durable::WriteError) -> Self {
        StateError::Write {
            path: e.path,
            step: e.step,
            source: e.source,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_have_a_kind_and_serialize_as_kind_and_message() {
        let e = StateError::UnsupportedVersion {
            path: PathBuf::from("/s.json"),
            version: 9,
        };
        assert_eq!(e.kind(), "unsupported-version");
        assert_eq!(
            serde_json::to_value(&e).unwrap(),
            serde_json::json!({"kind": "unsupported-version", "message": e.to_string()})
        );
        let corrupt = parse_state(b"[", Path::new("/s.json")).unwrap_err();
        assert_eq!(serde_json::to_value(&corrupt).unwrap()["kind"], "corrupt");
    }

    use crate::ids::test_id as id;

    fn absence(polls: u32, since_ms: u64) -> Absence {
        Absence { polls, since_ms }
    }

    fn sample() -> State {
        State {
            admitted: [id(1), id(2), id(3)].into(),
            confirmed: [id(1), id(2)].into(),
            joining: [id(4)].into(),
            observed_ms: 90_000,
            absent: [(id(3), absence(2, 1_000)), (id(4), absence(1, 89_000))].into(),
            recent_leaves_ms: vec![10_000, 80_000],
        }
    }

    #[test]
    fn the_current_version_is_read_straight_and_nothing_else_is() {
        let state = sample();
        let text = String::from_utf8(render_state(&state)).unwrap();
        assert_eq!(parse_current(text.as_bytes()), Some(state.clone()));
        assert_eq!(parse_state(text.as_bytes(), Path::new("s")).unwrap(), state);
        let ids = |s: &BTreeSet<GroupId>| serde_json::to_string(s).unwrap();
        let (a, c) = (ids(&state.admitted), ids(&state.confirmed));
        // Other forms take the general path, which reads them as before or names the fault.
        // (`A` and `C` stand for the admitted and confirmed arrays.)
        for (template, loads) in [
            (r#"{"version":1,"confirmed":C}"#, true),
            ("C", true),
            (r#"{"version":2,"admitted":A,"confirmed":C}"#, true),
            (
                r#"{"version":2,"admitted":A,"confirmed":C,"joining":[]}"#,
                false,
            ),
            (r#"{"version":5,"admitted":A,"confirmed":C}"#, false),
            (r#"{"version":3,"admitted":A,"confirmed":C}"#, true),
            (r#"{"version":3,"admitted":A,"confirmed":C,"x":1}"#, false),
            (r#"{"version":2.0,"admitted":A,"confirmed":C}"#, false),
            (r#"{"version":2,"admitted":A,"confirmed":C,"x":1}"#, false),
            (r#"{"version":2,"admitted":A}"#, false),
            // A derived reader would take this array in field order: it is no state file.
            ("[2,A,C]", false),
        ] {
            let doc = template.replace('A', &a).replace('C', &c);
            assert_eq!(parse_current(doc.as_bytes()), None, "{doc}");
            assert_eq!(
                parse_state(doc.as_bytes(), Path::new("s")).is_ok(),
                loads,
                "{doc}"
            );
        }
        // Whitespace before the object is still the current version.
        let spaced = format!(" \n\t{text}");
        assert_eq!(parse_current(spaced.as_bytes()), Some(state));
    }

    #[test]
    fn renders_as_compares_with_the_rendered_document_without_building_it() {
        let state = sample();
        let file = render_state(&state);
        assert!(renders_as(&state, &file));
        assert!(!renders_as(&state, &file[..file.len() - 1]), "shorter");
        assert!(!renders_as(&state, &[&file[..], b"\n"].concat()), "longer");
        let mut changed = file.clone();
        let at = changed.len() / 2;
        changed[at] ^= 1;
        assert!(!renders_as(&state, &changed), "one byte differs");
        assert!(!renders_as(&State::default(), &file));
    }

    #[test]
    fn a_repeated_write_failure_has_one_key_whatever_temp_file_it_named() {
        let dir = tempfile::tempdir().unwrap();
        let not_a_dir = dir.path().join("state");
        std::fs::write(&not_a_dir, b"a file where the directory should be").unwrap();
        let mut store = StateStore::new(not_a_dir.join("fleet-confirmed.json"));
        let errors: Vec<StateError> = (1..=3)
            .map(|n| {
                let state = State {
                    admitted: [id(n)].into(),
                    ..State::default()
                };
                store.save(&state).unwrap_err()
            })
            .collect();
        assert!(errors.iter().all(|e| matches!(e, StateError::Write { .. })));
        assert!(errors
            .iter()
            .all(|e| e.stable_key() == errors[0].stable_key()));
        assert!(store.check_writable().is_err());
    }

    #[test]
    fn a_key_named_twice_is_corrupt_at_any_depth() {
        let a = "11".repeat(32);
        let b = "22".repeat(32);
        for doc in [
            format!(r#"{{"version":2,"admitted":["{a}"],"confirmed":[],"confirmed":["{a}"]}}"#),
            format!(r#"{{"version":2,"version":1,"confirmed":["{a}"]}}"#),
            format!(
                r#"{{"version":2,"admitted":["{a}","{b}"],"confirmed":[],"absent_polls":{{"{a}":1,"{a}":3}}}}"#
            ),
        ] {
            let err = parse_state(doc.as_bytes(), Path::new("s.json")).unwrap_err();
            assert!(matches!(err, StateError::Corrupt { .. }), "{doc}: {err}");
            assert!(err.to_string().contains("duplicate key"), "{err}");
        }
    }

    #[test]
    fn round_trip_and_write_only_on_change() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state").join("fleet-confirmed.json");
        let mut store = StateStore::new(&path);
        assert_eq!(store.load().unwrap(), None);
        let state = State {
            admitted: [id(1), id(2)].into(),
            confirmed: [id(1)].into(),
            absent: [(id(2), absence(1, 0))].into(),
            ..State::default()
        };
        assert!(!store.is_saved(&state));
        assert!(store.save(&state).unwrap());
        assert!(store.is_saved(&state));
        assert!(
            !store.save(&state).unwrap(),
            "unchanged state is not rewritten"
        );
        store.forget_written();
        assert!(!store.is_saved(&state), "forgotten: written again");
        assert!(store.save(&state).unwrap());
        let mut again = StateStore::new(&path);
        assert_eq!(again.load().unwrap(), Some(state.clone()));
        assert!(
            !again.save(&state).unwrap(),
            "a loaded file counts as written"
        );
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.contains("\"version\": 4"), "{text}");
        let leftovers: Vec<_> = std::fs::read_dir(path.parent().unwrap())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(
            leftovers,
            vec![std::ffi::OsString::from("fleet-confirmed.json")]
        );
    }

    #[test]
    fn save_replaces_the_file_by_rename() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("fleet-confirmed.json");
        let mut store = StateStore::new(&path);
        store.save(&State::default()).unwrap();
        let before = std::fs::metadata(&path).unwrap().ino();
        store
            .save(&State {
                admitted: [id(3)].into(),
                confirmed: [id(3)].into(),
                ..State::default()
            })
            .unwrap();
        let after = std::fs::metadata(&path).unwrap().ino();
        assert_ne!(
            before, after,
            "a new inode: written beside and renamed over"
        );
    }

    #[test]
    fn a_failed_write_keeps_the_old_file() {
        use std::os::unix::fs::PermissionsExt;
        if nix::unistd::geteuid().is_root() {
            eprintln!("skipping: root ignores directory permissions");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("fleet-confirmed.json");
        let mut store = StateStore::new(&path);
        let old = State {
            admitted: [id(1)].into(),
            confirmed: [id(1)].into(),
            ..State::default()
        };
        store.save(&old).unwrap();
        let old_bytes = std::fs::read(&path).unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o500)).unwrap();
        let err = store.save(&State::default()).unwrap_err();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
        assert!(err.to_string().contains("fleet-confirmed.json"), "{err}");
        assert_eq!(std::fs::read(&path).unwrap(), old_bytes);
    }

    #[test]
    fn reads_version_1_and_the_bash_array() {
        let a = id(0xab).to_string();
        let p = Path::new("s.json");
        let v1 = parse_state(
            format!("{{\"version\":1,\"confirmed\":[\"{a}\"]}}").as_bytes(),
            p,
        )
        .unwrap();
        assert_eq!(v1.confirmed, [id(0xab)].into());
        assert_eq!(v1.admitted, [id(0xab)].into());
        let bare = parse_state(format!("[\"{}\"]", a.to_uppercase()).as_bytes(), p).unwrap();
        assert_eq!(bare, v1);
        assert_eq!(parse_state(b"[]", p).unwrap(), State::default());
    }

    #[test]
    fn load_restores_the_invariants() {
        let a = id(1).to_string();
        let b = id(2).to_string();
        let text = format!(
            "{{\"version\":2,\"admitted\":[],\"confirmed\":[\"{a}\"],\"absent_polls\":{{\"{b}\":2}}}}"
        );
        let s = parse_state(text.as_bytes(), Path::new("s")).unwrap();
        assert_eq!(s.admitted, [id(1)].into(), "confirmed implies admitted");
        assert!(s.absent.is_empty(), "counts only for admitted ids");

        // The report keeps what the file said and names each repair.
        let report = inspect_state(text.as_bytes(), Path::new("s")).unwrap();
        assert_eq!(report.format, StateFormat::V2);
        assert!(report.on_disk.admitted.is_empty());
        assert_eq!(report.on_disk.confirmed, [id(1)].into());
        assert_eq!(report.on_disk.absent[&id(2)], absence(2, 0));
        assert_eq!(report.state, s);
        assert_eq!(
            report.repairs,
            vec![
                Repair::ConfirmedNotAdmitted(id(1)),
                Repair::AbsentNotAdmitted(id(2))
            ]
        );
        assert!(report.repairs[0]
            .to_string()
            .contains("confirmed but was not admitted"));

        // Joining and admitted at once: the admission wins. A count for a joining id stays.
        let c = id(3).to_string();
        let text = format!(
            "{{\"version\":3,\"admitted\":[\"{a}\"],\"confirmed\":[],\"joining\":[\"{a}\",\"{c}\"],\"absent_polls\":{{\"{c}\":1}}}}"
        );
        let report = inspect_state(text.as_bytes(), Path::new("s")).unwrap();
        assert_eq!(report.format, StateFormat::V3);
        assert_eq!(report.on_disk.joining, [id(1), id(3)].into());
        assert_eq!(report.state.joining, [id(3)].into());
        assert_eq!(
            report.state.absent[&id(3)],
            absence(1, 0),
            "v3 counts load as absences observed for 0 s"
        );
        assert_eq!(report.repairs, vec![Repair::JoiningAdmitted(id(1))]);
    }

    #[test]
    fn inspect_tells_a_missing_file_from_a_sound_one_and_older_formats_need_no_repair() {
        let dir = tempfile::tempdir().unwrap();
        let store = StateStore::new(dir.path().join("fleet-confirmed.json"));
        assert_eq!(store.inspect().unwrap(), StateFile::Missing);

        std::fs::write(store.path(), format!("[\"{}\"]", id(3))).unwrap();
        let StateFile::Present(report) = store.inspect().unwrap() else {
            panic!("a present file")
        };
        assert_eq!(report.format, StateFormat::BareArray);
        assert!(
            report.on_disk.admitted.is_empty(),
            "the bare format has no admitted set"
        );
        assert_eq!(report.state.admitted, [id(3)].into());
        assert!(
            report.repairs.is_empty(),
            "admitted = confirmed is the format's meaning"
        );

        let mut writer = StateStore::new(store.path());
        let sound = State {
            admitted: [id(1), id(2)].into(),
            confirmed: [id(1)].into(),
            joining: [id(3)].into(),
            observed_ms: 5_000,
            absent: [(id(2), absence(1, 4_000)), (id(3), absence(1, 5_000))].into(),
            recent_leaves_ms: vec![1_000],
        };
        writer.save(&sound).unwrap();
        let StateFile::Present(report) = store.inspect().unwrap() else {
            panic!("a present file")
        };
        assert_eq!(report.format, StateFormat::V4);
        assert_eq!(report.on_disk, sound);
        assert_eq!(report.state, sound);
        assert!(report.repairs.is_empty());

        // Version 2 (no joining set) reads as it was written.
        let (one, two) = (id(1), id(2));
        std::fs::write(
            store.path(),
            format!(r#"{{"version":2,"admitted":["{one}","{two}"],"confirmed":["{one}"],"absent_polls":{{"{two}":1}}}}"#),
        )
        .unwrap();
        let StateFile::Present(report) = store.inspect().unwrap() else {
            panic!("a present file")
        };
        assert_eq!(report.format, StateFormat::V2);
        let v2 = State {
            admitted: sound.admitted.clone(),
            confirmed: sound.confirmed.clone(),
            absent: [(id(2), absence(1, 0))].into(),
            ..State::default()
        };
        assert_eq!(report.state, v2);
        assert!(report.repairs.is_empty());
    }

    #[test]
    fn corrupt_files_are_loud_errors_naming_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("fleet-confirmed.json");
        for (bytes, want) in [
            (&b""[..], "corrupt"),
            (b"{", "corrupt"),
            (b"not json", "corrupt"),
            (b"{\"confirmed\":[]}", "no \"version\""),
            (b"{\"version\":\"2\"}", "whole number"),
            (
                b"{\"version\":2,\"admitted\":[\"abcd\"],\"confirmed\":[]}",
                "64 hex",
            ),
            (
                b"{\"version\":2,\"admitted\":[],\"confirmed\":[],\"extra\":1}",
                "extra",
            ),
            (b"[\"abcd\"]", "corrupt"),
            (b"{\"version\":9,\"confirmed\":[]}", "version 9"),
        ] {
            std::fs::write(&path, bytes).unwrap();
            let err = StateStore::new(&path).load().unwrap_err();
            let text = err.to_string();
            assert!(text.contains("fleet-confirmed.json"), "{text}");
            assert!(
                text.contains(want),
                "{:?}: {text}",
                String::from_utf8_lossy(bytes)
            );
        }
    }

    #[test]
    fn writability_is_checked_before_anything_happens() {
        let dir = tempfile::tempdir().unwrap();
        let ok = StateStore::new(dir.path().join("new").join("fleet-confirmed.json"));
        ok.check_writable().unwrap();
        assert!(dir.path().join("new").is_dir());
        assert_eq!(
            std::fs::read_dir(dir.path().join("new")).unwrap().count(),
            0
        );
        // A file where the directory should be: even root cannot write there.
        std::fs::write(dir.path().join("blocker"), "").unwrap();
        let bad = StateStore::new(dir.path().join("blocker").join("fleet-confirmed.json"));
        let err = bad.check_writable().unwrap_err().to_string();
        assert!(
            err.contains("blocker") && err.contains("create directory"),
            "{err}"
        );
    }

    #[test]
    fn corrupt_messages_say_what_was_found() {
        let p = Path::new("s.json");
        let msg = |b: &[u8]| parse_state(b, p).unwrap_err().to_string();
        assert!(
            msg(b"null").contains("found a JSON null"),
            "{}",
            msg(b"null")
        );
        assert!(msg(b"7").contains("found a JSON number"));
        assert!(msg(b"[1]").contains("an array, but not of 64-hex ids"));
        assert!(msg(b"{").contains("not JSON"));
    }

    #[test]
    fn an_unreadable_file_is_an_error_not_empty() {
        let dir = tempfile::tempdir().unwrap();
        // A directory where the file should be: reading fails with an I/O error.
        let path = dir.path().join("fleet-confirmed.json");
        std::fs::create_dir(&path).unwrap();
        let err = StateStore::new(&path).load().unwrap_err();
        assert!(matches!(err, StateError::Read { .. }), "{err}");
    }

    #[test]
    fn temp_files_left_by_a_killed_write_are_removed_and_the_state_kept() {
        let dir = tempfile::tempdir().unwrap();
        let mut store = StateStore::new(dir.path().join("fleet-confirmed.json"));
        let state = State {
            admitted: [id(1)].into(),
            confirmed: [id(1)].into(),
            ..State::default()
        };
        store.save(&state).unwrap();
        for name in [".fleet-confirmed.a1B2c3.tmp", ".fleet-confirmed.x.probe"] {
            std::fs::write(dir.path().join(name), b"{\"version\":2,").unwrap();
        }
        std::fs::write(dir.path().join("unrelated.tmp"), b"x").unwrap();
        assert_eq!(store.remove_stale_temp_files(), 2);
        let mut left: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        assert_eq!(left, ["fleet-confirmed.json", "unrelated.tmp"]);
        assert_eq!(StateStore::new(store.path()).load().unwrap(), Some(state));
    }

    #[test]
    fn the_inspect_report_serializes_and_displays_for_a_tool() {
        let a = "AB".repeat(32);
        let b = "cd".repeat(32);
        let text = format!(
            r#"{{"version": 2, "admitted": ["{b}"], "confirmed": ["{a}"], "absent_polls": {{}}}}"#
        );
        let report = inspect_state(text.as_bytes(), Path::new("s.json")).unwrap();
        let json = serde_json::to_value(&report).unwrap();
        let a = a.to_lowercase();
        assert_eq!(json["format"], "v2");
        assert_eq!(json["on_disk"]["confirmed"], serde_json::json!([a]));
        assert_eq!(json["state"]["admitted"], serde_json::json!([a, b]));
        assert_eq!(
            json["repairs"],
            serde_json::json!([{
                "kind": "confirmed-not-admitted",
                "group_id": a,
                "text": format!("{a} is confirmed but was not admitted: added to admitted"),
            }])
        );
        assert_eq!(
            report.to_string(),
            format!(
                "format v2\nadmitted 2, confirmed 1, joining 0, absent from polls 0\n\
                 repaired on load: {a} is confirmed but was not admitted: added to admitted\n"
            )
        );
        let present = serde_json::to_value(StateFile::Present(report)).unwrap();
        assert_eq!(present["present"], true);
        assert_eq!(present["report"], json);
        assert_eq!(
            serde_json::to_value(StateFile::Missing).unwrap(),
            serde_json::json!({"present": false})
        );
        let names: Vec<String> = [
            StateFormat::BareArray,
            StateFormat::V1,
            StateFormat::V2,
            StateFormat::V3,
            StateFormat::V4,
        ]
        .iter()
        .map(|f| format!("{f} {}", serde_json::to_string(f).unwrap()))
        .collect();
        assert_eq!(
            names,
            [
                r#"bare-array "bare-array""#,
                r#"v1 "v1""#,
                r#"v2 "v2""#,
                r#"v3 "v3""#,
                r#"v4 "v4""#
            ]
        );
    }

    #[test]
    fn the_sets_are_walked_only_when_their_version_is_not_the_one_written() {
        let now = tokio::time::Instant::now();
        let dir = tempfile::tempdir().unwrap();
        let mut store = StateStore::new(dir.path().join("fleet-confirmed.json"));
        let written = State {
            admitted: [id(1)].into(),
            ..State::default()
        };
        store.mark_written(written.clone(), Some(7), now);
        let moved = State {
            admitted: [id(1), id(2)].into(),
            ..State::default()
        };
        // The caller's version vouches for the sets: they are not compared.
        assert!(store.is_recorded_at(&moved, Some(7), now));
        // Another version, or none, and the walk sees the change.
        assert!(!store.is_recorded_at(&moved, Some(8), now));
        assert!(!store.is_recorded_at(&moved, None, now));
        assert!(store.is_recorded_at(&written, Some(8), now));
        // What the version does not cover is still compared.
        let stamped = State {
            recent_leaves_ms: vec![1],
            ..written.clone()
        };
        assert!(!store.is_recorded_at(&stamped, Some(7), now));
        // Forgotten, loaded or saved without a version: no version vouches any more.
        store.forget_written();
        store.mark_written(written.clone(), None, now);
        assert!(!store.is_recorded_at(&moved, Some(7), now));
        // Adopted only for the state the file holds.
        store.adopt_sets_version(&moved, 9);
        assert!(!store.is_recorded_at(&moved, Some(9), now));
        store.adopt_sets_version(&written, 9);
        assert!(store.is_recorded_at(&moved, Some(9), now));
    }

    #[test]
    fn time_alone_is_written_once_a_minute_and_only_when_something_reads_the_clock() {
        let start = tokio::time::Instant::now();
        let dir = tempfile::tempdir().unwrap();
        let mut store = StateStore::new(dir.path().join("fleet-confirmed.json"));
        let mut s = State {
            admitted: [id(1)].into(),
            ..State::default()
        };
        assert!(!store.is_recorded(&s, start), "nothing written yet");
        store.save(&s).unwrap();
        // Nothing reads the clock: its advance alone is never due.
        s.observed_ms += 3_600_000;
        assert!(store.is_recorded(&s, start + Duration::from_secs(7200)));
        // An absence starts: a change of facts, due at once.
        s.absent.insert(id(1), absence(1, s.observed_ms));
        assert!(!store.is_recorded(&s, start));
        store.save(&s).unwrap();
        let written = tokio::time::Instant::now();
        // One more poll, a second later: time alone, not due within the minute...
        s.observed_ms += 1_000;
        s.absent.get_mut(&id(1)).unwrap().polls += 1;
        assert!(s.same_but_time(store.last_written.as_ref().unwrap()));
        assert!(store.is_recorded(&s, written + Duration::from_secs(59)));
        // ...and due once it has passed.
        assert!(!store.is_recorded(&s, written + TIME_ONLY_WRITE_INTERVAL));
        // A leave started (a new reading) is a fact: due at once.
        let mut leave = s.clone();
        leave.recent_leaves_ms.push(leave.observed_ms);
        assert!(!store.is_recorded(&leave, written));
    }

    #[test]
    fn a_reading_after_the_clock_loads_as_now() {
        let a = id(1);
        let text = format!(
            r#"{{"version":4,"admitted":["{a}"],"confirmed":[],"observed_ms":1000,"absent":{{"{a}":{{"polls":2,"since_ms":5000}}}},"recent_leaves_ms":[9000,500]}}"#
        );
        let report = inspect_state(text.as_bytes(), Path::new("s")).unwrap();
        assert_eq!(report.repairs, vec![Repair::ReadingAfterClock(2)]);
        assert_eq!(report.state.absence_observed(&a), Some(Duration::ZERO));
        assert_eq!(report.state.recent_leaves_ms, vec![500, 1000]);
    }

    #[test]
    fn a_bash_state_file_brings_in_the_files_beside_it_until_the_first_write() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("fleet-confirmed.json");
        std::fs::write(&path, format!("[\"{}\"]", id(1))).unwrap();
        let admitted = format!("[\"{}\",\"{}\"]", id(1), id(2));
        std::fs::write(dir.path().join(bash_import::ADMITTED_FILE), &admitted).unwrap();
        let mut store = StateStore::new(&path);
        let state = store.load().unwrap().unwrap();
        assert_eq!(
            state.admitted,
            [id(1), id(2)].into(),
            "admitted ids imported"
        );
        assert_eq!(state.confirmed, [id(1)].into(), "not confirmed again");
        let StateFile::Present(report) = store.inspect().unwrap() else {
            panic!("a present file")
        };
        assert_eq!(report.state, state);
        assert_eq!(
            report.bash_import.map(|i| i.admitted),
            Some([id(1), id(2)].into())
        );

        // A corrupt side file stops the load, naming it; so does an unreadable one.
        let pending = dir.path().join(bash_import::LEAVE_PENDING_FILE);
        std::fs::write(&pending, b"").unwrap();
        let err = StateStore::new(&path).load().unwrap_err();
        assert!(matches!(err, StateError::Import(_)), "{err}");
        assert!(
            err.to_string().contains(bash_import::LEAVE_PENDING_FILE),
            "{err}"
        );
        assert!(StateStore::new(&path).inspect().is_err());
        // Timers old and new carry over onto the observed clock (an absence at most an
        // hour); the hour's leave counts.
        let now = unix_now();
        std::fs::write(
            &pending,
            format!(
                r#"{{"absent_since":{{"{}":{}}},"recent_leaves":[{}]}}"#,
                id(2),
                now - 30 * 3600,
                now - 60
            ),
        )
        .unwrap();
        let timed = StateStore::new(&path).load().unwrap().unwrap();
        let observed = timed.absence_observed(&id(2)).unwrap();
        assert_eq!(
            observed,
            bash_import::IMPORTED_ABSENCE_MAX,
            "30 h count an hour"
        );
        assert_eq!(timed.absent[&id(2)].polls, 0);
        let ages: Vec<u64> = timed
            .recent_leaves_ms
            .iter()
            .map(|t| timed.observed_ms - t)
            .collect();
        assert!(
            ages.len() == 1 && (54_000..=66_000).contains(&ages[0]),
            "{ages:?}"
        );
        std::fs::write(&pending, b"{}").unwrap();

        // The first write is this sidecar's format; the Bash files are left as they are,
        // and no longer read.
        assert!(store.save(&state).unwrap(), "an imported state is written");
        assert!(std::fs::read_to_string(&path)
            .unwrap()
            .contains("\"version\": 4"));
        assert_eq!(
            std::fs::read_to_string(dir.path().join(bash_import::ADMITTED_FILE)).unwrap(),
            admitted
        );
        std::fs::write(&pending, b"").unwrap();
        assert_eq!(StateStore::new(&path).load().unwrap(), Some(state));
    }
}
