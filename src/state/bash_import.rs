//! Import of the fleet's current (Bash) sidecar's files, read beside a state file in its
//! format (a bare JSON array of confirmed ids; docs/bash-sidecar.md describes the files).
//!
//! That sidecar keeps, in the same directory (`/mnt/data/fleet/` on the fleet's images):
//!
//! * [`ADMITTED_FILE`] (`fleet-admitted.json`): a JSON array of the ids merod admitted and
//!   has not been seen to leave, confirmed or not;
//! * [`LEAVE_PENDING_FILE`] (`fleet-leave-pending.json`):
//!   `{"absent_since": {id: epoch}, "recent_leaves": [epoch], "suspicious": bool,
//!   "deferred": [id]}`: when each withdrawn admitted id was first seen absent, and when
//!   the leaves of the last hour returned (Unix seconds).
//!
//! Reading is split from deciding: [`read_beside`] does the file I/O and nothing else
//! ([`BashFiles`], a missing file is `None`); [`parse_admitted`] and [`parse_leave_pending`]
//! take bytes; [`map_import`] is a pure function of the parsed files, the confirmed set and
//! the wall-clock time, giving the [`BashImport`] the state is built from.
//!
//! Rules (fail closed): a file that is missing is no error (the Bash sidecar seeds its
//! admitted set from the confirmed one, and so does this import); a file that is there but
//! cannot be read, is empty, is not JSON, names a key twice, has a key or a value of the wrong
//! kind, or an id that is not 64 hex digits, is an error naming the file, like a corrupt state
//! file: guessing would either forget a namespace merod holds or restart its leave timer.
//!
//! The stamps are wall-clock readings, and the wall clock at import can be wrong (an RTC
//! days ahead, NTP not synced yet at first boot), so no stamp may bring a leave closer
//! than the daemon can vouch for:
//!
//! * every stamp is read against the earlier of the wall clock now and the time
//!   `fleet-leave-pending.json` was last written (its mtime, [`BashFiles::leave_pending_written`]):
//!   the stamps and the mtime were both taken from the clock of the Bash sidecar's days, so
//!   a clock that is wrong only now cannot make an absence longer or a leave older; an
//!   unreadable mtime makes every stamp read as of now (no absence observed, every recent
//!   leave counted);
//! * an imported absence counts at most [`IMPORTED_ABSENCE_MAX`] (one hour) toward
//!   `leave_grace`: that bounds what a clock wrong in the Bash sidecar's days, or a file
//!   copied without its times, can take off the grace; the rest must be observed here.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use crate::ids::GroupId;

/// The Bash sidecar's admitted set, beside its `fleet-confirmed.json`.
pub const ADMITTED_FILE: &str = "fleet-admitted.json";
/// The Bash sidecar's leave timers and recent leaves, beside its `fleet-confirmed.json`.
pub const LEAVE_PENDING_FILE: &str = "fleet-leave-pending.json";
/// How far back the Bash sidecar counts leaves against its budget (one hour); older stamps
/// are dropped on import, as that sidecar drops them on load.
pub const RECENT_LEAVES_WINDOW: Duration = Duration::from_secs(3600);
/// The most an absence observed by the Bash sidecar counts toward `leave_grace` here (one
/// hour): the rest of the grace must be observed by this daemon, so a wrong wall clock
/// brings no leave more than this much closer.
pub const IMPORTED_ABSENCE_MAX: Duration = Duration::from_secs(3600);

/// `fleet-leave-pending.json` as written: epochs in Unix seconds.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LeavePending {
    /// When each withdrawn admitted id was first seen absent from a good poll.
    #[serde(default)]
    pub absent_since: BTreeMap<GroupId, u64>,
    /// When each leave of (about) the last hour returned.
    #[serde(default)]
    pub recent_leaves: Vec<u64>,
    /// The Bash sidecar's mass-withdrawal guard flag: read for the shape, not imported (the
    /// guard here recomputes from the next poll).
    #[serde(default)]
    pub suspicious: bool,
    /// Ids the Bash sidecar deferred for its budget: read for the shape, not imported (they
    /// keep their `absent_since` timers, which are).
    #[serde(default)]
    pub deferred: BTreeSet<GroupId>,
}

