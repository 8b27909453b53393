//! The fleet token: attested registration against the loopback emulators (every answer, the
//! `tee/attest` fallback, the wait for merod's account, the restart, rejection and
//! recovery), a replaced `fleet_token_file` picked up on a 401 and on SIGHUP, and the
//! secrets never in the output.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use base64::Engine;
use fleet_sidecar::testing::mdma::{PollReply, RegisterReply, ISSUED_TOKEN};
use fleet_sidecar::testing::merod::{mock_quote, ACCOUNT_ID};
use fleet_sidecar::testing::metadata::MetadataEmulator;
use fleet_sidecar::testing::sandbox::{Sandbox, PEER_ID};
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::common::*;

const RELAY: &str = "https://relay.example";
const ENROLMENT: &str = "NEVER-LOGGED-TOKEN-enrolment";
/// What MDMA wants before the node registered: a token the node does not have.
const UNKNOWN: &str = "NEVER-LOGGED-TOKEN-not-the-nodes";

/// The metadata server of the fleet's images: `relay-url` and `enrolment-token` set.
async fn metadata() -> MetadataEmulator {
    metadata_after(Duration::ZERO).await
}

/// [`metadata`], each answer sent `delay` after its request.
async fn metadata_after(delay: Duration) -> MetadataEmulator {
    let md = MetadataEmulator::start().await.unwrap();
    md.set("relay-url", &format!("{RELAY}\r\n"));
    md.set("enrolment-token", ENROLMENT);
    md.set_delay(delay);
    md
}

fn token_file(sb: &Sandbox) -> PathBuf {
    sb.dir().join("data/fleet/fleet-token")
}

fn registration(sb: &Sandbox, md: &MetadataEmulator) -> String {
    format!(
        "[registration]\ntoken_file = \"{}\"\nmetadata_url = \"{}\"\nretry_interval = \"1s\"\n",
        token_file(sb).display(),
        md.attributes_url()
    )
}

/// A sandbox whose MDMA refuses every poll until the node registered, and whose merod has
/// an account.
async fn fleet() -> (Sandbox, MetadataEmulator) {
    let sb = Sandbox::start(None).await.unwrap();
    sb.mdma.set_token(Some(UNKNOWN.to_owned()));
    sb.merod.set_minted(true);
    (sb, metadata().await)
}

fn nonce(challenge: &str) -> String {
    hex::encode(Sha256::digest(
        format!("{challenge}|{PEER_ID}|{ACCOUNT_ID}|{RELAY}").as_bytes(),
    ))
}

fn merod_calls(sb: &Sandbox, path: &str) -> Vec<String> {
    sb.merod
        .calls()
        .into_iter()
        .filter(|c| c.path == path)
        .map(|c| c.body)
        .collect()
}

fn field<'a>(body: &'a Value, name: &str) -> Option<&'a str> {
    body.get(name).and_then(Value::as_str)
}

async fn polls_carry(sb: &Sandbox, token: &str, limit: Duration) {
    eventually(&format!("a poll accepted with {token}"), limit, || {
        sb.mdma
            .polls()
            .iter()
            .any(|p| p.token.as_deref() == Some(token) && p.status == 200)
    })
    .await;
}

fn mode(p: &Path) -> u32 {
    std::fs::metadata(p).unwrap().permissions().mode() & 0o777
}

