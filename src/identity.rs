//! What the sidecar reads from merod's own `config.toml`: the node's PeerId
//! (`[identity].peer_id`) and where its admin API listens (`[server].listen`, tried in
//! order).
//!
//! merod writes that file atomically with mode 0600; it also holds `[identity].keypair`, a
//! secret. The document is deserialized into a struct that has no field for it, so the
//! keypair is never kept, copied, or printed (docs/merod-admin.md).

use std::path::{Path, PathBuf};

use multiaddr::{Multiaddr, Protocol};
use serde::Deserialize;
use url::Url;

use crate::config::{MerodConfig, DEFAULT_ADMIN_URL};
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
#[non_exhaustive]
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
        "merod config {path}: [server].listen[0] = {value:?} cannot be turned into a URL: {source}"
    )]
    InvalidListen {
        /// merod's config.toml.
        path: PathBuf,
        /// The multiaddr as written.
        value: String,
        /// What is wrong with it.
        #[source]
        source: ListenAddrError,
    },
}

impl IdentityError {
    /// The failure's one classification, stable for a program to match (the `kind` of its
    /// `Serialize` form, `{"kind": …, "message": …}`): `read`, `parse`, `missing-peer-id`,
    /// `invalid-peer-id`, `invalid-listen`.
    pub fn kind(&self) -> &'static str {
        match self {
            IdentityError::Read { .. } => "read",
            IdentityError::Parse { .. } => "parse",
            IdentityError::MissingPeerId { .. } => "missing-peer-id",
            IdentityError::InvalidPeerId { .. } => "invalid-peer-id",
            IdentityError::InvalidListen { .. } => "invalid-listen",
        }
    }
}

serialize_kind_and_message!(IdentityError);

/// Why a `[server].listen` multiaddr gives no admin URL.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ListenAddrError {
    /// Not a multiaddr.
    #[error("not a multiaddr: {0}")]
    Multiaddr(#[from] multiaddr::Error),
    /// No `/ip4`, `/ip6` or `/dns*` component.
    #[error("no IP or DNS host")]
    NoHost,
    /// No `/tcp` component.
    #[error("no TCP port")]
    NoPort,
    /// The host and port do not form a URL.
    #[error("not a URL host: {0}")]
    Url(#[from] url::ParseError),
}

fn load(path: &Path) -> Result<MerodToml, IdentityError> {
    let text = std::fs::read_to_string(path).map_err(|source| IdentityError::Read {
        path: path.to_owned(),
        source,
    })?;
    parse(path, &text)
}

/// `text` as merod's config.toml; `path` only names it in errors.
fn parse(path: &Path, text: &str) -> Result<MerodToml, IdentityError> {
    toml::from_str(text).map_err(|e| IdentityError::Parse {
        path: path.to_owned(),
        message: e.message().to_owned(),
    })
}

/// `[identity].peer_id` of a parsed config.toml (`path` names it in errors).
fn peer_id_of(path: &Path, doc: MerodToml) -> Result<PeerId, IdentityError> {
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

/// The admin URLs of `[server].listen` of a parsed config.toml, in order: the first's, and
/// those of the later entries that are IP or DNS hosts with a TCP port (the others are
/// skipped: merod may listen on more than the admin API needs). `None` without a listen.
fn listen_urls_of(path: &Path, doc: MerodToml) -> Result<Option<(Url, Vec<Url>)>, IdentityError> {
    let mut listen = doc.server.map(|s| s.listen).unwrap_or_default().into_iter();
    let Some(first) = listen.next() else {
        return Ok(None);
    };
    let first = multiaddr_to_url(&first).map_err(|source| IdentityError::InvalidListen {
        path: path.to_owned(),
        value: first,
        source,
    })?;
    let mut rest: Vec<Url> = Vec::new();
    for url in listen.filter_map(|l| multiaddr_to_url(&l).ok()) {
        if url != first && !rest.contains(&url) {
            rest.push(url);
        }
    }
    Ok(Some((first, rest)))
}

/// Both readers over config.toml text already in memory, as [`read_peer_id`] and
/// `listen_urls_from_merod_config` do after reading the file (the fuzz target's entry:
/// no file per input).
#[cfg(feature = "fuzzing")]
pub(crate) fn parse_text(
    text: &str,
) -> (
    Result<PeerId, IdentityError>,
    Result<Option<Url>, IdentityError>,
) {
    let path = Path::new("config.toml");
    (
        parse(path, text).and_then(|doc| peer_id_of(path, doc)),
        parse(path, text)
            .and_then(|doc| listen_urls_of(path, doc))
            .map(|urls| urls.map(|(first, _)| first)),
    )
}

/// Reads the node's PeerId from `[identity].peer_id` of merod's config.toml at `path`
/// (on a fleet node `/mnt/data/calimero/default/config.toml`).
///
/// Errors: [`IdentityError::Read`], [`IdentityError::Parse`],
/// [`IdentityError::MissingPeerId`], [`IdentityError::InvalidPeerId`].
pub fn read_peer_id(path: &Path) -> Result<PeerId, IdentityError> {
    peer_id_of(path, load(path)?)
}

/// The admin API base URLs merod serves, from `[server].listen` of its config.toml at
/// `path`, in order: `listen[0]`'s (`/ip4/127.0.0.1/tcp/2528` → `http://127.0.0.1:2528/`)
/// and those of the later entries that are IP/DNS hosts with a TCP port. `Ok(None)` when
/// the file or the key is absent (the caller then uses
/// [`crate::config::DEFAULT_ADMIN_URL`]).
///
/// Errors: an unreadable or invalid file, or a `listen[0]` that is not an IP/DNS host with
/// a TCP port.
fn listen_urls_from_merod_config(path: &Path) -> Result<Option<(Url, Vec<Url>)>, IdentityError> {
    let doc = match load(path) {
        Err(IdentityError::Read { source, .. })
            if source.kind() == std::io::ErrorKind::NotFound =>
        {
            return Ok(None)
        }
        other => other?,
    };
    listen_urls_of(path, doc)
}

/// Where [`resolve_admin_url`] found merod's admin URL.
#[derive(Debug)]
pub enum AdminUrlSource {
    /// `[merod].admin_url` of the sidecar's config.
    Configured,
    /// `[server].listen[0]` of merod's config.toml at this path.
    MerodListen(PathBuf),
    /// [`DEFAULT_ADMIN_URL`]: merod's config.toml at this path does not exist (a wrong
    /// `[merod]` home or node shows here first).
    DefaultNoMerodConfig(PathBuf),
    /// [`DEFAULT_ADMIN_URL`]: merod's config.toml at this path has no `[server].listen`.
    DefaultNoListen(PathBuf),
    /// [`DEFAULT_ADMIN_URL`]: merod's config.toml could not be used.
    DefaultUnreadable(IdentityError),
}

impl std::fmt::Display for AdminUrlSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AdminUrlSource::Configured => f.write_str("[merod].admin_url"),
            AdminUrlSource::MerodListen(path) => {
                write!(f, "[server].listen of {}", path.display())
            }
            AdminUrlSource::DefaultNoMerodConfig(path) => write!(
                f,
                "the default: {} does not exist (is [merod] home/node right?)",
                path.display()
            ),
            AdminUrlSource::DefaultNoListen(path) => {
                write!(f, "the default: {} has no [server].listen", path.display())
            }
            AdminUrlSource::DefaultUnreadable(e) => write!(f, "the default: {e}"),
        }
    }
}

