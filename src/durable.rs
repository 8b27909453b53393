//! Durable file writes, the one way this crate writes a file it must not lose or half-write
//! (the state file, the join-status file, the fleet token and its registration record):
//! [`write_atomically`] writes a temp file in the target's directory, fsyncs it, renames it
//! over the target and fsyncs the directory, so a crash at any point leaves the old document
//! or the new one, never a mix.
//!
//! Every temp file it creates is named [`TEMP_PREFIX`]`…`, whatever it writes, so one
//! start-up sweep ([`remove_stale_temp_files`]) finds what a crash left in a directory: a
//! crash during the token write then leaves no copy of the token behind for good.
//!
//! A record that changes a little at a time keeps its changes in a [`Journal`] beside it
//! (lines appended, fsynced once a batch) and is written whole only now and then.
//!
//! [`read_capped`] is the matching read of a node file the daemon only looks at: bounded in
//! size, never blocked on a FIFO.

use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// The name every temp file of [`write_atomically`] and [`check_writable`] starts with.
pub(crate) const TEMP_PREFIX: &str = ".fleet-tmp.";

/// Temp-file names older releases used, `(prefix, suffix)`: swept too, so an upgrade after a
/// crash removes what the old binary left (`.fleet-token-*` may hold a token).
const LEGACY_TEMP_NAMES: [(&str, &str); 3] = [
    (".fleet-confirmed.", ".tmp"),
    (".fleet-confirmed.", ".probe"),
    (".fleet-token-", ""),
];

/// A durable write (or a writability probe) failed; the target, if it existed, is intact.
#[derive(Debug, thiserror::Error)]
#[error("cannot write {path} ({step}): {source}")]
pub(crate) struct WriteError {
    /// The file being written (or the directory being probed).
    pub(crate) path: PathBuf,
    /// The step that failed: `create directory`, `create temp file`, `write temp file`,
    /// `chmod temp file`, `fsync temp file`, `rename`, `fsync directory`.
    pub(crate) step: &'static str,
    /// The I/O error.
    #[source]
    pub(crate) source: std::io::Error,
}

/// Writes `bytes` to `path` atomically with permissions `mode` (e.g. `0o600` for a secret,
/// `0o644` for a document operators read): a temp file in the same directory, fsync, rename,
/// fsync of the directory. A missing directory is created with its parents, `0700` when
/// `mode` gives group and others nothing, else with the process's default. Blocks: run it
/// on the blocking pool from async code.
///
/// Errors: [`WriteError`] naming the failed step; the old file is then intact (a temp file
/// may be left only by a crash, and [`remove_stale_temp_files`] removes it).
pub(crate) fn write_atomically(path: &Path, bytes: &[u8], mode: u32) -> Result<(), WriteError> {
    let mut tmp = temp_file_beside(path, mode)?;
    tmp.write_all(bytes)
        .map_err(failed(path, "write temp file"))?;
    tmp.as_file()
        .set_permissions(std::fs::Permissions::from_mode(mode))
        .map_err(failed(path, "chmod temp file"))?;
    tmp.as_file()
        .sync_all()
        .map_err(failed(path, "fsync temp file"))?;
    tmp.persist(path)
        .map_err(|e| failed(path, "rename")(e.error))?;
    std::fs::File::open(parent_dir(path))
        .and_then(|d| d.sync_all())
        .map_err(failed(path, "fsync directory"))?;
    Ok(())
}

/// An append-only file of lines beside a record written whole with [`write_atomically`]:
/// each change since the record was last written is one line, so what a change costs on
/// disk is its own size, not the record's. Lines are appended as they come; [`Journal::sync`]
/// makes what was appended durable (one fsync, whatever the number of lines). The owner
/// writes the record whole now and then and [`Journal::clear`]s the journal after it.
/// Blocks: run it on the blocking pool from async code.
#[cfg(feature = "daemon")] // the recovery job's alone: a tool's build leaves it out
#[derive(Debug)]
pub(crate) struct Journal {
    path: PathBuf,
    file: std::fs::File,
    len: u64,
}

#[cfg(feature = "daemon")]
impl Journal {
    /// Opens `path` for appending, created with `mode` (its directory as
    /// [`write_atomically`] creates one) and made durable in its directory when new.
    ///
    /// Errors: [`WriteError`] naming `path` and the failed step.
    pub(crate) fn open(path: &Path, mode: u32) -> Result<Self, WriteError> {
        use std::os::unix::fs::OpenOptionsExt;
        let existed = path.exists();
        if !existed {
            // The directory, as a record's write would make it.
            drop(temp_file_beside(path, mode)?);
        }
        let file = std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .mode(mode)
            .open(path)
            .map_err(failed(path, "open journal"))?;
        if !existed {
            std::fs::File::open(parent_dir(path))
                .and_then(|d| d.sync_all())
                .map_err(failed(path, "fsync directory"))?;
        }
        let len = file.metadata().map_err(failed(path, "stat journal"))?.len();
        Ok(Self {
            path: path.to_owned(),
            file,
            len,
        })
    }