/// Every poll reports as `relay_url` the metadata's `relay-url` that registration sends,
/// read by a job (once a minute), never by the poll; a metadata server that fails
/// afterwards changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn polls_report_the_metadata_relay_url_read_by_a_job_never_by_the_poll() {
    let (sb, md) = fleet().await;
    let d = start(&sb, &registration(&sb, &md));
    polls_carry(&sb, ISSUED_TOKEN, Duration::from_secs(20)).await;
    eventually(
        "a poll carrying the relay URL",
        Duration::from_secs(20),
        || {
            sb.mdma
                .polls()
                .last()
                .and_then(|p| p.relay_url.clone())
                .as_deref()
                == Some(RELAY)
        },
    )
    .await;
    md.set_failing("relay-url", Some(503));
    let from = sb.mdma.polls().len();
    eventually("five more polls", Duration::from_secs(20), || {
        sb.mdma.polls().len() >= from + 5
    })
    .await;
    let polls = sb.mdma.polls();
    assert!(
        polls[from..]
            .iter()
            .all(|p| p.relay_url.as_deref() == Some(RELAY)),
        "{:?}",
        polls
            .iter()
            .map(|p| p.relay_url.clone())
            .collect::<Vec<_>>()
    );
    // Before the first read polls say "" (unknown), never anything else.
    assert!(polls
        .iter()
        .all(|p| matches!(p.relay_url.as_deref(), Some("" | RELAY))));
    // Registration's one read and the job's first: not one per poll.
    assert!(md.reads("relay-url") <= 3, "{}", md.reads("relay-url"));
    assert_eq!(d.telemetry.snapshot().relay_url.as_deref(), Some(RELAY));
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_registers_through_the_attest_fallback_and_polls_with_its_token_at_once() {
    let (sb, md) = fleet().await;
    let d = start(&sb, &registration(&sb, &md));
    polls_carry(&sb, ISSUED_TOKEN, Duration::from_secs(20)).await;

    // Any poll before went without a token, and was refused (so nothing was planned); the
    // registration is usually done before the first poll.
    let polls = sb.mdma.polls();
    let first = polls
        .iter()
        .position(|p| p.token.is_some())
        .expect("a poll with the token");
    assert!(polls[..first].iter().all(|p| p.status == 401));
    assert!(polls[first..].iter().all(|p| p.status == 200));
    // One registration, as the contract says.
    let regs = sb.mdma.registrations();
    assert_eq!(regs.len(), 1);
    let body = Value::Object(regs[0].body.clone().unwrap());
    let challenge = sb.mdma.challenges()[0].clone();
    assert_eq!(field(&body, "peer_id"), Some(PEER_ID));
    assert_eq!(field(&body, "executor_account"), Some(ACCOUNT_ID));
    assert_eq!(field(&body, "relay_url"), Some(RELAY));
    assert_eq!(field(&body, "challenge"), Some(challenge.as_str()));
    assert_eq!(field(&body, "enrolment_token"), Some(ENROLMENT));
    let nonce = nonce(&challenge);
    assert_eq!(
        field(&body, "quote"),
        Some(mock_quote(&nonce).as_str()),
        "the quote is over sha256(challenge|peer_id|account|relay_url)"
    );
    // rc.25: registration-attest answers 404, so tee/attest made the quote, unbound.
    assert!(body.get("quote_binding").is_none(), "{body}");
    let sent = format!(r#"{{"nonce":"{nonce}"}}"#);
    for path in [
        "/admin-api/tee/registration-attest",
        "/admin-api/tee/attest",
    ] {
        assert_eq!(
            merod_calls(&sb, path),
            std::slice::from_ref(&sent),
            "{path}"
        );
    }
    assert_eq!(md.without_header(), 0);

    // Stored atomically, 0600 in a 0700 directory, with whom it was issued to.
    let file = token_file(&sb);
    assert_eq!(std::fs::read_to_string(&file).unwrap(), ISSUED_TOKEN);
    assert_eq!(mode(&file), 0o600);
    assert_eq!(mode(file.parent().unwrap()), 0o700);
    let record: Value = serde_json::from_slice(
        &std::fs::read(file.with_file_name("fleet-registration.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(
        record,
        serde_json::json!({"executor_account": ACCOUNT_ID, "peer_id": PEER_ID, "relay_url": RELAY})
    );

    let status = d.telemetry.snapshot();
    assert_eq!(status.fleet_token, "registered");
    assert!(status
        .registration
        .as_deref()
        .unwrap()
        .starts_with("registered at"));
    let metrics = d.telemetry.encode_metrics();
    assert_eq!(
        metric(
            &metrics,
            r#"fleet_sidecar_registrations_total{outcome="registered"}"#
        ),
        1.0
    );
    // Neither secret reaches the status or the metrics.
    let shown = format!("{}{metrics}", serde_json::to_string(&status).unwrap());
    assert!(!shown.contains("NEVER-LOGGED-TOKEN"), "{shown}");
    d.stop().await;
}

/// A node with a TLS key registers with a CSR for its relay host: sent as `csr`, kept as
/// `csr-<host>.b64` in `[tls] dir`, and committed to by the nonce the quote is over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_with_a_tls_key_registers_with_a_csr_the_quote_commits_to() {
    use p256::pkcs8::EncodePrivateKey;
    let (sb, md) = fleet().await;
    let tls = sb.dir().join("tls");
    std::fs::create_dir_all(&tls).unwrap();
    let key = p256::SecretKey::random(&mut p256::elliptic_curve::rand_core::OsRng);
    let pem = key.to_pkcs8_pem(p256::pkcs8::LineEnding::LF).unwrap();
    std::fs::write(tls.join("key.pem"), pem.as_bytes()).unwrap();
    std::fs::write(tls.join("csr-old.example.b64"), "stale").unwrap();
    let d = start(&sb, &registration(&sb, &md));
    polls_carry(&sb, ISSUED_TOKEN, Duration::from_secs(20)).await;

    let regs = sb.mdma.registrations();
    let body = Value::Object(regs[0].body.clone().unwrap());
    let csr = field(&body, "csr").expect("a csr").to_owned();
    assert_eq!(
        std::fs::read_to_string(tls.join("csr-relay.example.b64")).unwrap(),
        csr
    );
    assert!(!tls.join("csr-old.example.b64").exists());
    let der = base64::engine::general_purpose::STANDARD
        .decode(&csr)
        .unwrap();
    let request = <x509_cert::request::CertReq as x509_cert::der::Decode>::from_der(&der).unwrap();
    assert_eq!(request.info.subject.to_string(), "CN=relay.example");
    let challenge = sb.mdma.challenges()[0].clone();
    let csr_hash = hex::encode(Sha256::digest(csr.as_bytes()));
    let nonce = hex::encode(Sha256::digest(
        format!("{challenge}|{PEER_ID}|{ACCOUNT_ID}|{RELAY}|{csr_hash}").as_bytes(),
    ));
    assert_eq!(field(&body, "quote"), Some(mock_quote(&nonce).as_str()));
    d.stop().await;
}

/// merod behind its second `[server].listen` address (the first refuses
/// connections). The loop's probe picks the second; registration's identity and quote go
/// there too, so the node registers (they went to `listen[0]` and never got through).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registration_asks_merod_at_the_listen_address_that_answered() {
    let (sb, md) = fleet().await;
    let dead = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let merod_port = sb.merod.addr().port();
    let toml = sb.dir().join("calimero/default/config.toml");
    let text = std::fs::read_to_string(&toml).unwrap().replace(
        &format!("listen = [\"/ip4/127.0.0.1/tcp/{merod_port}\"]"),
        &format!("listen = [\"/ip4/127.0.0.1/tcp/{dead}\", \"/ip4/127.0.0.1/tcp/{merod_port}\"]"),
    );
    assert!(text.contains(&format!("tcp/{dead}")), "{text}");
    std::fs::write(&toml, text).unwrap();
    let cfg = sb.write_config(&registration(&sb, &md)).unwrap();
    let _daemon = spawn_daemon(&cfg, false, &[]);
    polls_carry(&sb, ISSUED_TOKEN, Duration::from_secs(20)).await;
    assert_eq!(merod_calls(&sb, "/admin-api/identity").len(), 1);
    assert_eq!(merod_calls(&sb, "/admin-api/tee/attest").len(), 1);
    assert_eq!(sb.mdma.registrations().len(), 1);
}

/// `once` with `[registration]` and no stored token: the first attempt ends before the
/// poll (here it takes a second, the metadata server being slow), so the one poll carries
/// the token it earned, instead of going without one and being refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn once_registers_before_its_poll() {
    let sb = Sandbox::start(None).await.unwrap();
    sb.mdma.set_token(Some(UNKNOWN.to_owned()));
    sb.merod.set_minted(true);
    sb.mdma.set_reply(PollReply::assign([A]));
    let md = metadata_after(Duration::from_millis(500)).await;
    let cfg = sb.write_config(&registration(&sb, &md)).unwrap();
    let out = tokio::task::spawn_blocking(move || {
        run_once(&["--config", cfg.to_str().unwrap(), "once"], &[])
    })
    .await
    .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    let polls = sb.mdma.polls();
    assert_eq!(polls.len(), 1, "{stderr}");
    assert_eq!(polls[0].token.as_deref(), Some(ISSUED_TOKEN));
    assert_eq!(polls[0].status, 200);
    assert!(sb.mdma.confirmed().contains(A), "{stderr}");
    assert_eq!(
        std::fs::read_to_string(token_file(&sb)).unwrap(),
        ISSUED_TOKEN
    );
    assert!(!stderr.contains("NEVER-LOGGED-TOKEN"), "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quote_from_registration_attest_is_sent_bound() {
    let (sb, md) = fleet().await;
    sb.merod.set_registration_attest(true);
    let d = start(&sb, &registration(&sb, &md));
    polls_carry(&sb, ISSUED_TOKEN, Duration::from_secs(20)).await;
    d.stop().await;
    let body = Value::Object(sb.mdma.registrations()[0].body.clone().unwrap());
    assert_eq!(field(&body, "quote_binding"), Some("registration"));
    assert!(merod_calls(&sb, "/admin-api/tee/attest").is_empty());
    // The body has exactly the fields of proto/mdma-register.request.json.
    let example: Value = serde_json::from_str(
        &std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("proto/mdma-register.request.json"),
        )
        .unwrap(),
    )
    .unwrap();
    let keys = |v: &Value| v.as_object().unwrap().keys().cloned().collect::<Vec<_>>();
    assert_eq!(keys(&body), keys(&example));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registration_waits_for_merod_s_account_and_says_it_is_blocked() {
    let (sb, md) = fleet().await;
    sb.merod.set_minted(false);
    let d = start(&sb, &registration(&sb, &md));
    eventually("blocked in the status", Duration::from_secs(20), || {
        d.telemetry
            .snapshot()
            .registration
            .is_some_and(|r| r.starts_with("blocked: merod holds no account yet"))
    })
    .await;
    // Nothing was asked of MDMA meanwhile; polls went on without a token.
    assert!(sb.mdma.challenges().is_empty() && sb.mdma.registrations().is_empty());
    assert!(sb.mdma.polls().iter().all(|p| p.token.is_none()));
    let metrics = d.telemetry.encode_metrics();
    assert!(
        metric(
            &metrics,
            r#"fleet_sidecar_registrations_total{outcome="blocked"}"#
        ) >= 1.0
    );
    assert_eq!(d.telemetry.snapshot().fleet_token, "none");
    // The job harness shows why registration fails, and when it worked again.
    let job = d.telemetry.snapshot().jobs["registration"].clone();
    assert!(
        job.failing
            .as_deref()
            .is_some_and(|f| f.contains("merod holds no account yet")),
        "{job:?}"
    );
    // The node takes part in a namespace: the account exists, registration goes ahead.
    sb.merod.set_minted(true);
    polls_carry(&sb, ISSUED_TOKEN, Duration::from_secs(20)).await;
    eventually(
        "registration no longer failing",
        Duration::from_secs(5),
        || {
            let job = d.telemetry.snapshot().jobs["registration"].clone();
            job.failing.is_none() && job.last_good_at.is_some()
        },
    )
    .await;
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_and_an_unavailable_mdma_are_retried_with_backoff_until_registered() {
    let (sb, md) = fleet().await;
    sb.mdma
        .queue_register_replies([RegisterReply::Status(403), RegisterReply::Status(503)]);
    let d = start(&sb, &registration(&sb, &md));
    polls_carry(&sb, ISSUED_TOKEN, Duration::from_secs(30)).await;
    let metrics = d.telemetry.encode_metrics();
    d.stop().await;
    let regs = sb.mdma.registrations();
    let statuses: Vec<u16> = regs.iter().map(|r| r.status).collect();
    assert_eq!(statuses, [403, 503, 200]);
    // Backoff: the second retry waited at least twice the first (1 s, then 2 s).
    assert!(regs[1].at - regs[0].at >= Duration::from_secs(1));
    assert!(regs[2].at - regs[1].at >= Duration::from_secs(2));
    // A fresh challenge for each attempt.
    assert_eq!(sb.mdma.challenges().len(), 3);
    for (outcome, n) in [("refused", 1.0), ("unavailable", 1.0), ("registered", 1.0)] {
        assert_eq!(
            metric(
                &metrics,
                &format!(r#"fleet_sidecar_registrations_total{{outcome="{outcome}"}}"#)
            ),
            n,
            "{outcome}"
        );
    }
}

/// MDMA's answers are read strictly only where the node uses them: registration uses the
/// challenge's `challenge`, so an `expires_at_ms` written as a float (a Python or
/// JavaScript backend's integer) or as something else entirely fails no attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_challenge_s_expiry_as_a_float_or_unreadable_fails_no_registration() {
    for expiry in [
        serde_json::json!(1_733_150_000_000.0_f64),
        serde_json::json!("soon"),
    ] {
        let (sb, md) = fleet().await;
        sb.mdma.set_challenge_expiry(expiry.clone());
        let d = start(&sb, &registration(&sb, &md));
        polls_carry(&sb, ISSUED_TOKEN, Duration::from_secs(20)).await;
        d.stop().await;
        // The first attempt went through: one challenge, one registration.
        assert_eq!(sb.mdma.challenges().len(), 1, "{expiry}");
        assert_eq!(sb.mdma.registrations().len(), 1, "{expiry}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registration_without_a_token_polls_without_one() {
    let sb = Sandbox::start(None).await.unwrap();
    sb.merod.set_minted(true);
    let md = metadata().await;
    sb.mdma.set_register_reply(RegisterReply::Tokenless);
    let d = start(&sb, &registration(&sb, &md));
    eventually("tokenless", Duration::from_secs(20), || {
        d.telemetry.snapshot().fleet_token == "tokenless"
    })
    .await;
    let ok_polls = sb.mdma.polls().len();
    eventually("polls go on", Duration::from_secs(10), || {
        sb.mdma.polls().len() > ok_polls + 1
    })
    .await;
    d.stop().await;
    assert!(sb.mdma.polls().iter().all(|p| p.token.is_none()));
    assert_eq!(sb.mdma.registrations().len(), 1, "no registration storm");
    assert!(!token_file(&sb).exists());
}

/// A crash during a token write leaves its temp file, a copy of the token, beside the token
/// file: the next start removes it (this release's name and the one older releases used)
/// before anything is written there, and keeps every other file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_write_cut_by_a_crash_leaves_no_copy_of_the_token_after_the_next_start() {
    let (sb, md) = fleet().await;
    let dir = token_file(&sb).parent().unwrap().to_owned();
    std::fs::create_dir_all(&dir).unwrap();
    for name in [".fleet-tmp.Ab12Cd", ".fleet-token-Xy34Zw", "keep.txt"] {
        std::fs::write(dir.join(name), ISSUED_TOKEN).unwrap();
        std::fs::set_permissions(dir.join(name), std::fs::Permissions::from_mode(0o600)).unwrap();
    }
    let d = start(&sb, &registration(&sb, &md));
    polls_carry(&sb, ISSUED_TOKEN, Duration::from_secs(20)).await;
    d.stop().await;
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(
        names,
        ["fleet-registration.json", "fleet-token", "keep.txt"]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stored_token_is_reused_after_a_restart_without_a_new_registration() {
    let (sb, md) = fleet().await;
    let extra = registration(&sb, &md);
    let d = start(&sb, &extra);
    polls_carry(&sb, ISSUED_TOKEN, Duration::from_secs(20)).await;
    d.stop().await;
    let before = sb.mdma.polls().len();

    let d = start(&sb, &extra);
    eventually("polls after the restart", Duration::from_secs(20), || {
        sb.mdma.polls().len() > before + 2
    })
    .await;
    d.stop().await;
    let after = &sb.mdma.polls()[before..];
    assert!(
        after
            .iter()
            .all(|p| p.token.as_deref() == Some(ISSUED_TOKEN) && p.status == 200),
        "the first poll after the restart carries the stored token"
    );
    assert_eq!(sb.mdma.registrations().len(), 1);
    assert_eq!(sb.mdma.challenges().len(), 1);
}

/// Recovery beyond the reference: MDMA rotates its key and refuses the issued token; after
/// 30 s of refused polls the node registers again and polls with the new token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_refused_for_30_s_is_replaced_by_a_new_registration() {
    let (sb, md) = fleet().await;
    let d = start(&sb, &registration(&sb, &md));
    polls_carry(&sb, ISSUED_TOKEN, Duration::from_secs(20)).await;
    let rotated = "NEVER-LOGGED-TOKEN-after-the-rotation";
    sb.mdma.set_token(Some(UNKNOWN.to_owned()));
    sb.mdma
        .set_register_reply(RegisterReply::Issue(rotated.to_owned()));
    let refused_at = std::time::Instant::now();
    eventually("a refused poll", Duration::from_secs(10), || {
        sb.mdma.polls().last().is_some_and(|p| p.status == 401)
    })
    .await;
    polls_carry(&sb, rotated, Duration::from_secs(60)).await;
    d.stop().await;
    let regs = sb.mdma.registrations();
    assert_eq!(regs.len(), 2);
    assert!(
        regs[1].at - refused_at >= Duration::from_secs(29),
        "registered again only after 30 s of refusals ({:?})",
        regs[1].at - refused_at
    );
    assert_eq!(std::fs::read_to_string(token_file(&sb)).unwrap(), rotated);
}

/// A replaced `fleet_token_file` is used without a restart once MDMA refuses the
/// old token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replaced_fleet_token_file_is_read_again_on_a_refused_poll() {
    let sb = Sandbox::start(None).await.unwrap();
    let old = "NEVER-LOGGED-TOKEN-old";
    let new = "NEVER-LOGGED-TOKEN-new";
    sb.mdma.set_token(Some(old.to_owned()));
    let file = sb.dir().join("fleet-token");
    std::fs::write(&file, old).unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
    let d = start(&sb, &format!("fleet_token_file = \"{}\"", file.display()));
    polls_carry(&sb, old, Duration::from_secs(20)).await;
    assert_eq!(d.telemetry.snapshot().fleet_token, "configured");
    // The operator replaces the file (atomically, as a credential update does) and MDMA
    // accepts only the new token.
    let tmp = sb.dir().join("fleet-token.tmp");
    std::fs::write(&tmp, new).unwrap();
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o600)).unwrap();
    std::fs::rename(&tmp, &file).unwrap();
    sb.mdma.set_token(Some(new.to_owned()));
    polls_carry(&sb, new, Duration::from_secs(10)).await;
    // It is a job like any other: in the live status, read only when asked (no read at
    // start, so every run here followed a refused poll), not failing.
    let job = d.telemetry.snapshot().jobs["fleet_token_file"].clone();
    assert!(job.runs >= 1 && job.failing.is_none(), "{job:?}");
    d.stop().await;
}

/// SIGHUP: the binary reads `fleet_token_file` again on SIGHUP (MDMA accepts
/// both tokens here, so only the signal can make the new one appear). Nothing of either
/// token reaches the output.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reads_the_fleet_token_file_again_and_no_token_reaches_the_output() {
    let sb = Sandbox::start(None).await.unwrap();
    let old = "NEVER-LOGGED-TOKEN-before-hup";
    let new = "NEVER-LOGGED-TOKEN-after-hup";
    let file = sb.dir().join("fleet-token");
    std::fs::write(&file, old).unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
    let config = sb
        .write_config(&format!(
            "fleet_token_file = \"{}\"\nlog_format = \"json\"",
            file.display()
        ))
        .unwrap();
    let daemon = spawn_daemon(&config, true, &[]);
    polls_carry(&sb, old, Duration::from_secs(20)).await;
    std::fs::write(&file, new).unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(
        sb.mdma
            .polls()
            .iter()
            .all(|p| p.token.as_deref() == Some(old)),
        "without SIGHUP (and no refusal) the token in use is kept"
    );
    daemon.signal(nix::sys::signal::Signal::SIGHUP);
    polls_carry(&sb, new, Duration::from_secs(10)).await;
    let out = daemon.stop().await;
    let text = format!(
        "{}{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
        std::fs::read_to_string(sb.log_file()).unwrap_or_default()
    );
    assert!(
        text.contains("SIGHUP") || text.contains("token changed"),
        "{text}"
    );
    assert!(!text.contains("NEVER-LOGGED-TOKEN"), "{text}");
}

