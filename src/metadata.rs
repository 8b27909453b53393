//! The instance metadata server (GCE's `computeMetadata/v1/instance/attributes/`): the
//! attributes the fleet's images are created with ([`MetadataAttribute`]), read by one
//! client that registration, the poll's `relay_url` and the token installs share.
//!
//! Every read is bounded ([`METADATA_TIMEOUT`] for the connection and the whole answer, at
//! most [`MAX_METADATA_ATTRIBUTE`] bytes), carries `Metadata-Flavor: Google` (GCE refuses a
//! read without it), never goes through a proxy (the server is link-local, and a proxy would
//! see the enrolment token) and follows no redirect. CR and LF are removed from the text.
//!
//! A metadata server's blip must not change what the node believes: [`MetadataClient::value`]
//! keeps the last value read of each attribute through a failed read and through a 404 that
//! follows a value, so only a value read changes it.

use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tracing::{debug, warn};
use url::Url;

use crate::net::{read_capped, BodyError};

/// How often, while it is in use, what the metadata says of the node (the relay URL it
/// registered with) is read again to find a change: registration's identity check and the
/// relay job both read on this cadence, so the two send the same value.
#[cfg(feature = "daemon")]
pub(crate) const REREAD_EVERY: Duration = Duration::from_secs(60);

/// Bound of one attribute read: connecting, the answer and its body together.
pub const METADATA_TIMEOUT: Duration = Duration::from_secs(5);
/// Largest attribute text read, in bytes; a longer answer is a failed read.
pub const MAX_METADATA_ATTRIBUTE: usize = 64 * 1024;
/// merod's loopback admin port on the fleet's images when the metadata `server-port` is
/// unset or refused (calimero-init's choice).
pub const DEFAULT_SERVER_PORT: u16 = 2428;

/// An instance attribute the fleet sets, by the name the metadata server knows it by.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MetadataAttribute {
    /// `relay-url`: the relay the node registers with and reports as `relay_url`.
    RelayUrl,
    /// `server-port`: merod's loopback admin port (see [`server_port`]).
    ServerPort,
    /// `enrolment-token`: the secret a registration proves the node was enrolled with.
    /// Never logged.
    EnrolmentToken,
    /// `logs-endpoint`: where the node ships its logs.
    LogsEndpoint,
    /// `metrics-endpoint`: where the node ships its metrics.
    MetricsEndpoint,
}

impl MetadataAttribute {
    /// Every attribute, in a fixed order.
    pub const ALL: [MetadataAttribute; 5] = [
        MetadataAttribute::RelayUrl,
        MetadataAttribute::ServerPort,
        MetadataAttribute::EnrolmentToken,
        MetadataAttribute::LogsEndpoint,
        MetadataAttribute::MetricsEndpoint,
    ];

    /// The attribute's name on the metadata server (`relay-url`, …).
    pub fn name(self) -> &'static str {
        match self {
            MetadataAttribute::RelayUrl => "relay-url",
            MetadataAttribute::ServerPort => "server-port",
            MetadataAttribute::EnrolmentToken => "enrolment-token",
            MetadataAttribute::LogsEndpoint => "logs-endpoint",
            MetadataAttribute::MetricsEndpoint => "metrics-endpoint",
        }
    }

    fn index(self) -> usize {
        match self {
            MetadataAttribute::RelayUrl => 0,
            MetadataAttribute::ServerPort => 1,
            MetadataAttribute::EnrolmentToken => 2,
            MetadataAttribute::LogsEndpoint => 3,
            MetadataAttribute::MetricsEndpoint => 4,
        }
    }
}