/// What [`read_beside`] found next to a Bash state file; `None` where the file is missing.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BashFiles {
    /// `fleet-admitted.json`, parsed.
    pub admitted: Option<BTreeSet<GroupId>>,
    /// `fleet-leave-pending.json`, parsed.
    pub leave_pending: Option<LeavePending>,
    /// When `fleet-leave-pending.json` was last written (its mtime, Unix seconds, on the
    /// clock of that time); `None` when it is missing or its mtime could not be read.
    pub leave_pending_written: Option<u64>,
}

/// The Bash sidecar's state as this sidecar keeps it: what the state is built from.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BashImport {
    /// Admitted ids: the confirmed set plus `fleet-admitted.json` (the confirmed set alone
    /// when that file is missing, as the Bash sidecar seeds it).
    pub admitted: BTreeSet<GroupId>,
    /// For each admitted id with a timer: how long it has already been observed absent
    /// (`min(now, written)` − `absent_since`, at most [`IMPORTED_ABSENCE_MAX`]; zero for a
    /// stamp in the future, so a clock fault never shortens the wait). Timers of ids not
    /// admitted are dropped, as the Bash sidecar does.
    pub absence_observed: BTreeMap<GroupId, Duration>,
    /// For each leave of the last hour: how long ago it returned (`min(now, written)` −
    /// the stamp), most recent first (zero for a stamp in the future: it still counts
    /// against the budget).
    pub recent_leaves_ago: Vec<Duration>,
}

/// `{"admitted": [id], "absence_observed_secs": {id: s}, "recent_leaves_ago_secs": [s]}`
/// (whole seconds), for tools reading a [`crate::StateReport`].
impl serde::Serialize for BashImport {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        let absence: BTreeMap<&GroupId, u64> = self
            .absence_observed
            .iter()
            .map(|(id, d)| (id, d.as_secs()))
            .collect();
        let ago: Vec<u64> = self
            .recent_leaves_ago
            .iter()
            .map(Duration::as_secs)
            .collect();
        let mut st = s.serialize_struct("BashImport", 3)?;
        st.serialize_field("admitted", &self.admitted)?;
        st.serialize_field("absence_observed_secs", &absence)?;
        st.serialize_field("recent_leaves_ago_secs", &ago)?;
        st.end()
    }
}

/// Why a Bash sidecar file could not be imported. Each names the file.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ImportError {
    /// The file exists but could not be read.
    #[error("cannot read the Bash sidecar's {path}: {source} (fix or move it aside; the sidecar will not guess what it held)")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The file is not in the Bash sidecar's format.
    #[error("the Bash sidecar's {path} is corrupt: {reason} (fix or move it aside; the sidecar will not guess what it held)")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
}

/// Parses `fleet-admitted.json`: a JSON array of 64-hex ids (any case; repeated ids are
/// one). `path` only names the file in errors.
///
/// Errors: [`ImportError::Corrupt`] for anything else, an empty file included.
pub fn parse_admitted(bytes: &[u8], path: &Path) -> Result<BTreeSet<GroupId>, ImportError> {
    strict(bytes, path, "a JSON array of 64-hex ids")
}

/// Parses `fleet-leave-pending.json` (keys `absent_since`, `recent_leaves`, `suspicious`,
/// `deferred`, each optional; no other key; every stamp a whole number of Unix seconds).
/// `path` only names the file in errors.
///
/// Errors: [`ImportError::Corrupt`] for anything else, an empty file included.
pub fn parse_leave_pending(bytes: &[u8], path: &Path) -> Result<LeavePending, ImportError> {
    const EXPECTED: &str =
        "an object {\"absent_since\": {id: epoch}, \"recent_leaves\": [epoch], ...}";
    // An object only: a derived reader would also take an array, in field order.
    let first = bytes.iter().find(|b| !b.is_ascii_whitespace());
    if first.is_some() && first != Some(&b'{') {
        return Err(ImportError::Corrupt {
            path: path.to_owned(),
            reason: format!("expected {EXPECTED}, found no object"),
        });
    }
    strict(bytes, path, EXPECTED)
}

