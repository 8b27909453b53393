//! MDMA over HTTPS: TLS is always verified, and `mdma_ca_file` adds a private trust root.

use std::sync::Arc;

use fleet_sidecar::testing::mdma::{MdmaEmulator, PollReply};
use fleet_sidecar::PeerId;
use fleet_sidecar::{
    mdma::MdmaClientError, mdma::NodeReport, ControlPlane, MdmaClient, PollError, RequestError,
};
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::service::TowerToHyperService;
use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair};
use tokio_rustls::rustls::ServerConfig;
use tokio_rustls::TlsAcceptor;

use crate::common::*;

struct Pki {
    ca_pem: String,
    server: ServerConfig,
}

fn pki() -> Pki {
    let ca_key = KeyPair::generate().unwrap();
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca_cert = ca.self_signed(&ca_key).unwrap();
    let key = KeyPair::generate().unwrap();
    let leaf = CertificateParams::new(vec!["localhost".to_owned()])
        .unwrap()
        .signed_by(&key, &ca_cert, &ca_key)
        .unwrap();
    let server = tls_server_config(&leaf, &key);
    Pki {
        ca_pem: ca_cert.pem(),
        server,
    }
}

/// The MDMA emulator's routes behind TLS on 127.0.0.1 (served with hyper over tokio-rustls,
/// since axum::serve takes a plain TCP listener). Returns `https://localhost:PORT/`.
async fn https_mdma(pki: &Pki, mdma: &MdmaEmulator) -> url::Url {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let acceptor = TlsAcceptor::from(Arc::new(pki.server.clone()));
    // Forward every request to the plain emulator: TLS is the only difference.
    let upstream = mdma.url();
    let proxy = axum::Router::new().fallback(move |req: axum::extract::Request| {
        let upstream = upstream.clone();
        async move {
            let (parts, body) = req.into_parts();
            let bytes = axum::body::to_bytes(body, 1 << 20)
                .await
                .unwrap_or_default();
            let mut r = reqwest::Client::new().request(
                parts.method.clone(),
                upstream
                    .join(parts.uri.path().trim_start_matches('/'))
                    .unwrap(),
            );
            for (k, v) in &parts.headers {
                r = r.header(k, v);
            }
            let resp = r.body(bytes).send().await.unwrap();
            let status = resp.status();
            (status, resp.bytes().await.unwrap_or_default())
        }
    });
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let acceptor = acceptor.clone();
            let service = TowerToHyperService::new(proxy.clone());
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(tls), service)
                    .await;
            });
        }
    });
    format!("https://localhost:{port}/").parse().unwrap()
}

fn peer() -> PeerId {
    fleet_sidecar::testing::sandbox::PEER_ID.parse().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_private_ca_file_is_trusted_and_nothing_else_is() {
    let pki = pki();
    let mdma = MdmaEmulator::start(None).await.unwrap();
    mdma.set_reply(PollReply::assign([A]));
    let url = https_mdma(&pki, &mdma).await;
    let dir = tempfile::tempdir().unwrap();
    let ca_file = dir.path().join("mdma-ca.pem");
    std::fs::write(&ca_file, &pki.ca_pem).unwrap();

    let trusted = MdmaClient::new(&url, None, Some(&ca_file)).unwrap();
    let desired = trusted
        .should_join(&peer(), None, NodeReport::default())
        .await
        .unwrap();
    assert_eq!(desired.assignments, set(&[A]));

    // Without the CA file the same server is refused: verification is never off.
    let untrusted = MdmaClient::new(&url, None, None).unwrap();
    let err = untrusted
        .should_join(&peer(), None, NodeReport::default())
        .await
        .unwrap_err();
    assert!(
        matches!(err, PollError::Request(RequestError::Transport { .. })),
        "{err}"
    );
    assert!(
        err.to_string().to_lowercase().contains("certificate"),
        "{err}"
    );
    assert_eq!(mdma.polls().len(), 1, "the refused poll never reached MDMA");
}

#[test]
fn an_unusable_ca_file_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("ca.pem");
    std::fs::write(&file, "not a certificate\n").unwrap();
    let url: url::Url = "https://mdma.example/".parse().unwrap();
    let err = MdmaClient::new(&url, None, Some(&file)).unwrap_err();
    assert!(matches!(err, MdmaClientError::CaParse { .. }), "{err}");
    assert!(err.to_string().contains("ca.pem"));
    let err = MdmaClient::new(&url, None, Some(&dir.path().join("missing.pem"))).unwrap_err();
    assert!(matches!(err, MdmaClientError::CaRead { .. }), "{err}");
}
