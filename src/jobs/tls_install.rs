//! The certificate MDMA delivers (`tls_certificate` in a should-join answer that passed the
//! gate), installed as `cert.pem` in `[tls] dir` by a job beside the loop: the poll only
//! hands it over ([`CertInstaller::offer`]) and never waits for the install.
//!
//! The rule ([`judge`], pure; the delivery is checked whole before anything is written):
//! - it holds PEM `CERTIFICATE` blocks and nothing but whitespace around them: a private
//!   key, any other block or stray text refuses it (a world-readable `cert.pem` never
//!   carries a key);
//! - exactly one of its certificates (the leaf) certifies `key.pem`'s public key (the
//!   SubjectPublicKeyInfo compared in-process); it is written first, the rest of the chain
//!   after it in the order delivered;
//! - the leaf is valid now: not before its `notBefore` (less [`NOT_YET_VALID_SKEW`]), not
//!   after its `notAfter`; the chain's other certificates are the TLS clients' business
//!   (public chains carry expired cross-signs on purpose);
//! - the leaf was not issued before the installed one (an earlier `notBefore`: a replay or a
//!   stale cache), unless the installed one is the image's self-signed placeholder;
//! - "the same certificate" is the same DER chain however it is encoded (line endings, final
//!   newlines, line widths): it changes nothing. What is written is the chain re-encoded
//!   (LF, 64 columns), so nothing but certificates' DER ever reaches the file.
//!
//! A refusal is said once per distinct delivery (the last [`REFUSALS_REMEMBERED`] kept),
//! since MDMA repeats it every poll; otherwise the chain is written atomically (mode 0644),
//! then every unit in `[tls] restart_units` is restarted through systemd's D-Bus API
//! ([`UnitControl`]). A failed restart is retried with the back-off until it succeeds or a
//! newer certificate is installed; the certificate stays installed.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use sha2::{Digest, Sha256};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};
use x509_cert::der::{pem, Decode, Encode};
use x509_cert::Certificate;

use super::install::{
    deliveries, file_work, restart_each, Delivered, Deliveries, InstallError, FILES_DEADLINE,
};
use super::node_files::{cert_not_after, NodeFilesView};
use super::units::{UnitControl, RESTART_TIMEOUT};
use crate::config::Config;
use crate::durable;
use crate::jobs::{self, Job, Schedule};
use crate::node_tls::{public_key_der, KeyError};
use crate::telemetry::Telemetry;

/// The installed certificate's mode: readable by the TLS terminator's user.
const CERT_MODE: u32 = 0o644;
/// Largest `key.pem` or installed `cert.pem` read; a larger file is not one, and a delivery
/// that would write a larger one is refused (it would read as foreign and be written again).
const MAX_FILE: u64 = 64 * 1024;
/// How far in the future a leaf's `notBefore` may lie and still be installed: the CA's clock
/// and ours disagree by a little (CAs backdate by minutes for the same reason).
pub(crate) const NOT_YET_VALID_SKEW: Duration = Duration::from_secs(5 * 60);
/// How many refused deliveries are remembered so that each is logged once: MDMA's replicas
/// may alternate between a few, and an unbounded memory would grow with what MDMA sends.
pub(crate) const REFUSALS_REMEMBERED: usize = 32;
/// Most certificates in one delivery (a leaf and its chain are a handful).
const MAX_CHAIN: usize = 16;

/// What to do with a delivered certificate.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Write these bytes as `cert.pem` (the leaf, then its chain, re-encoded), then restart.
    Install(Vec<u8>),
    /// The same DER chain as the installed certificate: nothing to do.
    Unchanged,
    /// Not installed, and why.
    Refused(Refusal),
}

