//! The certificate MDMA delivers (`tls_certificate` in a should-join answer that passed the
//! gate), installed as `cert.pem` in `[tls] dir` by a job beside the loop: the poll only
//! hands it over ([`CertInstaller::offer`]) and never waits for the install.
//!
//! The rule ([`judge`], pure): a certificate byte-identical to the installed one changes
//! nothing; one that does not certify `key.pem`'s public key (the SubjectPublicKeyInfo of
//! its first certificate against the key's, compared in-process) is refused and said once
//! per distinct certificate, since MDMA repeats it every poll; otherwise it is written
//! atomically (mode 0644), then every unit in `[tls] restart_units` is restarted through
//! systemd's D-Bus API ([`UnitControl`]). A failed restart is retried with the back-off
//! until it succeeds or a newer certificate is installed; the certificate stays installed.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use sha2::{Digest, Sha256};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::node_files::{cert_not_after, first_certificate, NodeFilesView};
use super::units::{UnitControl, UnitError, RESTART_TIMEOUT};
use crate::backoff::RETRY;
use crate::config::Config;
use crate::durable::{self, WriteError};
use crate::jobs::{self, Job, Schedule};
use crate::node_tls::public_key_der;
use crate::outcome::Timed;
use crate::telemetry::Telemetry;

/// The installed certificate's mode: readable by the TLS terminator's user.
const CERT_MODE: u32 = 0o644;
/// Largest `key.pem` or installed `cert.pem` read; a larger file is not one.
const MAX_FILE: u64 = 64 * 1024;
/// Bound of reading the key and the installed certificate and writing the new one.
const FILES_DEADLINE: Duration = Duration::from_secs(10);

/// What to do with a delivered certificate.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Write these bytes as `cert.pem` (the delivery, ending in one newline), then restart.
    Install(Vec<u8>),
    /// Byte-identical to the installed certificate: nothing to do.
    Unchanged,
    /// Not installed, and why.
    Refused(String),
}

/// What becomes of `delivered` (a PEM certificate, possibly a chain) given `key.pem`'s
/// bytes (`None`: no key file) and the installed `cert.pem`'s (`None`: none).
pub(crate) fn judge(delivered: &str, key_pem: Option<&[u8]>, installed: Option<&[u8]>) -> Verdict {
    let mut bytes = delivered.as_bytes().to_vec();
    if !bytes.ends_with(b"\n") {
        bytes.push(b'\n');
    }
    if installed == Some(&bytes[..]) {
        return Verdict::Unchanged;
    }
    let key = match key_pem {
        Some(k) if !k.iter().all(u8::is_ascii_whitespace) => k,
        _ => return Verdict::Refused("the node has no TLS key (key.pem) to match it".to_owned()),
    };
    let Some(cert) = first_certificate(delivered.as_bytes()) else {
        return Verdict::Refused("it is not a PEM X.509 certificate".to_owned());
    };
    let certified =
        match x509_cert::der::Encode::to_der(&cert.tbs_certificate.subject_public_key_info) {
            Ok(der) => der,
            Err(e) => return Verdict::Refused(format!("its public key cannot be encoded: {e}")),
        };
    match public_key_der(key) {
        Ok(own) if own == certified => Verdict::Install(bytes),
        Ok(_) => Verdict::Refused("it certifies another key than key.pem's".to_owned()),
        Err(why) => Verdict::Refused(format!("key.pem: {why}")),
    }
}

/// Why an install or its restarts failed (retried with the back-off).
#[derive(Debug, thiserror::Error)]
pub(crate) enum InstallError {
    /// `key.pem` or `cert.pem` could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The new `cert.pem` could not be written.
    #[error(transparent)]
    Write(#[from] WriteError),
    /// The file work did not end within its bound (a hung disk).
    #[error("the certificate files did not answer within {0:?}")]
    Stalled(Duration),
    /// A unit could not be restarted.
    #[error("restart of {unit}: {source}")]
    Restart {
        /// The unit.
        unit: String,
        /// Why.
        #[source]
        source: UnitError,
    },
}

impl Timed for InstallError {
    fn is_timeout(&self) -> bool {
        match self {
            InstallError::Stalled(_) => true,
            InstallError::Restart { source, .. } => source.is_timeout(),
            _ => false,
        }
    }
}

/// The loop's end of the job: hands it the certificates polls deliver.
#[derive(Debug)]
pub(crate) struct CertInstaller {
    delivered: watch::Sender<Option<Arc<str>>>,
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
        let (delivered, rx) = watch::channel(None);
        let job = InstallJob {
            delivered: rx,
            handled: None,
            restarts: Vec::new(),
            refused: None,
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
        jobs::offer(&self.delivered, Arc::from(pem));
    }
}

struct InstallJob {
    delivered: watch::Receiver<Option<Arc<str>>>,
    /// The delivery last judged (installed, unchanged or refused).
    handled: Option<Arc<str>>,
    /// The units still to restart for the certificate installed last.
    restarts: Vec<String>,
    /// SHA-256 of the certificate refused last: a refusal is said once per certificate.
    refused: Option<[u8; 32]>,
    key: PathBuf,
    cert: PathBuf,
    restart_units: Vec<String>,
    units: Arc<dyn UnitControl>,
    /// Asked to look at `cert.pem` at once after an install, so polls report the expiry.
    files: NodeFilesView,
    telemetry: Arc<Telemetry>,
}

impl InstallJob {
    /// Reads the key and the installed certificate, judges `pem` and writes it if so.
    async fn install(&self, pem: Arc<str>) -> Result<Verdict, InstallError> {
        let (key, cert) = (self.key.clone(), self.cert.clone());
        let work = tokio::task::spawn_blocking(move || {
            let key_pem = read_bounded(&key)?;
            // An oversized cert.pem cannot be the delivery: it is replaced.
            let installed = match durable::read_capped(&cert, MAX_FILE) {
                Err(e) if e.kind() == std::io::ErrorKind::FileTooLarge => Some(Vec::new()),
                read => read.map_err(|source| InstallError::Read {
                    path: cert.clone(),
                    source,
                })?,
            };
            let verdict = judge(&pem, key_pem.as_deref(), installed.as_deref());
            if let Verdict::Install(bytes) = &verdict {
                durable::write_atomically(&cert, bytes, CERT_MODE)?;
            }
            Ok(verdict)
        });
        match tokio::time::timeout(FILES_DEADLINE, work).await {
            Ok(Ok(done)) => done,
            Ok(Err(_)) | Err(_) => Err(InstallError::Stalled(FILES_DEADLINE)),
        }
    }
}

/// A file's bytes, `None` when it does not exist ([`durable::read_capped`] at [`MAX_FILE`]).
fn read_bounded(path: &std::path::Path) -> Result<Option<Vec<u8>>, InstallError> {
    durable::read_capped(path, MAX_FILE).map_err(|source| InstallError::Read {
        path: path.to_owned(),
        source,
    })
}

#[async_trait]
impl Job for InstallJob {
    type Output = ();
    type Error = InstallError;
    const NAME: &'static str = "tls_install";
    const FAILING: &'static str = "the delivered TLS certificate cannot be installed";
    const EFFECT: &'static str = "retried with the back-off";
    const RECOVERED: &'static str = "the delivered TLS certificate is installed";

