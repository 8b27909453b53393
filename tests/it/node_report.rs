//! What the node tells MDMA and hands merod, over HTTP against the emulators:
//! join-status after each fleet-join outcome, the assignment's admitter addresses in the
//! fleet-join (and an older core's 400), the role in the confirm, and merod's own 404s.

use std::time::Duration;

use fleet_sidecar::testing::mdma::PollReply;
use fleet_sidecar::testing::merod::{JoinBehaviour, LeaveBehaviour};
use fleet_sidecar::testing::sandbox::{Sandbox, PEER_ID};
use fleet_sidecar::{MerodClient, MerodError, Node, State, StateStore};

use crate::common::*;

const LIMIT: Duration = Duration::from_secs(30);
const ADMITTER: &str =
    "/ip4/10.0.0.7/tcp/2428/p2p/12D3KooWSeVdxK56xM4YSnh88AaEnqzrqYHyMPGxtMJ8jufC151U";

fn refuse_under_data() -> JoinBehaviour {
    JoinBehaviour::Refuse {
        refusals: vec![(
            "12D3KooWSeVdxK56xM4YSnh88AaEnqzrqYHyMPGxtMJ8jufC151U".to_owned(),
            "MRTD not in the admission policy".to_owned(),
        )],
        under_data: true,
    }
}

