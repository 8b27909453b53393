//! The node's files every poll reports on: the TLS certificate's expiry
//! (`tls_cert_not_after`) and the log-shipping token's fingerprint (`logs_token_fp`). A job
//! on the harness looks at them every [`CHECK_EVERY`] and reads a file again only when it
//! changed (its length, modification time, inode or device); the poll takes what the job
//! last published and never reads a file itself, so a hung disk cannot stall the heartbeat.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime};

use sha2::{Digest, Sha256};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::durable;
use crate::jobs::{self, Job, JobHandle, Schedule};
use crate::node_tls::pem_block;
use crate::outcome::Timed;
use crate::telemetry::Telemetry;

/// How often the files are looked at (a `stat` each; read only when changed).
pub(crate) const CHECK_EVERY: Duration = Duration::from_secs(10);
/// The bound of one look (local files: past it the disk hangs).
const RUN_DEADLINE: Duration = Duration::from_secs(10);
/// Largest file read: a certificate chain or a token is a few KiB; anything larger is not
/// one, and reads as unknown.
const MAX_FILE: u64 = 64 * 1024;

/// What the node's files say, as a poll reports it: `None` for a part switched off (the
/// field is left out of the body), `Some("")` while unknown.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct NodeFiles {
    /// `tls_cert_not_after`: the certificate's `notAfter` as `YYYY-MM-DDTHH:MM:SSZ`.
    pub(crate) tls_cert_not_after: Option<String>,
    /// `logs_token_fp`: lowercase hex SHA-256 of the token file's bytes.
    pub(crate) logs_token_fp: Option<String>,
}

/// `notAfter` of the first certificate in `pem` as `YYYY-MM-DDTHH:MM:SSZ` (UTC); `""` when
/// there is none, it does not parse, or it is self-signed (issuer equals subject: the
/// image's placeholder, which asks MDMA for a certificate).
pub(crate) fn cert_not_after(pem: &[u8]) -> String {
    let Some(cert) = first_certificate(pem) else {
        return String::new();
    };
    let tbs = &cert.tbs_certificate;
    if tbs.issuer == tbs.subject {
        return String::new();
    }
    humantime::format_rfc3339_seconds(tbs.validity.not_after.to_system_time()).to_string()
}

/// The first certificate of a PEM file or chain, if it parses (the rest is not read).
pub(crate) fn first_certificate(pem: &[u8]) -> Option<x509_cert::Certificate> {
    let block = pem_block(std::str::from_utf8(pem).ok()?, "CERTIFICATE")?;
    <x509_cert::Certificate as x509_cert::der::DecodePem>::from_pem(block).ok()
}

/// Lowercase hex SHA-256 of `token`; `""` for an empty one. Never the token itself.
pub(crate) fn token_fingerprint(token: &[u8]) -> String {
    if token.is_empty() {
        return String::new();
    }
    hex::encode(Sha256::digest(token))
}

/// What tells a file's versions apart without reading it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Stamp {
    len: u64,
    modified: Option<SystemTime>,
    ino: u64,
    dev: u64,
}

/// `path`'s stamp; `None` when it is missing or cannot be looked at.
fn stamp(path: &Path) -> Option<Stamp> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(path).ok()?;
    Some(Stamp {
        len: m.len(),
        modified: m.modified().ok(),
        ino: m.ino(),
        dev: m.dev(),
    })
}

/// One file, read again only when its stamp changes.
#[derive(Debug)]
struct Watched {
    path: PathBuf,
    /// What it says from its bytes.
    parse: fn(&[u8]) -> String,
    /// The stamp of the version read (`Some(None)`: seen missing); `None` before a look.
    seen: Option<Option<Stamp>>,
    value: String,
    /// Reads so far (a changed file is read; an unchanged one is not).
    reads: u64,
}

impl Watched {
    fn new(path: PathBuf, parse: fn(&[u8]) -> String) -> Self {
        Self {
            path,
            parse,
            seen: None,
            value: String::new(),
            reads: 0,
        }
    }

    /// What the file says now; read only if it changed since the last look.
    fn look(&mut self) -> String {
        let now = stamp(&self.path);
        if self.seen != Some(now) {
            self.value = match now {
                Some(s) if s.len <= MAX_FILE => {
                    self.reads += 1;
                    match durable::read_capped(&self.path, MAX_FILE) {
                        Ok(Some(b)) => (self.parse)(&b),
                        _ => String::new(),
                    }
                }
                _ => String::new(),
            };
            self.seen = Some(now);
        }
        self.value.clone()
    }
}

