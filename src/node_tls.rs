//! The node's TLS key (`key.pem` in `[tls] dir`, P-256): its public key, which a certificate
//! MDMA delivers must certify before it is installed, and the certificate signing request
//! registration sends so MDMA can sign a certificate for the relay host.
//!
//! The CSR ([`registration_csr`]) is DER with SAN DNS = the relay URL's host (and CN = the
//! host when it fits X.509's 64 characters), signed with the node's key, sent as one line of
//! base64. A host no CA would sign (an IP literal, `localhost`, a label over 63 characters or
//! a name over 253) gets no CSR, and registration goes on without one. It is kept in `[tls] dir` as
//! `csr-<host>.b64` and byte-stable: the registration nonce commits to its SHA-256, and an
//! ECDSA signature over the same request is deterministic here (RFC 6979), so a lost cache
//! gives the same bytes again. A cached CSR over another key (the key was replaced) is made
//! again; the other hosts' cached CSRs are removed.

use std::path::{Path, PathBuf};
use std::str::FromStr;

use base64::Engine;
use tracing::warn;
use x509_cert::builder::{Builder, RequestBuilder};
use x509_cert::der::asn1::Ia5String;
use x509_cert::der::{Decode, Encode};
use x509_cert::ext::pkix::name::GeneralName;
use x509_cert::ext::pkix::SubjectAltName;
use x509_cert::name::Name;
use x509_cert::request::CertReq;

use crate::durable;

/// Largest `key.pem` (or cached CSR) read; a larger file is not one.
const MAX_KEY_FILE: u64 = 64 * 1024;
/// The cached CSR's mode: it is public (it holds the public key and the host).
const CSR_MODE: u32 = 0o644;
/// Longest host a CSR is made for (a DNS name's limit, RFC 1035).
const MAX_HOST: usize = 253;
/// Longest label of that host (RFC 1035).
const MAX_LABEL: usize = 63;
/// Longest common name X.509 takes (RFC 5280's `ub-common-name`): a longer host goes in the
/// SAN only.
const MAX_CN: usize = 64;

/// The first PEM block labelled `label` in `text` (`-----BEGIN {label}-----` to its
/// `-----END {label}-----`), if whole.
pub(crate) fn pem_block<'t>(text: &'t str, label: &str) -> Option<&'t str> {
    let begin = format!("-----BEGIN {label}-----");
    let end = format!("-----END {label}-----");
    let start = text.find(&begin)?;
    let len = text[start..].find(&end)?;
    Some(&text[start..start + len + end.len()])
}

/// Why `key.pem` is not a P-256 private key (or its public key cannot be encoded); never
/// holds the key's bytes.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub(crate) enum KeyError {
    /// The file is not text.
    #[error("not UTF-8")]
    NotUtf8,
    /// No `PRIVATE KEY` nor `EC PRIVATE KEY` block.
    #[error("no PEM private key")]
    NoPrivateKey,
    /// A PKCS#8 block that is not a P-256 key.
    #[error("not a P-256 key ({0})")]
    Pkcs8(p256::pkcs8::Error),
    /// A SEC1 block that is not a P-256 key.
    #[error("not a P-256 key ({0})")]
    Sec1(p256::elliptic_curve::Error),
    /// Its SubjectPublicKeyInfo could not be encoded.
    #[error("{0}")]
    PublicKey(p256::pkcs8::spki::Error),
}

/// A P-256 private key from PEM: PKCS#8 (`PRIVATE KEY`) or SEC1 (`EC PRIVATE KEY`, after
/// any `EC PARAMETERS` block, as `openssl ecparam` writes it).
///
/// Errors: [`KeyError`], why it is not one, for the log (never the key's bytes).
pub(crate) fn secret_key(pem: &[u8]) -> Result<p256::SecretKey, KeyError> {
    use p256::pkcs8::DecodePrivateKey;
    let text = std::str::from_utf8(pem).map_err(|_| KeyError::NotUtf8)?;
    if let Some(block) = pem_block(text, "PRIVATE KEY") {
        p256::SecretKey::from_pkcs8_pem(block).map_err(KeyError::Pkcs8)
    } else if let Some(block) = pem_block(text, "EC PRIVATE KEY") {
        p256::SecretKey::from_sec1_pem(block).map_err(KeyError::Sec1)
    } else {
        Err(KeyError::NoPrivateKey)
    }
}

