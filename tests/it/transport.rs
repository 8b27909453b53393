//! Hostile transports and environments: environment proxies never capture loopback calls;
//! MDMA answering one byte a second, an oversized answer, and bad TLS (wrong hostname,
//! expired certificate, untrusted issuer) each fail the poll with the cause named and never
//! lead to a leave; merod answers naming a key twice fail closed; a CA file with a bad block
//! names the file and the block.

use std::sync::Arc;
use std::time::Duration;

use fleet_sidecar::daemon::{self, CycleOutcome, Deps};
use fleet_sidecar::testing::mdma::{fleet_answer, MdmaEmulator, PollReply};
use fleet_sidecar::testing::sandbox::Sandbox;
use fleet_sidecar::Config;
use fleet_sidecar::{mdma::MdmaClientError, mdma::MAX_POLL_BODY, MdmaClient};
use fleet_sidecar::{MerodClient, MerodError, Node};
use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;

use crate::common::*;
use crate::fakes::Fake;

const DEAD_PROXY: &str = "http://127.0.0.1:9";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn environment_proxies_never_reach_loopback_merod_or_mdma() {
    let sb = Sandbox::start(None).await.unwrap();
    sb.mdma.set_reply(PollReply::assign([A]));
    let cfg = sb.write_config("").unwrap();
    let proxy = std::ffi::OsStr::new(DEAD_PROXY);
    let env: Vec<(&str, &std::ffi::OsStr)> = [
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "ALL_PROXY",
        "http_proxy",
        "https_proxy",
        "all_proxy",
    ]
    .into_iter()
    .map(|k| (k, proxy))
    .collect();
    let mut child = spawn_daemon(&cfg, false, &env);
    eventually(
        "A joined and confirmed with every proxy variable set",
        Duration::from_secs(30),
        || sb.mdma.confirmed().contains(A),
    )
    .await;
    assert!(sb.merod.held().contains(A));
    child.kill().unwrap();
    child.wait().unwrap();
}