/// The binary registering: neither the issued token nor the enrolment token appears in its
/// output, its log file, `/status`, `/metrics`, `status` or `check-config`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_secret_of_a_registration_reaches_any_output() {
    let (sb, md) = fleet().await;
    // One refusal first, so the failure path is logged too.
    sb.mdma.queue_register_replies([RegisterReply::Status(403)]);
    let listen = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listen.local_addr().unwrap();
    drop(listen);
    let extra = format!(
        "status_listen = \"{addr}\"\nlog_format = \"text\"\n{}",
        registration(&sb, &md)
    );
    let config = sb.write_config(&extra).unwrap();
    let daemon = spawn_daemon(&config, true, &[("RUST_LOG", "debug".as_ref())]);
    polls_carry(&sb, ISSUED_TOKEN, Duration::from_secs(30)).await;
    let http = reqwest::Client::builder().no_proxy().build().unwrap();
    let mut shown = String::new();
    for path in ["status", "metrics"] {
        shown += &http
            .get(format!("http://{addr}/{path}"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
    }
    for cmd in [&["status"][..], &["status", "--json"], &["check-config"]] {
        let args: Vec<&str> = ["--config", config.to_str().unwrap()]
            .into_iter()
            .chain(cmd.iter().copied())
            .collect();
        let out = run_once(&args, &[]);
        shown += &String::from_utf8_lossy(&out.stdout);
        shown += &String::from_utf8_lossy(&out.stderr);
    }
    assert!(
        shown.contains("fleet_sidecar_registrations_total"),
        "{shown}"
    );
    assert!(shown.contains("\"fleet_token\":\"registered\""), "{shown}");
    assert!(
        shown.contains("token_file") && shown.contains("is present"),
        "{shown}"
    );
    // The recovery is logged once the daemon has seen an accepted poll, a moment after
    // the emulator recorded it (see the test below).
    eventually("the recovery logged", Duration::from_secs(20), || {
        std::fs::read_to_string(sb.log_file())
            .unwrap_or_default()
            .contains("MDMA accepts the polls again")
    })
    .await;
    let out = daemon.stop().await;
    // Each line is on stderr and in the log file: count on stderr.
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    shown += &String::from_utf8_lossy(&out.stdout);
    shown += &stderr;
    shown += &std::fs::read_to_string(sb.log_file()).unwrap_or_default();
    assert!(shown.contains("registration failed"), "{shown}");
    assert!(shown.contains("registered with MDMA"), "{shown}");
    assert_eq!(
        stderr.matches("refuses polls without a token").count(),
        1,
        "'no token yet' is said once, on the edge"
    );
    assert_eq!(stderr.matches("MDMA accepts the polls again").count(), 1);
    assert!(!shown.contains("NEVER-LOGGED-TOKEN"), "{shown}");
}

/// A token MDMA stops accepting is logged as rejected once, and the recovery once (here by
/// the replaced `fleet_token_file`, read again on the refused poll).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rejected_token_is_logged_once_on_the_edge_and_once_on_recovery() {
    let sb = Sandbox::start(None).await.unwrap();
    let old = "NEVER-LOGGED-TOKEN-rejected";
    let new = "NEVER-LOGGED-TOKEN-accepted";
    sb.mdma.set_token(Some(old.to_owned()));
    let file = sb.dir().join("fleet-token");
    std::fs::write(&file, old).unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
    let config = sb
        .write_config(&format!("fleet_token_file = \"{}\"", file.display()))
        .unwrap();
    let daemon = spawn_daemon(&config, true, &[]);
    polls_carry(&sb, old, Duration::from_secs(20)).await;
    sb.mdma.set_token(Some(new.to_owned()));
    let before = sb.mdma.polls().len();
    eventually("three refused polls", Duration::from_secs(20), || {
        sb.mdma.polls()[before..]
            .iter()
            .filter(|p| p.status == 401)
            .count()
            >= 3
    })
    .await;
    std::fs::write(&file, new).unwrap();
    polls_carry(&sb, new, Duration::from_secs(20)).await;
    // The emulator records a poll before it answers: the daemon sees the answer (and logs
    // the recovery) a moment later, which a loaded machine can stretch past a SIGTERM sent
    // now. The log file gets the same lines as stderr.
    eventually("the recovery logged", Duration::from_secs(20), || {
        std::fs::read_to_string(sb.log_file())
            .unwrap_or_default()
            .contains("MDMA accepts the polls again")
    })
    .await;
    let out = daemon.stop().await;
    // Each line is on stderr and in the log file: count on stderr.
    let text = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(text.matches("token rejected").count(), 1, "{text}");
    assert_eq!(
        text.matches("MDMA accepts the polls again").count(),
        1,
        "{text}"
    );
    assert!(!text.contains("no token yet"), "{text}");
    let all = text + &std::fs::read_to_string(sb.log_file()).unwrap_or_default();
    assert!(!all.contains("NEVER-LOGGED-TOKEN"), "{all}");
}