    /// Appends `line` and a newline (not yet durable: see [`Journal::sync`]).
    ///
    /// Errors: [`WriteError`] naming the journal.
    pub(crate) fn append(&mut self, line: &[u8]) -> Result<(), WriteError> {
        let mut bytes = Vec::with_capacity(line.len() + 1);
        bytes.extend_from_slice(line);
        bytes.push(b'\n');
        self.file
            .write_all(&bytes)
            .map_err(failed(&self.path, "append to journal"))?;
        self.len += bytes.len() as u64;
        Ok(())
    }

    /// Makes every line appended so far durable (fdatasync).
    ///
    /// Errors: [`WriteError`] naming the journal.
    pub(crate) fn sync(&mut self) -> Result<(), WriteError> {
        self.file
            .sync_data()
            .map_err(failed(&self.path, "fsync journal"))
    }

    /// Empties the journal, durably: call it once the record holding its lines is written.
    ///
    /// Errors: [`WriteError`] naming the journal.
    pub(crate) fn clear(&mut self) -> Result<(), WriteError> {
        self.file
            .set_len(0)
            .map_err(failed(&self.path, "truncate journal"))?;
        self.len = 0;
        self.sync()
    }

    /// Bytes in the journal.
    pub(crate) fn len(&self) -> u64 {
        self.len
    }
}

/// Checks that [`write_atomically`] can write beside `path`: its directory exists (created
/// as [`write_atomically`] would, for `mode`) and a file can be created in it (a temp file,
/// removed at once).
///
/// Errors: [`WriteError`] naming `path` and the failed step.
pub(crate) fn check_writable(path: &Path, mode: u32) -> Result<(), WriteError> {
    temp_file_beside(path, mode).map(drop)
}

/// A new temp file ([`TEMP_PREFIX`], mode 0600, removed when dropped) in `path`'s directory,
/// the directory created first if missing (`0700` for a private `mode`).
fn temp_file_beside(path: &Path, mode: u32) -> Result<tempfile::NamedTempFile, WriteError> {
    let dir = parent_dir(path);
    if !dir.is_dir() {
        let mut builder = std::fs::DirBuilder::new();
        builder.recursive(true);
        if mode & 0o077 == 0 {
            builder.mode(0o700);
        }
        builder
            .create(dir)
            .map_err(failed(path, "create directory"))?;
    }
    tempfile::Builder::new()
        .prefix(TEMP_PREFIX)
        .tempfile_in(dir)
        .map_err(failed(path, "create temp file"))
}

/// The [`WriteError`] of `step` on `path`, for `map_err`.
fn failed<'a>(
    path: &'a Path,
    step: &'static str,
) -> impl FnOnce(std::io::Error) -> WriteError + 'a {
    move |source| WriteError {
        path: path.to_owned(),
        step,
        source,
    }
}

/// Removes the temp files a write interrupted by a crash or `SIGKILL` left in `dir` (this
/// release's [`TEMP_PREFIX`] and the names older releases used); no other file is touched.
/// Run at start, before anything writes there. Returns how many were removed; a directory
/// that cannot be listed counts as none.
pub(crate) fn remove_stale_temp_files(dir: &Path) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .filter_map(Result::ok)
        .filter(|e| is_temp_name(&e.file_name().to_string_lossy()))
        .filter(|e| e.file_type().is_ok_and(|t| t.is_file()))
        .filter(|e| std::fs::remove_file(e.path()).is_ok())
        .count()
}

/// Whether `name` is one of the temp files this crate's writes create.
fn is_temp_name(name: &str) -> bool {
    name.starts_with(TEMP_PREFIX)
        || LEGACY_TEMP_NAMES.iter().any(|(prefix, suffix)| {
            name.len() > prefix.len() + suffix.len()
                && name.starts_with(prefix)
                && name.ends_with(suffix)
        })
}

/// Reads a local file of at most `cap` bytes, the one bounded read of the node's own files
/// (its TLS key and certificate, the logs token): `Ok(None)` when it does not exist. The file
/// is opened without blocking, so a FIFO or a device in its place is refused rather than
/// read or waited on. Blocks on the disk: run it on the blocking pool from async code.
///
/// Errors: [`std::io::ErrorKind::FileTooLarge`] past `cap` bytes (nothing is cut short and
/// taken for the file), [`std::io::ErrorKind::InvalidInput`] for anything but a regular file,
/// and the open or read's own error.
#[cfg(feature = "daemon")] // the daemon's alone: a tool's build leaves it out
pub(crate) fn read_capped(path: &Path, cap: u64) -> std::io::Result<Option<Vec<u8>>> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let file = match std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_NONBLOCK)
        .open(path)
    {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    if !file.metadata()?.is_file() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "not a regular file",
        ));
    }
    let mut bytes = Vec::new();
    file.take(cap.saturating_add(1)).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > cap {
        return Err(std::io::Error::new(
            std::io::ErrorKind::FileTooLarge,
            format!("larger than {cap} bytes"),
        ));
    }
    Ok(Some(bytes))
}

