//! The recovery envelopes against the loopback emulators: MDMA's route through the client,
//! and the job beside the loop (sealed per member through merod, written with a version,
//! rewritten only on a change, deleted for members and namespaces gone, idle on a merod
//! without the seal route).

use std::time::Duration;

use fleet_sidecar::testing::mdma::{MdmaEmulator, PollReply};
use fleet_sidecar::testing::merod::ACCOUNT_ID;
use fleet_sidecar::testing::sandbox::{Sandbox, PEER_ID};
use fleet_sidecar::{
    mdma::RecoveryEnvelope, mdma::RecoveryKey, mdma::RequestMethod, CallError, FleetToken,
    MdmaClient, RequestError,
};

const A: &str = "38069a4cc4285c4245c84587ac60084ba53502a8b91c9b108bca40f10ec4d3df";
const PEER: &str = "12D3KooWNXNMakaAKyWpBemRiWWqusgQCrxvwjtJdRQMzLScTJDT";
const SUB: &str = "5151515151515151515151515151515151515151515151515151515151515151";
const LIMIT: Duration = Duration::from_secs(30);
/// A base58 signing key, as merod 0.11.0-rc.25 answers it: its case is part of it.
const BASE58_KEY: &str = "Fvum43kcWzbpDArV95nmHtMHgMF57d995qzz1xCynTci";

use crate::common::*;

fn record_file(sb: &Sandbox) -> std::path::PathBuf {
    sb.state_file().with_file_name("fleet-recovery.json")
}

/// The accounts of the envelopes MDMA holds.
fn held_accounts(sb: &Sandbox) -> Vec<String> {
    sb.mdma
        .recovery_envelopes()
        .into_keys()
        .map(|(_, _, account)| account)
        .collect()
}

/// A namespace A of 150 members and the node (more than merod's default page of 100), with
/// a subgroup holding the node and one context; the node's device has a base58 key.
fn big_namespace(sb: &Sandbox) -> Vec<String> {
    let others: Vec<String> = (0..150u32).map(|i| format!("{i:064x}")).collect();
    let mut rows: Vec<(&str, &str)> = others.iter().map(|a| (a.as_str(), "Member")).collect();
    rows.push((ACCOUNT_ID, "ReadOnlyTee"));
    sb.merod.set_group_members(A, &rows);
    sb.merod.set_subgroups(A, &[SUB]);
    sb.merod
        .set_group_members(SUB, &[(ACCOUNT_ID, "ReadOnlyTee")]);
    sb.merod.set_contexts(SUB, &["ctxS".to_owned()]);
    // Listed in the subgroup too: in the envelope once.
    sb.merod
        .set_member_devices(SUB, &[(ACCOUNT_ID, &[("ab01", BASE58_KEY)])]);
    sb.merod.set_member_devices(
        A,
        &[
            (ACCOUNT_ID, &[("AB01", BASE58_KEY)]),
            (&others[0], &[("cd02", "k2")]),
        ],
    );
    sb.merod.set_seal_route(true);
    let mut all = others;
    all.push(ACCOUNT_ID.to_owned());
    all.sort();
    all
}

/// PUT takes a version above the one held (409 otherwise, named as a PUT), DELETE drops
/// the envelope and answers 200 even when none is held.
#[tokio::test]
async fn the_client_puts_and_deletes_envelopes_and_a_stale_version_is_a_409() {
    let mdma = MdmaEmulator::start(Some("t0ken".to_owned())).await.unwrap();
    let client = MdmaClient::new(&mdma.url(), Some(FleetToken::new("t0ken")), None).unwrap();
    let key = RecoveryKey {
        peer_id: PEER.parse().unwrap(),
        account_id: "ab".repeat(32),
        namespace_id: A.parse().unwrap(),
    };
    let put = |version| RecoveryEnvelope {
        key: key.clone(),
        ciphertext: "{}".to_owned(),
        version,
    };
    client.put_recovery_envelope(&put(1)).await.unwrap();
    let err = client.put_recovery_envelope(&put(1)).await.unwrap_err();
    assert!(
        matches!(
            &err,
            CallError::Request(RequestError::Status { status: 409, method, .. }) if *method == RequestMethod::Put
        ),
        "{err}"
    );
    assert!(err.to_string().starts_with("PUT http://"), "{err}");
    client.put_recovery_envelope(&put(2)).await.unwrap();
    assert_eq!(mdma.recovery_envelopes().len(), 1);
    client.delete_recovery_envelope(&key).await.unwrap();
    client.delete_recovery_envelope(&key).await.unwrap();
    assert!(mdma.recovery_envelopes().is_empty());
    let methods: Vec<(String, u16)> = mdma
        .recovery_calls()
        .into_iter()
        .map(|c| (c.method, c.status))
        .collect();
    assert_eq!(
        methods,
        [
            ("PUT".to_owned(), 200),
            ("PUT".to_owned(), 409),
            ("PUT".to_owned(), 200),
            ("DELETE".to_owned(), 200),
            ("DELETE".to_owned(), 200)
        ]
    );
}