impl fmt::Display for MetadataAttribute {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Why an attribute could not be read. Never holds the attribute's text.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MetadataError {
    /// The client could not be built (the TLS backend failed to start).
    #[error("cannot build the metadata HTTP client: {0}")]
    Client(#[source] reqwest::Error),
    /// No answer: the connection failed or broke.
    #[error("metadata attribute {url}: {source}")]
    Transport {
        /// The attribute's URL.
        url: Url,
        /// The connection's error (without its URL, which is `url`).
        #[source]
        source: reqwest::Error,
    },
    /// No whole answer within [`METADATA_TIMEOUT`].
    #[error("metadata attribute {url}: no answer within {after:?}")]
    Timeout {
        /// The attribute's URL.
        url: Url,
        /// How long it was waited for.
        after: Duration,
    },
    /// An answer other than 200 and 404.
    #[error("metadata attribute {url}: HTTP {status}")]
    Status {
        /// The attribute's URL.
        url: Url,
        /// The HTTP status.
        status: u16,
    },
    /// The text is larger than [`MAX_METADATA_ATTRIBUTE`] or not UTF-8.
    #[error("metadata attribute {url}: {reason}")]
    Body {
        /// The attribute's URL.
        url: Url,
        /// What is wrong with it (`larger than N bytes`, `not UTF-8`).
        reason: String,
    },
}

impl MetadataError {
    /// Whether the read ran out of time.
    pub fn is_timeout(&self) -> bool {
        match self {
            MetadataError::Timeout { .. } => true,
            MetadataError::Transport { source, .. } => source.is_timeout(),
            _ => false,
        }
    }
}

/// A client of the instance metadata server at `base` (the attributes URL, ending in `/`).
/// Cheap to clone: clones share the connection pool and the values last read.
#[derive(Clone)]
pub struct MetadataClient {
    http: reqwest::Client,
    base: Url,
    /// The last value read of each attribute (by [`MetadataAttribute::index`]).
    last: Arc<Mutex<[Option<String>; 5]>>,
}

impl fmt::Debug for MetadataClient {
    /// The base URL only: the values read include the enrolment token.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MetadataClient")
            .field("base", &self.base.as_str())
            .finish_non_exhaustive()
    }
}

impl MetadataClient {
    /// A client of the attributes under `base` (a missing final `/` is added, so
    /// `…/attributes` and `…/attributes/` are the same).
    ///
    /// Errors: [`MetadataError::Client`] when the HTTP client cannot be built.
    pub fn new(mut base: Url) -> Result<Self, MetadataError> {
        if !base.path().ends_with('/') {
            let path = format!("{}/", base.path());
            base.set_path(&path);
        }
        let http = reqwest::Client::builder()
            .no_proxy()
            .timeout(METADATA_TIMEOUT)
            .connect_timeout(METADATA_TIMEOUT)
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(MetadataError::Client)?;
        Ok(Self {
            http,
            base,
            last: Arc::default(),
        })
    }

    /// The attributes URL the client reads under.
    pub fn base(&self) -> &Url {
        &self.base
    }

    /// One read of `attribute`: `Some(text)` with CR and LF removed (nothing else), `None`
    /// when the server answers 404 (the attribute is not set). Does not touch the values
    /// kept by [`value`](Self::value).
    ///
    /// Errors: [`MetadataError::Transport`], [`MetadataError::Timeout`] (after
    /// [`METADATA_TIMEOUT`]), [`MetadataError::Status`] (anything but 200 and 404),
    /// [`MetadataError::Body`].
    pub async fn read(
        &self,
        attribute: MetadataAttribute,
    ) -> Result<Option<String>, MetadataError> {
        // The name is a fixed relative path segment: joining it cannot fail or escape.
        let url = self
            .base
            .join(attribute.name())
            .unwrap_or_else(|_| self.base.clone());
        let read = async {
            let resp = self
                .http
                .get(url.clone())
                .header("Metadata-Flavor", "Google")
                .send()
                .await
                .map_err(|e| MetadataError::Transport {
                    url: url.clone(),
                    source: e.without_url(),
                })?;
            match resp.status().as_u16() {
                200 => {}
                404 => return Ok(None),
                status => {
                    return Err(MetadataError::Status {
                        url: url.clone(),
                        status,
                    })
                }
            }
            let bytes = read_capped(resp, MAX_METADATA_ATTRIBUTE)
                .await
                .map_err(|e| match e {
                    BodyError::Transport(source) => MetadataError::Transport {
                        url: url.clone(),
                        source: source.without_url(),
                    },
                    too_large => MetadataError::Body {
                        url: url.clone(),
                        reason: too_large.into_error(|r| r, |e| e.to_string()),
                    },
                })?;
            let text = String::from_utf8(bytes).map_err(|_| MetadataError::Body {
                url: url.clone(),
                reason: "not UTF-8".to_owned(),
            })?;
            Ok(Some(text.replace(['\r', '\n'], "")))
        };
        match tokio::time::timeout(METADATA_TIMEOUT, read).await {
            Ok(r) => r,
            Err(_) => Err(MetadataError::Timeout {
                url,
                after: METADATA_TIMEOUT,
            }),
        }
    }