/// The directory `path` lives in (`.` for a bare file name).
pub(crate) fn parent_dir(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_capped_read_is_the_whole_file_or_an_error_never_a_cut_or_a_wait() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("f");
        assert!(read_capped(&file, 4).unwrap().is_none(), "missing is None");
        std::fs::write(&file, b"1234").unwrap();
        assert_eq!(read_capped(&file, 4).unwrap().unwrap(), b"1234");
        std::fs::write(&file, b"12345").unwrap();
        let e = read_capped(&file, 4).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::FileTooLarge, "{e}");
        let fifo = dir.path().join("fifo");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU).unwrap();
        // Without a writer, a blocking open would wait for good.
        let e = read_capped(&fifo, 4).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput, "{e}");
        let e = read_capped(dir.path(), 4).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput, "{e}");
    }

    fn mode(p: &Path) -> u32 {
        std::fs::metadata(p).unwrap().permissions().mode() & 0o777
    }

    fn names(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    #[test]
    fn a_write_replaces_the_file_with_its_mode_and_leaves_nothing_beside_it() {
        let dir = tempfile::tempdir().unwrap();
        let private = dir.path().join("a/b/secret");
        write_atomically(&private, b"one", 0o600).unwrap();
        write_atomically(&private, b"two", 0o600).unwrap();
        assert_eq!(std::fs::read(&private).unwrap(), b"two");
        assert_eq!(mode(&private), 0o600);
        assert_eq!(mode(&dir.path().join("a")), 0o700);
        assert_eq!(mode(&dir.path().join("a/b")), 0o700);
        assert_eq!(names(&dir.path().join("a/b")), ["secret"]);

        let public = dir.path().join("c/doc.json");
        write_atomically(&public, b"{}", 0o644).unwrap();
        assert_eq!(mode(&public), 0o644);
        assert_ne!(mode(&dir.path().join("c")), 0o700);
        check_writable(&public, 0o644).unwrap();
        assert_eq!(names(&dir.path().join("c")), ["doc.json"]);
    }

    #[test]
    fn a_failed_write_names_the_path_and_step_and_keeps_the_old_file() {
        let dir = tempfile::tempdir().unwrap();
        // A directory where the file should be: the rename fails.
        let target = dir.path().join("taken");
        std::fs::create_dir(&target).unwrap();
        std::fs::write(target.join("x"), b"x").unwrap();
        let e = write_atomically(&target, b"new", 0o644).unwrap_err();
        assert_eq!(e.step, "rename");
        assert!(e.to_string().contains(&*target.to_string_lossy()), "{e}");
        assert_eq!(names(dir.path()), ["taken"]);
        // A file where the directory should be.
        let e = check_writable(&target.join("x/y"), 0o644).unwrap_err();
        assert_eq!(e.step, "create directory");
    }

    #[test]
    fn the_sweep_removes_every_temp_file_a_crash_can_leave_and_nothing_else() {
        let dir = tempfile::tempdir().unwrap();
        let stale = [
            ".fleet-tmp.a1B2c3",
            ".fleet-confirmed.a1B2c3.tmp",
            ".fleet-confirmed.x.probe",
            ".fleet-token-Zq9xYw",
        ];
        let kept = [
            ".fleet-confirmed.",
            ".fleet-token-",
            "fleet-confirmed.json",
            "fleet-token",
            "unrelated.tmp",
        ];
        for name in stale.iter().chain(&kept) {
            std::fs::write(dir.path().join(name), b"NEVER-LOGGED-TOKEN").unwrap();
        }
        std::fs::create_dir(dir.path().join(".fleet-tmp.dir")).unwrap();
        assert_eq!(remove_stale_temp_files(dir.path()), stale.len());
        let mut expect: Vec<&str> = kept.to_vec();
        expect.push(".fleet-tmp.dir");
        expect.sort_unstable();
        assert_eq!(names(dir.path()), expect);
        assert_eq!(remove_stale_temp_files(&dir.path().join("missing")), 0);
    }

    #[test]
    fn the_parent_of_a_bare_name_is_the_working_directory() {
        assert_eq!(parent_dir(Path::new("f")), Path::new("."));
        assert_eq!(parent_dir(Path::new("/a/f")), Path::new("/a"));
    }
}