/// Why a delivered certificate is not installed (a block's label is named, never its
/// content; certificates are counted from 1 in the order delivered).
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub(crate) enum Refusal {
    /// Something else than PEM blocks and whitespace.
    #[error("it holds text outside PEM blocks")]
    TextOutsidePem,
    /// A `-----BEGIN ` with no closing dashes.
    #[error("a PEM block's header is cut short")]
    HeaderCut,
    /// A block that is not a certificate (its label, cut to 40 characters).
    #[error("it holds a {0:?} block (only certificates are installed)")]
    OtherBlock(String),
    /// A certificate block without its end line.
    #[error("a certificate block has no end line")]
    NoEndLine,
    /// A certificate block that does not decode.
    #[error("certificate {index} is not valid PEM ({why})")]
    BadPem {
        /// Which certificate.
        index: usize,
        /// Why (`pem`'s error is not a `std` error).
        why: pem::Error,
    },
    /// A block that decodes to another label.
    #[error("certificate {0} is not one")]
    NotCertificate(usize),
    /// More than [`MAX_CHAIN`] certificates.
    #[error("it holds more than {MAX_CHAIN} certificates")]
    TooMany,
    /// No certificate at all.
    #[error("it is not a PEM X.509 certificate")]
    Empty,
    /// A certificate whose DER is not X.509.
    #[error("certificate {index} is not X.509 ({source})")]
    NotX509 {
        /// Which certificate.
        index: usize,
        /// Why.
        source: x509_cert::der::Error,
    },
    /// `key.pem` is missing or blank.
    #[error("the node has no TLS key (key.pem) to match it")]
    NoKey,
    /// `key.pem` is not a P-256 key.
    #[error("key.pem: {0}")]
    BadKey(KeyError),
    /// A certificate's public key could not be encoded to compare it.
    #[error("certificate {index}'s public key cannot be encoded: {source}")]
    KeyEncoding {
        /// Which certificate.
        index: usize,
        /// Why.
        source: x509_cert::der::Error,
    },
    /// No certificate is over `key.pem`'s key.
    #[error("it certifies another key than key.pem's")]
    OtherKey,
    /// More than one certificate is over `key.pem`'s key.
    #[error("{0} of its certificates certify key.pem's key: which is the leaf is ambiguous")]
    AmbiguousLeaf(usize),
    /// The leaf's `notBefore` is ahead of now (beyond [`NOT_YET_VALID_SKEW`]).
    #[error("it is not valid until {}", rfc3339(*.0))]
    NotYetValid(SystemTime),
    /// The leaf's `notAfter` has passed.
    #[error("it expired at {}", rfc3339(*.0))]
    Expired(SystemTime),
    /// The leaf is older than the installed (CA-issued) one.
    #[error(
        "it was issued before the installed certificate (notBefore {} < {}): a replay or a \
         stale copy",
        rfc3339(*.not_before),
        rfc3339(*.installed_from)
    )]
    Replay {
        /// The delivered leaf's `notBefore`.
        not_before: SystemTime,
        /// The installed leaf's.
        installed_from: SystemTime,
    },
    /// The chain could not be written as PEM.
    #[error("cannot be encoded as PEM ({0})")]
    PemEncoding(pem::Error),
    /// The chain as PEM is larger than [`MAX_FILE`].
    #[error("it is larger than {MAX_FILE} bytes")]
    TooLarge,
}

/// The DER of every certificate in `text`, in order: PEM `CERTIFICATE` blocks with nothing
/// but whitespace around them (LF or CRLF line endings).
///
/// Errors: [`Refusal`], why it is not only certificates.
pub(crate) fn certificate_chain(text: &str) -> Result<Vec<Vec<u8>>, Refusal> {
    const BEGIN: &str = "-----BEGIN ";
    let mut chain = Vec::new();
    let mut rest = text.trim_start();
    while !rest.is_empty() {
        if !rest.starts_with(BEGIN) {
            return Err(Refusal::TextOutsidePem);
        }
        let label_end = rest[BEGIN.len()..]
            .find("-----")
            .map(|i| BEGIN.len() + i)
            .ok_or(Refusal::HeaderCut)?;
        let label = &rest[BEGIN.len()..label_end];
        if label != "CERTIFICATE" {
            let shown: String = label.chars().take(40).filter(|c| !c.is_control()).collect();
            return Err(Refusal::OtherBlock(shown));
        }
        let end = "-----END CERTIFICATE-----";
        let block_end = rest
            .find(end)
            .map(|i| i + end.len())
            .ok_or(Refusal::NoEndLine)?;
        let (label, der) =
            pem::decode_vec(&rest.as_bytes()[..block_end]).map_err(|why| Refusal::BadPem {
                index: chain.len() + 1,
                why,
            })?;
        if label != "CERTIFICATE" {
            return Err(Refusal::NotCertificate(chain.len() + 1));
        }
        chain.push(der);
        if chain.len() > MAX_CHAIN {
            return Err(Refusal::TooMany);
        }
        rest = rest[block_end..].trim_start();
    }
    if chain.is_empty() {
        return Err(Refusal::Empty);
    }
    Ok(chain)
}