    /// `attribute` as the node believes it now: read, with surrounding whitespace trimmed
    /// (except `server-port`, which [`server_port`] judges as written), and folded into the
    /// last value read. A value read (even `""`) replaces it. A 404 is `""` ("not set") only
    /// when nothing was read before, and a failed read or a 404 after a value keep the last
    /// value: a metadata server's blip never changes what the node reports or registers.
    ///
    /// Errors: the read's [`MetadataError`], only when no value was read (or
    /// [`remember`](Self::remember)ed) before.
    pub async fn value(&self, attribute: MetadataAttribute) -> Result<String, MetadataError> {
        let read = self.read(attribute).await;
        let read = read.map(|text| {
            text.map(|t| match attribute {
                MetadataAttribute::ServerPort => t,
                _ => t.trim().to_owned(),
            })
        });
        let mut last = self.last.lock().unwrap_or_else(PoisonError::into_inner);
        fold(&mut last[attribute.index()], attribute, read)
    }

    /// The value [`value`](Self::value) last settled on for `attribute`, if any (no read).
    pub fn last(&self, attribute: MetadataAttribute) -> Option<String> {
        self.last.lock().unwrap_or_else(PoisonError::into_inner)[attribute.index()].clone()
    }

    /// Takes `value` as read for `attribute` unless this client read it already: what an
    /// earlier run read (a value it recorded), so a blip right after a restart keeps it.
    pub fn remember(&self, attribute: MetadataAttribute, value: &str) {
        let mut last = self.last.lock().unwrap_or_else(PoisonError::into_inner);
        last[attribute.index()].get_or_insert_with(|| value.to_owned());
    }

    /// merod's loopback admin port from `server-port`, judged by [`server_port`]:
    /// [`DEFAULT_SERVER_PORT`] when it is unset, unreadable (with nothing read before) or
    /// refused, the last with a warning naming the value.
    pub async fn server_port(&self) -> u16 {
        match self.value(MetadataAttribute::ServerPort).await {
            Ok(raw) => server_port(&raw).unwrap_or_else(|| {
                if !raw.is_empty() {
                    warn!(
                        value = %raw.escape_debug(),
                        default = DEFAULT_SERVER_PORT,
                        "metadata server-port is not a port (1-65535): using the default"
                    );
                }
                DEFAULT_SERVER_PORT
            }),
            Err(e) => {
                debug!("metadata server-port unreadable ({e}): using the default");
                DEFAULT_SERVER_PORT
            }
        }
    }
}

/// Folds one read (`Ok(Some)`: a value; `Ok(None)`: 404; `Err`: failed) into `last`.
fn fold(
    last: &mut Option<String>,
    attribute: MetadataAttribute,
    read: Result<Option<String>, MetadataError>,
) -> Result<String, MetadataError> {
    match (read, last.as_ref()) {
        (Ok(Some(value)), _) => {
            *last = Some(value.clone());
            Ok(value)
        }
        (Ok(None), None) => {
            *last = Some(String::new());
            Ok(String::new())
        }
        (Ok(None), Some(kept)) => {
            debug!(%attribute, "metadata answered 404 after a value was read: keeping the last one read");
            Ok(kept.clone())
        }
        (Err(e), Some(kept)) => {
            debug!(%attribute, "metadata unreadable ({e}): keeping the last one read");
            Ok(kept.clone())
        }
        (Err(e), None) => Err(e),
    }
}