/// Runs one cycle (`once`) with A held and confirmed, leaving on the first withdrawing poll,
/// against the MDMA at `url`: the poll must fail naming `cause`, and nothing may be left.
async fn poll_fails_without_a_leave(
    url: &url::Url,
    ca_file: Option<&std::path::Path>,
    cause: &str,
) {
    let node = NodeDir::new();
    let a = gid(A);
    node.seed(&[a].into(), &[a].into());
    let merod = Fake::default();
    merod.with(|w| w.held.insert(a));
    let mdma = MdmaClient::new(url, None, ca_file).unwrap();
    let cfg: Config = node.config(REFERENCE);
    let deps = Deps::new(Arc::new(mdma), Arc::new(merod.clone()));
    let started = std::time::Instant::now();
    let outcome = daemon::once(cfg, deps, CancellationToken::new())
        .await
        .unwrap()
        .unwrap();
    let CycleOutcome::PollFailed(e) = outcome else {
        panic!("{url}: the poll should fail ({cause}), got {outcome:?}");
    };
    // The loop logs `poll failed, cycle skipped …: {e}`.
    let line = e.to_string();
    assert!(
        line.to_lowercase().contains(&cause.to_lowercase()),
        "the log line names {cause:?}: {line}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(13),
        "ended at its deadline: {:?}",
        started.elapsed()
    );
    assert!(merod.with(|w| w.leaves.is_empty()), "never a leave");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_mdma_sending_one_byte_a_second_is_cut_at_the_deadline() {
    let url = raw_server(CHUNKED, |mut tcp| async move {
        for _ in 0..60 {
            if tcp.write_all(b"1\r\n \r\n").await.is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    })
    .await;
    poll_fails_without_a_leave(&url, None, "no answer within 10s").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_over_the_body_cap_is_refused_unread() {
    // Chunked: the cap is found while streaming; the server then stalls, so reading the
    // whole answer would end in the timeout instead.
    let url = raw_server(CHUNKED, |mut tcp| async move {
        let chunk = format!("{:x}\r\n{}\r\n", 64 * 1024, " ".repeat(64 * 1024));
        for _ in 0..(MAX_POLL_BODY / (64 * 1024) + 16) {
            if tcp.write_all(chunk.as_bytes()).await.is_err() {
                return;
            }
        }
        tokio::time::sleep(Duration::from_secs(60)).await;
    })
    .await;
    let started = std::time::Instant::now();
    poll_fails_without_a_leave(&url, None, "larger than").await;
    assert!(
        started.elapsed() < Duration::from_secs(8),
        "{:?}",
        started.elapsed()
    );
    // Announced: refused before a byte of the body is read.
    let url = raw_server(
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 104857600\r\n\r\n",
        |tcp| async move {
            // Keep the connection open, sending nothing more.
            let _open = tcp;
            tokio::time::sleep(Duration::from_secs(60)).await;
        },
    )
    .await;
    poll_fails_without_a_leave(&url, None, "larger than").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_merod_answer_over_the_body_cap_is_refused_unread() {
    use fleet_sidecar::merod::MAX_MEROD_BODY;
    // Announced larger than the cap, then nothing: reading it would wait for the deadline
    // (and, sent, fill the memory); refused at once instead, for the listing's pages and
    // for every other call alike.
    let head: &'static str = Box::leak(
        format!(
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
            MAX_MEROD_BODY + 1
        )
        .into_boxed_str(),
    );
    let url = raw_server(head, |tcp| async move {
        let _open = tcp;
        tokio::time::sleep(Duration::from_secs(60)).await;
    })
    .await;
    let merod = MerodClient::new(&url).unwrap();
    let started = std::time::Instant::now();
    let listing = merod.list_namespaces().await.unwrap_err();
    let status = merod.network_status().await.unwrap_err();
    for err in [&listing, &status] {
        assert!(matches!(err, MerodError::Answer { .. }), "{err}");
        assert!(err.to_string().contains("larger than"), "{err}");
    }
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "refused before the deadline: {:?}",
        started.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_sized_answer_of_10000_assignments_with_8_admitters_each_is_accepted() {
    let body = fleet_answer(10_000, 8);
    assert!(
        body.len() > 4 * 1024 * 1024,
        "larger than the former 4 MiB cap: {} bytes",
        body.len()
    );
    assert!(body.len() <= MAX_POLL_BODY, "{} bytes", body.len());
    let emu = MdmaEmulator::start(None).await.unwrap();
    emu.set_reply(PollReply::RawBody(body));
    let mdma = MdmaClient::new(&emu.url(), None, None).unwrap();
    let peer: fleet_sidecar::PeerId = fleet_sidecar::testing::sandbox::PEER_ID.parse().unwrap();
    let answer = fleet_sidecar::ControlPlane::should_join(
        &mdma,
        &peer,
        None,
        fleet_sidecar::mdma::NodeReport::default(),
    )
    .await
    .expect("a fleet-sized answer is a good poll");
    assert_eq!(answer.assignments.len(), 10_000);
    assert!(answer
        .assignments
        .contains(&format!("{:064x}", 9_999).parse().unwrap()));
}

struct Ca {
    key: KeyPair,
    cert: rcgen::Certificate,
}

fn ca(name: &str) -> Ca {
    let key = KeyPair::generate().unwrap();
    let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    p.distinguished_name
        .push(rcgen::DnType::CommonName, name.to_owned());
    let cert = p.self_signed(&key).unwrap();
    Ca { key, cert }
}

/// An HTTPS server on 127.0.0.1 presenting a leaf for `names` signed by `issuer`, valid
/// until `not_after` years from 1970 + 30 (i.e. in the past when `expired`).
async fn tls_server(issuer: &Ca, names: &[&str], expired: bool) -> u16 {
    let key = KeyPair::generate().unwrap();
    let mut p =
        CertificateParams::new(names.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap();
    if expired {
        p.not_before = rcgen::date_time_ymd(2000, 1, 1);
        p.not_after = rcgen::date_time_ymd(2001, 1, 1);
    }
    let leaf = p.signed_by(&key, &issuer.cert, &issuer.key).unwrap();
    let server = tls_server_config(&leaf, &key);
    let acceptor = TlsAcceptor::from(Arc::new(server));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let _ = acceptor.accept(tcp).await;
            });
        }
    });
    port
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_tls_fails_the_poll_naming_the_cause() {
    let trusted = ca("trusted test CA");
    let stranger = ca("unknown test CA");
    let dir = tempfile::tempdir().unwrap();
    let ca_file = dir.path().join("ca.pem");
    std::fs::write(&ca_file, trusted.cert.pem()).unwrap();
    for (issuer, names, expired, cause) in [
        (
            &trusted,
            &["mdma.other.example"][..],
            false,
            "not valid for name",
        ),
        (&trusted, &["localhost"][..], true, "expired"),
        (&stranger, &["localhost"][..], false, "issuer"),
    ] {
        let port = tls_server(issuer, names, expired).await;
        let url: url::Url = format!("https://localhost:{port}/").parse().unwrap();
        poll_fails_without_a_leave(&url, Some(&ca_file), cause).await;
    }
}

#[test]
fn a_ca_file_with_a_bad_trailing_block_names_the_file_and_the_block() {
    let good = ca("good").cert.pem();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("mdma-ca.pem");
    let bad_der = "-----BEGIN CERTIFICATE-----\nMIIBAAAA\n-----END CERTIFICATE-----\n";
    std::fs::write(&file, format!("{good}{bad_der}")).unwrap();
    let url: url::Url = "https://mdma.example/".parse().unwrap();
    let err = MdmaClient::new(&url, None, Some(&file)).unwrap_err();
    assert!(matches!(err, MdmaClientError::CaParse { .. }), "{err}");
    let text = err.to_string();
    assert!(text.contains("mdma-ca.pem"), "{text}");
    assert!(
        text.contains("certificate 2"),
        "names the bad block: {text}"
    );
    assert!(text != "builder error" && text.len() > 60, "{text}");
}

/// A loopback merod answering every call with `body` (status 200).
async fn merod_answering(body: &'static str) -> url::Url {
    let app = axum::Router::new().fallback(move || async move {
        (
            [(axum::http::header::CONTENT_TYPE, "application/json")],
            body,
        )
    });
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move { axum::serve(listener, app).await });
    format!("http://127.0.0.1:{port}/").parse().unwrap()
}