/// merod's admin API base URL and where it came from.
#[derive(Debug)]
pub struct AdminUrl {
    /// The base URL, e.g. `http://127.0.0.1:2528/`.
    pub url: Url,
    /// Where it came from; the `Default*` variants say why the default was used.
    pub source: AdminUrlSource,
    /// From [`AdminUrlSource::MerodListen`] only: the URLs of the later `[server].listen`
    /// entries, in order (duplicates and entries that are not an IP/DNS host with a TCP
    /// port left out). The daemon tries [`AdminUrl::url`] and then each of these, and uses
    /// the first that answers.
    pub fallbacks: Vec<Url>,
}

/// merod's admin URL as the daemon resolves it, in this order: `[merod].admin_url` of the
/// sidecar's config, else `[server].listen` of merod's config.toml
/// (`{home}/{node}/config.toml`: `listen[0]`, with the later entries as
/// [`AdminUrl::fallbacks`]), else [`DEFAULT_ADMIN_URL`] (`http://127.0.0.1:2528`).
///
/// Never fails: a missing or unreadable merod config.toml falls back to the default, and
/// [`AdminUrl::source`] says why, for the caller to log.
pub fn resolve_admin_url(merod: &MerodConfig) -> AdminUrl {
    if let Some(url) = &merod.admin_url {
        return AdminUrl {
            url: url.clone(),
            source: AdminUrlSource::Configured,
            fallbacks: Vec::new(),
        };
    }
    let path = merod.config_toml();
    let source = match listen_urls_from_merod_config(&path) {
        Ok(Some((url, fallbacks))) => {
            return AdminUrl {
                url,
                source: AdminUrlSource::MerodListen(path),
                fallbacks,
            }
        }
        Ok(None) if !path.exists() => AdminUrlSource::DefaultNoMerodConfig(path),
        Ok(None) => AdminUrlSource::DefaultNoListen(path),
        Err(e) => AdminUrlSource::DefaultUnreadable(e),
    };
    AdminUrl {
        url: default_admin_url(),
        source,
        fallbacks: Vec::new(),
    }
}

