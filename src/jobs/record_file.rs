//! A job's record kept beside the state file, written once for the jobs that keep one (the
//! inventory's `fleet-inventory.json`, the recovery envelopes' `fleet-recovery.json`):
//! where it is ([`beside_state`]), how it is read back ([`read`]: JSON, at most
//! [`MAX_RECORD`] bytes; none is the empty record) and how it is written whole
//! ([`write_whole`]: atomically, off the runtime). What a lost record costs is each job's
//! to say.

use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::config::Config;
use crate::durable::{self, WriteError};

/// Largest record read: far above what 10,000 namespaces write, and a bound on a corrupt
/// or foreign file.
pub(crate) const MAX_RECORD: u64 = 64 * 1024 * 1024;

/// Where the record `name` of `cfg`'s node is kept: beside the state file.
pub(crate) fn beside_state(cfg: &Config, name: &str) -> PathBuf {
    durable::parent_dir(&cfg.state_file).join(name)
}

/// Why a record could not be read back.
#[derive(Debug, thiserror::Error)]
pub(crate) enum Unread {
    /// The file could not be read (or is larger than [`MAX_RECORD`]).
    #[error("cannot be read ({0})")]
    Read(#[source] std::io::Error),
    /// It is not the record's JSON.
    #[error("is unreadable ({0})")]
    Parse(#[source] serde_json::Error),
}

/// The record at `path`; the empty one when there is none.
///
/// Errors: [`Unread`]: the caller says what is lost and starts from the empty record.
pub(crate) fn read<T: DeserializeOwned + Default>(path: &Path) -> Result<T, Unread> {
    match durable::read_capped(path, MAX_RECORD).map_err(Unread::Read)? {
        None => Ok(T::default()),
        Some(bytes) => serde_json::from_slice(&bytes).map_err(Unread::Parse),
    }
}

/// Why a record was not written.
#[derive(Debug, thiserror::Error)]
pub(crate) enum Unwritten {
    /// It could not be rendered.
    #[error("cannot render it ({0})")]
    Render(#[source] serde_json::Error),
    /// The write failed.
    #[error(transparent)]
    Write(#[from] WriteError),
    /// The blocking task writing it stopped (a panic, or the runtime shutting down).
    #[error("its write stopped ({0})")]
    Stopped(#[source] tokio::task::JoinError),
}

/// Writes `record` whole to `path` (mode `mode`), atomically, off the runtime; then runs
/// `after` in the same blocking task (the recovery job empties its journal there, only once
/// the record holds what it held). The bytes written.
///
/// Errors: [`Unwritten`]; the file on disk is then the one before.
pub(crate) async fn write_whole<T: Serialize>(
    record: &T,
    path: PathBuf,
    mode: u32,
    after: impl FnOnce() -> Result<(), WriteError> + Send + 'static,
) -> Result<u64, Unwritten> {
    let bytes = serde_json::to_vec(record).map_err(Unwritten::Render)?;
    let len = bytes.len() as u64;
    tokio::task::spawn_blocking(move || {
        durable::write_atomically(&path, &bytes, mode)?;
        after()
    })
    .await
    .map_err(Unwritten::Stopped)??;
    Ok(len)
}