/// The metadata `server-port` as a port: 1 to 5 ASCII digits (leading zeros dropped, so
/// `02428` is 2428) whose value lies in 1–65535, the text exactly as read (CR and LF
/// removed, nothing else: `2428 ` is refused). `None` for anything else, the fleet's rule,
/// so a value such as `1@evil.example` or `2428/../x` never reaches a URL.
pub fn server_port(raw: &str) -> Option<u16> {
    if raw.is_empty() || raw.len() > 5 || !raw.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    raw.parse::<u16>().ok().filter(|&p| p != 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_port_keeps_exactly_the_fleets_values() {
        for (raw, port) in [
            ("2428", 2428),
            ("8080", 8080),
            ("65535", 65535),
            ("02428", 2428),
            ("1", 1),
        ] {
            assert_eq!(server_port(raw), Some(port), "{raw:?}");
        }
        for raw in [
            "",
            "0",
            "00000",
            "65536",
            "123456",
            "-1",
            "+1",
            "2428 ",
            " 2428",
            "1@evil.example",
            "2428/../x",
            "$(id)",
            "２４２８",
            "0x10",
        ] {
            assert_eq!(server_port(raw), None, "{raw:?}");
        }
    }

    fn failed() -> Result<Option<String>, MetadataError> {
        Err(MetadataError::Status {
            url: Url::parse("http://169.254.169.254/a/relay-url").unwrap(),
            status: 503,
        })
    }

    #[test]
    fn only_a_value_read_changes_what_the_node_believes() {
        let a = MetadataAttribute::RelayUrl;
        let read = |v: &str| Ok(Some(v.to_owned()));
        let mut last = None;
        // Nothing read yet: a failure is a failure, a 404 is "not set".
        assert!(fold(&mut last, a, failed()).is_err());
        assert_eq!(fold(&mut last, a, Ok(None)).unwrap(), "");
        // A value read replaces it; a 404 blip or an error afterwards keep it.
        assert_eq!(
            fold(&mut last, a, read("https://r1")).unwrap(),
            "https://r1"
        );
        assert_eq!(fold(&mut last, a, Ok(None)).unwrap(), "https://r1");
        assert_eq!(fold(&mut last, a, failed()).unwrap(), "https://r1");
        assert_eq!(
            fold(&mut last, a, read("https://r2")).unwrap(),
            "https://r2"
        );
        // An empty value read is a value: the operator cleared it.
        assert_eq!(fold(&mut last, a, read("")).unwrap(), "");
        assert_eq!(fold(&mut last, a, Ok(None)).unwrap(), "");
    }

    #[test]
    fn remembered_values_count_as_read_but_never_replace_one() {
        let md = MetadataClient::new(Url::parse("http://127.0.0.1:9/attrs").unwrap()).unwrap();
        assert_eq!(md.base().as_str(), "http://127.0.0.1:9/attrs/");
        assert_eq!(md.last(MetadataAttribute::RelayUrl), None);
        md.remember(MetadataAttribute::RelayUrl, "https://earlier");
        md.remember(MetadataAttribute::RelayUrl, "https://later");
        assert_eq!(
            md.last(MetadataAttribute::RelayUrl).as_deref(),
            Some("https://earlier")
        );
        // Each attribute keeps its own value; clones share them.
        assert_eq!(md.clone().last(MetadataAttribute::EnrolmentToken), None);
        assert!(!format!("{md:?}").contains("earlier"));
    }

    #[test]
    fn every_attribute_has_its_own_slot() {
        let mut seen = [false; 5];
        for a in MetadataAttribute::ALL {
            assert!(!std::mem::replace(&mut seen[a.index()], true), "{a}");
        }
    }
}
