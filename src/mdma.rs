//! The fleet control plane (MDMA) client: `POST /api/fleet/should-join` and
//! `POST /api/fleet/confirm` (docs/mdma.md).
//!
//! The poll is strict: only HTTP 200 with a JSON object whose `assignments` is an array of
//! objects each with a 64-hex `group_id` string (and, if present, `retain` an array of
//! 64-hex strings) is a successful poll. Anything else fails the whole poll — dropping just
//! a bad entry would make that namespace look withdrawn. Unknown fields are ignored.
//! Every request is bounded (10 s), TLS is always verified (system roots plus an optional
//! extra CA file), redirects are not followed, and the token goes only into the
//! `X-Fleet-Token` header.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::Duration;

use async_trait::async_trait;
use serde::Serialize;
use url::Url;

use crate::config::Secret;
use crate::ids::{GroupId, PeerId};
use crate::mrtd::Mrtd;
use crate::reconcile::Desired;

/// Bound of one MDMA request, connect to last byte (docs/mdma.md).
pub const MDMA_TIMEOUT: Duration = Duration::from_secs(10);
/// Largest poll answer read; a longer one fails the poll (a sane answer is a few KiB).
pub const MAX_POLL_BODY: usize = 4 * 1024 * 1024;

/// A request to MDMA that got no usable answer.
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    /// No answer: connection refused, DNS, TLS, reset (reqwest's message, no secret in it).
    #[error("POST {url}: {reason}")]
    Transport {
        /// The request URL.
        url: Url,
        /// What failed.
        reason: String,
    },
    /// No complete answer within [`MDMA_TIMEOUT`].
    #[error("POST {url}: no answer within {timeout:?}")]
    Timeout {
        /// The request URL.
        url: Url,
        /// The bound.
        timeout: Duration,
    },
    /// An answer with a status that does not count as success.
    #[error("POST {url}: HTTP {status}")]
    Status {
        /// The request URL.
        url: Url,
        /// The HTTP status.
        status: u16,
    },
}

impl RequestError {
    fn from_reqwest(url: &Url, e: &reqwest::Error) -> Self {
        if e.is_timeout() {
            RequestError::Timeout {
                url: url.clone(),
                timeout: MDMA_TIMEOUT,
            }
        } else {
            RequestError::Transport {
                url: url.clone(),
                reason: describe(e),
            }
        }
    }
}

/// Why a poll failed. Every variant means: skip the whole cycle.
#[derive(Debug, thiserror::Error)]
pub enum PollError {
    /// No answer, a timeout, or a status other than 200 (redirects and 204 included).
    #[error(transparent)]
    Request(#[from] RequestError),
    /// The client did not finish within the loop's own deadline.
    #[error("poll gave no answer within {timeout:?}")]
    Deadline {
        /// The deadline.
        timeout: Duration,
    },
    /// A 200 whose body is not a valid assignment document.
    #[error("POST {url}: HTTP 200 but {reason}")]
    Malformed {
        /// The should-join URL.
        url: Url,
        /// What is wrong with the body.
        reason: String,
    },
}

impl PollError {
    /// A short stable label of the failure kind (for logs and metrics): `transport`,
    /// `timeout`, `status`, `malformed`.
    pub fn kind(&self) -> &'static str {
        match self {
            PollError::Request(RequestError::Transport { .. }) => "transport",
            PollError::Request(RequestError::Timeout { .. }) | PollError::Deadline { .. } => {
                "timeout"
            }
            PollError::Request(RequestError::Status { .. }) => "status",
            PollError::Malformed { .. } => "malformed",
        }
    }
}

/// Why a confirm failed (no answer, a timeout, or a non-2xx status): the namespace stays
/// unconfirmed and is confirmed again later.
pub type ConfirmError = RequestError;

/// Why the MDMA client could not be built.
#[derive(Debug, thiserror::Error)]
pub enum MdmaClientError {
    /// The extra CA file could not be read.
    #[error("cannot read mdma_ca_file {path}: {source}")]
    CaRead {
        /// The CA file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The extra CA file holds no usable PEM certificate.
    #[error("mdma_ca_file {path} holds no usable PEM certificate: {reason}")]
    CaParse {
        /// The CA file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The HTTP client could not be built (TLS backend).
    #[error("cannot build the MDMA HTTP client: {0}")]
    Build(String),
}

/// The control plane as the daemon sees it; [`MdmaClient`] is the real one, tests supply
/// their own.
#[async_trait]
pub trait ControlPlane: Send + Sync + 'static {
    /// Polls `should-join` for this node. `mrtd` is left out of the request when `None`.
    ///
    /// Errors: [`PollError`]: any of them means the poll failed.
    async fn should_join(
        &self,
        peer_id: &PeerId,
        mrtd: Option<&Mrtd>,
    ) -> Result<Desired, PollError>;

    /// Confirms the admission of `group_id`.
    ///
    /// Errors: [`ConfirmError`]; the namespace then stays unconfirmed.
    async fn confirm(&self, peer_id: &PeerId, group_id: GroupId) -> Result<(), ConfirmError>;
}

/// MDMA over HTTPS with reqwest/rustls.
#[derive(Clone, Debug)]
pub struct MdmaClient {
    http: reqwest::Client,
    should_join_url: Url,
    confirm_url: Url,
    token: Option<Secret>,
}

#[derive(Serialize)]
struct PollRequest<'a> {
    peer_id: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    mrtd: Option<String>,
}

