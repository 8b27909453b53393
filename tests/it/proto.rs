//! The examples in proto/ are exactly what the code sends and reads.

use std::path::PathBuf;
use std::time::Duration;

use fleet_sidecar::mdma::parse_should_join;
use fleet_sidecar::testing::mdma::PollReply;
use fleet_sidecar::testing::sandbox::Sandbox;
use fleet_sidecar::{state::parse_state, state::render_state};
use serde_json::Value;

use crate::common::*;

fn proto(name: &str) -> String {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("proto")
        .join(name);
    std::fs::read_to_string(path).expect("proto file")
}

fn json(text: &str) -> Value {
    serde_json::from_str(text).expect("JSON")
}

#[test]
fn the_should_join_answer_parses() {
    let d = parse_should_join(proto("mdma-should-join.response.json").as_bytes()).unwrap();
    assert_eq!(d.assignments, set(&[A]));
    assert_eq!(d.retain, set(&[B]));
}

#[test]
fn the_state_example_is_the_current_format() {
    let text = proto("state-v4.json");
    let state = parse_state(text.as_bytes(), std::path::Path::new("state-v4.json")).unwrap();
    assert_eq!(
        json(&String::from_utf8(render_state(&state)).unwrap()),
        json(&text)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_requests_are_what_the_clients_send() {
    let sb = Sandbox::start(None).await.unwrap();
    sb.mdma.set_reply(PollReply::assign([A]));
    let d = start(&sb, "");
    eventually(
        "A confirmed and reported held",
        Duration::from_secs(20),
        || {
            sb.mdma.confirmed().contains(A)
                && sb
                    .mdma
                    .polls()
                    .iter()
                    .any(|p| p.held_namespaces.as_deref() == Some(&[A.to_owned()][..]))
        },
    )
    .await;
    d.stop().await;
    // A poll after the held refresh saw A: it reports what merod holds.
    let polls = sb.mdma.polls();
    let poll = polls
        .iter()
        .find(|p| p.held_namespaces.as_deref() == Some(&[A.to_owned()][..]))
        .expect("a poll reporting A as held");
    let sent = serde_json::json!({
        "peer_id": poll.peer_id,
        "mrtd": poll.mrtd,
        "held_namespaces": poll.held_namespaces,
        "tls_cert_not_after": poll.tls_cert_not_after,
        "logs_token_fp": poll.logs_token_fp,
        "relay_url": poll.relay_url,
    });
    assert_eq!(sent, json(&proto("mdma-should-join.request.json")));
    let confirm = &sb.mdma.confirms()[0];
    let sent = serde_json::json!({
        "peer_id": confirm.peer_id,
        "group_id": confirm.group_id,
        "authorship_ready": confirm.authorship_ready,
        "tee_role": confirm.tee_role,
    });
    assert_eq!(sent, json(&proto("mdma-confirm.request.json")));
    let join = first_fleet_join(&sb);
    assert_eq!(
        json(&join.body),
        json(&proto("merod-fleet-join.request.json"))
    );
}