/// The SubjectPublicKeyInfo (DER) of a P-256 private key in PEM (see [`secret_key`]).
///
/// Errors: [`KeyError`], why it is not one.
pub(crate) fn public_key_der(pem: &[u8]) -> Result<Vec<u8>, KeyError> {
    spki_der(&secret_key(pem)?)
}

fn spki_der(key: &p256::SecretKey) -> Result<Vec<u8>, KeyError> {
    use p256::pkcs8::EncodePublicKey;
    key.public_key()
        .to_public_key_der()
        .map(|der| der.as_bytes().to_vec())
        .map_err(KeyError::PublicKey)
}

/// Why a relay URL's host cannot be in a certificate: `host` is shown cut to 80
/// characters.
#[derive(Debug, thiserror::Error)]
pub(crate) enum RelayHostError {
    /// An IP literal (`[…]` around an IPv6 one).
    #[error("the relay host {0} is an IP address, which no CA signs a certificate for")]
    IpAddress(String),
    /// Longer than [`MAX_HOST`] characters.
    #[error("the relay host {host} is {len} characters long; a DNS name has at most {MAX_HOST}")]
    TooLong {
        /// The host, shown.
        host: String,
        /// Its length in characters.
        len: usize,
    },
    /// `localhost` or a name under it.
    #[error("the relay host {0} is local; no CA signs a certificate for it")]
    Local(String),
    /// A label with a character no DNS name has (or empty, or a `-` at an end).
    #[error("the relay host {host} is not a DNS name (label {label:?})")]
    NotDns {
        /// The host, shown.
        host: String,
        /// The label.
        label: String,
    },
    /// A label longer than [`MAX_LABEL`].
    #[error("the relay host {host} has a label of {len} characters; a DNS label has at most {MAX_LABEL}")]
    LabelTooLong {
        /// The host, shown.
        host: String,
        /// The label's length.
        len: usize,
    },
}

/// The host a CSR is made for: the relay URL's host, lowercase, when it is a DNS name a CA
/// signs: labels of 1 to [`MAX_LABEL`] letters, digits and `-` (not at either end), at most
/// [`MAX_HOST`] characters in all, not `localhost` (nor under it).
///
/// Returns `Ok(None)` when there is no host to ask for (an empty URL, one that does not
/// parse or has no host).
///
/// Errors: [`RelayHostError`], why the host cannot be in a certificate (an IP literal,
/// `localhost`, a label or a name too long, a character no DNS name has), for the one log
/// line that says so.
pub(crate) fn relay_host(relay_url: &str) -> Result<Option<String>, RelayHostError> {
    let Ok(url) = url::Url::parse(relay_url.trim()) else {
        return Ok(None);
    };
    let host = match url.host() {
        None => return Ok(None),
        Some(url::Host::Domain("")) => return Ok(None),
        Some(url::Host::Ipv4(ip)) => return Err(RelayHostError::IpAddress(ip.to_string())),
        Some(url::Host::Ipv6(ip)) => return Err(RelayHostError::IpAddress(format!("[{ip}]"))),
        Some(url::Host::Domain(d)) => d.to_ascii_lowercase(),
    };
    let shown = || {
        let mut s: String = host.chars().take(80).collect();
        if host.len() > 80 {
            s.push('…');
        }
        s
    };
    if host.len() > MAX_HOST {
        return Err(RelayHostError::TooLong {
            host: shown(),
            len: host.len(),
        });
    }
    if host == "localhost" || host.ends_with(".localhost") {
        return Err(RelayHostError::Local(host));
    }
    for label in host.split('.') {
        let fine = !label.is_empty()
            && !label.starts_with('-')
            && !label.ends_with('-')
            && label
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
        if !fine {
            return Err(RelayHostError::NotDns {
                host: shown(),
                label: label.to_owned(),
            });
        }
        if label.len() > MAX_LABEL {
            return Err(RelayHostError::LabelTooLong {
                host: shown(),
                len: label.len(),
            });
        }
    }
    Ok(Some(host))
}