/// The files watched: `None` for a part switched off.
#[derive(Debug)]
struct Files {
    cert: Option<Watched>,
    token: Option<Watched>,
}

impl Files {
    fn of(cfg: &Config) -> Self {
        Self {
            cert: cfg.tls.cert_file().map(|p| Watched::new(p, cert_not_after)),
            token: cfg
                .logs_token
                .reported_file()
                .map(|p| Watched::new(p.to_owned(), token_fingerprint)),
        }
    }

    fn look(&mut self) -> NodeFiles {
        NodeFiles {
            tls_cert_not_after: self.cert.as_mut().map(Watched::look),
            logs_token_fp: self.token.as_mut().map(Watched::look),
        }
    }

    /// What a poll says before the first look: `""` for every part switched on.
    fn unknown(&self) -> NodeFiles {
        NodeFiles {
            tls_cert_not_after: self.cert.as_ref().map(|_| String::new()),
            logs_token_fp: self.token.as_ref().map(|_| String::new()),
        }
    }
}

/// The look stopped without an answer (the blocking task panicked).
#[derive(Debug, thiserror::Error)]
#[error("the node's files could not be looked at: {0}")]
pub(crate) struct LookStopped(#[source] tokio::task::JoinError);

impl Timed for LookStopped {
    fn is_timeout(&self) -> bool {
        false
    }
}

struct NodeFilesJob {
    files: Arc<Mutex<Files>>,
    /// A look still under way (a run cut during it): awaited before another starts, so a
    /// hung disk holds one blocking thread, not one per run.
    looking: Option<JoinHandle<NodeFiles>>,
    telemetry: Arc<Telemetry>,
}

impl Job for NodeFilesJob {
    type Output = Arc<NodeFiles>;
    type Error = LookStopped;
    const NAME: &'static str = "node_files";
    const FAILING: &'static str = "the node's files cannot be looked at";
    const EFFECT: &'static str =
        "polls report tls_cert_not_after and logs_token_fp as unknown (\"\")";
    const RECOVERED: &'static str = "the node's files are looked at again";

    fn schedule(&self) -> Schedule {
        Schedule::every(CHECK_EVERY, RUN_DEADLINE)
    }

    async fn run(&mut self) -> Result<Arc<NodeFiles>, LookStopped> {
        let files = Arc::clone(&self.files);
        let looking = self.looking.get_or_insert_with(|| {
            tokio::task::spawn_blocking(move || {
                files.lock().unwrap_or_else(PoisonError::into_inner).look()
            })
        });
        let seen = looking.await;
        self.looking = None;
        let seen = seen.map_err(LookStopped)?;
        self.telemetry.update(|st| {
            st.tls_cert_not_after = seen.tls_cert_not_after.clone();
            st.logs_token_fp = seen.logs_token_fp.clone();
        });
        Ok(Arc::new(seen))
    }
}

/// What the poll reads of the node's files.
#[derive(Clone, Debug)]
pub(crate) struct NodeFilesView {
    job: Option<JobHandle<Arc<NodeFiles>>>,
    unknown: Arc<NodeFiles>,
}

impl NodeFilesView {
    /// Starts the job on `cfg`'s `[tls]` and `[logs_token]` (none when both are off).
    pub(crate) fn start(
        cfg: &Config,
        telemetry: Arc<Telemetry>,
        shutdown: CancellationToken,
    ) -> Self {
        let files = Files::of(cfg);
        let unknown = Arc::new(files.unknown());
        let job = (files.cert.is_some() || files.token.is_some()).then(|| {
            jobs::spawn(
                NodeFilesJob {
                    files: Arc::new(Mutex::new(files)),
                    looking: None,
                    telemetry: Arc::clone(&telemetry),
                },
                telemetry,
                shutdown,
            )
        });
        Self { job, unknown }
    }

    /// Asks for a look soon (a file was just written), so the next polls report it.
    pub(crate) fn look_soon(&self) {
        if let Some(job) = &self.job {
            job.run_soon();
        }
    }

    /// What the next poll reports: the job's latest look, or unknown (`""`) before the
    /// first one and after a failed one.
    pub(crate) fn poll_fields(&self) -> Arc<NodeFiles> {
        self.job
            .as_ref()
            .and_then(JobHandle::latest_good)
            .unwrap_or_else(|| Arc::clone(&self.unknown))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A certificate for `subject` signed by a CA named `issuer` (itself when `None`),
    /// valid until 2031-02-03 00:00:00 UTC, with the CA's certificate after it.
    fn cert(subject: &str, issuer: Option<&str>) -> String {
        use rcgen::{CertificateParams, DistinguishedName, DnType, KeyPair};
        let named = |cn: &str| {
            let mut dn = DistinguishedName::new();
            dn.push(DnType::CommonName, cn);
            dn
        };
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(vec!["node.test".to_owned()]).unwrap();
        params.not_after = rcgen::date_time_ymd(2031, 2, 3);
        params.distinguished_name = named(subject);
        match issuer {
            None => params.self_signed(&key).unwrap().pem(),
            Some(name) => {
                let ca_key = KeyPair::generate().unwrap();
                let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
                ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
                ca.distinguished_name = named(name);
                let ca = ca.self_signed(&ca_key).unwrap();
                let leaf = params.signed_by(&key, &ca, &ca_key).unwrap();
                format!("{}{}", leaf.pem(), ca.pem())
            }
        }
    }

    #[test]
    fn the_expiry_is_the_first_certificate_s_unless_it_is_self_signed() {
        let issued = cert("node-1", Some("fleet CA"));
        assert_eq!(cert_not_after(issued.as_bytes()), "2031-02-03T00:00:00Z");
        // A key block before it does not hide it.
        let keyed =
            format!("-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n{issued}");
        assert_eq!(cert_not_after(keyed.as_bytes()), "2031-02-03T00:00:00Z");
        // The image's placeholder (issuer = subject) asks MDMA for a certificate.
        assert_eq!(cert_not_after(cert("node-1", None).as_bytes()), "");
        for garbage in [
            &b""[..],
            b"not a pem",
            b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n",
            &[0xff, 0xfe],
        ] {
            assert_eq!(cert_not_after(garbage), "", "{garbage:?}");
        }
    }

    #[test]
    fn the_token_s_fingerprint_is_its_sha256_and_never_the_token() {
        let token = b"vector-token-abc";
        let fp = token_fingerprint(token);
        assert_eq!(fp, hex::encode(Sha256::digest(token)));
        assert_eq!(fp.len(), 64);
        assert!(!fp.contains("vector-token-abc"));
        assert_eq!(token_fingerprint(b""), "");
    }

    #[test]
    fn a_part_switched_off_is_left_out_and_one_on_is_unknown_until_looked_at() {
        let dir = tempfile::tempdir().unwrap();
        let text = |extra: &str| {
            format!(
                "mdma_url = \"https://m\"\n[tdx]\nmrtd_path = \"{d}/m\"\n{extra}",
                d = dir.path().display()
            )
        };
        let cfg = |extra: &str| Config::from_toml(&text(extra), Path::new("t.toml")).unwrap();
        let on = Files::of(&cfg("")).unknown();
        assert_eq!(
            (
                on.tls_cert_not_after.as_deref(),
                on.logs_token_fp.as_deref()
            ),
            (Some(""), Some(""))
        );
        let off = cfg("[tls]\nreport = false\n[logs_token]\nreport = false\n");
        assert_eq!(Files::of(&off).unknown(), NodeFiles::default());
        let token_only = Files::of(&cfg("[tls]\nreport = false\n")).unknown();
        assert_eq!(token_only.tls_cert_not_after, None);
        assert_eq!(token_only.logs_token_fp.as_deref(), Some(""));
    }

    #[test]
    fn a_file_is_read_again_only_when_it_changed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("provided_token");
        let mut w = Watched::new(path.clone(), token_fingerprint);
        assert_eq!(
            (w.look(), w.reads),
            (String::new(), 0),
            "missing: unknown, nothing read"
        );
        std::fs::write(&path, "one").unwrap();
        let one = token_fingerprint(b"one");
        assert_eq!(w.look(), one);
        for _ in 0..5 {
            assert_eq!(w.look(), one);
        }
        assert_eq!(w.reads, 1, "unchanged: not read again");
        // Replaced (a new inode, as an atomic write makes), same length.
        let next = dir.path().join("next");
        std::fs::write(&next, "two").unwrap();
        std::fs::rename(&next, &path).unwrap();
        assert_eq!((w.look(), w.reads), (token_fingerprint(b"two"), 2));
        std::fs::remove_file(&path).unwrap();
        assert_eq!((w.look(), w.reads), (String::new(), 2), "gone: unknown");
        // Larger than any token: unknown, not read.
        std::fs::write(&path, vec![b'x'; 70 * 1024]).unwrap();
        assert_eq!((w.look(), w.reads), (String::new(), 2));
    }
}
