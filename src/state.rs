//! The persisted state: which namespaces merod admitted, which of those MDMA acknowledged
//! (confirmed), which a fleet-join was sent for without its admission recorded yet
//! (joining), and how many successful polls each withdrawn one has been absent from.
//!
//! File: `/var/lib/calimero/fleet-confirmed.json` by default. A versioned JSON document:
//!
//! ```json
//! {"version": 3,
//!  "admitted":  ["<64 hex>", ...],
//!  "confirmed": ["<64 hex>", ...],
//!  "joining":   ["<64 hex>", ...],
//!  "absent_polls": {"<64 hex>": 1}}
//! ```
//!
//! Also read (never written): version 2 (the same without `joining`), version 1,
//! `{"version": 1, "confirmed": [...]}`, and a bare JSON array of ids (the Bash sidecar's
//! confirmed set); the last two load with `admitted = confirmed`.
//!
//! Writes are atomic — temp file in the same directory, fsync, rename, fsync the directory —
//! and happen only when the document changed. A missing file is a first start (empty
//! state); an unreadable or corrupt one is an error that names the file: it never turns
//! into an empty set, because that would silently stop every future leave.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::ids::GroupId;

/// The version [`StateStore::save`] writes.
pub const STATE_VERSION: u32 = 3;

/// The sets the reconciler keeps between cycles and across restarts.
///
/// Invariants (restored on load): `confirmed ⊆ admitted`, `joining` and `admitted` are
/// disjoint, and every key of `absent_polls` is in `admitted` or `joining`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct State {
    /// Namespaces merod admitted (`admitted: true`, verified) and has not been seen to leave.
    pub admitted: BTreeSet<GroupId>,
    /// Admitted namespaces whose admission MDMA acknowledged (`/api/fleet/confirm` 2xx).
    pub confirmed: BTreeSet<GroupId>,
    /// Namespaces a fleet-join was sent for (recorded before it is sent) whose admission is
    /// not recorded: merod may hold them (a crash, or a join that timed out here but went
    /// through there), so a withdrawn one is left like an admitted one. An admission moves
    /// the id to `admitted`; a leave (merod holding nothing counts) drops it.
    #[serde(default)]
    pub joining: BTreeSet<GroupId>,
    /// For admitted or joining namespaces missing from the latest successful polls: how
    /// many consecutive successful polls they have been absent from.
    #[serde(default)]
    pub absent_polls: BTreeMap<GroupId, u32>,
}

impl State {
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
            self.absent_polls
                .keys()
                .filter(|id| !held(id))
                .map(|&id| Repair::AbsentNotAdmitted(id)),
        );
        self.absent_polls.retain(|id, _| held(id));
        repairs
    }
}

/// Which document format a state file holds.
///
/// `Display` and `Serialize` (a JSON string): `bare-array`, `v1`, `v2`, `v3`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum StateFormat {
    /// A bare JSON array of 64-hex ids: the Bash sidecar's confirmed set.
    BareArray,
    /// `{"version": 1, "confirmed": [...]}`.
    V1,
    /// `{"version": 2, "admitted": [...], "confirmed": [...], "absent_polls": {...}}`.
    V2,
    /// Version 2 plus `"joining": [...]`: what [`StateStore::save`] writes.
    V3,
}

