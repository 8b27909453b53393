//! The context inventory against the loopback emulators: reported in full once a namespace is
//! confirmed, with its groups, contexts, role, counts and bytes; a failed post retried with
//! nothing kept meanwhile; a withdrawn namespace pruned by the next full report; and the
//! heartbeat's cadence untouched while a walk is slow.

use std::time::{Duration, Instant};

use fleet_sidecar::testing::mdma::PollReply;
use fleet_sidecar::testing::merod::ACCOUNT_ID;
use fleet_sidecar::testing::sandbox::Sandbox;
use serde_json::{json, Value};

use crate::common::*;

const A: &str = "38069a4cc4285c4245c84587ac60084ba53502a8b91c9b108bca40f10ec4d3df";
const SUB: &str = "5151515151515151515151515151515151515151515151515151515151515151";
const LIMIT: Duration = Duration::from_secs(20);

fn record_file(sb: &Sandbox) -> std::path::PathBuf {
    sb.state_file().with_file_name("fleet-inventory.json")
}

/// The posts so far, as bodies.
fn posts(sb: &Sandbox) -> Vec<Value> {
    sb.mdma
        .inventories()
        .into_iter()
        .filter(|p| p.status == 200)
        .map(|p| Value::Object(p.body.unwrap()))
        .collect()
}

/// A namespace A with a subgroup holding one context, A holding two.
fn tree(sb: &Sandbox) {
    sb.merod.set_subgroups(A, &[SUB]);
    sb.merod
        .set_contexts(A, &["ctxB".to_owned(), "ctxA".to_owned()]);
    sb.merod.set_contexts(SUB, &["ctxC".to_owned()]);
    sb.merod.set_usage_total(A, 4096);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_confirmed_namespace_is_reported_in_full_and_a_withdrawn_one_pruned() {
    let sb = Sandbox::start(None).await.unwrap();
    tree(&sb);
    sb.mdma.set_reply(PollReply::assign([A]));
    let d = start(&sb, "leave_grace = \"0s\"");
    let with_a = |p: &Value| p["namespaces"].to_string().contains(A);
    eventually("a report of A", LIMIT, || posts(&sb).iter().any(with_a)).await;
    // Before A was confirmed the node reported, in full, that it holds nothing.
    assert!(posts(&sb).iter().all(|p| p["full"] == json!(true)));
    let first = &posts(&sb).into_iter().find(with_a).unwrap();
    assert_eq!(
        first["full"],
        json!(true),
        "a changed set is reported in full"
    );
    assert_eq!(
        first["peer_id"],
        json!(fleet_sidecar::testing::sandbox::PEER_ID)
    );
    let ns = &first["namespaces"][0];
    assert_eq!(ns["namespace_id"], json!(A));
    assert_eq!(
        ns["groups"],
        json!([
            {"group_id": A, "context_ids": ["ctxA", "ctxB"], "authorship_ready": false},
            {"group_id": SUB, "context_ids": ["ctxC"], "authorship_ready": false},
        ]),
        "contexts under their own group, sorted; a ReadOnlyTee is not ready"
    );
    assert_eq!(ns["context_count"], json!(3));
    assert_eq!(ns["member_count"], json!(2));
    assert_eq!(ns["tee_role"], json!("ReadOnlyTee"));
    assert_eq!(ns["bytes"]["total"], json!(4096));
    assert!(ns["bytes"].get("private_state").is_some(), "snake_case");
    let wire = first.to_string();
    assert!(!wire.contains(ACCOUNT_ID), "no account id on the wire");
    // Kept beside the state file, with when the full report landed.
    eventually("the record", LIMIT, || record_file(&sb).exists()).await;
    let record: Value = serde_json::from_slice(&std::fs::read(record_file(&sb)).unwrap()).unwrap();
    assert!(record["last_full"].as_u64().unwrap() > 0);
    // Each namespace as a fingerprint of what was posted (64 hex), not the report.
    let fingerprint = record["namespaces"][A].as_str().unwrap_or_default();
    assert!(
        fingerprint.len() == 64 && fingerprint.bytes().all(|b| b.is_ascii_hexdigit()),
        "{record}"
    );

    // Withdrawn and left: the confirmed set changed, so the next report is full and empty.
    sb.mdma.set_reply(PollReply::assign::<[&str; 0], &str>([]));
    eventually("a full report without A", LIMIT, || {
        let all = posts(&sb);
        let after = all.iter().position(with_a).unwrap();
        all[after..]
            .iter()
            .any(|p| p["full"] == json!(true) && p["namespaces"] == json!([]))
    })
    .await;
    eventually("A pruned from the record", LIMIT, || {
        std::fs::read(record_file(&sb))
            .ok()
            .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
            .is_some_and(|r| r["namespaces"] == json!({}))
    })
    .await;
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_post_keeps_nothing_and_is_sent_again() {
    let sb = Sandbox::start(None).await.unwrap();
    tree(&sb);
    sb.mdma.set_inventory_status(Some(503));
    sb.mdma.set_reply(PollReply::assign([A]));
    let d = start(&sb, "");
    eventually("a refused post", LIMIT, || {
        sb.mdma.inventories().iter().any(|p| p.status == 503)
    })
    .await;
    assert!(
        !record_file(&sb).exists(),
        "nothing is kept of a post that did not land"
    );
    sb.mdma.set_inventory_status(None);
    eventually("the post of A, sent again", LIMIT, || {
        posts(&sb)
            .iter()
            .any(|p| p["namespaces"].to_string().contains(A))
    })
    .await;
    assert!(posts(&sb).iter().all(|p| p["full"] == json!(true)));
    eventually("the record", LIMIT, || record_file(&sb).exists()).await;
    d.stop().await;
}

/// The walk runs beside the loop: merod answering the inventory's reads 3 s late does not
/// slow the once-a-second heartbeat.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_walk_does_not_slow_the_heartbeat() {
    let sb = Sandbox::start(None).await.unwrap();
    tree(&sb);
    sb.merod.set_inventory_delay(Duration::from_secs(3));
    sb.mdma.set_reply(PollReply::assign([A]));
    let d = start(&sb, "");
    eventually("A confirmed", LIMIT, || !sb.mdma.confirmed().is_empty()).await;
    let since = Instant::now();
    let before = sb.mdma.polls().len();
    tokio::time::sleep(Duration::from_secs(6)).await;
    let polled = sb.mdma.polls().len() - before;
    assert!(
        polled >= 4,
        "{polled} polls in {:?} while the walk waited on merod",
        since.elapsed()
    );
    assert!(
        sb.merod.inventory_calls("usage") >= 1,
        "the walk was under way"
    );
    d.stop().await;
}