#[tokio::test]
async fn merod_answers_naming_a_key_twice_fail_closed() {
    let a = gid(A);
    let url = merod_answering(r#"{"admitted":false,"status":"announced","admitted":true}"#).await;
    let err = MerodClient::new(&url)
        .unwrap()
        .fleet_join(a, &[])
        .await
        .unwrap_err();
    assert!(err.to_string().contains("duplicate key"), "{err}");
    let url = merod_answering(
        r#"{"data":{"namespaceId":"c0ffee00c0ffee00c0ffee00c0ffee00c0ffee00c0ffee00c0ffee00c0ffee00","namespaceId":"38069a4cc4285c4245c84587ac60084ba53502a8b91c9b108bca40f10ec4d3df"}}"#,
    )
    .await;
    let err = MerodClient::new(&url)
        .unwrap()
        .holds_namespace(a)
        .await
        .unwrap_err();
    assert!(
        matches!(err, MerodError::Status { status: 200, .. }),
        "membership unknown: {err}"
    );
    // merod's refusal reasons are kept for the log.
    let url = merod_answering(
        r#"{"admitted":false,"status":"announced","reason":"no verifier answered"}"#,
    )
    .await;
    let got = MerodClient::new(&url)
        .unwrap()
        .fleet_join(a, &[])
        .await
        .unwrap();
    assert_eq!(got.reasons, vec!["no verifier answered".to_owned()]);
}

/// merod moves to another of its `[server].listen` addresses while the daemon runs (it stops
/// answering on the first, which the start-up probe chose): the first call refused there
/// makes the daemon probe the addresses again, so the next join goes to the second one,
/// without a restart. (Before, every later call went to the first address and failed.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_merod_that_moves_to_its_second_listen_address_is_followed_without_a_restart() {
    let sb = Sandbox::start(None).await.unwrap();
    let first = sb.merod.addr();
    let second = sb.merod.listen_also().await.unwrap();
    let toml = sb.dir().join("calimero/default/config.toml");
    let text = std::fs::read_to_string(&toml).unwrap().replace(
        &format!("listen = [\"/ip4/127.0.0.1/tcp/{}\"]", first.port()),
        &format!(
            "listen = [\"/ip4/127.0.0.1/tcp/{}\", \"/ip4/127.0.0.1/tcp/{}\"]",
            first.port(),
            second.port()
        ),
    );
    assert!(text.contains(&format!("tcp/{}", second.port())), "{text}");
    std::fs::write(&toml, text).unwrap();
    sb.mdma.set_reply(PollReply::assign([A]));
    let cfg = sb.write_config("").unwrap();
    let _daemon = spawn_daemon(&cfg, false, &[]);
    eventually(
        "A joined at the first address",
        Duration::from_secs(20),
        || sb.merod.held().contains(A),
    )
    .await;

    sb.merod.stop_listening_at(first);
    sb.mdma.set_reply(PollReply::assign([A, B]));
    eventually(
        "B joined at the second address",
        Duration::from_secs(30),
        || sb.merod.held().contains(B),
    )
    .await;
    assert!(sb.merod.held().contains(A), "nothing was left meanwhile");
}

/// MDMA's `Retry-After`, as seconds or as an HTTP date, reaches the error of a refused poll
/// and confirm (what the daemon waits out); garbage reads as nothing asked.
#[tokio::test]
async fn retry_after_reaches_the_error_as_seconds_or_an_http_date() {
    use fleet_sidecar::ControlPlane;
    let emu = MdmaEmulator::start(None).await.unwrap();
    let mdma = MdmaClient::new(&emu.url(), None, None).unwrap();
    let peer: fleet_sidecar::PeerId = fleet_sidecar::testing::sandbox::PEER_ID.parse().unwrap();
    let poll = || mdma.should_join(&peer, None, fleet_sidecar::mdma::NodeReport::default());
    emu.set_reply(PollReply::Status(429));
    emu.set_retry_after(Some("30"));
    let e = poll().await.unwrap_err();
    assert_eq!(e.retry_after(), Some(Duration::from_secs(30)), "{e}");
    let at = std::time::SystemTime::now() + Duration::from_secs(40);
    emu.set_retry_after(Some(&httpdate::fmt_http_date(at)));
    let asked = poll().await.unwrap_err().retry_after().unwrap();
    assert!(
        (Duration::from_secs(38)..=Duration::from_secs(41)).contains(&asked),
        "{asked:?}"
    );
    emu.set_retry_after(Some("soon"));
    assert_eq!(poll().await.unwrap_err().retry_after(), None);
    // A confirm refused with one.
    emu.set_retry_after(Some("7"));
    emu.fail_next_confirms(&"ab".repeat(32), 1);
    let id: fleet_sidecar::GroupId = "ab".repeat(32).parse().unwrap();
    let e = mdma.confirm(&peer, id, None).await.unwrap_err();
    assert_eq!(e.retry_after(), Some(Duration::from_secs(7)), "{e}");
}