impl StateFormat {
    /// The name `Display` and `Serialize` give: `bare-array`, `v1`, `v2`, `v3`.
    pub fn as_str(self) -> &'static str {
        match self {
            StateFormat::BareArray => "bare-array",
            StateFormat::V1 => "v1",
            StateFormat::V2 => "v2",
            StateFormat::V3 => "v3",
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
/// `{"kind": "confirmed-not-admitted" | "absent-not-admitted" | "joining-admitted",
/// "group_id": "<64 lowercase hex>", "text": "<the Display sentence>"}`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Repair {
    /// Listed as confirmed but not as admitted (a v2 document only: the older formats have
    /// no admitted set). Must never happen; loading adds it to `admitted`, so the namespace
    /// stays protected from a leave that only `admitted` would allow.
    ConfirmedNotAdmitted(GroupId),
    /// An `absent_polls` count for a namespace neither admitted nor joining; loading drops
    /// the count.
    AbsentNotAdmitted(GroupId),
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
        }
    }

    /// The namespace the repair is about.
    pub fn group_id(&self) -> GroupId {
        match self {
            Repair::ConfirmedNotAdmitted(id)
            | Repair::AbsentNotAdmitted(id)
            | Repair::JoiningAdmitted(id) => *id,
        }
    }
}

impl Serialize for Repair {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        #[derive(Serialize)]
        struct Out {
            kind: &'static str,
            group_id: GroupId,
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
                    "{id} has an absent_polls count but is neither admitted nor joining: dropped"
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
/// let report = fleet_sidecar::inspect_state(text, std::path::Path::new("state.json")).unwrap();
/// assert_eq!(serde_json::to_value(&report).unwrap()["format"], "v1");
/// assert!(report.to_string().starts_with("format v1\n"));
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct StateReport {
    /// The document's format.
    pub format: StateFormat,
    /// The sets exactly as the file holds them. The bare and v1 formats hold no
    /// `admitted` set (it is empty here) and no `absent_polls`.
    pub on_disk: State,
    /// What the daemon runs on: the bare and v1 formats read with `admitted = confirmed`,
    /// then [`StateReport::repairs`] applied.
    pub state: State,
    /// What loading changed to restore the invariants (empty for a sound file).
    pub repairs: Vec<Repair>,
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
            s.absent_polls.len()
        )?;
        for repair in &self.repairs {
            writeln!(f, "repaired on load: {repair}")?;
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

/// Version 2: no `joining` set.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct V2 {
    admitted: BTreeSet<GroupId>,
    confirmed: BTreeSet<GroupId>,
    #[serde(default)]
    absent_polls: BTreeMap<GroupId, u32>,
}

/// Version 1: the confirmed set only (the reference's semantics).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct V1 {
    confirmed: BTreeSet<GroupId>,
}

/// Why the state file could not be used. Each names the file.
#[derive(Debug, thiserror::Error)]
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
    #[error("state file {path} has version {version}, this sidecar reads versions 1 to 3")]
    UnsupportedVersion {
        /// The state file.
        path: PathBuf,
        /// The version found.
        version: u64,
    },
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

impl StateError {
    /// A key that stays the same while the same fault repeats (variant, step, OS error),
    /// unlike the message, which may name a random temp file: for logging a fault once.
    pub fn stable_key(&self) -> String {
        match self {
            StateError::Read { source, .. } => format!("read:{:?}", source.kind()),
            StateError::Corrupt { reason, .. } => format!("corrupt:{reason}"),
            StateError::UnsupportedVersion { version, .. } => format!("version:{version}"),
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
    })
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
        return Ok((StateFormat::V3, state));
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
    match version {
        1 => {
            let v1: V1 = serde_json::from_value(value).map_err(|e| corrupt(e.to_string()))?;
            Ok((
                StateFormat::V1,
                State {
                    confirmed: v1.confirmed,
                    ..State::default()
                },
            ))
        }
        2 => {
            let v2: V2 = serde_json::from_value(value).map_err(|e| corrupt(e.to_string()))?;
            Ok((
                StateFormat::V2,
                State {
                    admitted: v2.admitted,
                    confirmed: v2.confirmed,
                    joining: BTreeSet::new(),
                    absent_polls: v2.absent_polls,
                },
            ))
        }
        3 => Ok((
            StateFormat::V3,
            serde_json::from_value(value).map_err(|e| corrupt(e.to_string()))?,
        )),
        version => Err(StateError::UnsupportedVersion {
            path: path.to_owned(),
            version,
        }),
    }
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
        absent_polls: BTreeMap<GroupId, u32>,
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
        absent_polls: doc.absent_polls,
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
}

impl StateStore {
    /// A store for the file at `path` (nothing is read yet).
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self {
            path: path.into(),
            last_written: None,
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
        let report = inspect_state(&bytes, &self.path)?;
        for repair in &report.repairs {
            tracing::warn!(path = %self.path.display(), "state file repaired on load: {repair}");
        }
        // A file in an older form (or not normalized) is rewritten at the first save.
        self.last_written = renders_as(&report.state, &bytes).then(|| report.state.clone());
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
            Ok(bytes) => inspect_state(&bytes, &self.path).map(StateFile::Present),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(StateFile::Missing),
            Err(source) => Err(StateError::Read {
                path: self.path.clone(),
                source,
            }),
        }
    }

