//! What MDMA delivers in a should-join answer, installed beside the loop: the TLS
//! certificate, only over the node's own key, the units restarted through the
//! [`UnitControl`] (systemd's D-Bus API in production; a stand-in that records here).

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use fleet_sidecar::daemon::{UnitControl, UnitError};
use fleet_sidecar::emulator::mdma::PollReply;
use fleet_sidecar::emulator::sandbox::Sandbox;
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_is_installed_only_over_the_node_key_once_and_its_restart_retried() {
    let sb = Sandbox::start(None).await.unwrap();
    let tls = sb.dir().join("tls");
    std::fs::create_dir_all(&tls).unwrap();
    let key = KeyPair::generate().unwrap();
    std::fs::write(tls.join("key.pem"), key.serialize_pem()).unwrap();
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
