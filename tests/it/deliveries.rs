//! What MDMA delivers in a should-join answer, installed beside the loop: the TLS
//! certificate, only over the node's own key, the units restarted through the
//! [`UnitControl`] (systemd's D-Bus API in production; a stand-in that records here).

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use fleet_sidecar::daemon::{UnitControl, UnitError};
use fleet_sidecar::testing::mdma::PollReply;
use fleet_sidecar::testing::sandbox::Sandbox;
use rcgen::{CertificateParams, DistinguishedName, DnType, KeyPair};

use crate::common::*;

const LIMIT: Duration = Duration::from_secs(30);

/// Records every restart; refuses the first `refuse` of them.
#[derive(Default)]
struct Units {
    restarted: Mutex<Vec<String>>,
    asked: AtomicU32,
    refuse: AtomicU32,
}

#[async_trait]
impl UnitControl for Units {
    async fn restart(&self, unit: &str) -> Result<(), UnitError> {
        self.asked.fetch_add(1, Ordering::SeqCst);
        if self
            .refuse
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
        {
            return Err(UnitError::Other("Access denied".to_owned()));
        }
        self.restarted.lock().unwrap().push(unit.to_owned());
        Ok(())
    }
}

/// A certificate for `key` from a fleet CA, valid until 2031-02-03.
fn issued(key: &KeyPair) -> String {
    let ca_key = KeyPair::generate().unwrap();
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, "fleet CA");
    ca.distinguished_name = dn;
    let ca = ca.self_signed(&ca_key).unwrap();
    let mut leaf = CertificateParams::new(vec!["node.test".to_owned()]).unwrap();
    leaf.not_after = rcgen::date_time_ymd(2031, 2, 3);
    leaf.signed_by(key, &ca, &ca_key).unwrap().pem()
}

