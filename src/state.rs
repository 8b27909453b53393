//! The persisted state: which namespaces merod admitted, which of those MDMA acknowledged
//! (confirmed), and how many successful polls each withdrawn one has been absent from.
//!
//! File: `/var/lib/calimero/fleet-confirmed.json` by default. A versioned JSON document:
//!
//! ```json
//! {"version": 2,
//!  "admitted":  ["<64 hex>", ...],
//!  "confirmed": ["<64 hex>", ...],
//!  "absent_polls": {"<64 hex>": 1}}
//! ```
//!
//! Also read (never written): version 1, `{"version": 1, "confirmed": [...]}`, and a bare JSON
//! array of ids (the Bash sidecar's confirmed set); both load with `admitted = confirmed`.
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
pub const STATE_VERSION: u32 = 2;

/// The sets the reconciler keeps between cycles and across restarts.
///
/// Invariants (restored on load): `confirmed ⊆ admitted`, and every key of `absent_polls`
/// is in `admitted`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct State {
    /// Namespaces merod admitted (`admitted: true`, verified) and has not been seen to leave.
    pub admitted: BTreeSet<GroupId>,
    /// Admitted namespaces whose admission MDMA acknowledged (`/api/fleet/confirm` 2xx).
    pub confirmed: BTreeSet<GroupId>,
    /// For admitted namespaces missing from the latest successful polls: how many
    /// consecutive successful polls they have been absent from.
    #[serde(default)]
    pub absent_polls: BTreeMap<GroupId, u32>,
}

impl State {
    fn normalize(mut self) -> Self {
        self.admitted.extend(self.confirmed.iter().copied());
        let admitted = &self.admitted;
        self.absent_polls.retain(|id, _| admitted.contains(id));
        self
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
    #[error("state file {path} has version {version}, this sidecar reads versions 1 and 2")]
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

/// Parses a state document (any supported version).
///
/// Errors: [`StateError::Corrupt`], [`StateError::UnsupportedVersion`]; `path` only names
/// the file in them.
pub fn parse_state(bytes: &[u8], path: &Path) -> Result<State, StateError> {
    let corrupt = |reason: String| StateError::Corrupt {
        path: path.to_owned(),
        reason,
    };
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
            return Ok(State {
                admitted: confirmed.clone(),
                confirmed,
                absent_polls: BTreeMap::new(),
            })
        }
        DocumentIn::Versioned(map) => map,
    };
    let version = map
        .remove("version")
        .ok_or_else(|| corrupt("no \"version\" key".to_owned()))?
        .as_u64()
        .ok_or_else(|| corrupt("\"version\" is not a whole number".to_owned()))?;
    let value = serde_json::Value::Object(map);
    let state = match version {
        1 => {
            let v1: V1 = serde_json::from_value(value).map_err(|e| corrupt(e.to_string()))?;
            State {
                admitted: v1.confirmed.clone(),
                confirmed: v1.confirmed,
                absent_polls: BTreeMap::new(),
            }
        }
        2 => serde_json::from_value(value).map_err(|e| corrupt(e.to_string()))?,
        version => {
            return Err(StateError::UnsupportedVersion {
                path: path.to_owned(),
                version,
            })
        }
    };
    Ok(state.normalize())
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
        let state = parse_state(&bytes, &self.path)?;
        // A file in an older form (or not normalized) is rewritten at the first save.
        self.last_written = (render_state(&state) == bytes).then(|| state.clone());
        Ok(Some(state))
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

    /// Writes `state` if its document differs from what the file holds; returns whether it
    /// wrote. Atomic: a crash at any point leaves either the old or the new document.
    ///
    /// Errors: [`StateError::Write`] naming the failed step; the old file is then intact.
    pub fn save(&mut self, state: &State) -> Result<bool, StateError> {
        if self.last_written.as_ref() == Some(state) {
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

    #[test]
    fn round_trip_and_write_only_on_change() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state").join("fleet-confirmed.json");
        let mut store = StateStore::new(&path);
        assert_eq!(store.load().unwrap(), None);
        let state = State {
            admitted: [id(1), id(2)].into(),
            confirmed: [id(1)].into(),
            absent_polls: [(id(2), 1)].into(),
        };
        assert!(store.save(&state).unwrap());
        assert!(
            !store.save(&state).unwrap(),
            "unchanged state is not rewritten"
        );
        let mut again = StateStore::new(&path);
        assert_eq!(again.load().unwrap(), Some(state.clone()));
        assert!(
            !again.save(&state).unwrap(),
            "a loaded file counts as written"
        );
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.contains("\"version\": 2"), "{text}");
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
}