#[derive(Serialize)]
struct ConfirmRequest<'a> {
    peer_id: &'a str,
    group_id: String,
}

impl MdmaClient {
    /// A client for MDMA at `base` (a URL ending in `/`), sending `token` as
    /// `X-Fleet-Token` when set, trusting the system roots plus the PEM certificates in
    /// `ca_file`.
    ///
    /// Errors: [`MdmaClientError`] for an unreadable or empty CA file.
    pub fn new(
        base: &Url,
        token: Option<Secret>,
        ca_file: Option<&std::path::Path>,
    ) -> Result<Self, MdmaClientError> {
        let mut builder = reqwest::Client::builder()
            .timeout(MDMA_TIMEOUT)
            .connect_timeout(MDMA_TIMEOUT)
            .redirect(reqwest::redirect::Policy::none())
            .tls_built_in_webpki_certs(false)
            .tls_built_in_native_certs(true)
            .https_only(base.scheme() == "https")
            .user_agent(concat!("fleet-sidecar/", env!("CARGO_PKG_VERSION")));
        if let Some(path) = ca_file {
            let pem = std::fs::read(path).map_err(|source| MdmaClientError::CaRead {
                path: path.to_owned(),
                source,
            })?;
            let certs = reqwest::Certificate::from_pem_bundle(&pem).map_err(|e| {
                MdmaClientError::CaParse {
                    path: path.to_owned(),
                    reason: e.to_string(),
                }
            })?;
            if certs.is_empty() {
                return Err(MdmaClientError::CaParse {
                    path: path.to_owned(),
                    reason: "no CERTIFICATE block".to_owned(),
                });
            }
            for cert in certs {
                builder = builder.add_root_certificate(cert);
            }
        }
        let http = builder
            .build()
            .map_err(|e| MdmaClientError::Build(e.to_string()))?;
        let join = |path: &str| {
            base.join(path)
                .map_err(|e| MdmaClientError::Build(format!("{base}{path}: {e}")))
        };
        Ok(Self {
            http,
            should_join_url: join("api/fleet/should-join")?,
            confirm_url: join("api/fleet/confirm")?,
            token,
        })
    }

    fn post<B: Serialize>(&self, url: &Url, body: &B) -> reqwest::RequestBuilder {
        let req = self.http.post(url.clone()).json(body);
        match &self.token {
            Some(t) => req.header("X-Fleet-Token", t.expose()),
            None => req,
        }
    }
}