/// A sandbox whose node has a TLS key (`tls/key.pem`): the sandbox, the directory, the key.
async fn node_with_key() -> (Sandbox, std::path::PathBuf, KeyPair) {
    let sb = Sandbox::start(None).await.unwrap();
    let tls = sb.dir().join("tls");
    std::fs::create_dir_all(&tls).unwrap();
    let key = KeyPair::generate().unwrap();
    std::fs::write(tls.join("key.pem"), key.serialize_pem()).unwrap();
    (sb, tls, key)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_is_installed_only_over_the_node_key_once_and_its_restart_retried() {
    let (sb, tls, key) = node_with_key().await;
    let cert_file = tls.join("cert.pem");

    // First MDMA delivers a certificate over another key, poll after poll.
    let impostor = issued(&KeyPair::generate().unwrap());
    sb.mdma.set_reply(PollReply::assign::<[&str; 0], &str>([]));
    sb.mdma
        .set_delivery("tls_certificate", Some(impostor.into()));
    let cfg = sb.config("").expect("config");
    let mut deps = sb.deps(&cfg).expect("deps");
    let units = Arc::new(Units::default());
    units.refuse.store(1, Ordering::SeqCst);
    deps.units = Arc::clone(&units) as Arc<dyn UnitControl>;
    let d = spawn_loop(cfg, deps);
    eventually("five polls", LIMIT, || sb.mdma.polls().len() >= 5).await;
    assert!(
        !cert_file.exists(),
        "an impostor certificate is never installed"
    );
    assert_eq!(units.asked.load(Ordering::SeqCst), 0);
    let metrics = d.telemetry.encode_metrics();
    assert_eq!(
        metric(
            &metrics,
            "fleet_sidecar_tls_installs_total{outcome=\"refused\"}"
        ),
        1.0,
        "judged once, not once per poll"
    );

    // Then one over the node's key: installed (0644), the unit restarted; the first
    // restart is refused and retried with the back-off.
    let good = issued(&key);
    sb.mdma
        .set_delivery("tls_certificate", Some(good.clone().into()));
    eventually("the restart, retried", LIMIT, || {
        !units.restarted.lock().unwrap().is_empty()
    })
    .await;
    assert_eq!(*units.restarted.lock().unwrap(), ["traefik.service"]);
    assert_eq!(
        units.asked.load(Ordering::SeqCst),
        2,
        "one refused, one done"
    );
    assert_eq!(std::fs::read_to_string(&cert_file).unwrap(), good);
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&cert_file).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o644);
    }
    // Polls report the new expiry; the same certificate, delivered poll after poll, is
    // neither written nor restarted again.
    eventually("the expiry reported", LIMIT, || {
        sb.mdma
            .polls()
            .last()
            .unwrap()
            .tls_cert_not_after
            .as_deref()
            == Some("2031-02-03T00:00:00Z")
    })
    .await;
    let from = sb.mdma.polls().len();
    eventually("five more polls", LIMIT, || {
        sb.mdma.polls().len() >= from + 5
    })
    .await;
    assert_eq!(units.asked.load(Ordering::SeqCst), 2);
    let metrics = d.telemetry.encode_metrics();
    assert_eq!(
        metric(
            &metrics,
            "fleet_sidecar_tls_installs_total{outcome=\"installed\"}"
        ),
        1.0
    );
    assert_eq!(
        metric(
            &metrics,
            "fleet_sidecar_unit_restarts_total{outcome=\"error\"}"
        ),
        1.0
    );
    assert_eq!(
        metric(
            &metrics,
            "fleet_sidecar_unit_restarts_total{outcome=\"ok\"}"
        ),
        1.0
    );
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_certificate_in_alternating_encodings_is_installed_and_restarted_once() {
    let (sb, tls, key) = node_with_key().await;
    let lf = issued(&key);
    // As MDMA's replicas may serialise one certificate: LF, CRLF, an extra final newline.
    let encodings = [lf.clone(), lf.replace('\n', "\r\n"), format!("{lf}\n")];
    sb.mdma.set_reply(PollReply::assign::<[&str; 0], &str>([]));
    sb.mdma
        .set_delivery("tls_certificate", Some(encodings[0].clone().into()));
    let cfg = sb.config("").expect("config");
    let mut deps = sb.deps(&cfg).expect("deps");
    let units = Arc::new(Units::default());
    deps.units = Arc::clone(&units) as Arc<dyn UnitControl>;
    let d = spawn_loop(cfg, deps);
    eventually("the first install", LIMIT, || {
        !units.restarted.lock().unwrap().is_empty()
    })
    .await;
    for round in 1..=9 {
        let from = sb.mdma.polls().len();
        sb.mdma.set_delivery(
            "tls_certificate",
            Some(encodings[round % encodings.len()].clone().into()),
        );
        eventually("a poll with the next encoding", LIMIT, || {
            sb.mdma.polls().len() >= from + 2
        })
        .await;
    }
    assert_eq!(
        units.asked.load(Ordering::SeqCst),
        1,
        "one certificate, one restart"
    );
    assert_eq!(std::fs::read_to_string(tls.join("cert.pem")).unwrap(), lf);
    let metrics = d.telemetry.encode_metrics();
    assert_eq!(
        metric(
            &metrics,
            "fleet_sidecar_tls_installs_total{outcome=\"installed\"}"
        ),
        1.0
    );
    assert!(
        metric(
            &metrics,
            "fleet_sidecar_tls_installs_total{outcome=\"unchanged\"}"
        ) >= 5.0,
        "each new encoding judged the same certificate"
    );
    d.stop().await;
}

/// An executable script in `dir` that appends its arguments, one line per run, to
/// `{name}.args`.
fn recording_script(dir: &std::path::Path, name: &str) -> std::path::PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let script = dir.join(format!("{name}.sh"));
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\necho \"$*\" >> {}\n",
            dir.join(format!("{name}.args")).display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    script
}

fn runs(dir: &std::path::Path, name: &str) -> Vec<String> {
    std::fs::read_to_string(dir.join(format!("{name}.args")))
        .unwrap_or_default()
        .lines()
        .map(str::to_owned)
        .collect()
}