/// A delivery's identity for saying a refusal once: SHA-256 of its certificates' DER when it
/// holds only certificates (so its encodings are one delivery), of its bytes otherwise.
pub(crate) fn delivery_digest(delivered: &str) -> [u8; 32] {
    let mut hash = Sha256::new();
    match certificate_chain(delivered) {
        Ok(chain) => {
            for der in chain {
                hash.update((der.len() as u64).to_be_bytes());
                hash.update(&der);
            }
        }
        Err(_) => {
            hash.update(b"bytes");
            hash.update(delivered.as_bytes());
        }
    }
    hash.finalize().into()
}

/// The chain as PEM: LF line endings, 64 columns, one block after another.
fn encode_chain(chain: &[&[u8]]) -> Result<Vec<u8>, Refusal> {
    let mut out = String::new();
    for der in chain {
        let block = pem::encode_string("CERTIFICATE", pem::LineEnding::LF, der)
            .map_err(Refusal::PemEncoding)?;
        out.push_str(&block);
    }
    Ok(out.into_bytes())
}

/// An RFC 3339 time for a refusal's reason.
fn rfc3339(t: SystemTime) -> String {
    humantime::format_rfc3339_seconds(t).to_string()
}

/// What becomes of `delivered` (PEM certificates: a leaf and its chain, in any order) given
/// `key.pem`'s bytes (`None`: no key file), the installed `cert.pem`'s (`None`: none) and
/// the wall clock `now`. Pure: the files are read and written by the caller.
pub(crate) fn judge(
    delivered: &str,
    key_pem: Option<&[u8]>,
    installed: Option<&[u8]>,
    now: SystemTime,
) -> Verdict {
    match judge_chain(delivered, key_pem, installed, now) {
        Ok(verdict) => verdict,
        Err(why) => Verdict::Refused(why),
    }
}