    /// Removes temp files a write interrupted by a crash or `SIGKILL` left beside the state
    /// file (`.fleet-confirmed.*.tmp`, `.fleet-confirmed.*.probe`); the state file itself is
    /// never touched (writes are atomic renames). Run at start, before any write. Returns
    /// how many were removed; a directory that cannot be listed counts as none.
    pub fn remove_stale_temp_files(&self) -> usize {
        let Ok(entries) = std::fs::read_dir(parent_dir(&self.path)) else {
            return 0;
        };
        entries
            .filter_map(Result::ok)
            .filter(|e| {
                let name = e.file_name();
                let name = name.to_string_lossy();
                name.starts_with(".fleet-confirmed.")
                    && (name.ends_with(".tmp") || name.ends_with(".probe"))
            })
            .filter(|e| std::fs::remove_file(e.path()).is_ok())
            .count()
    }

    /// Checks that the state can be written: the directory exists (it is created if
    /// missing) and a file can be created in it. Run before anything is joined, so a
    /// read-only or wrong `state_file` stops the daemon instead of admissions that can never
    /// be recorded.
    ///
    /// Errors: [`StateError::Write`] naming the failed step.
    pub fn check_writable(&self) -> Result<(), StateError> {
        let err = |step: &'static str| {
            move |source: std::io::Error| StateError::Write {
                path: self.path.clone(),
                step,
                source,
            }
        };
        let dir = parent_dir(&self.path);
        std::fs::create_dir_all(dir).map_err(err("create directory"))?;
        tempfile::Builder::new()
            .prefix(".fleet-confirmed.")
            .suffix(".probe")
            .tempfile_in(dir)
            .map(drop)
            .map_err(err("create a file in the directory"))
    }

    /// Forgets what was last written, so the next [`StateStore::save`] writes even an
    /// unchanged document (used to retry after a failed write).
    pub fn forget_written(&mut self) {
        self.last_written = None;
    }

    /// Whether the file holds `state` as far as this store knows (it loaded or last wrote
    /// it, and [`StateStore::forget_written`] was not called since): [`StateStore::save`]
    /// would then write nothing.
    pub fn is_saved(&self, state: &State) -> bool {
        self.last_written.as_ref() == Some(state)
    }

    /// Writes `state` if its document differs from what the file holds; returns whether it
    /// wrote. Atomic: a crash at any point leaves either the old or the new document.
    ///
    /// Errors: [`StateError::Write`] naming the failed step; the old file is then intact.
    pub fn save(&mut self, state: &State) -> Result<bool, StateError> {
        if self.is_saved(state) {
            return Ok(false);
        }
        write_atomically(&self.path, &render_state(state))?;
        match &mut self.last_written {
            Some(last) => last.clone_from(state),
            None => self.last_written = Some(state.clone()),
        }
        Ok(true)
    }
}