/// A DER certificate signing request for `host` (SAN DNS, and CN when the host fits X.509's
/// [`MAX_CN`] characters; a longer one leaves the subject empty, as CAs issue such names),
/// signed with `key` (ECDSA P-256 with SHA-256, deterministic: the same key and host give
/// the same bytes).
///
/// Errors: [`CsrError`], why the request cannot be built (not expected for a host
/// [`relay_host`] gave).
pub(crate) fn csr_der(key: &p256::SecretKey, host: &str) -> Result<Vec<u8>, CsrError> {
    let signer = p256::ecdsa::SigningKey::from(key);
    let subject = if host.len() <= MAX_CN {
        Name::from_str(&format!("CN={host}"))?
    } else {
        Name::default()
    };
    let dns = Ia5String::new(host)?;
    let mut request = RequestBuilder::new(subject, &signer)?;
    request.add_extension(&SubjectAltName(vec![GeneralName::DnsName(dns)]))?;
    Ok(request.build::<p256::ecdsa::DerSignature>()?.to_der()?)
}

/// Why a CSR could not be built.
#[derive(Debug, thiserror::Error)]
pub(crate) enum CsrError {
    /// A name or the request could not be encoded.
    #[error("{0}")]
    Der(#[from] x509_cert::der::Error),
    /// The request could not be assembled or signed.
    #[error("{0}")]
    Builder(#[from] x509_cert::builder::Error),
    /// The key's public key could not be encoded.
    #[error(transparent)]
    Key(#[from] KeyError),
}

/// `csr-<host>.b64` in `dir`: where the CSR for `host` is kept.
pub(crate) fn cache_file(dir: &Path, host: &str) -> PathBuf {
    dir.join(format!("csr-{host}.b64"))
}

/// What registration sends as `csr`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Csr {
    /// The CSR, one line of base64 (no newline).
    Ready(String),
    /// No CSR: the relay URL has no host to ask a certificate for (a lab node's empty one).
    NoHost,
    /// No CSR, and why (for the log): no key, or one that is not a P-256 key.
    Without(String),
}

/// The node's key could not be read: the attempt fails and is retried, since a failed
/// read says nothing about whether there is a key (a registration without a CSR would
/// leave the node without a certificate until it registers again).
#[derive(Debug, thiserror::Error)]
#[error("cannot read the node's TLS key {path}: {source}")]
pub(crate) struct KeyUnreadable {
    /// `key.pem`.
    pub(crate) path: PathBuf,
    /// The I/O error.
    #[source]
    pub(crate) source: std::io::Error,
}

/// The CSR registration sends for `relay_url`, over `key.pem` in `dir`: the cached one when
/// it is over this key, else made and cached (a failed cache write is logged: the CSR is
/// deterministic, so the next attempt sends the same bytes); the other hosts' cached CSRs
/// are removed. Blocks on the disk: run it on the blocking pool.
///
/// Errors: [`KeyUnreadable`] when `key.pem` exists but cannot be read.
pub(crate) fn registration_csr(dir: &Path, relay_url: &str) -> Result<Csr, KeyUnreadable> {
    let host = match relay_host(relay_url) {
        Ok(Some(host)) => host,
        Ok(None) => return Ok(Csr::NoHost),
        Err(why) => return Ok(Csr::Without(why.to_string())),
    };
    let key_file = dir.join("key.pem");
    let key_pem = match durable::read_capped(&key_file, MAX_KEY_FILE) {
        Ok(Some(pem)) if !pem.iter().all(u8::is_ascii_whitespace) => pem,
        Ok(_) => {
            return Ok(Csr::Without(format!(
                "no TLS key at {}",
                key_file.display()
            )))
        }
        // Too large, or not a regular file: not a key, whatever is read next time.
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::FileTooLarge | std::io::ErrorKind::InvalidInput
            ) =>
        {
            return Ok(Csr::Without(format!("{}: {e}", key_file.display())))
        }
        Err(source) => {
            return Err(KeyUnreadable {
                path: key_file,
                source,
            })
        }
    };
    let key = match secret_key(&key_pem) {
        Ok(k) => k,
        Err(why) => return Ok(Csr::Without(format!("{}: {why}", key_file.display()))),
    };
    let made = spki_der(&key)
        .map_err(CsrError::from)
        .and_then(|spki| Ok((spki, csr_der(&key, &host)?)));
    let (spki, der) = match made {
        Ok(made) => made,
        Err(why) => return Ok(Csr::Without(format!("no CSR for {host}: {why}"))),
    };
    let cache = cache_file(dir, &host);
    let text = match cached(&cache, &spki) {
        Some(text) => text,
        None => {
            let text = base64::engine::general_purpose::STANDARD.encode(der);
            if let Err(e) = durable::write_atomically(&cache, text.as_bytes(), CSR_MODE) {
                warn!("the CSR for {host} is sent but not kept: {e}");
            }
            text
        }
    };
    remove_other_hosts(dir, &cache);
    Ok(Csr::Ready(text))
}

/// The CSR cached in `file` when it is one line of base64 of a CSR over the key whose
/// SubjectPublicKeyInfo is `spki`.
fn cached(file: &Path, spki: &[u8]) -> Option<String> {
    let bytes = durable::read_capped(file, MAX_KEY_FILE).ok()??;
    let text = std::str::from_utf8(&bytes).ok()?.trim_end_matches('\n');
    let der = base64::engine::general_purpose::STANDARD
        .decode(text)
        .ok()?;
    let request = CertReq::from_der(&der).ok()?;
    let over = request.info.public_key.to_der().ok()?;
    (over == spki).then(|| text.to_owned())
}

/// Removes every `csr-*.b64` in `dir` but `keep` (a failure is logged).
fn remove_other_hosts(dir: &Path, keep: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.filter_map(Result::ok) {
        let name = entry.file_name();
        let name = name.to_string_lossy();
        let path = entry.path();
        if name.starts_with("csr-") && name.ends_with(".b64") && path != keep {
            if let Err(e) = std::fs::remove_file(&path) {
                warn!("cannot remove the stale CSR {}: {e}", path.display());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A P-256 key as `openssl genpkey` writes it (PKCS#8 PEM).
    fn key_pem() -> String {
        use p256::pkcs8::EncodePrivateKey;
        let key = p256::SecretKey::random(&mut p256::elliptic_curve::rand_core::OsRng);
        key.to_pkcs8_pem(p256::pkcs8::LineEnding::LF)
            .unwrap()
            .to_string()
    }

    fn decode(text: &str) -> CertReq {
        let der = base64::engine::general_purpose::STANDARD
            .decode(text)
            .unwrap();
        CertReq::from_der(&der).unwrap()
    }

    /// The SAN DNS names of a CSR's extension request.
    fn san_dns(req: &CertReq) -> Vec<String> {
        use x509_cert::ext::Extensions;
        let mut names = Vec::new();
        for attr in req.info.attributes.iter() {
            // extensionRequest (PKCS#9).
            if attr.oid.to_string() != "1.2.840.113549.1.9.14" {
                continue;
            }
            for value in attr.values.iter() {
                let exts: Extensions = value.decode_as().unwrap();
                for ext in exts {
                    if ext.extn_id.to_string() == "2.5.29.17" {
                        let san = SubjectAltName::from_der(ext.extn_value.as_bytes()).unwrap();
                        for name in san.0 {
                            if let GeneralName::DnsName(d) = name {
                                names.push(d.to_string());
                            }
                        }
                    }
                }
            }
        }
        names
    }

    #[test]
    fn the_host_is_the_relay_url_s_lowercased_and_nothing_for_none_or_garbage() {
        for (url, host) in [
            ("https://H.example", Some("h.example")),
            ("https://relay.example/admin-api/x", Some("relay.example")),
            ("https://relay.example:8443", Some("relay.example")),
            ("https://relay", Some("relay")),
            ("", None),
            ("not a url", None),
            ("relay.example:443", None),
            ("file:///etc/passwd", None),
        ] {
            assert_eq!(relay_host(url).unwrap().as_deref(), host, "{url:?}");
        }
    }

    #[test]
    fn a_host_no_ca_signs_is_refused_saying_why() {
        let label63 = "a".repeat(63);
        let name253 = format!("{label63}.{label63}.{label63}.{}", "b".repeat(61));
        assert_eq!(name253.len(), 253);
        assert_eq!(
            relay_host(&format!("https://{name253}/"))
                .unwrap()
                .as_deref(),
            Some(name253.as_str()),
            "at the limits: fine"
        );
        for (url, why) in [
            ("http://10.0.0.7:2428".to_owned(), "IP address"),
            ("https://[::1]/".to_owned(), "IP address"),
            ("https://2130706433/".to_owned(), "IP address"),
            ("https://localhost:8443".to_owned(), "local"),
            ("https://relay.LOCALHOST".to_owned(), "local"),
            (
                format!("https://{}.example", "a".repeat(64)),
                "a label of 64",
            ),
            (format!("https://{name253}x/"), "254 characters"),
            (format!("https://a.{name253}/"), "255 characters"),
            ("https://relay.example./".to_owned(), r#"label """#),
            ("https://-relay.example/".to_owned(), "not a DNS name"),
            ("https://relay_1.example/".to_owned(), "not a DNS name"),
        ] {
            match relay_host(&url) {
                Err(e) => assert!(e.to_string().contains(why), "{url}: {e}"),
                Ok(h) => panic!("{url}: {h:?}"),
            }
        }
    }

    #[test]
    fn a_host_over_64_characters_goes_in_the_san_only() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("key.pem"), key_pem()).unwrap();
        let label63 = "h".repeat(63);
        let hosts = [
            format!("{}.com", "a".repeat(60)),
            format!("{}.com", "a".repeat(61)),
            format!("{label63}.{label63}.{label63}.{}", "b".repeat(61)),
        ];
        for host in hosts {
            let len = host.len();
            let Csr::Ready(text) =
                registration_csr(dir.path(), &format!("https://{host}/")).unwrap()
            else {
                panic!("no CSR for {len}")
            };
            let req = decode(&text);
            assert_eq!(san_dns(&req), std::slice::from_ref(&host));
            let cn = req.info.subject.to_string();
            if len <= MAX_CN {
                assert_eq!(cn, format!("CN={host}"));
            } else {
                assert_eq!(cn, "", "no CN over 64 characters");
            }
        }
        // Refused hosts: no CSR, and why; nothing cached.
        for url in ["https://localhost/", "http://192.0.2.1/"] {
            match registration_csr(dir.path(), url).unwrap() {
                Csr::Without(why) => assert!(why.contains("relay host"), "{why}"),
                other => panic!("{url}: {other:?}"),
            }
        }
    }

    #[test]
    fn the_csr_names_the_host_as_cn_and_san_and_is_over_the_node_s_key_and_signed() {
        use p256::ecdsa::signature::Verifier;
        let dir = tempfile::tempdir().unwrap();
        let pem = key_pem();
        std::fs::write(dir.path().join("key.pem"), &pem).unwrap();
        let Csr::Ready(text) = registration_csr(dir.path(), "https://Relay.Example/x").unwrap()
        else {
            panic!("no CSR")
        };
        assert!(!text.contains(['\n', '\r', ' ']), "one line");
        let req = decode(&text);
        assert_eq!(req.info.subject.to_string(), "CN=relay.example");
        assert_eq!(san_dns(&req), ["relay.example"]);
        assert_eq!(
            req.info.public_key.to_der().unwrap(),
            public_key_der(pem.as_bytes()).unwrap()
        );
        let key = secret_key(pem.as_bytes()).unwrap();
        let verifying = p256::ecdsa::VerifyingKey::from(key.public_key());
        let signature = p256::ecdsa::DerSignature::try_from(req.signature.raw_bytes()).unwrap();
        verifying
            .verify(&req.info.to_der().unwrap(), &signature)
            .expect("signed with the node's key");
        // Cached where the contract says, exactly as sent.
        assert_eq!(
            std::fs::read_to_string(dir.path().join("csr-relay.example.b64")).unwrap(),
            text
        );
    }

    #[test]
    fn the_csr_is_byte_stable_across_restarts_and_a_lost_cache() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("key.pem"), key_pem()).unwrap();
        let first = registration_csr(dir.path(), "https://relay.example").unwrap();
        assert_eq!(
            registration_csr(dir.path(), "https://relay.example").unwrap(),
            first
        );
        std::fs::remove_file(dir.path().join("csr-relay.example.b64")).unwrap();
        assert_eq!(
            registration_csr(dir.path(), "https://relay.example").unwrap(),
            first,
            "deterministic: the same bytes without the cache"
        );
    }

    #[test]
    fn a_cached_csr_is_kept_verbatim_while_it_is_over_the_key_and_made_again_after_a_new_key() {
        let dir = tempfile::tempdir().unwrap();
        let key = dir.path().join("key.pem");
        std::fs::write(&key, key_pem()).unwrap();
        let Csr::Ready(ours) = registration_csr(dir.path(), "https://relay.example").unwrap()
        else {
            panic!("no CSR")
        };
        // One an older sidecar made (with a newline): kept as it is, so a nonce it
        // committed to still matches.
        let cache = dir.path().join("csr-relay.example.b64");
        // openssl signs with a random nonce: the same request, other bytes.
        let other = {
            let k = secret_key(std::fs::read(&key).unwrap().as_slice()).unwrap();
            let signer = p256::ecdsa::SigningKey::from(&k);
            let mut request =
                RequestBuilder::new(Name::from_str("CN=relay.example").unwrap(), &signer).unwrap();
            let dns = Ia5String::new("relay.example").unwrap();
            request
                .add_extension(&SubjectAltName(vec![GeneralName::DnsName(dns)]))
                .unwrap();
            let der = request
                .build_with_rng::<p256::ecdsa::DerSignature>(
                    &mut p256::elliptic_curve::rand_core::OsRng,
                )
                .unwrap()
                .to_der()
                .unwrap();
            base64::engine::general_purpose::STANDARD.encode(der)
        };
        assert_ne!(other, ours);
        std::fs::write(&cache, format!("{other}\n")).unwrap();
        assert_eq!(
            registration_csr(dir.path(), "https://relay.example").unwrap(),
            Csr::Ready(other)
        );
        std::fs::write(&cache, "garbage").unwrap();
        assert_eq!(
            registration_csr(dir.path(), "https://relay.example").unwrap(),
            Csr::Ready(ours.clone())
        );
        // The key was replaced: the cached CSR is over the old one.
        std::fs::write(&key, key_pem()).unwrap();
        let Csr::Ready(new) = registration_csr(dir.path(), "https://relay.example").unwrap() else {
            panic!("no CSR")
        };
        assert_ne!(new, ours);
        assert_eq!(std::fs::read_to_string(&cache).unwrap(), new);
    }

    #[test]
    fn a_new_host_gives_a_new_csr_and_removes_the_old_hosts_cache() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("key.pem"), key_pem()).unwrap();
        std::fs::write(dir.path().join("cert.pem"), "kept").unwrap();
        let old = registration_csr(dir.path(), "https://old.example").unwrap();
        assert!(dir.path().join("csr-old.example.b64").exists());
        let Csr::Ready(new) = registration_csr(dir.path(), "https://new.example").unwrap() else {
            panic!("no CSR")
        };
        assert_ne!(Csr::Ready(new.clone()), old);
        assert_eq!(san_dns(&decode(&new)), ["new.example"]);
        let mut names: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(names, ["cert.pem", "csr-new.example.b64", "key.pem"]);
    }

    #[test]
    fn without_a_host_or_a_usable_key_there_is_no_csr_and_an_unreadable_key_fails() {
        let dir = tempfile::tempdir().unwrap();
        let key = dir.path().join("key.pem");
        let without = |url: &str| {
            matches!(
                registration_csr(dir.path(), url).unwrap(),
                Csr::Without(_) | Csr::NoHost
            )
        };
        assert!(without("https://relay.example"), "no key.pem");
        std::fs::write(&key, "\n").unwrap();
        assert!(without("https://relay.example"), "an empty key.pem");
        std::fs::write(&key, "-----BEGIN RSA PRIVATE KEY-----\n").unwrap();
        assert!(without("https://relay.example"), "not a P-256 key");
        std::fs::write(&key, key_pem()).unwrap();
        assert!(without(""), "no relay URL");
        assert!(without("not a url"));
        assert!(
            std::fs::read_dir(dir.path()).unwrap().count() == 1,
            "nothing cached without a CSR"
        );
        // A key that is there but cannot be read is unknown: the attempt fails.
        std::fs::remove_file(&key).unwrap();
        std::os::unix::fs::symlink(&key, &key).unwrap();
        assert!(registration_csr(dir.path(), "https://relay.example").is_err());
    }
}
