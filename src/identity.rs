//! What the sidecar reads from merod's own `config.toml`: the node's PeerId
//! (`[identity].peer_id`) and where its admin API listens (`[server].listen[0]`).
//!
//! merod writes that file atomically with mode 0600; it also holds `[identity].keypair`, a
//! secret. The document is deserialized into a struct that has no field for it, so the
//! keypair is never kept, copied, or printed (docs/merod-admin.md).

use std::path::{Path, PathBuf};

use multiaddr::{Multiaddr, Protocol};
use serde::Deserialize;
use url::Url;

use crate::ids::{PeerId, PeerIdError};

/// The parts of merod's config.toml the sidecar uses; every other key is skipped unread.
#[derive(Debug, Default, Deserialize)]
struct MerodToml {
    #[serde(default)]
    identity: Option<IdentityTable>,
    #[serde(default)]
    server: Option<ServerTable>,
}

#[derive(Debug, Default, Deserialize)]
struct IdentityTable {
    peer_id: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
struct ServerTable {
    #[serde(default)]
    listen: Vec<String>,
}

/// Why merod's config.toml did not yield what was asked. Each names the file.
#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    /// The file could not be read.
    #[error("cannot read merod config {path}: {source}")]
    Read {
        /// merod's config.toml.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The file is not TOML, or a key has the wrong type (only the parser's message is
    /// kept: the file holds a secret).
    #[error("merod config {path} cannot be read: {message}")]
    Parse {
        /// merod's config.toml.
        path: PathBuf,
        /// The parser's message, without the text of the line.
        message: String,
    },
    /// `[identity].peer_id` is absent.
    #[error("merod config {path} has no [identity].peer_id")]
    MissingPeerId {
        /// merod's config.toml.
        path: PathBuf,
    },
    /// `[identity].peer_id` is not a PeerId.
    #[error("merod config {path}: [identity].peer_id is invalid: {source}")]
    InvalidPeerId {
        /// merod's config.toml.
        path: PathBuf,
        /// What is wrong with it.
        source: PeerIdError,
    },
    /// `[server].listen[0]` is not a multiaddr of an IP or DNS host and a TCP port.
    #[error(
        "merod config {path}: [server].listen[0] = {value:?} cannot be turned into a URL: {reason}"
    )]
    InvalidListen {
        /// merod's config.toml.
        path: PathBuf,
        /// The multiaddr as written.
        value: String,
        /// What is wrong with it.
        reason: String,
    },
}

fn load(path: &Path) -> Result<MerodToml, IdentityError> {
    let text = std::fs::read_to_string(path).map_err(|source| IdentityError::Read {
        path: path.to_owned(),
        source,
    })?;
    toml::from_str(&text).map_err(|e| IdentityError::Parse {
        path: path.to_owned(),
        message: e.message().to_owned(),
    })
}

/// Reads the node's PeerId from `[identity].peer_id` of merod's config.toml at `path`
/// (on a fleet node `/mnt/data/calimero/default/config.toml`).
///
/// Errors: [`IdentityError::Read`], [`IdentityError::Parse`],
/// [`IdentityError::MissingPeerId`], [`IdentityError::InvalidPeerId`].
pub fn read_peer_id(path: &Path) -> Result<PeerId, IdentityError> {
    let doc = load(path)?;
    let raw = doc
        .identity
        .and_then(|i| i.peer_id)
        .ok_or_else(|| IdentityError::MissingPeerId {
            path: path.to_owned(),
        })?;
    raw.parse().map_err(|source| IdentityError::InvalidPeerId {
        path: path.to_owned(),
        source,
    })
}

/// The admin API base URL merod serves, from `[server].listen[0]` of its config.toml at
/// `path`: `/ip4/127.0.0.1/tcp/2528` → `http://127.0.0.1:2528/`. `Ok(None)` when the file
/// or the key is absent (the caller then uses [`crate::config::DEFAULT_ADMIN_URL`]).
///
/// Errors: an unreadable or invalid file, or a listen address that is not an IP/DNS host
/// with a TCP port.
pub fn admin_url_from_merod_config(path: &Path) -> Result<Option<Url>, IdentityError> {
    let doc = match load(path) {
        Err(IdentityError::Read { source, .. })
            if source.kind() == std::io::ErrorKind::NotFound =>
        {
            return Ok(None)
        }
        other => other?,
    };
    let Some(first) = doc.server.and_then(|s| s.listen.into_iter().next()) else {
        return Ok(None);
    };
    multiaddr_to_url(&first)
        .map(Some)
        .map_err(|reason| IdentityError::InvalidListen {
            path: path.to_owned(),
            value: first,
            reason,
        })
}