fn write_atomically(path: &Path, bytes: &[u8]) -> Result<(), StateError> {
    let err = |step: &'static str| {
        move |source: std::io::Error| StateError::Write {
            path: path.to_owned(),
            step,
            source,
        }
    };
    let dir = parent_dir(path);
    std::fs::create_dir_all(dir).map_err(err("create directory"))?;
    let mut tmp = tempfile::Builder::new()
        .prefix(".fleet-confirmed.")
        .suffix(".tmp")
        .tempfile_in(dir)
        .map_err(err("create temp file"))?;
    tmp.write_all(bytes).map_err(err("write temp file"))?;
    set_readable(tmp.as_file()).map_err(err("chmod temp file"))?;
    tmp.as_file().sync_all().map_err(err("fsync temp file"))?;
    tmp.persist(path).map_err(|e| err("rename")(e.error))?;
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(err("fsync directory"))?;
    Ok(())
}

/// The directory a state file lives in (`.` for a bare file name).
fn parent_dir(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

/// The state holds no secret: make it readable (0644) for `fleet-sidecar status` and
/// operators, as the Bash sidecar's file was.
fn set_readable(file: &std::fs::File) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    file.set_permissions(std::fs::Permissions::from_mode(0o644))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(n: u8) -> GroupId {
        GroupId::from_bytes([n; 32])
    }

    fn sample() -> State {
        State {
            admitted: [id(1), id(2), id(3)].into(),
            confirmed: [id(1), id(2)].into(),
            joining: [id(4)].into(),
            absent_polls: [(id(3), 2), (id(4), 1)].into(),
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
        for (doc, loads) in [
            (format!(r#"{{"version":1,"confirmed":{c}}}"#), true),
            (c.clone(), true),
            (
                format!(r#"{{"version":2,"admitted":{a},"confirmed":{c}}}"#),
                true,
            ),
            (
                format!(r#"{{"version":2,"admitted":{a},"confirmed":{c},"joining":[]}}"#),
                false,
            ),
            (
                format!(r#"{{"version":4,"admitted":{a},"confirmed":{c}}}"#),
                false,
            ),
            (
                format!(r#"{{"version":3,"admitted":{a},"confirmed":{c},"x":1}}"#),
                false,
            ),
            (
                format!(r#"{{"version":2.0,"admitted":{a},"confirmed":{c}}}"#),
                false,
            ),
            (
                format!(r#"{{"version":2,"admitted":{a},"confirmed":{c},"x":1}}"#),
                false,
            ),
            (format!(r#"{{"version":2,"admitted":{a}}}"#), false),
            // A derived reader would take this array in field order: it is no state file.
            (format!(r#"[2,{a},{c}]"#), false),
        ] {
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
            joining: BTreeSet::new(),
            absent_polls: [(id(2), 1)].into(),
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
        assert!(text.contains("\"version\": 3"), "{text}");
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
                joining: BTreeSet::new(),
                absent_polls: BTreeMap::new(),
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
            joining: BTreeSet::new(),
            absent_polls: BTreeMap::new(),
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
        assert!(s.absent_polls.is_empty(), "counts only for admitted ids");

        // The report keeps what the file said and names each repair.
        let report = inspect_state(text.as_bytes(), Path::new("s")).unwrap();
        assert_eq!(report.format, StateFormat::V2);
        assert!(report.on_disk.admitted.is_empty());
        assert_eq!(report.on_disk.confirmed, [id(1)].into());
        assert_eq!(report.on_disk.absent_polls.get(&id(2)), Some(&2));
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
        assert_eq!(report.state.absent_polls.get(&id(3)), Some(&1));
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
            absent_polls: [(id(2), 1), (id(3), 1)].into(),
        };
        writer.save(&sound).unwrap();
        let StateFile::Present(report) = store.inspect().unwrap() else {
            panic!("a present file")
        };
        assert_eq!(report.format, StateFormat::V3);
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
            joining: BTreeSet::new(),
            absent_polls: [(id(2), 1)].into(),
            ..sound
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
                r#"v3 "v3""#
            ]
        );
    }
}