fn judge_chain(
    delivered: &str,
    key_pem: Option<&[u8]>,
    installed: Option<&[u8]>,
    now: SystemTime,
) -> Result<Verdict, Refusal> {
    let chain = certificate_chain(delivered)?;
    let certs = chain
        .iter()
        .enumerate()
        .map(|(i, der)| {
            Certificate::from_der(der).map_err(|source| Refusal::NotX509 {
                index: i + 1,
                source,
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let key = match key_pem {
        Some(k) if !k.iter().all(u8::is_ascii_whitespace) => k,
        _ => return Err(Refusal::NoKey),
    };
    let own = public_key_der(key).map_err(Refusal::BadKey)?;
    let mut over_own = Vec::new();
    for (i, cert) in certs.iter().enumerate() {
        let spki = cert
            .tbs_certificate
            .subject_public_key_info
            .to_der()
            .map_err(|source| Refusal::KeyEncoding {
                index: i + 1,
                source,
            })?;
        if spki == own {
            over_own.push(i);
        }
    }
    let leaf = match over_own[..] {
        [leaf] => leaf,
        [] => return Err(Refusal::OtherKey),
        _ => return Err(Refusal::AmbiguousLeaf(over_own.len())),
    };
    let ordered: Vec<&[u8]> = std::iter::once(leaf)
        .chain((0..chain.len()).filter(|&i| i != leaf))
        .map(|i| chain[i].as_slice())
        .collect();
    let installed_chain = installed
        .and_then(|bytes| std::str::from_utf8(bytes).ok())
        .and_then(|text| certificate_chain(text).ok());
    if let Some(current) = &installed_chain {
        if current
            .iter()
            .map(Vec::as_slice)
            .eq(ordered.iter().copied())
        {
            return Ok(Verdict::Unchanged);
        }
    }
    let validity = &certs[leaf].tbs_certificate.validity;
    let not_before = validity.not_before.to_system_time();
    let not_after = validity.not_after.to_system_time();
    if not_before > now + NOT_YET_VALID_SKEW {
        return Err(Refusal::NotYetValid(not_before));
    }
    if not_after < now {
        return Err(Refusal::Expired(not_after));
    }
    let installed_leaf = installed_chain
        .as_ref()
        .and_then(|current| current.first())
        .and_then(|der| Certificate::from_der(der).ok());
    if let Some(current) = installed_leaf {
        let tbs = &current.tbs_certificate;
        let placeholder = tbs.issuer == tbs.subject;
        let current_from = tbs.validity.not_before.to_system_time();
        if !placeholder && not_before < current_from {
            return Err(Refusal::Replay {
                not_before,
                installed_from: current_from,
            });
        }
    }
    let bytes = encode_chain(&ordered)?;
    if bytes.len() as u64 > MAX_FILE {
        return Err(Refusal::TooLarge);
    }
    Ok(Verdict::Install(bytes))
}

/// The loop's end of the job: hands it the certificates polls deliver.
#[derive(Debug)]
pub(crate) struct CertInstaller {
    delivered: Deliveries<Arc<str>>,
}

impl CertInstaller {
    /// Starts the job for `cfg`'s `[tls]`, or `None` when installs are off (`install =
    /// false`) or nothing may be written (a dry run).
    pub(crate) fn start(
        cfg: &Config,
        units: Arc<dyn UnitControl>,
        files: NodeFilesView,
        telemetry: Arc<Telemetry>,
        shutdown: CancellationToken,
    ) -> Option<Self> {
        if !cfg.tls.install || cfg.dry_run {
            return None;
        }
        let (delivered, rx) = deliveries();
        let job = CertInstallJob {
            delivered: rx,
            restarts: Vec::new(),
            refused: VecDeque::new(),
            key: cfg.tls.key_file(),
            cert: cfg.tls.dir.join("cert.pem"),
            restart_units: cfg.tls.restart_units.clone(),
            units,
            files,
            telemetry: Arc::clone(&telemetry),
        };
        jobs::spawn(job, telemetry, shutdown);
        Some(Self { delivered })
    }

    /// Hands over the certificate a poll delivered; the job wakes only when it differs
    /// from the one handed over before (MDMA repeats a delivery every poll).
    pub(crate) fn offer(&self, pem: String) {
        self.delivered.offer(Arc::from(pem));
    }
}

struct CertInstallJob {
    /// The deliveries, and the one judged last (installed, unchanged or refused).
    delivered: Delivered<Arc<str>>,
    /// The units still to restart for the certificate installed last.
    restarts: Vec<String>,
    /// [`delivery_digest`]s of the deliveries refused last, newest at the back, at most
    /// [`REFUSALS_REMEMBERED`]: a refusal is said once per distinct delivery.
    refused: VecDeque<[u8; 32]>,
    key: PathBuf,
    cert: PathBuf,
    restart_units: Vec<String>,
    units: Arc<dyn UnitControl>,
    /// Asked to look at `cert.pem` at once after an install, so polls report the expiry.
    files: NodeFilesView,
    telemetry: Arc<Telemetry>,
}

impl CertInstallJob {
    /// Reads the key and the installed certificate, judges `pem` and writes it if so.
    async fn install(&self, pem: Arc<str>) -> Result<Verdict, InstallError> {
        let (key, cert) = (self.key.clone(), self.cert.clone());
        file_work("the certificate files", move || {
            let key_pem = read_bounded(&key)?;
            // An oversized cert.pem cannot be the delivery: it is replaced.
            let installed = match durable::read_capped(&cert, MAX_FILE) {
                Err(e) if e.kind() == std::io::ErrorKind::FileTooLarge => Some(Vec::new()),
                read => read.map_err(InstallError::read(&cert))?,
            };
            let verdict = judge(
                &pem,
                key_pem.as_deref(),
                installed.as_deref(),
                SystemTime::now(),
            );
            if let Verdict::Install(bytes) = &verdict {
                durable::write_atomically(&cert, bytes, CERT_MODE)?;
            }
            Ok(verdict)
        })
        .await
    }
}

/// Records `digest` among the refusals remembered; `true` when it is new (to be logged).
/// The oldest is forgotten past [`REFUSALS_REMEMBERED`].
fn remember_refusal(refused: &mut VecDeque<[u8; 32]>, digest: [u8; 32]) -> bool {
    if refused.contains(&digest) {
        return false;
    }
    if refused.len() == REFUSALS_REMEMBERED {
        refused.pop_front();
    }
    refused.push_back(digest);
    true
}

/// A file's bytes, `None` when it does not exist ([`durable::read_capped`] at [`MAX_FILE`]).
fn read_bounded(path: &std::path::Path) -> Result<Option<Vec<u8>>, InstallError> {
    durable::read_capped(path, MAX_FILE).map_err(InstallError::read(path))
}

impl Job for CertInstallJob {
    type Output = ();
    type Error = InstallError;
    const NAME: &'static str = "tls_install";
    const FAILING: &'static str = "the delivered TLS certificate cannot be installed";
    const RECOVERED: &'static str = "the delivered TLS certificate is installed";

    fn schedule(&self) -> Schedule {
        let restarts = u32::try_from(self.restart_units.len()).unwrap_or(u32::MAX);
        Schedule::when_asked(
            FILES_DEADLINE
                .saturating_add(RESTART_TIMEOUT.saturating_mul(restarts))
                .saturating_add(Duration::from_secs(1)),
        )
    }

    async fn run(&mut self) -> Result<(), InstallError> {
        if let Some(current) = self.delivered.new_one() {
            if let Some(pem) = current.clone() {
                let verdict = self.install(Arc::clone(&pem)).await.inspect_err(|_| {
                    Telemetry::count(&self.telemetry.tls_installs, "error");
                })?;
                match verdict {
                    Verdict::Unchanged => {
                        Telemetry::count(&self.telemetry.tls_installs, "unchanged");
                    }
                    Verdict::Refused(why) => {
                        Telemetry::count(&self.telemetry.tls_installs, "refused");
                        let digest = delivery_digest(&pem);
                        if remember_refusal(&mut self.refused, digest) {
                            warn!(
                                delivery_sha256 = %hex::encode(digest),
                                "MDMA delivered a TLS certificate that is not installed: {why}"
                            );
                        }
                    }
                    Verdict::Install(bytes) => {
                        Telemetry::count(&self.telemetry.tls_installs, "installed");
                        info!(
                            path = %self.cert.display(),
                            expires = %cert_not_after(&bytes),
                            "installed the TLS certificate MDMA delivered"
                        );
                        self.files.look_soon();
                        self.restarts = self.restart_units.clone();
                    }
                }
            }
            self.delivered.dealt_with(current);
        }
        restart_each(
            &*self.units,
            &mut self.restarts,
            &self.telemetry,
            "for the new TLS certificate",
        )
        .await
    }

    fn idle(&self) -> bool {
        self.restarts.is_empty() && self.delivered.all_dealt_with()
    }

    async fn wake(&mut self) {
        self.delivered.changed().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rcgen::{CertificateParams, DistinguishedName, DnType, KeyPair};

    /// 2030-06-01T00:00:00Z: the tests' clock.
    fn now() -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_906_502_400)
    }

    /// A leaf over `key` valid from `from` to `to` (years, 1 January) and its CA, both PEM.
    fn issued_between(key: &KeyPair, from: i32, to: i32) -> (String, String) {
        let mut params = CertificateParams::new(vec!["node.test".to_owned()]).unwrap();
        params.not_before = rcgen::date_time_ymd(from, 1, 1);
        params.not_after = rcgen::date_time_ymd(to, 1, 1);
        let ca_key = KeyPair::generate().unwrap();
        let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, "fleet CA");
        ca.distinguished_name = dn;
        let ca = ca.self_signed(&ca_key).unwrap();
        let leaf = params.signed_by(key, &ca, &ca_key).unwrap().pem();
        (leaf, ca.pem())
    }

    fn cert_for(key: &KeyPair) -> String {
        issued_between(key, 2029, 2031).0
    }

    fn refused(verdict: Verdict, why: &str) {
        match verdict {
            Verdict::Refused(r) => assert!(r.to_string().contains(why), "{why}: {r}"),
            v => panic!("{why}: {v:?}"),
        }
    }

    #[test]
    fn only_a_certificate_over_the_nodes_own_key_is_installed() {
        let key = KeyPair::generate().unwrap();
        let pkcs8 = key.serialize_pem();
        let cert = cert_for(&key);
        let trimmed = cert.trim_end();
        // Over our key: installed, ending in one newline whatever the delivery ended in.
        let want = format!("{trimmed}\n").into_bytes();
        assert_eq!(
            judge(trimmed, Some(pkcs8.as_bytes()), None, now()),
            Verdict::Install(want.clone())
        );
        assert_eq!(
            judge(&cert, Some(pkcs8.as_bytes()), Some(b"old"), now()),
            Verdict::Install(want.clone())
        );
        // The same bytes again: nothing (no restart).
        assert_eq!(
            judge(trimmed, Some(pkcs8.as_bytes()), Some(&want), now()),
            Verdict::Unchanged
        );
        // The same key as SEC1, after the parameters block `openssl ecparam -genkey` writes.
        let sec1 = {
            use p256::pkcs8::DecodePrivateKey;
            let secret = p256::SecretKey::from_pkcs8_pem(&pkcs8).unwrap();
            let pem = secret.to_sec1_pem(p256::pkcs8::LineEnding::LF).unwrap();
            format!(
                "-----BEGIN EC PARAMETERS-----\nBggqhkjOPQMBBw==\n-----END EC PARAMETERS-----\n{}",
                pem.as_str()
            )
        };
        assert!(matches!(
            judge(trimmed, Some(sec1.as_bytes()), None, now()),
            Verdict::Install(_)
        ));
        // Over another key, without a key, garbage: refused, saying why.
        let other = KeyPair::generate().unwrap().serialize_pem();
        for (key_pem, delivered, why) in [
            (Some(other.as_bytes()), trimmed, "another key"),
            (None, trimmed, "no TLS key"),
            (Some(&b" \n"[..]), trimmed, "no TLS key"),
            (Some(pkcs8.as_bytes()), "hello", "text outside PEM blocks"),
            (Some(pkcs8.as_bytes()), "", "not a PEM X.509"),
            (
                Some(&b"-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n"[..]),
                trimmed,
                "key.pem: not a P-256 key",
            ),
            (
                Some(&b"ssh-ed25519 AAAA"[..]),
                trimmed,
                "key.pem: no PEM private key",
            ),
        ] {
            refused(judge(delivered, key_pem, None, now()), why);
        }
    }

    #[test]
    fn a_delivery_holding_anything_but_certificates_is_refused_whole() {
        let key = KeyPair::generate().unwrap();
        let pkcs8 = key.serialize_pem();
        let (leaf, ca) = issued_between(&key, 2029, 2031);
        let other_key = KeyPair::generate().unwrap().serialize_pem();
        for (delivered, why) in [
            // The node's own key, or another, after the leaf: never into a 0644 file.
            (format!("{leaf}{pkcs8}"), "\"PRIVATE KEY\" block"),
            (format!("{leaf}{ca}{other_key}"), "\"PRIVATE KEY\" block"),
            (
                format!(
                    "{leaf}-----BEGIN EC PRIVATE KEY-----\nAAAA\n-----END EC PRIVATE KEY-----\n"
                ),
                "\"EC PRIVATE KEY\" block",
            ),
            (format!("subject=CN=node.test\n{leaf}"), "text outside"),
            (format!("{leaf}\nMIIBkTCB+wIJAK\n"), "text outside"),
            (
                format!("{leaf}-----BEGIN CERTIFICATE-----\nAAAA"),
                "no end line",
            ),
            (
                "-----BEGIN CERTIFICATE-----\n!!!!\n-----END CERTIFICATE-----\n".to_owned(),
                "not valid PEM",
            ),
            (
                "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n".to_owned(),
                "not X.509",
            ),
            (leaf.repeat(MAX_CHAIN + 1), "more than"),
            (format!("{leaf}{leaf}"), "ambiguous"),
        ] {
            refused(judge(&delivered, Some(pkcs8.as_bytes()), None, now()), why);
        }
    }

    #[test]
    fn the_leaf_over_the_key_is_written_first_and_its_chain_after_it() {
        let key = KeyPair::generate().unwrap();
        let pkcs8 = key.serialize_pem();
        let (leaf, ca) = issued_between(&key, 2029, 2031);
        let want = format!("{leaf}{ca}").into_bytes();
        for delivered in [format!("{leaf}{ca}"), format!("{ca}\n\n{leaf}")] {
            assert_eq!(
                judge(&delivered, Some(pkcs8.as_bytes()), None, now()),
                Verdict::Install(want.clone())
            );
        }
    }

    #[test]
    fn the_same_chain_in_another_encoding_changes_nothing() {
        let key = KeyPair::generate().unwrap();
        let pkcs8 = key.serialize_pem();
        let (leaf, ca) = issued_between(&key, 2029, 2031);
        let Verdict::Install(installed) =
            judge(&format!("{leaf}{ca}"), Some(pkcs8.as_bytes()), None, now())
        else {
            panic!("installed")
        };
        let lf = format!("{leaf}{ca}");
        let crlf = lf.replace('\n', "\r\n");
        for delivered in [
            lf.clone(),
            crlf.clone(),
            format!("{lf}\n"),
            format!("{crlf}\r\n"),
            lf.trim_end().to_owned(),
            format!("\n{lf}"),
        ] {
            assert_eq!(
                judge(&delivered, Some(pkcs8.as_bytes()), Some(&installed), now()),
                Verdict::Unchanged,
                "{delivered:?}"
            );
            assert_eq!(delivery_digest(&delivered), delivery_digest(&lf));
        }
        // An installed file in another encoding is the same certificate too.
        let installed_crlf = String::from_utf8(installed).unwrap().replace('\n', "\r\n");
        assert_eq!(
            judge(
                &lf,
                Some(pkcs8.as_bytes()),
                Some(installed_crlf.as_bytes()),
                now()
            ),
            Verdict::Unchanged
        );
    }

    #[test]
    fn a_leaf_out_of_its_validity_or_older_than_the_installed_one_is_refused() {
        let key = KeyPair::generate().unwrap();
        let pkcs8 = key.serialize_pem();
        let k = Some(pkcs8.as_bytes());
        // now() is 2030-06-01.
        refused(
            judge(&issued_between(&key, 2020, 2030).0, k, None, now()),
            "expired at 2030-01-01",
        );
        refused(
            judge(&issued_between(&key, 2031, 2032).0, k, None, now()),
            "not valid until 2031-01-01",
        );
        // Within the skew of its notBefore: installed.
        let (fresh, _) = issued_between(&key, 2030, 2032);
        let early = SystemTime::UNIX_EPOCH + Duration::from_secs(1_893_456_000)
            - NOT_YET_VALID_SKEW
            + Duration::from_secs(1);
        assert!(matches!(judge(&fresh, k, None, early), Verdict::Install(_)));
        refused(
            judge(&fresh, k, None, early - Duration::from_secs(2)),
            "not valid until",
        );
        // Issued before the installed one: a replay, refused; a newer one is installed.
        let (older, _) = issued_between(&key, 2029, 2031);
        let Verdict::Install(installed) = judge(&fresh, k, None, now()) else {
            panic!("installed")
        };
        refused(
            judge(&older, k, Some(&installed), now()),
            "issued before the installed",
        );
        let Verdict::Install(installed_older) = judge(&older, k, None, now()) else {
            panic!("installed")
        };
        assert!(matches!(
            judge(&fresh, k, Some(&installed_older), now()),
            Verdict::Install(_)
        ));
        // Over the image's self-signed placeholder, whatever its dates: installed.
        let mut placeholder = CertificateParams::new(vec!["node.test".to_owned()]).unwrap();
        placeholder.not_before = rcgen::date_time_ymd(2030, 5, 1);
        let placeholder = placeholder.self_signed(&key).unwrap().pem();
        assert!(matches!(
            judge(&older, k, Some(placeholder.as_bytes()), now()),
            Verdict::Install(_)
        ));
    }

    #[test]
    fn each_distinct_refusal_is_remembered_within_a_bound() {
        let mut memory = VecDeque::new();
        let (a, b) = ([1; 32], [2; 32]);
        // Two alternating: each said once.
        let said: Vec<bool> = [a, b, a, b, a, b]
            .into_iter()
            .map(|d| remember_refusal(&mut memory, d))
            .collect();
        assert_eq!(said, [true, true, false, false, false, false]);
        // The memory holds at most REFUSALS_REMEMBERED; the oldest goes first.
        for i in 0..REFUSALS_REMEMBERED * 2 {
            let mut d = [0xee; 32];
            d[..8].copy_from_slice(&(i as u64).to_be_bytes());
            assert!(remember_refusal(&mut memory, d));
        }
        assert_eq!(memory.len(), REFUSALS_REMEMBERED);
        assert!(remember_refusal(&mut memory, a), "forgotten, said again");
    }
}
