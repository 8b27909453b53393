//! Whether the state file's directory is on a RAM filesystem, whose content a reboot loses
//! (the fleet's sealed images keep `/var` in RAM): the node would forget what it admitted
//! and never leave a namespace withdrawn while it was down.
//!
//! Read from the kernel's mount table, `/proc/self/mountinfo` (proc(5)): the mount holding
//! a directory is the one with the longest mount point that is a prefix of it (the last
//! such line when mounts are stacked). RAM filesystems are `tmpfs` and `ramfs`, and an
//! `overlay` whose upper layer (`upperdir=`) is on one. [`parse_mountinfo`] and
//! [`ram_filesystem`] are pure; [`check_state_dir`] does the reads.

use std::path::{Path, PathBuf};

/// The kernel's mount table of this process.
pub const MOUNTINFO: &str = "/proc/self/mountinfo";

/// One line of `/proc/self/mountinfo`, the fields used here.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mount {
    /// Where it is mounted (octal escapes such as `\040` decoded).
    pub mount_point: PathBuf,
    /// The filesystem type (`ext4`, `tmpfs`, `overlay`, …).
    pub fstype: String,
    /// The filesystem's own options (`upperdir=…` for an overlay).
    pub super_options: String,
}

/// A state directory on a RAM filesystem.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RamFilesystem {
    /// The mount point holding the directory.
    pub mount_point: PathBuf,
    /// Its type: `tmpfs`, `ramfs` or `overlay`.
    pub fstype: String,
    /// For an overlay: its upper layer's directory and that layer's filesystem type.
    pub upper: Option<(PathBuf, String)>,
}

impl std::fmt::Display for RamFilesystem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} at {}", self.fstype, self.mount_point.display())?;
        if let Some((dir, fstype)) = &self.upper {
            write!(f, " (upper layer {} on {fstype})", dir.display())?;
        }
        Ok(())
    }
}

/// Why the check could not be made.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum VolatileCheckError {
    /// The mount table could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The mount table's path.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// No ancestor of the state file's directory resolves (a relative path from a
    /// directory that is gone?).
    #[error("cannot resolve the state file's directory {path}: {source}")]
    Resolve {
        /// The state file's directory.
        path: PathBuf,
        /// The I/O error of the last try.
        source: std::io::Error,
    },
}