/// [`DEFAULT_ADMIN_URL`] as a URL.
fn default_admin_url() -> Url {
    // A constant, not outside input; the unit tests resolve it.
    Url::parse(DEFAULT_ADMIN_URL).expect("DEFAULT_ADMIN_URL is a valid URL")
}

/// `/ip4/A/tcp/P`, `/ip6/A/tcp/P`, `/dns*/H/tcp/P` → `http://host:P/`; an unspecified
/// address (0.0.0.0, ::) is reached through loopback.
fn multiaddr_to_url(text: &str) -> Result<Url, ListenAddrError> {
    let addr: Multiaddr = text.parse()?;
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
        (Some(h), Some(p)) => Ok(Url::parse(&format!("http://{h}:{p}/"))?),
        (None, _) => Err(ListenAddrError::NoHost),
        (_, None) => Err(ListenAddrError::NoPort),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_have_a_kind_and_serialize_as_kind_and_message() {
        let e = IdentityError::MissingPeerId {
            path: PathBuf::from("/m/config.toml"),
        };
        assert_eq!(e.kind(), "missing-peer-id");
        assert_eq!(
            serde_json::to_value(&e).unwrap(),
            serde_json::json!({"kind": "missing-peer-id", "message": e.to_string()})
        );
        let unread = read_peer_id(Path::new("/nonexistent/config.toml")).unwrap_err();
        assert_eq!(unread.kind(), "read");
    }

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
            listen_urls_from_merod_config(&path)
                .unwrap()
                .unwrap()
                .0
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
            listen_urls_from_merod_config(Path::new("/nonexistent/config.toml"))
                .unwrap()
                .is_none()
        );
        let (_d, path) = write(&format!("[identity]\npeer_id = \"{PEER}\"\n"));
        assert!(listen_urls_from_merod_config(&path).unwrap().is_none());
    }

    fn merod_at(home: &Path, admin_url: Option<&str>) -> MerodConfig {
        MerodConfig {
            home: home.to_owned(),
            node: "default".to_owned(),
            admin_url: admin_url.map(|u| Url::parse(u).unwrap()),
        }
    }

    #[test]
    fn admin_url_resolution_order() {
        let home = tempfile::tempdir().unwrap();
        // Nothing anywhere: the default, because merod's config.toml is missing.
        let got = resolve_admin_url(&merod_at(home.path(), None));
        assert_eq!(got.url.as_str(), "http://127.0.0.1:2528/");
        assert!(matches!(
            got.source,
            AdminUrlSource::DefaultNoMerodConfig(_)
        ));

        let node_dir = home.path().join("default");
        std::fs::create_dir_all(&node_dir).unwrap();
        let toml = node_dir.join("config.toml");
        std::fs::write(&toml, format!("[identity]\npeer_id = \"{PEER}\"\n")).unwrap();
        let got = resolve_admin_url(&merod_at(home.path(), None));
        assert_eq!(got.url.as_str(), "http://127.0.0.1:2528/");
        assert!(matches!(got.source, AdminUrlSource::DefaultNoListen(_)));

        std::fs::write(&toml, "[server]\nlisten = [\"/ip4/127.0.0.1/tcp/9999\"]\n").unwrap();
        let got = resolve_admin_url(&merod_at(home.path(), None));
        assert_eq!(got.url.as_str(), "http://127.0.0.1:9999/");
        assert!(matches!(got.source, AdminUrlSource::MerodListen(p) if p == toml));

        // Every listen address, in order: the later ones are the fallbacks.
        std::fs::write(
            &toml,
            "[server]\nlisten = [\"/ip6/::1/tcp/9999\", \"/ip4/0.0.0.0/udp/1\", \"/ip4/127.0.0.1/tcp/9999\", \"/ip6/::/tcp/9999\"]\n",
        )
        .unwrap();
        let got = resolve_admin_url(&merod_at(home.path(), None));
        assert_eq!(got.url.as_str(), "http://[::1]:9999/");
        let fallbacks: Vec<&str> = got.fallbacks.iter().map(Url::as_str).collect();
        assert_eq!(
            fallbacks,
            ["http://127.0.0.1:9999/"],
            "no TCP port and repeats left out"
        );

        // The sidecar's own key wins over merod's config.toml.
        let got = resolve_admin_url(&merod_at(home.path(), Some("http://127.0.0.1:7777/")));
        assert_eq!(got.url.as_str(), "http://127.0.0.1:7777/");
        assert!(matches!(got.source, AdminUrlSource::Configured));

        std::fs::write(&toml, "[server]\nlisten = \"not a list\"\n").unwrap();
        let got = resolve_admin_url(&merod_at(home.path(), None));
        assert_eq!(got.url.as_str(), "http://127.0.0.1:2528/");
        assert!(matches!(got.source, AdminUrlSource::DefaultUnreadable(_)));
    }
}