/// The sandbox's config with both shippers on: their configs and recording scripts in
/// `shippers/` (vector's script `vector` instead when given), both endpoints configured.
fn with_shippers(
    sb: &Sandbox,
    vector: Option<std::path::PathBuf>,
) -> (fleet_sidecar::Config, std::path::PathBuf) {
    let mut cfg = sb.config("").expect("config");
    let shippers = sb.dir().join("shippers");
    std::fs::create_dir_all(&shippers).unwrap();
    for name in ["vector.yaml", "scrape.yml"] {
        std::fs::write(shippers.join(name), "").unwrap();
    }
    cfg.logs_token.vector_script = vector.unwrap_or_else(|| recording_script(&shippers, "vector"));
    cfg.logs_token.vector_config = shippers.join("vector.yaml");
    cfg.logs_token.vmagent_script = recording_script(&shippers, "vmagent");
    cfg.logs_token.vmagent_config = shippers.join("scrape.yml");
    cfg.logs_token.logs_endpoint = Some("https://logs.example".to_owned());
    cfg.logs_token.metrics_endpoint = Some("https://metrics.example".to_owned());
    (cfg, shippers)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_logs_token_is_installed_once_per_distinct_token_and_both_shippers_configured() {
    use sha2::Digest;
    const ONE: &str = "NEVER-LOGGED-TOKEN-logs-one";
    const TWO: &str = "NEVER-LOGGED-TOKEN-logs-two";
    let sb = Sandbox::start(None).await.unwrap();
    let dir = sb.dir().to_owned();
    let token_file = dir.join("provided_token");
    let (cfg, shippers) = with_shippers(&sb, None);
    let mut deps = sb.deps(&cfg).expect("deps");
    let units = Arc::new(Units::default());
    deps.units = Arc::clone(&units) as Arc<dyn UnitControl>;
    sb.mdma.set_reply(PollReply::assign::<[&str; 0], &str>([]));
    sb.mdma.set_delivery("logs_token", Some(ONE.into()));
    let d = spawn_loop(cfg, deps);

    eventually("vmagent configured", LIMIT, || {
        !runs(&shippers, "vmagent").is_empty()
    })
    .await;
    assert_eq!(
        std::fs::read(&token_file).unwrap(),
        ONE.as_bytes(),
        "no newline"
    );
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&token_file).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
    }
    let file = token_file.display();
    let vector = shippers.join("vector.yaml");
    let scrape = shippers.join("scrape.yml");
    assert_eq!(
        runs(&shippers, "vector"),
        [format!(
            "{} https://logs.example true provided {file}",
            vector.display()
        )]
    );
    assert_eq!(
        runs(&shippers, "vmagent"),
        [format!(
            "{} https://metrics.example true provided {file}",
            scrape.display()
        )]
    );
    assert_eq!(*units.restarted.lock().unwrap(), ["vector.service"]);

    // Delivered poll after poll, then as "": nothing more, and the token stays.
    let from = sb.mdma.polls().len();
    eventually("five more polls", LIMIT, || {
        sb.mdma.polls().len() >= from + 5
    })
    .await;
    sb.mdma.set_delivery("logs_token", Some("".into()));
    let from = sb.mdma.polls().len();
    eventually("five more polls", LIMIT, || {
        sb.mdma.polls().len() >= from + 5
    })
    .await;
    assert_eq!(runs(&shippers, "vector").len(), 1);
    assert_eq!(std::fs::read(&token_file).unwrap(), ONE.as_bytes());

    // A new token: installed and both shippers configured again; polls report it.
    sb.mdma.set_delivery("logs_token", Some(TWO.into()));
    eventually("vmagent configured again", LIMIT, || {
        runs(&shippers, "vmagent").len() == 2
    })
    .await;
    assert_eq!(std::fs::read(&token_file).unwrap(), TWO.as_bytes());
    let fp = hex::encode(sha2::Sha256::digest(TWO.as_bytes()));
    eventually("the new fingerprint reported", LIMIT, || {
        sb.mdma.polls().last().unwrap().logs_token_fp.as_deref() == Some(fp.as_str())
    })
    .await;
    let metrics = d.telemetry.encode_metrics();
    assert_eq!(
        metric(
            &metrics,
            "fleet_sidecar_logs_token_installs_total{outcome=\"installed\"}"
        ),
        2.0
    );
    assert_eq!(units.restarted.lock().unwrap().len(), 2);
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_configure_script_that_fails_restarts_no_shipper() {
    use std::os::unix::fs::PermissionsExt;
    let sb = Sandbox::start(None).await.unwrap();
    let failing = sb.dir().join("vector-fails.sh");
    std::fs::write(&failing, "#!/bin/sh\necho broken >&2\nexit 1\n").unwrap();
    std::fs::set_permissions(&failing, std::fs::Permissions::from_mode(0o755)).unwrap();
    let (cfg, shippers) = with_shippers(&sb, Some(failing));
    let mut deps = sb.deps(&cfg).expect("deps");
    let units = Arc::new(Units::default());
    deps.units = Arc::clone(&units) as Arc<dyn UnitControl>;
    sb.mdma.set_reply(PollReply::assign::<[&str; 0], &str>([]));
    sb.mdma
        .set_delivery("logs_token", Some("NEVER-LOGGED-TOKEN-fails".into()));
    let d = spawn_loop(cfg, deps);
    // vmagent's script runs after vector's: once it ran, vector's outcome is known.
    eventually("vmagent configured", LIMIT, || {
        !runs(&shippers, "vmagent").is_empty()
    })
    .await;
    assert!(
        units.restarted.lock().unwrap().is_empty() && units.asked.load(Ordering::SeqCst) == 0,
        "vector's script failed: vector is not restarted"
    );
    d.stop().await;
}