/// Strict JSON (duplicate keys refused) into `T`, errors naming `path` and what was expected.
fn strict<T: serde::de::DeserializeOwned>(
    bytes: &[u8],
    path: &Path,
    expected: &str,
) -> Result<T, ImportError> {
    let corrupt = |reason: String| ImportError::Corrupt {
        path: path.to_owned(),
        reason,
    };
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Err(corrupt(format!("empty, expected {expected}")));
    }
    if let Err(e) = crate::strict_json::reject_duplicate_keys(bytes) {
        if !e.is_syntax() && !e.is_eof() {
            return Err(corrupt(format!("ambiguous: {e}")));
        }
    }
    serde_json::from_slice(bytes).map_err(|e| corrupt(format!("expected {expected}: {e}")))
}

/// One side file as read: where, its bytes, and its mtime (Unix seconds, `None` if unreadable).
struct SideFile {
    path: PathBuf,
    bytes: Vec<u8>,
    written: Option<u64>,
}

/// Reads the Bash sidecar's files in the directory of `state_file` (I/O only; the decision
/// is [`map_import`]). A missing file is `None`.
///
/// Errors: [`ImportError`] naming the first file that is there but unreadable or corrupt.
pub fn read_beside(state_file: &Path) -> Result<BashFiles, ImportError> {
    let dir = crate::durable::parent_dir(state_file);
    // The bytes and the mtime of one open file (a missing file is `None`; an mtime that
    // cannot be read is `None` in its place, so nothing is vouched for by it).
    let read = |name: &str| -> Result<Option<SideFile>, ImportError> {
        let path = dir.join(name);
        let mut file = match std::fs::File::open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(source) => return Err(ImportError::Read { path, source }),
        };
        let mut bytes = Vec::new();
        if let Err(source) = std::io::Read::read_to_end(&mut file, &mut bytes) {
            return Err(ImportError::Read { path, source });
        }
        let written = file
            .metadata()
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map(|d| d.as_secs());
        Ok(Some(SideFile {
            path,
            bytes,
            written,
        }))
    };
    let admitted = read(ADMITTED_FILE)?
        .map(|f| parse_admitted(&f.bytes, &f.path))
        .transpose()?;
    let (leave_pending, leave_pending_written) = match read(LEAVE_PENDING_FILE)? {
        Some(f) => (Some(parse_leave_pending(&f.bytes, &f.path)?), f.written),
        None => (None, None),
    };
    Ok(BashFiles {
        leave_pending_written,
        admitted,
        leave_pending,
    })
}

