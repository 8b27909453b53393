//! The physical limits beside the idle poll at fleet scale: what the fleet's real answer
//! (10,000 assignments with 8 admitter addresses each, about 9.5 MB) costs to move and to
//! look at, on this machine, with nothing of the daemon around it.
//! `cargo run --release --example poll-limits -- [ROUNDS]` (default 20) prints, as CPU ms of
//! the client's thread per exchange or pass (the server runs on a thread of its own and is
//! not counted):
//!
//! - one keep-alive loopback exchange of the same bytes, HTTPS (rustls) and plain HTTP,
//!   the body read chunk by chunk and dropped: the floor of any poll of that answer;
//! - the same exchange through `MdmaClient::should_join_if_changed` holding the answer's
//!   digest (the daemon's poll up to the plan: the body hashed as it streams, then dropped);
//! - reading and hashing 9.5 MB already in memory: BLAKE3 and SHA-256.
//!
//! `scripts/poll-limits.sh` runs it beside the daemon bench (bench/RESULTS.md).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use fleet_sidecar::testing::mdma::fleet_answer_for;
use fleet_sidecar::{
    mdma::Holding, mdma::NodeReport, mdma::Polled, ControlPlane, MdmaClient, PeerId,
};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use sha2::Digest;

type Error = Box<dyn std::error::Error + Send + Sync>;

/// CPU time this thread has run, in ns (`/proc/thread-self/schedstat`, first field).
fn thread_cpu_ns() -> Result<u64, Error> {
    let text = std::fs::read_to_string("/proc/thread-self/schedstat")?;
    let first = text.split_whitespace().next().ok_or("empty schedstat")?;
    Ok(first.parse()?)
}

/// Runs `f` `rounds` times; prints CPU ms of this thread and wall ms per round.
fn figure<T>(
    name: &str,
    rounds: u32,
    mut f: impl FnMut() -> Result<T, Error>,
) -> Result<(), Error> {
    f()?; // warm: connections made, pages touched
    let (cpu0, wall0) = (thread_cpu_ns()?, Instant::now());
    for _ in 0..rounds {
        std::hint::black_box(f()?);
    }
    let cpu = (thread_cpu_ns()? - cpu0) as f64 / 1e6 / f64::from(rounds);
    let wall = wall0.elapsed().as_secs_f64() * 1e3 / f64::from(rounds);
    println!("{name}\t{cpu:.3}\t{wall:.3}");
    Ok(())
}

/// Serves `body` to every request on `127.0.0.1:0` (TLS when `tls` is given), keep-alive,
/// on a runtime of its own thread. Returns the address.
fn serve(body: Bytes, tls: Option<tokio_rustls::TlsAcceptor>) -> Result<SocketAddr, Error> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    listener.set_nonblocking(true)?;
    let addr = listener.local_addr()?;
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("server runtime");
        rt.block_on(async move {
            let listener = tokio::net::TcpListener::from_std(listener).expect("listener");
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let (body, tls) = (body.clone(), tls.clone());
                tokio::spawn(async move {
                    let service =
                        hyper::service::service_fn(move |req: hyper::Request<Incoming>| {
                            let body = body.clone();
                            async move {
                                let _ = req.into_body().collect().await;
                                Ok::<_, Infallible>(hyper::Response::new(Full::new(body)))
                            }
                        });
                    let http = hyper::server::conn::http1::Builder::new();
                    match tls {
                        Some(tls) => {
                            if let Ok(stream) = tls.accept(stream).await {
                                let _ = http.serve_connection(TokioIo::new(stream), service).await;
                            }
                        }
                        None => {
                            let _ = http.serve_connection(TokioIo::new(stream), service).await;
                        }
                    }
                });
            }
        });
    });
    Ok(addr)
}

fn main() -> Result<(), Error> {
    let rounds: u32 = std::env::args()
        .nth(1)
        .map(|r| r.parse())
        .transpose()?
        .unwrap_or(20);
    let ids: Vec<String> = (0..10_000u64)
        .map(|i| format!("{:064x}", 0xf1ee_u64 << 48 | i))
        .collect();
    let body = Bytes::from(fleet_answer_for(&ids, 8));

    // A self-signed certificate for 127.0.0.1, trusted by the clients through a CA file.
    let key = rcgen::KeyPair::generate()?;
    let params = rcgen::CertificateParams::new(vec!["127.0.0.1".to_owned()])?;
    let cert = params.self_signed(&key)?;
    let dir = tempfile::tempdir()?;
    let ca_file = dir.path().join("ca.pem");
    std::fs::write(&ca_file, cert.pem())?;
    let server = tokio_rustls::rustls::ServerConfig::builder_with_provider(Arc::new(
        tokio_rustls::rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()?
    .with_no_client_auth()
    .with_single_cert(
        vec![cert.der().clone()],
        tokio_rustls::rustls::pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into()),
    )?;
    let https = serve(
        body.clone(),
        Some(tokio_rustls::TlsAcceptor::from(Arc::new(server))),
    )?;
    let http = serve(body.clone(), None)?;

    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    println!(
        "# {} bytes, {rounds} rounds; CPU ms of the client's thread, wall ms",
        body.len()
    );
    println!("what\tcpu_ms\twall_ms");

    let raw = reqwest::Client::builder()
        .no_proxy()
        .add_root_certificate(reqwest::Certificate::from_pem(&cert.pem().into_bytes())?)
        .build()?;
    for (name, url) in [
        (
            "exchange, HTTPS",
            format!("https://{https}/api/fleet/should-join"),
        ),
        (
            "exchange, HTTP",
            format!("http://{http}/api/fleet/should-join"),
        ),
    ] {
        figure(name, rounds, || {
            rt.block_on(async {
                let mut resp = raw.post(&url).body("{}").send().await?;
                let mut n = 0;
                while let Some(chunk) = resp.chunk().await? {
                    n += chunk.len();
                }
                Ok(n)
            })
        })?;
    }

    let peer: PeerId = fleet_sidecar::testing::sandbox::PEER_ID.parse()?;
    for (name, base) in [
        (
            "MdmaClient, unchanged answer, HTTPS",
            format!("https://{https}/"),
        ),
        (
            "MdmaClient, unchanged answer, HTTP",
            format!("http://{http}/"),
        ),
    ] {
        let client = MdmaClient::builder(base.parse()?)
            .ca_file(&ca_file)
            .build()?;
        let held = rt.block_on(async {
            match client
                .should_join_if_changed(&peer, None, NodeReport::default(), Holding::default())
                .await?
            {
                Polled::Changed { digest, .. } => digest.ok_or_else(|| Error::from("no digest")),
                Polled::Unchanged => Err("unchanged with nothing held".into()),
            }
        })?;
        figure(name, rounds, || {
            rt.block_on(async {
                match client
                    .should_join_if_changed(
                        &peer,
                        None,
                        NodeReport::default(),
                        Holding {
                            answer: Some(&held),
                            joined: None,
                        },
                    )
                    .await?
                {
                    Polled::Unchanged => Ok(()),
                    Polled::Changed { .. } => Err(Error::from("the same bytes read as changed")),
                }
            })
        })?;
    }

    figure("BLAKE3 of the body in memory", rounds, || {
        Ok(*blake3::hash(&body).as_bytes())
    })?;
    figure("SHA-256 of the body in memory", rounds, || {
        Ok(<[u8; 32]>::from(sha2::Sha256::digest(&body)))
    })?;
    Ok(())
}