/// Decodes mountinfo's octal escapes (`\040` space, `\011` tab, `\012` newline, `\134`
/// backslash); anything else is kept as written.
fn unescape(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let octal = bytes.get(i + 1..i + 4).and_then(|d| {
            d.iter()
                .all(|c| (b'0'..=b'7').contains(c))
                .then(|| u8::from_str_radix(std::str::from_utf8(d).ok()?, 8).ok())
                .flatten()
        });
        match (bytes[i], octal) {
            (b'\\', Some(c)) => {
                out.push(c);
                i += 4;
            }
            (c, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Parses `/proc/self/mountinfo`. Lines it cannot make sense of are skipped (the table is
/// the kernel's; a skipped line can only hide a mount, never invent one).
pub fn parse_mountinfo(text: &str) -> Vec<Mount> {
    text.lines()
        .filter_map(|line| {
            let mut fields = line.split(' ');
            let mount_point = fields.nth(4)?;
            // Optional fields up to the separator, then type, source, super options.
            let mut rest = fields.skip_while(|f| *f != "-").skip(1);
            let fstype = rest.next()?;
            let _source = rest.next()?;
            let super_options = rest.next().unwrap_or("");
            Some(Mount {
                mount_point: PathBuf::from(unescape(mount_point)),
                fstype: unescape(fstype),
                super_options: unescape(super_options),
            })
        })
        .collect()
}

/// The mount holding `dir` (absolute, resolved): the longest mount point that is a prefix
/// of it, the last one listed when several are stacked there.
fn holding<'a>(mounts: &'a [Mount], dir: &Path) -> Option<&'a Mount> {
    mounts
        .iter()
        .filter(|m| dir.starts_with(&m.mount_point))
        .fold(None, |best: Option<&Mount>, m| match best {
            Some(b) if b.mount_point.components().count() > m.mount_point.components().count() => {
                Some(b)
            }
            _ => Some(m),
        })
}

fn is_ram(fstype: &str) -> bool {
    matches!(fstype, "tmpfs" | "ramfs")
}

/// Whether `dir` (absolute, resolved) is on a RAM filesystem by the mount table `mounts`:
/// tmpfs, ramfs, or an overlay whose `upperdir=` is on one. Pure.
pub fn ram_filesystem(mounts: &[Mount], dir: &Path) -> Option<RamFilesystem> {
    let mount = holding(mounts, dir)?;
    let found = |upper| RamFilesystem {
        mount_point: mount.mount_point.clone(),
        fstype: mount.fstype.clone(),
        upper,
    };
    if is_ram(&mount.fstype) {
        return Some(found(None));
    }
    if mount.fstype != "overlay" {
        return None;
    }
    let upperdir = mount
        .super_options
        .split(',')
        .find_map(|o| o.strip_prefix("upperdir="))?;
    let upperdir = PathBuf::from(upperdir);
    // The upper layer's own mount, not the overlay itself (an upper directory is never
    // inside the overlay it makes).
    let others: Vec<Mount> = mounts
        .iter()
        .filter(|m| !std::ptr::eq(*m, mount))
        .cloned()
        .collect();
    let layer = holding(&others, &upperdir)?;
    is_ram(&layer.fstype).then(|| found(Some((upperdir.clone(), layer.fstype.clone()))))
}

/// The nearest existing ancestor of `dir` (itself included), resolved (symbolic links,
/// `..`): the directory a state write would create its file under.
fn resolve_existing(dir: &Path) -> Result<PathBuf, std::io::Error> {
    let mut at = dir;
    loop {
        match std::fs::canonicalize(at) {
            Ok(p) => return Ok(p),
            Err(e) => match at.parent() {
                Some(up) if !up.as_os_str().is_empty() => at = up,
                // A relative path with no existing part: the working directory.
                Some(_) if at != Path::new(".") => at = Path::new("."),
                _ => return Err(e),
            },
        }
    }
}

/// Checks the directory of `state_file` against this process's mount table.
/// `Ok(Some(_))`: it is on a RAM filesystem, lost at reboot.
///
/// Errors: [`VolatileCheckError`] when the mount table or the directory cannot be read.
pub fn check_state_dir(state_file: &Path) -> Result<Option<RamFilesystem>, VolatileCheckError> {
    let dir = crate::durable::parent_dir(state_file);
    let resolved = resolve_existing(dir).map_err(|source| VolatileCheckError::Resolve {
        path: dir.to_owned(),
        source,
    })?;
    let table = std::fs::read_to_string(MOUNTINFO).map_err(|source| VolatileCheckError::Read {
        path: PathBuf::from(MOUNTINFO),
        source,
    })?;
    Ok(ram_filesystem(&parse_mountinfo(&table), &resolved))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A mount table in the kernel's layout, as a sealed image has it: the root sealed
    /// (ext4 read-only), `/var` an overlay whose upper layer is on tmpfs, the data disk ext4.
    const SEALED_IMAGE: &str = "\
22 1 253:0 / / ro,relatime shared:1 - ext4 /dev/mapper/root ro
23 22 0:21 / /proc rw,nosuid,nodev,noexec,relatime shared:12 - proc proc rw
24 22 0:22 / /run rw,nosuid,nodev shared:13 - tmpfs tmpfs rw,size=400000k,mode=755
25 24 0:23 / /run/overlay rw,relatime shared:14 - tmpfs tmpfs rw
26 22 0:24 / /var rw,relatime shared:15 - overlay overlay rw,lowerdir=/usr/share/var,upperdir=/run/overlay/var/upper,workdir=/run/overlay/var/work
27 22 253:1 / /mnt/data rw,relatime shared:16 - ext4 /dev/mapper/data rw
28 22 0:25 / /dev/shm rw,nosuid,nodev shared:17 - tmpfs tmpfs rw
29 27 0:26 / /mnt/data/scratch rw master:3 - ramfs ramfs rw
30 22 0:27 / /srv/with\\040space rw - tmpfs tmpfs rw
31 22 0:28 / /opt rw - overlay overlay rw,lowerdir=/usr,upperdir=/mnt/data/opt/upper,workdir=/mnt/data/opt/work
";

    fn check(dir: &str) -> Option<RamFilesystem> {
        ram_filesystem(&parse_mountinfo(SEALED_IMAGE), Path::new(dir))
    }

    #[test]
    fn parses_the_fields_after_the_separator_and_decodes_escapes() {
        let mounts = parse_mountinfo(SEALED_IMAGE);
        assert_eq!(mounts.len(), 10);
        assert_eq!(mounts[0].mount_point, PathBuf::from("/"));
        assert_eq!(mounts[0].fstype, "ext4");
        assert_eq!(mounts[7].fstype, "ramfs", "after an optional field");
        assert_eq!(mounts[8].mount_point, PathBuf::from("/srv/with space"));
        assert!(mounts[4]
            .super_options
            .contains("upperdir=/run/overlay/var/upper"));
        // Lines without the separator or too short are skipped, not guessed.
        assert!(parse_mountinfo("garbage\n1 2 3 4 /x rw shared:1 ext4\n\n").is_empty());
        assert_eq!(unescape(r"a\134b\0x\12"), r"a\b\0x\12");
    }

    #[test]
    fn each_kind_of_ram_filesystem_is_found_and_disks_are_not() {
        let tmpfs = check("/dev/shm/fleet").unwrap();
        assert_eq!(
            (tmpfs.fstype.as_str(), tmpfs.upper.as_ref()),
            ("tmpfs", None)
        );
        assert_eq!(tmpfs.to_string(), "tmpfs at /dev/shm");
        let ramfs = check("/mnt/data/scratch/fleet").unwrap();
        assert_eq!(
            ramfs.fstype, "ramfs",
            "the deeper mount wins over /mnt/data"
        );
        let overlay = check("/var/lib/calimero").unwrap();
        assert_eq!(overlay.fstype, "overlay");
        assert_eq!(
            overlay.upper,
            Some((PathBuf::from("/run/overlay/var/upper"), "tmpfs".to_owned()))
        );
        assert!(overlay
            .to_string()
            .contains("upper layer /run/overlay/var/upper on tmpfs"));
        assert!(check("/srv/with space/x").is_some());
        // On disk: the data disk, the sealed root, an overlay whose upper layer is on disk,
        // and a path that only shares a prefix of characters with a tmpfs mount.
        for dir in [
            "/mnt/data/fleet",
            "/etc/fleet",
            "/opt/fleet",
            "/runaway",
            "/dev/shmx",
        ] {
            assert_eq!(check(dir), None, "{dir}");
        }
    }

    #[test]
    fn stacked_mounts_the_last_one_listed_holds_the_directory() {
        let table = "\
1 0 8:1 / / rw - ext4 /dev/sda1 rw
2 1 0:5 / /state rw - tmpfs tmpfs rw
3 1 8:2 / /state rw - ext4 /dev/sda2 rw
4 1 0:6 / /other rw - ext4 /dev/sda3 rw
5 1 0:7 / /other rw - tmpfs tmpfs rw
";
        let mounts = parse_mountinfo(table);
        assert_eq!(ram_filesystem(&mounts, Path::new("/state/x")), None);
        assert!(ram_filesystem(&mounts, Path::new("/other/x")).is_some());
        // An overlay without an upper layer (read-only) or one on an unknown mount is no
        // RAM filesystem by this table.
        let ro = parse_mountinfo("1 0 0:1 / / rw - overlay overlay ro,lowerdir=/a:/b\n");
        assert_eq!(ram_filesystem(&ro, Path::new("/x")), None);
    }

    #[test]
    fn dev_shm_here_is_tmpfs_and_a_missing_directory_is_judged_by_its_ancestor() {
        if !Path::new("/dev/shm").is_dir() {
            eprintln!("SKIPPED: no /dev/shm");
            return;
        }
        let dir = tempfile::tempdir_in("/dev/shm").unwrap();
        let found = check_state_dir(&dir.path().join("not/yet/fleet-confirmed.json"))
            .unwrap()
            .expect("/dev/shm is tmpfs");
        assert_eq!(found.fstype, "tmpfs");
        let disk = tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap();
        let on_disk = check_state_dir(&disk.path().join("fleet-confirmed.json")).unwrap();
        assert!(
            on_disk.as_ref().is_none_or(|fs| fs.fstype == "overlay"),
            "the checkout is on disk: {on_disk:?}"
        );
    }
}