/// Every member of a namespace of 151 gets an envelope (the Bash stopped at merod's first
/// page of 100 and wrote none), the node's own with its base58 key as merod gave it and
/// the subgroup's context; a steady namespace is not written again; a withdrawn and left
/// namespace's envelopes are deleted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_member_of_a_namespace_past_a_page_is_written_and_none_deleted_on_one_read() {
    let sb = Sandbox::start(None).await.unwrap();
    let members = big_namespace(&sb);
    sb.mdma.set_reply(PollReply::assign([A]));
    let d = start(&sb, REFERENCE);
    eventually("151 envelopes", LIMIT, || {
        sb.mdma.recovery_envelopes().len() == 151
    })
    .await;
    assert_eq!(held_accounts(&sb), members);
    assert!(sb
        .mdma
        .recovery_envelopes()
        .keys()
        .all(|(peer, ns, _)| peer == PEER_ID && ns == A));
    let own: Vec<String> = sb
        .merod
        .sealed()
        .into_iter()
        .filter(|(_, account, _)| account == ACCOUNT_ID)
        .map(|(_, _, plaintext)| plaintext)
        .collect();
    assert_eq!(own.len(), 1, "{own:?}");
    assert!(
        own[0].contains(&format!(
            r#""devices":[{{"device_id":"ab01","signing_key":"{BASE58_KEY}"}}]"#
        )),
        "{}",
        own[0]
    );
    assert!(
        own[0].contains(&format!(r#""groups":["{A}","{SUB}"]"#)),
        "{}",
        own[0]
    );
    assert!(own[0].contains(r#""contexts":["ctxS"]"#), "{}", own[0]);
    eventually("the record", LIMIT, || {
        std::fs::read(record_file(&sb))
            .ok()
            .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
            .is_some_and(|r| r["envelopes"].as_object().is_some_and(|e| e.len() == 151))
    })
    .await;
    let puts = sb.mdma.recovery_calls().len();
    let runs = || {
        d.telemetry
            .snapshot()
            .jobs
            .get("recovery")
            .map_or(0, |j| j.runs)
    };
    let before = runs();
    // Withdrawn: the node leaves A. A pass runs when the confirmed set drops it, another
    // when the leave ends; merod no longer listing A is one read: nothing is deleted on it
    // (deletes need two reads a pass apart: src/jobs/recovery.rs's tests).
    sb.mdma.set_reply(PollReply::assign::<[&str; 0], &str>([]));
    eventually("A left", LIMIT, || !sb.merod.held().contains(A)).await;
    eventually(
        "the passes after the withdrawal and the leave",
        LIMIT,
        || runs() >= before + 2,
    )
    .await;
    let polls = sb.mdma.polls().len();
    eventually("five more polls", LIMIT, || {
        sb.mdma.polls().len() >= polls + 5
    })
    .await;
    assert_eq!(
        sb.mdma.recovery_calls().len(),
        puts,
        "nothing written or deleted on one read"
    );
    assert_eq!(sb.mdma.recovery_envelopes().len(), 151);
    d.stop().await;
}

/// On a merod without the seal route (rc.25, the emulator's default) the job asks once,
/// says why in the status, writes nothing and stays idle: no second seal within seconds
/// while the heartbeat goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_seal_route_the_job_says_so_once_and_idles() {
    let sb = Sandbox::start(None).await.unwrap();
    sb.mdma.set_reply(PollReply::assign([A]));
    let d = start(&sb, "");
    eventually("the job failing", LIMIT, || {
        d.telemetry
            .snapshot()
            .jobs
            .get("recovery")
            .and_then(|j| j.failing.clone())
            .is_some_and(|f| f.contains("no seal route"))
    })
    .await;
    let seals = sb.merod.inventory_calls("seal");
    assert_eq!(seals, 1);
    let polls = sb.mdma.polls().len();
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(sb.merod.inventory_calls("seal"), 1, "not asked again");
    assert!(sb.mdma.polls().len() >= polls + 3, "the heartbeat goes on");
    assert!(sb.mdma.recovery_calls().is_empty());
    assert!(!record_file(&sb).exists() || held_accounts(&sb).is_empty());
    d.stop().await;
}