/// Maps the Bash sidecar's state (its confirmed set and the files beside it) into what this
/// sidecar keeps, at wall-clock time `now_unix` (Unix seconds). Every stamp is read against
/// `min(now_unix, files.leave_pending_written)` (as of now when that is unknown), and an
/// absence counts at most [`IMPORTED_ABSENCE_MAX`] (module docs: why). Pure.
pub fn map_import(confirmed: &BTreeSet<GroupId>, files: &BashFiles, now_unix: u64) -> BashImport {
    let mut admitted = confirmed.clone();
    if let Some(listed) = &files.admitted {
        admitted.extend(listed.iter().copied());
    }
    let pending = files.leave_pending.clone().unwrap_or_default();
    // How long before the vouched-for "now" a stamp was taken; nothing when the file's
    // write time is unknown (no stamp can be dated then).
    let ago = |stamp: u64| match files.leave_pending_written {
        Some(written) => now_unix.min(written).saturating_sub(stamp),
        None => 0,
    };
    let absence_observed = pending
        .absent_since
        .iter()
        .filter(|(id, _)| admitted.contains(id))
        .map(|(&id, &since)| {
            (
                id,
                Duration::from_secs(ago(since)).min(IMPORTED_ABSENCE_MAX),
            )
        })
        .collect();
    let window = RECENT_LEAVES_WINDOW.as_secs();
    let mut recent_leaves_ago: Vec<Duration> = pending
        .recent_leaves
        .iter()
        .map(|&at| ago(at))
        .filter(|&ago| ago < window)
        .map(Duration::from_secs)
        .collect();
    recent_leaves_ago.sort();
    BashImport {
        admitted,
        absence_observed,
        recent_leaves_ago,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(n: u8) -> GroupId {
        format!("{n:02x}").repeat(32).parse().unwrap()
    }

    const NOW: u64 = 1_800_000_000;
    const HOUR: u64 = 3600;

    /// One state directory with a bare-array state file and the given side files.
    fn dir_with(admitted: Option<&[u8]>, pending: Option<&[u8]>) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("fleet-confirmed.json"), b"[]").unwrap();
        if let Some(bytes) = admitted {
            std::fs::write(dir.path().join(ADMITTED_FILE), bytes).unwrap();
        }
        if let Some(bytes) = pending {
            std::fs::write(dir.path().join(LEAVE_PENDING_FILE), bytes).unwrap();
        }
        dir
    }

    /// Every content a side file can have here: missing, empty, JSON-empty, corrupt, sound.
    #[derive(Clone, Copy, Debug)]
    enum Content {
        Missing,
        ZeroBytes,
        JsonEmpty,
        Corrupt,
        Sound,
    }
    const CONTENTS: [Content; 5] = [
        Content::Missing,
        Content::ZeroBytes,
        Content::JsonEmpty,
        Content::Corrupt,
        Content::Sound,
    ];

    /// What `c` is in the admitted file (`[0]`) and in the leave-pending file (`[1]`);
    /// `None` for a missing file.
    fn file_bytes(c: Content) -> Option<[Vec<u8>; 2]> {
        let sound = [
            format!("[\"{}\",\"{}\"]\n", id(1), id(2)),
            format!(
                r#"{{"absent_since":{{"{}":{}}},"recent_leaves":[{}],"suspicious":false,"deferred":[]}}"#,
                id(2),
                NOW - 30 * HOUR,
                NOW - 60
            ),
        ];
        let [admitted, pending]: [&[u8]; 2] = match c {
            Content::Missing => return None,
            Content::ZeroBytes => [b"", b""],
            Content::JsonEmpty => [b"[]\n", b"{}"],
            Content::Corrupt => [b"[\"11\", ", b"{\"absent_since\": [1]}"],
            Content::Sound => [sound[0].as_bytes(), sound[1].as_bytes()],
        };
        Some([admitted.to_vec(), pending.to_vec()])
    }

    #[test]
    fn every_combination_of_the_two_files() {
        let confirmed: BTreeSet<GroupId> = [id(1)].into();
        for a in CONTENTS {
            for p in CONTENTS {
                let admitted = file_bytes(a).map(|[bytes, _]| bytes);
                let pending = file_bytes(p).map(|[_, bytes]| bytes);
                let dir = dir_with(admitted.as_deref(), pending.as_deref());
                let got = read_beside(&dir.path().join("fleet-confirmed.json"));
                let broken = |c: Content| matches!(c, Content::ZeroBytes | Content::Corrupt);
                if broken(a) || broken(p) {
                    let err = got.expect_err(&format!("{a:?} {p:?}")).to_string();
                    let named = if broken(a) {
                        ADMITTED_FILE
                    } else {
                        LEAVE_PENDING_FILE
                    };
                    assert!(err.contains(named), "{a:?} {p:?}: {err}");
                    assert!(err.contains("corrupt"), "{err}");
                    continue;
                }
                let mut files = got.unwrap_or_else(|e| panic!("{a:?} {p:?}: {e}"));
                assert_eq!(
                    files.leave_pending_written.is_some(),
                    files.leave_pending.is_some(),
                    "{a:?} {p:?}: the write time read with the file"
                );
                // Dated as if written at NOW (the stamps are relative to it).
                files.leave_pending_written = files.leave_pending_written.map(|_| NOW);
                let import = map_import(&confirmed, &files, NOW);
                let want_admitted: BTreeSet<GroupId> = match a {
                    Content::Sound => [id(1), id(2)].into(),
                    _ => confirmed.clone(),
                };
                assert_eq!(import.admitted, want_admitted, "{a:?} {p:?}");
                let timer = matches!((a, p), (Content::Sound, Content::Sound));
                assert_eq!(
                    import.absence_observed,
                    if timer {
                        [(id(2), IMPORTED_ABSENCE_MAX)].into()
                    } else {
                        BTreeMap::new()
                    },
                    "{a:?} {p:?}: a timer only for an admitted id"
                );
                assert_eq!(
                    import.recent_leaves_ago,
                    if matches!(p, Content::Sound) {
                        vec![Duration::from_secs(60)]
                    } else {
                        Vec::new()
                    },
                    "{a:?} {p:?}"
                );
            }
        }
    }

    #[test]
    fn timers_old_and_new_carry_their_observed_absence() {
        let files = BashFiles {
            admitted: Some([id(1), id(2), id(3), id(4)].into()),
            leave_pending: Some(LeavePending {
                absent_since: [
                    (id(1), NOW - 30 * HOUR), // old: counts one hour
                    (id(2), NOW - 60),        // new: a minute ago
                    (id(3), NOW),             // this very second
                    (id(4), NOW + 10 * HOUR), // clock was ahead: nothing observed
                    (id(5), NOW - 40 * HOUR), // not admitted: dropped
                ]
                .into(),
                recent_leaves: vec![NOW - HOUR, NOW - HOUR + 1, NOW - 5, NOW + 100, 0],
                suspicious: true,
                deferred: [id(1)].into(),
            }),
            leave_pending_written: Some(NOW),
        };
        let import = map_import(&BTreeSet::new(), &files, NOW);
        assert_eq!(
            import.absence_observed,
            [
                // 30 h under the Bash sidecar count one hour here.
                (id(1), IMPORTED_ABSENCE_MAX),
                (id(2), Duration::from_secs(60)),
                (id(3), Duration::ZERO),
                (id(4), Duration::ZERO),
            ]
            .into()
        );
        let json = serde_json::to_value(&import).unwrap();
        assert_eq!(json["absence_observed_secs"][id(1).to_string()], HOUR);
        assert_eq!(
            json["recent_leaves_ago_secs"],
            serde_json::json!([0, 5, HOUR - 1])
        );
        // The hour's leaves, most recent first; a stamp an hour old or more is out of the
        // budget, one in the future still counts.
        assert_eq!(
            import.recent_leaves_ago,
            vec![
                Duration::ZERO,
                Duration::from_secs(5),
                Duration::from_secs(HOUR - 1)
            ]
        );
    }

    #[test]
    fn a_wall_clock_before_every_stamp_observes_nothing() {
        let files = BashFiles {
            admitted: Some([id(1)].into()),
            leave_pending: Some(LeavePending {
                absent_since: [(id(1), NOW)].into(),
                recent_leaves: vec![NOW],
                ..LeavePending::default()
            }),
            leave_pending_written: Some(NOW),
        };
        let import = map_import(&BTreeSet::new(), &files, 0);
        assert_eq!(import.absence_observed, [(id(1), Duration::ZERO)].into());
        assert_eq!(import.recent_leaves_ago, vec![Duration::ZERO]);
    }

    /// The first start after a switch, with the wall clock two days ahead (a wrong RTC, NTP
    /// not synced yet): the stamps are read against the file's last write, so the absence
    /// is the minute the Bash sidecar saw, not two days, and a leave of five seconds before
    /// that write still counts against the hour's budget.
    #[test]
    fn a_wall_clock_ahead_of_the_files_last_write_adds_nothing() {
        let files = BashFiles {
            admitted: Some([id(1)].into()),
            leave_pending: Some(LeavePending {
                absent_since: [(id(1), NOW - 60)].into(),
                recent_leaves: vec![NOW - 5],
                ..LeavePending::default()
            }),
            leave_pending_written: Some(NOW),
        };
        for now in [NOW, NOW + 10, NOW + 2 * 24 * HOUR, u64::MAX] {
            let import = map_import(&BTreeSet::new(), &files, now);
            assert_eq!(
                import.absence_observed,
                [(id(1), Duration::from_secs(60))].into(),
                "now {now}"
            );
            assert_eq!(
                import.recent_leaves_ago,
                vec![Duration::from_secs(5)],
                "now {now}"
            );
        }
        // A wall clock behind the write dates the stamps by itself (only shorter).
        let import = map_import(&BTreeSet::new(), &files, NOW - 30);
        assert_eq!(
            import.absence_observed,
            [(id(1), Duration::from_secs(30))].into()
        );
    }

    /// A file whose write time cannot be read vouches for no absence, and every leave in
    /// it counts as just returned.
    #[test]
    fn an_unknown_write_time_dates_every_stamp_as_now() {
        let files = BashFiles {
            admitted: Some([id(1)].into()),
            leave_pending: Some(LeavePending {
                absent_since: [(id(1), NOW - 30 * HOUR)].into(),
                recent_leaves: vec![NOW - 50 * HOUR],
                ..LeavePending::default()
            }),
            leave_pending_written: None,
        };
        let import = map_import(&BTreeSet::new(), &files, NOW);
        assert_eq!(import.absence_observed, [(id(1), Duration::ZERO)].into());
        assert_eq!(import.recent_leaves_ago, vec![Duration::ZERO]);
    }

    #[test]
    fn the_files_as_the_bash_sidecar_writes_them() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/bash-sidecar");
        let files = read_beside(&dir.join("fleet-confirmed.json")).unwrap();
        let admitted = files.admitted.clone().unwrap();
        assert_eq!(admitted.len(), 3);
        let pending = files.leave_pending.clone().unwrap();
        assert_eq!(pending.absent_since.len(), 2);
        assert_eq!(pending.recent_leaves.len(), 2);
        assert!(pending.deferred.is_empty());
        // Mixed-case ids read as the same namespace.
        assert!(pending.absent_since.keys().all(|id| admitted.contains(id)));
    }

    #[test]
    fn corrupt_shapes_are_refused_with_the_reason() {
        let p = Path::new("/mnt/data/fleet/fleet-leave-pending.json");
        let a = id(1);
        for (bytes, want) in [
            (String::new(), "empty"),
            ("  \n".to_owned(), "empty"),
            ("null".to_owned(), "expected an object"),
            ("[]".to_owned(), "expected an object"),
            ("[{}, [], false, []]".to_owned(), "found no object"),
            (r#"{"absent_since":{"abcd":1}}"#.to_owned(), "64 hex"),
            (format!(r#"{{"absent_since":{{"{a}":"1"}}}}"#), "expected"),
            (format!(r#"{{"absent_since":{{"{a}":1.5}}}}"#), "expected"),
            (format!(r#"{{"absent_since":{{"{a}":-1}}}}"#), "expected"),
            (r#"{"recent_leaves":[1,"x"]}"#.to_owned(), "expected"),
            (r#"{"suspicious":"no"}"#.to_owned(), "expected"),
            (r#"{"other":1}"#.to_owned(), "unknown field"),
            (
                format!(r#"{{"absent_since":{{"{a}":1,"{a}":2}}}}"#),
                "duplicate key",
            ),
            (
                r#"{"recent_leaves":[],"recent_leaves":[1]}"#.to_owned(),
                "duplicate key",
            ),
        ] {
            let err = parse_leave_pending(bytes.as_bytes(), p)
                .unwrap_err()
                .to_string();
            assert!(err.contains("fleet-leave-pending.json"), "{err}");
            assert!(err.contains(want), "{bytes}: {err}");
        }
        let p = Path::new("fleet-admitted.json");
        for (bytes, want) in [
            ("", "empty"),
            ("{}", "expected a JSON array"),
            ("[\"abcd\"]", "64 hex"),
            ("[1]", "expected a JSON array"),
            ("[", "expected a JSON array"),
        ] {
            let err = parse_admitted(bytes.as_bytes(), p).unwrap_err().to_string();
            assert!(
                err.contains("fleet-admitted.json") && err.contains(want),
                "{bytes}: {err}"
            );
        }
        // Sound forms: every key optional, ids in any case, repeats are one.
        let upper = a.to_string().to_uppercase();
        assert_eq!(
            parse_admitted(format!("[\"{upper}\",\"{a}\"]").as_bytes(), p).unwrap(),
            [a].into()
        );
        assert_eq!(
            parse_leave_pending(b"{}", p).unwrap(),
            LeavePending::default()
        );
    }

    #[test]
    fn an_unreadable_file_is_an_error_naming_it() {
        let dir = dir_with(None, None);
        std::fs::create_dir(dir.path().join(LEAVE_PENDING_FILE)).unwrap();
        let err = read_beside(&dir.path().join("fleet-confirmed.json")).unwrap_err();
        assert!(matches!(err, ImportError::Read { .. }), "{err}");
        assert!(err.to_string().contains(LEAVE_PENDING_FILE), "{err}");
    }
}