/// `/ip4/A/tcp/P`, `/ip6/A/tcp/P`, `/dns*/H/tcp/P` → `http://host:P/`; an unspecified
/// address (0.0.0.0, ::) is reached through loopback.
fn multiaddr_to_url(text: &str) -> Result<Url, String> {
    let addr: Multiaddr = text.parse().map_err(|e| format!("{e}"))?;
    let mut host = None;
    let mut port = None;
    for proto in addr.iter() {
        match proto {
            Protocol::Ip4(ip) if ip.is_unspecified() => host = Some("127.0.0.1".to_owned()),
            Protocol::Ip4(ip) => host = Some(ip.to_string()),
            Protocol::Ip6(ip) if ip.is_unspecified() => host = Some("[::1]".to_owned()),
            Protocol::Ip6(ip) => host = Some(format!("[{ip}]")),
            Protocol::Dns(h) | Protocol::Dns4(h) | Protocol::Dns6(h) => host = Some(h.to_string()),
            Protocol::Tcp(p) => port = Some(p),
            _ => {}
        }
    }
    match (host, port) {
        (Some(h), Some(p)) => Url::parse(&format!("http://{h}:{p}/")).map_err(|e| e.to_string()),
        (None, _) => Err("no IP or DNS host".to_owned()),
        (_, None) => Err("no TCP port".to_owned()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PEER: &str = "12D3KooWJ6X2tBZEd8qKWvJyhtH2v2XyP4eQ9dcU2xZ8Y6YrjcVk";

    fn write(text: &str) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("config.toml");
        std::fs::write(&path, text).unwrap();
        (dir, path)
    }

    #[test]
    fn reads_the_peer_id_and_ignores_the_keypair() {
        let (_d, path) = write(&format!(
            "[identity]\npeer_id = \"{PEER}\"\nkeypair = \"SECRETKEYPAIR\"\n\n[server]\nlisten = [\"/ip4/127.0.0.1/tcp/2528\"]\n"
        ));
        assert_eq!(read_peer_id(&path).unwrap().as_str(), PEER);
        assert_eq!(
            admin_url_from_merod_config(&path)
                .unwrap()
                .unwrap()
                .as_str(),
            "http://127.0.0.1:2528/"
        );
    }

    #[test]
    fn absent_or_bad_peer_id_is_a_clear_error() {
        let (_d, path) = write("[identity]\nkeypair = \"SECRETKEYPAIR\"\n");
        let err = read_peer_id(&path).unwrap_err();
        assert!(matches!(err, IdentityError::MissingPeerId { .. }));
        assert!(err.to_string().contains("[identity].peer_id"));

        let (_d, path) = write("[identity]\npeer_id = \"0OIl\"\nkeypair = \"SECRETKEYPAIR\"\n");
        let err = read_peer_id(&path).unwrap_err();
        assert!(matches!(err, IdentityError::InvalidPeerId { .. }));

        let err = read_peer_id(Path::new("/nonexistent/config.toml")).unwrap_err();
        assert!(err.to_string().contains("/nonexistent/config.toml"));
    }

    #[test]
    fn a_broken_file_never_echoes_the_keypair() {
        let (_d, path) = write("[identity]\nkeypair = SECRETKEYPAIR\n");
        let err = read_peer_id(&path).unwrap_err();
        assert!(!err.to_string().contains("SECRETKEYPAIR"), "{err}");
        assert!(!format!("{err:?}").contains("SECRETKEYPAIR"), "{err:?}");
    }

    #[test]
    fn listen_multiaddrs_become_urls() {
        for (ma, url) in [
            ("/ip4/127.0.0.1/tcp/2528", "http://127.0.0.1:2528/"),
            ("/ip4/0.0.0.0/tcp/2528", "http://127.0.0.1:2528/"),
            ("/ip6/::1/tcp/2600", "http://[::1]:2600/"),
            ("/ip6/::/tcp/2600", "http://[::1]:2600/"),
            ("/dns/node.local/tcp/80", "http://node.local/"),
        ] {
            assert_eq!(multiaddr_to_url(ma).unwrap().as_str(), url, "{ma}");
        }
        assert!(multiaddr_to_url("/ip4/127.0.0.1/udp/1").is_err());
        assert!(multiaddr_to_url("garbage").is_err());
    }

    #[test]
    fn no_file_or_no_listen_means_use_the_default() {
        assert!(
            admin_url_from_merod_config(Path::new("/nonexistent/config.toml"))
                .unwrap()
                .is_none()
        );
        let (_d, path) = write(&format!("[identity]\npeer_id = \"{PEER}\"\n"));
        assert!(admin_url_from_merod_config(&path).unwrap().is_none());
    }
}