fn fleet_joins(sb: &Sandbox) -> Vec<fleet_sidecar::testing::merod::CallRecord> {
    sb.merod
        .calls()
        .into_iter()
        .filter(|c| c.path == "/admin-api/tee/fleet-join")
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn join_status_says_why_a_join_waits_and_attempts_survive_a_restart() {
    let sb = Sandbox::start(None).await.unwrap();
    sb.merod.set_join(A, refuse_under_data());
    sb.mdma.set_reply(PollReply::assign([A]));
    let d = start(&sb, "");
    eventually("a refused report", LIMIT, || {
        !sb.mdma.join_statuses().is_empty()
    })
    .await;
    let first = sb.mdma.join_statuses()[0].body.clone();
    assert_eq!(first["state"], "refused", "{first}");
    assert_eq!(first["group_id"], A);
    assert_eq!(first["peer_id"], PEER_ID);
    assert_eq!(first["attempts"], 1);
    assert_eq!(first["error"], serde_json::Value::Null);
    assert_eq!(
        first["refusals"][0]["reason"],
        "MRTD not in the admission policy"
    );
    // The same outcome again is not reported again (only every 10th attempt).
    eventually("a second attempt", LIMIT, || sb.merod.joins(A) >= 2).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        sb.mdma.join_statuses().len(),
        1,
        "{:?}",
        sb.mdma.join_statuses()
    );
    // /status shows the latest outcome and its reason.
    let live = d.telemetry.snapshot();
    let shown = &live.join_outcomes[&gid(A)];
    assert_eq!(shown.state, "refused");
    assert!(shown
        .reason
        .as_deref()
        .unwrap()
        .contains("MRTD not in the admission policy"));
    d.stop().await;

    // A restart keeps counting; the flat shape is read too, and a change is reported.
    let before = sb.merod.joins(A) as u64;
    sb.merod.set_join(
        A,
        JoinBehaviour::Refuse {
            refusals: vec![("12D3KooWB".to_owned(), "quorum not reached".to_owned())],
            under_data: false,
        },
    );
    sb.mdma.set_join_status_route(false);
    let d = start(&sb, "");
    eventually("a report after the restart", LIMIT, || {
        sb.mdma.join_statuses().len() >= 2
    })
    .await;
    let after = sb.mdma.join_statuses()[1].clone();
    assert_eq!(after.status, 404, "an MDMA without the route");
    assert_eq!(after.body["refusals"][0]["reason"], "quorum not reached");
    assert!(
        after.body["attempts"].as_u64().unwrap() > before,
        "{}",
        after.body
    );
    // A 404 from MDMA changes nothing about joining: admitted and confirmed as usual.
    sb.merod.set_join(A, JoinBehaviour::default());
    eventually("A confirmed", LIMIT, || {
        load(&sb).confirmed.contains(&gid(A))
    })
    .await;
    eventually("the admitted report", LIMIT, || {
        sb.mdma
            .join_statuses()
            .iter()
            .any(|r| r.body["state"] == "admitted")
    })
    .await;
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_fleet_join_is_reported_as_an_error() {
    let sb = Sandbox::start(None).await.unwrap();
    sb.merod.set_join(
        A,
        JoinBehaviour::Error {
            status: 500,
            message: "Failed to generate attestation".to_owned(),
        },
    );
    sb.mdma.set_reply(PollReply::assign([A]));
    let d = start(&sb, "");
    eventually("an error report", LIMIT, || {
        !sb.mdma.join_statuses().is_empty()
    })
    .await;
    d.stop().await;
    let body = &sb.mdma.join_statuses()[0].body;
    assert_eq!(body["state"], "error", "{body}");
    assert!(
        body["error"]
            .as_str()
            .unwrap()
            .contains("Failed to generate attestation"),
        "{body}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admitter_addrs_go_to_fleet_join_and_an_older_core_is_asked_again_without_them() {
    let sb = Sandbox::start(None).await.unwrap();
    sb.mdma
        .set_admitter_addrs(A, vec![ADMITTER.to_owned(), "dns-name:2428".to_owned()]);
    sb.mdma.set_reply(PollReply::assign([A]));
    let d = start(&sb, "");
    eventually("A confirmed", LIMIT, || {
        load(&sb).confirmed.contains(&gid(A))
    })
    .await;
    d.stop().await;
    let join: serde_json::Value = serde_json::from_str(&first_fleet_join(&sb).body).unwrap();
    assert_eq!(
        join["admitterAddrs"],
        serde_json::json!([ADMITTER]),
        "{join}"
    );

    // An older core refuses the field: asked again at once without it, and not offered it
    // again (B's join has none either).
    let sb = Sandbox::start(None).await.unwrap();
    sb.merod.set_older_core(true);
    sb.mdma.set_admitter_addrs(A, vec![ADMITTER.to_owned()]);
    sb.mdma.set_admitter_addrs(B, vec![ADMITTER.to_owned()]);
    sb.mdma.set_reply(PollReply::assign([A]));
    let d = start(&sb, "");
    eventually("A confirmed", LIMIT, || {
        load(&sb).confirmed.contains(&gid(A))
    })
    .await;
    sb.mdma.set_reply(PollReply::assign([A, B]));
    eventually("B confirmed", LIMIT, || {
        load(&sb).confirmed.contains(&gid(B))
    })
    .await;
    d.stop().await;
    let joins = fleet_joins(&sb);
    let statuses: Vec<u16> = joins.iter().map(|c| c.status).collect();
    assert_eq!(statuses, [400, 200, 200], "{joins:?}");
    assert!(joins[0].body.contains("admitterAddrs"));
    assert!(!joins[1].body.contains("admitterAddrs") && !joins[2].body.contains("admitterAddrs"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_confirm_carries_the_role_and_a_changed_role_is_confirmed_again() {
    let sb = Sandbox::start(None).await.unwrap();
    sb.merod.set_role(A, "RelayTee");
    sb.mdma.set_reply(PollReply::assign([A, B]));
    let d = start(&sb, "");
    eventually("both confirmed", LIMIT, || {
        load(&sb).confirmed == set(&[A, B])
    })
    .await;
    let role_of = |g: &str| {
        sb.mdma
            .confirms()
            .iter()
            .rev()
            .find(|c| c.group_id.as_deref() == Some(g))
            .map(|c| (c.tee_role.clone(), c.authorship_ready))
    };
    assert_eq!(
        role_of(A),
        Some((Some(Some("RelayTee".into())), Some(true)))
    );
    assert_eq!(
        role_of(B),
        Some((Some(Some("ReadOnlyTee".into())), Some(false)))
    );
    // B is promoted: the next held refresh (asked for after C's join) reads roles again and
    // B is confirmed again with its new role.
    sb.merod.set_role(B, "RelayTee");
    sb.mdma.set_reply(PollReply::assign([A, B, C]));
    eventually("B confirmed again as RelayTee", LIMIT, || {
        role_of(B) == Some((Some(Some("RelayTee".into())), Some(true)))
    })
    .await;
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_merod_s_own_404_means_not_held() {
    let sb = Sandbox::start(None).await.unwrap();
    let merod = MerodClient::new(&sb.merod.url()).unwrap();
    assert!(
        !merod.holds_namespace(gid(A)).await.unwrap(),
        "merod's own 404"
    );
    sb.merod.set_foreign_404(A, true);
    let err = merod.holds_namespace(gid(A)).await.unwrap_err();
    assert!(
        matches!(err, MerodError::Refused { status: 404, .. }),
        "unknown: {err}"
    );

    // A joining-only namespace MDMA withdrew is not dropped on a 404 of another shape.
    StateStore::new(sb.state_file())
        .save(&State {
            joining: set(&[A]),
            ..State::default()
        })
        .unwrap();
    sb.merod.set_default_leave(LeaveBehaviour::default());
    sb.mdma.set_reply(PollReply::assign([B]));
    // No leave grace: a withdrawn joining-only namespace is checked at once.
    let d = start(&sb, "leave_grace = \"0s\"");
    eventually("B confirmed", LIMIT, || {
        load(&sb).confirmed.contains(&gid(B))
    })
    .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        load(&sb).joining.contains(&gid(A)),
        "kept: membership unknown"
    );
    assert_eq!(sb.merod.leaves(A), 0);
    // merod's own answer again: dropped with no leave sent.
    sb.merod.set_foreign_404(A, false);
    eventually("A dropped", LIMIT, || !load(&sb).joining.contains(&gid(A))).await;
    d.stop().await;
    assert_eq!(sb.merod.leaves(A), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admission_merod_does_not_list_yet_stays_recorded_and_is_checked_again() {
    let sb = Sandbox::start(None).await.unwrap();
    sb.merod.set_join(
        A,
        JoinBehaviour::AdmitWithoutHolding {
            delay: Duration::ZERO,
        },
    );
    sb.mdma.set_reply(PollReply::assign([A]));
    let d = start(&sb, "");
    eventually("two attempts", LIMIT, || sb.merod.joins(A) >= 2).await;
    let state = load(&sb);
    assert!(
        state.joining.contains(&gid(A)) && state.admitted.is_empty(),
        "{state:?}"
    );
    sb.merod.set_join(A, JoinBehaviour::default());
    eventually("A confirmed", LIMIT, || {
        load(&sb).confirmed.contains(&gid(A))
    })
    .await;
    d.stop().await;
}

/// merod upgraded and restarted between two readiness probes (never seen down): a refusal of
/// `admitterAddrs` does not stick for the life of the process, the field is offered again
/// once the refusal is older than its bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_admitter_addrs_is_offered_again_after_its_bound() {
    use fleet_sidecar::testing::merod::MerodEmulator;
    let merod = MerodEmulator::start().await.unwrap();
    merod.set_older_core(true);
    let bound = Duration::from_millis(500);
    let client = MerodClient::builder(merod.url())
        .admitter_addrs_retry(bound)
        .build()
        .unwrap();
    let addrs = [ADMITTER.to_owned()];
    let joins = || -> Vec<(u16, bool)> {
        merod
            .calls()
            .into_iter()
            .filter(|c| c.path == "/admin-api/tee/fleet-join")
            .map(|c| (c.status, c.body.contains("admitterAddrs")))
            .collect()
    };
    assert!(client.fleet_join(gid(A), &addrs).await.unwrap().admitted);
    assert!(client.admitter_addrs_refused());
    // The newer core is up now; the refusal still holds within its bound.
    merod.set_older_core(false);
    assert!(client.fleet_join(gid(A), &addrs).await.unwrap().admitted);
    tokio::time::sleep(bound).await;
    assert!(
        !client.admitter_addrs_refused(),
        "forgotten after its bound"
    );
    assert!(client.fleet_join(gid(A), &addrs).await.unwrap().admitted);
    assert_eq!(
        joins(),
        [(400, true), (200, false), (200, false), (200, true)],
        "asked again without the field, then offered it again"
    );
    assert!(!client.admitter_addrs_refused());
}

/// A certificate for `node-1` issued by a fleet CA (not self-signed), valid until
/// 2031-02-03 00:00:00 UTC.
fn issued_cert_pem() -> String {
    use rcgen::{BasicConstraints, CertificateParams, DistinguishedName, DnType, IsCa, KeyPair};
    let named = |cn: &str| {
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, cn);
        dn
    };
    let ca_key = KeyPair::generate().unwrap();
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name = named("fleet CA");
    let ca = ca.self_signed(&ca_key).unwrap();
    let key = KeyPair::generate().unwrap();
    let mut leaf = CertificateParams::new(vec!["node.test".to_owned()]).unwrap();
    leaf.not_after = rcgen::date_time_ymd(2031, 2, 3);
    leaf.distinguished_name = named("node-1");
    leaf.signed_by(&key, &ca, &ca_key).unwrap().pem()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn polls_carry_the_certificate_s_expiry_and_the_logs_token_s_fingerprint() {
    use sha2::Digest;
    let sb = Sandbox::start(None).await.unwrap();
    let dir = sb.dir().to_owned();
    let fp = |t: &str| hex::encode(sha2::Sha256::digest(t.as_bytes()));
    sb.mdma.set_reply(PollReply::assign::<[&str; 0], &str>([]));
    // Before any file: both reported, unknown.
    let d = start(&sb, "");
    eventually("a poll", LIMIT, || !sb.mdma.polls().is_empty()).await;
    let first = &sb.mdma.polls()[0];
    assert_eq!(
        (
            first.tls_cert_not_after.as_deref(),
            first.logs_token_fp.as_deref()
        ),
        (Some(""), Some(""))
    );
    // The files appear: the next look (within 10 s) reports them.
    std::fs::create_dir_all(dir.join("tls")).unwrap();
    std::fs::write(dir.join("tls/cert.pem"), issued_cert_pem()).unwrap();
    std::fs::write(dir.join("provided_token"), "token-one").unwrap();
    let latest = || sb.mdma.polls().last().cloned().unwrap();
    eventually("both reported", LIMIT, || {
        let p = latest();
        p.tls_cert_not_after.as_deref() == Some("2031-02-03T00:00:00Z")
            && p.logs_token_fp.as_deref() == Some(fp("token-one").as_str())
    })
    .await;
    // A new token (written beside and renamed over, as a delivery does) is reported.
    std::fs::write(dir.join("provided_token.new"), "token-two").unwrap();
    std::fs::rename(dir.join("provided_token.new"), dir.join("provided_token")).unwrap();
    eventually("the new token's fingerprint", LIMIT, || {
        latest().logs_token_fp.as_deref() == Some(fp("token-two").as_str())
    })
    .await;
    // Never the token itself, in any poll.
    assert!(sb.mdma.polls().iter().all(|p| {
        p.logs_token_fp.as_deref() != Some("token-one")
            && p.logs_token_fp.as_deref() != Some("token-two")
    }));
    // `/status` shows what polls report.
    let status = d.telemetry.snapshot();
    assert_eq!(
        status.tls_cert_not_after.as_deref(),
        Some("2031-02-03T00:00:00Z")
    );
    assert_eq!(status.logs_token_fp, Some(fp("token-two")));
    d.stop().await;
}

/// merod answers "no account yet" until the node takes part in a namespace: the account is
/// asked for every 15 s meanwhile, then kept (never asked again), and every poll carries it
/// (`""` until then).
#[tokio::test(start_paused = true)]
async fn the_executor_account_is_asked_every_15_s_until_known_then_kept_and_reported() {
    use crate::fakes::Fake;
    let node = NodeDir::new();
    let fake = Fake::default();
    fake.with(|w| w.account_not_minted = true);
    let running = fake.run(node.config(""));
    tokio::time::sleep(Duration::from_secs(40)).await;
    fake.with(|w| {
        assert_eq!(w.identity_reads.len(), 3, "at 0, 15 and 30 s");
        assert!(w.accounts_reported.iter().all(|a| a.as_deref() == Some("")));
        w.account_not_minted = false;
    });
    tokio::time::sleep(Duration::from_secs(60)).await;
    let shown = running.telemetry.snapshot().executor_account;
    running.stop().await;
    fake.with(|w| {
        assert_eq!(
            w.identity_reads.len(),
            4,
            "known at 45 s, then never asked again"
        );
        let last = w.accounts_reported.last().unwrap().clone();
        assert_eq!(last, Some("ab".repeat(32)));
    });
    assert_eq!(shown, Some("ab".repeat(32)), "shown in /status");
}

/// merod's external addresses reach every poll as `swarm_addrs`, each ending in the node's
/// own PeerId, read every 60 s (never by the poll itself); `[]` before the first read.
#[tokio::test(start_paused = true)]
async fn swarm_addrs_are_merod_s_external_addresses_read_every_60_s() {
    use crate::fakes::Fake;
    let node = NodeDir::new();
    let fake = Fake::default();
    fake.with(|w| {
        w.external_addrs = vec![
            "/ip4/1.2.3.4/udp/2528/quic-v1".to_owned(),
            "/ip4/1.2.3.4/tcp/2528/p2p/SELF".to_owned(),
        ]
    });
    let running = fake.run(node.config(""));
    tokio::time::sleep(Duration::from_secs(5)).await;
    let want = vec![
        "/ip4/1.2.3.4/udp/2528/quic-v1/p2p/SELF".to_owned(),
        "/ip4/1.2.3.4/tcp/2528/p2p/SELF".to_owned(),
    ];
    fake.with(|w| {
        assert_eq!(w.swarm_reported.last().unwrap().as_ref(), Some(&want));
        w.external_addrs.push("/ip4/5.6.7.8/tcp/1".to_owned());
    });
    tokio::time::sleep(Duration::from_secs(120)).await;
    running.stop().await;
    fake.with(|w| {
        // At start, 60 s and 120 s: not once per poll (125 of them).
        assert_eq!(w.network_reads.len(), 3, "{:?}", w.network_reads);
        assert!(w.polls.len() > 100);
        let last = w.swarm_reported.last().unwrap().clone().unwrap();
        assert_eq!(last.len(), 3);
        assert_eq!(last[2], "/ip4/5.6.7.8/tcp/1/p2p/SELF");
    });
}

/// `[registration] relay_url` is what every poll reports as `relay_url`, from the first
/// poll on; without `[registration]` the node reads no metadata and reports `""`.
#[tokio::test(start_paused = true)]
async fn polls_report_the_configured_relay_url_and_empty_without_registration() {
    use crate::fakes::Fake;
    for (extra, want) in [
        (
            "[registration]\ntoken_file = \"/nonexistent/tok\"\nrelay_url = \"https://relay.example\"\n",
            "https://relay.example",
        ),
        ("", ""),
    ] {
        let node = NodeDir::new();
        let fake = Fake::default();
        let running = fake.run(node.config(extra));
        tokio::time::sleep(Duration::from_secs(5)).await;
        let shown = running.telemetry.snapshot().relay_url;
        running.stop().await;
        fake.with(|w| {
            assert!(w.relays_reported.len() >= 3, "{extra}");
            assert!(
                w.relays_reported.iter().all(|r| r.as_deref() == Some(want)),
                "{extra}: {:?}",
                w.relays_reported
            );
        });
        assert_eq!(shown.as_deref(), Some(want), "shown in /status");
    }
}