/// reqwest's error text with its causes (it never holds a header, so never the token).
fn describe(e: &reqwest::Error) -> String {
    let mut text = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

#[async_trait]
impl ControlPlane for MdmaClient {
    async fn should_join(
        &self,
        peer_id: &PeerId,
        mrtd: Option<&Mrtd>,
    ) -> Result<Desired, PollError> {
        let url = &self.should_join_url;
        let body = PollRequest {
            peer_id: peer_id.as_str(),
            mrtd: mrtd.map(Mrtd::to_hex),
        };
        let fail = |e: reqwest::Error| PollError::from(RequestError::from_reqwest(url, &e));
        let mut resp = self.post(url, &body).send().await.map_err(fail)?;
        let status = resp.status().as_u16();
        if status != 200 {
            return Err(RequestError::Status {
                url: url.clone(),
                status,
            }
            .into());
        }
        let mut bytes = Vec::new();
        while let Some(chunk) = resp.chunk().await.map_err(fail)? {
            if bytes.len() + chunk.len() > MAX_POLL_BODY {
                return Err(PollError::Malformed {
                    url: url.clone(),
                    reason: format!("the body is larger than {MAX_POLL_BODY} bytes"),
                });
            }
            bytes.extend_from_slice(&chunk);
        }
        parse_should_join(&bytes).map_err(|reason| PollError::Malformed {
            url: url.clone(),
            reason,
        })
    }

    async fn confirm(&self, peer_id: &PeerId, group_id: GroupId) -> Result<(), ConfirmError> {
        let url = &self.confirm_url;
        let body = ConfirmRequest {
            peer_id: peer_id.as_str(),
            group_id: group_id.to_string(),
        };
        let resp = self
            .post(url, &body)
            .send()
            .await
            .map_err(|e| RequestError::from_reqwest(url, &e))?;
        let status = resp.status();
        if status.is_success() {
            Ok(())
        } else {
            Err(RequestError::Status {
                url: url.clone(),
                status: status.as_u16(),
            })
        }
    }
}

/// Validates a 200 `should-join` body (docs/mdma.md) into the desired sets.
///
/// Errors: a one-line reason naming the first fault (not JSON, not an object, no
/// `assignments` array, an entry without a 64-hex `group_id`, a bad `retain`).
pub fn parse_should_join(body: &[u8]) -> Result<Desired, String> {
    use serde_json::Value;
    let doc: Value =
        serde_json::from_slice(body).map_err(|e| format!("the body is not JSON ({e})"))?;
    let obj = doc
        .as_object()
        .ok_or_else(|| "the body is not a JSON object".to_owned())?;
    let entries = match obj.get("assignments") {
        Some(Value::Array(a)) => a,
        Some(_) => return Err("\"assignments\" is not an array".to_owned()),
        None => return Err("the body has no \"assignments\"".to_owned()),
    };
    let mut assigned = BTreeSet::new();
    for (i, entry) in entries.iter().enumerate() {
        let group = entry
            .as_object()
            .ok_or_else(|| format!("assignments[{i}] is not an object"))?
            .get("group_id")
            .ok_or_else(|| format!("assignments[{i}] has no \"group_id\""))?
            .as_str()
            .ok_or_else(|| format!("assignments[{i}].group_id is not a string"))?;
        let id = group
            .parse::<GroupId>()
            .map_err(|e| format!("assignments[{i}].group_id: {e}"))?;
        assigned.insert(id);
    }
    let mut retain = BTreeSet::new();
    match obj.get("retain") {
        None => {}
        Some(Value::Array(a)) => {
            for (i, v) in a.iter().enumerate() {
                let s = v
                    .as_str()
                    .ok_or_else(|| format!("retain[{i}] is not a string"))?;
                retain.insert(
                    s.parse::<GroupId>()
                        .map_err(|e| format!("retain[{i}]: {e}"))?,
                );
            }
        }
        Some(_) => return Err("\"retain\" is not an array".to_owned()),
    }
    Ok(Desired { assigned, retain })
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: &str = "38069a4cc4285c4245c84587ac60084ba53502a8b91c9b108bca40f10ec4d3df";
    const B: &str = "abababababababababababababababababababababababababababababababab";

    fn id(s: &str) -> GroupId {
        s.parse().unwrap()
    }

    #[test]
    fn a_good_answer_gives_the_sets_and_ignores_extras() {
        let body = format!(
            r#"{{"assignments":[{{"group_id":"{A}","admitter_addrs":["/ip4/1.2.3.4/tcp/1"]}},
                {{"group_id":"{}","new_hint":1}}],"retain":["{B}"],"future":{{"x":1}}}}"#,
            B.to_uppercase()
        );
        let d = parse_should_join(body.as_bytes()).unwrap();
        assert_eq!(d.assigned, [id(A), id(B)].into());
        assert_eq!(d.retain, [id(B)].into());
        let empty = parse_should_join(br#"{"assignments":[]}"#).unwrap();
        assert_eq!(empty, Desired::default());
    }

    #[test]
    fn every_wrong_shape_fails_the_whole_poll() {
        let good = format!(r#"{{"group_id":"{A}"}}"#);
        for body in [
            String::new(),
            "not json".to_owned(),
            "[]".to_owned(),
            "null".to_owned(),
            r#""assignments""#.to_owned(),
            "{}".to_owned(),
            r#"{"assignments":null}"#.to_owned(),
            r#"{"assignments":{}}"#.to_owned(),
            format!(r#"{{"assignments":[{good},"{A}"]}}"#),
            format!(r#"{{"assignments":[{good},{{}}]}}"#),
            format!(r#"{{"assignments":[{good},{{"group_id":7}}]}}"#),
            format!(r#"{{"assignments":[{good},{{"group_id":"abcd"}}]}}"#),
            format!(
                r#"{{"assignments":[{good},{{"group_id":"{}"}}]}}"#,
                "z".repeat(64)
            ),
            format!(r#"{{"assignments":[{good}],"retain":"{A}"}}"#),
            format!(r#"{{"assignments":[{good}],"retain":[1]}}"#),
            format!(r#"{{"assignments":[{good}],"retain":["abc"]}}"#),
            format!(r#"{{"assignments":[{good}]"#),
        ] {
            assert!(parse_should_join(body.as_bytes()).is_err(), "{body}");
        }
    }
}