    fn schedule(&self) -> Schedule {
        let restarts = u32::try_from(self.restart_units.len()).unwrap_or(u32::MAX);
        Schedule {
            every: None,
            min_gap: Duration::ZERO,
            deadline: FILES_DEADLINE
                .saturating_add(RESTART_TIMEOUT.saturating_mul(restarts))
                .saturating_add(Duration::from_secs(1)),
            backoff: RETRY,
        }
    }

    async fn run(&mut self) -> Result<(), InstallError> {
        let current = self.delivered.borrow_and_update().clone();
        if current != self.handled {
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
                        let digest: [u8; 32] = Sha256::digest(pem.as_bytes()).into();
                        if self.refused != Some(digest) {
                            self.refused = Some(digest);
                            warn!(
                                certificate_sha256 = %hex::encode(digest),
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
            self.handled = current;
        }
        while let Some(unit) = self.restarts.first() {
            match self.units.restart(unit).await {
                Ok(()) => {
                    Telemetry::count(&self.telemetry.unit_restarts, "ok");
                    info!(unit = %unit, "restarted for the new TLS certificate");
                    self.restarts.remove(0);
                }
                Err(source) => {
                    let label = if source.is_timeout() {
                        "timeout"
                    } else {
                        "error"
                    };
                    Telemetry::count(&self.telemetry.unit_restarts, label);
                    return Err(InstallError::Restart {
                        unit: unit.clone(),
                        source,
                    });
                }
            }
        }
        Ok(())
    }

    fn idle(&self) -> bool {
        self.restarts.is_empty() && *self.delivered.borrow() == self.handled
    }

    async fn wake(&mut self) {
        if self.delivered.changed().await.is_err() {
            // The loop is gone (shutdown): nothing will be delivered again.
            std::future::pending::<()>().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rcgen::{CertificateParams, KeyPair};

    fn cert_for(key: &KeyPair) -> String {
        let params = CertificateParams::new(vec!["node.test".to_owned()]).unwrap();
        let ca_key = KeyPair::generate().unwrap();
        let ca = CertificateParams::new(Vec::<String>::new())
            .unwrap()
            .self_signed(&ca_key)
            .unwrap();
        params.signed_by(key, &ca, &ca_key).unwrap().pem()
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
            judge(trimmed, Some(pkcs8.as_bytes()), None),
            Verdict::Install(want.clone())
        );
        assert_eq!(
            judge(&cert, Some(pkcs8.as_bytes()), Some(b"old")),
            Verdict::Install(want.clone())
        );
        // The same bytes again: nothing (no restart).
        assert_eq!(
            judge(trimmed, Some(pkcs8.as_bytes()), Some(&want)),
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
            judge(trimmed, Some(sec1.as_bytes()), None),
            Verdict::Install(_)
        ));
        // Over another key, without a key, garbage: refused, saying why.
        let other = KeyPair::generate().unwrap().serialize_pem();
        for (key_pem, delivered, why) in [
            (Some(other.as_bytes()), trimmed, "another key"),
            (None, trimmed, "no TLS key"),
            (Some(&b" \n"[..]), trimmed, "no TLS key"),
            (Some(pkcs8.as_bytes()), "hello", "not a PEM X.509"),
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
            match judge(delivered, key_pem, None) {
                Verdict::Refused(r) => assert!(r.contains(why), "{why}: {r}"),
                v => panic!("{why}: {v:?}"),
            }
        }
    }
}
