//! The safety gate: a failed poll of any kind joins nothing, leaves nothing, and leaves the
//! state file byte-identical — even with the reference's leave-at-once rules.

use std::os::unix::fs::MetadataExt;
use std::time::Duration;

use fleet_sidecar::daemon::{self, CycleOutcome};
use fleet_sidecar::testing::mdma::PollReply;
use fleet_sidecar::testing::sandbox::Sandbox;
use tokio_util::sync::CancellationToken;

use crate::common::*;

async fn failed_poll_changes_nothing(kind: &str, reply: Option<PollReply>) {
    let sb = Sandbox::start(None).await.unwrap();
    sb.merod.hold(A);
    sb.merod.hold(B);
    let before = seed(&sb, &[A, B], &[A, B]);
    let inode = std::fs::metadata(sb.state_file()).unwrap().ino();
    let cfg = sb.config(REFERENCE).unwrap();
    match reply {
        Some(r) => sb.mdma.set_reply(r),
        None => sb.mdma.shutdown(), // connection refused
    }
    let deps = sb.deps(&cfg).unwrap();
    let outcome = daemon::once(cfg, deps, CancellationToken::new())
        .await
        .unwrap()
        .unwrap();
    assert!(
        matches!(outcome, CycleOutcome::PollFailed(_)),
        "{kind}: {outcome:?}"
    );
    assert_eq!(
        sb.merod.leaves(A) + sb.merod.leaves(B),
        0,
        "{kind}: left after a failed poll"
    );
    assert_eq!(
        sb.merod.joins(A) + sb.merod.joins(B),
        0,
        "{kind}: joined after a failed poll"
    );
    assert_eq!(
        std::fs::read(sb.state_file()).unwrap(),
        before,
        "{kind}: state changed"
    );
    assert_eq!(
        std::fs::metadata(sb.state_file()).unwrap().ino(),
        inode,
        "{kind}: rewritten"
    );
    assert_eq!(sb.merod.held(), strings(&[A, B]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_refused() {
    failed_poll_changes_nothing("connection refused", None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timeout() {
    failed_poll_changes_nothing("timeout", Some(PollReply::Hang)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_500() {
    failed_poll_changes_nothing("500", Some(PollReply::Status(500))).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_statuses() {
    for status in [204, 301, 401, 404, 503] {
        failed_poll_changes_nothing(&format!("{status}"), Some(PollReply::Status(status))).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ok_with_non_json() {
    failed_poll_changes_nothing(
        "200 non-JSON",
        Some(PollReply::RawBody("<html>oops</html>".to_owned())),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ok_without_assignments() {
    for body in ["{}", "{\"assignment\":[]}", "{\"assignments\":null}", "[]"] {
        failed_poll_changes_nothing(body, Some(PollReply::RawBody(body.to_owned()))).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ok_with_one_malformed_id() {
    let body = format!(
        "{{\"assignments\":[{{\"group_id\":\"{A}\"}},{{\"group_id\":\"{}\"}}]}}",
        &B[..63]
    );
    failed_poll_changes_nothing("one malformed id", Some(PollReply::RawBody(body))).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_withdrawal_after_an_outage_is_still_left() {
    let sb = Sandbox::start(None).await.unwrap();
    sb.merod.hold(A);
    sb.merod.hold(B);
    seed(&sb, &[A, B], &[A, B]);
    sb.mdma.queue_replies([
        PollReply::Status(500),
        PollReply::RawBody("nope".to_owned()),
        PollReply::Status(503),
    ]);
    sb.mdma.set_reply(PollReply::assign([A]));
    let d = start(&sb, REFERENCE);
    assert!(sb.mdma.wait_for_polls(3, Duration::from_secs(10)).await);
    assert_eq!(sb.merod.leaves(B), 0, "nothing left during the outage");
    eventually("B left", Duration::from_secs(10), || {
        !sb.merod.held().contains(B)
    })
    .await;
    eventually("state records B gone", Duration::from_secs(5), || {
        !load(&sb).admitted.contains(&gid(B))
    })
    .await;
    d.stop().await;
    assert_eq!(sb.merod.held(), strings(&[A]));
    assert_eq!(load(&sb).confirmed, set(&[A]));
}

/// An answer byte-for-byte the last accepted one is that answer again, not parsed again;
/// one changed byte anywhere (an assignment, a field the gate checks, only the spacing) is
/// parsed and validated again, and a body refused by the gate is never kept.
#[tokio::test]
async fn only_an_answer_identical_to_the_last_accepted_one_is_reused() {
    use fleet_sidecar::testing::mdma::MdmaEmulator;
    use fleet_sidecar::{mdma::NodeReport, ControlPlane, MdmaClient, PeerId, PollError};

    let mdma = MdmaEmulator::start(None).await.unwrap();
    let client = MdmaClient::builder(mdma.url()).build().unwrap();
    let peer: PeerId = fleet_sidecar::testing::sandbox::PEER_ID.parse().unwrap();
    let poll = |body: String| {
        mdma.set_reply(PollReply::RawBody(body));
        client.should_join(&peer, None, NodeReport::default())
    };
    let body = |a: &str| {
        format!(
            r#"{{"assignments":[{{"group_id":"{a}","admitter_addrs":["/ip4/10.0.0.1/tcp/2428"]}}],"retain":["{B}"],"logs_token":"t"}}"#
        )
    };
    let first = poll(body(A)).await.unwrap();
    assert_eq!(first.assignments, set(&[A]));
    assert_eq!(client.answers_reused(), 0);
    for n in 1..=3 {
        let again = poll(body(A)).await.unwrap();
        assert_eq!(again, first, "the same answer");
        assert_eq!(client.answers_reused(), n);
        // Not a copy of the addresses: the kept answer's lists are shared.
        let id = A.parse().unwrap();
        assert!(std::sync::Arc::ptr_eq(
            &again.admitter_addrs[&id],
            &first.admitter_addrs[&id]
        ));
    }
    // One changed byte in an assignment: parsed again, the new set.
    let changed = poll(body(C)).await.unwrap();
    assert_eq!(changed.assignments, set(&[C]));
    assert_eq!(client.answers_reused(), 3);
    // A byte that breaks the gate (an id that is not hex, a key named twice): refused as
    // any malformed answer, never taken for the one before it.
    let not_hex = body(C).replacen(&C[..1], "g", 1);
    let twice = body(C).replacen("\"retain\"", "\"logs_token\":\"u\",\"retain\"", 1);
    for bad in [not_hex, twice] {
        assert!(
            matches!(poll(bad.clone()).await, Err(PollError::Malformed { .. })),
            "{bad}"
        );
    }
    assert_eq!(client.answers_reused(), 3);
    // Only the spacing changed: parsed again (the same answer), then reused.
    let spaced = body(C).replace(",", ", ");
    assert_eq!(poll(spaced.clone()).await.unwrap(), changed);
    assert_eq!(client.answers_reused(), 3);
    assert_eq!(poll(spaced).await.unwrap(), changed);
    assert_eq!(client.answers_reused(), 4);
}

/// A chunked `200` JSON answer that closes its connection: each poll opens one.
const CHUNKED_CLOSE: &str = "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n";

/// Serves chunked answers (keep-alive off: a connection each), the next of `bodies`
/// to each connection, in pieces of the given size, each written on its own after a pause
/// (so the client reads them apart).
async fn serve_in_pieces(bodies: Vec<(String, usize)>) -> url::Url {
    use tokio::io::AsyncWriteExt;
    let bodies = std::sync::Arc::new(bodies);
    let next = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    raw_server(CHUNKED_CLOSE, move |mut conn| {
        let n = next.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let bodies = std::sync::Arc::clone(&bodies);
        async move {
            let Some((body, piece)) = bodies.get(n) else {
                return;
            };
            for part in body.as_bytes().chunks(*piece) {
                let mut chunk = format!("{:x}\r\n", part.len()).into_bytes();
                chunk.extend_from_slice(part);
                chunk.extend_from_slice(b"\r\n");
                if conn.write_all(&chunk).await.is_err() {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            let _ = conn.write_all(b"0\r\n\r\n").await;
        }
    })
    .await
}

/// The digest is of the bytes, not of how they arrived: an answer read in many pieces is
/// the answer read whole, the same bytes split otherwise are reused, and one changed byte
/// in the last piece is parsed again.
#[tokio::test]
async fn an_answer_read_in_pieces_is_read_and_recognized_whatever_its_split() {
    use fleet_sidecar::{mdma::NodeReport, ControlPlane, MdmaClient, PeerId};

    let body = |a: &str| {
        format!(
            r#"{{"assignments":[{{"group_id":"{B}"}},{{"group_id":"{a}","admitter_addrs":["/ip4/10.0.0.1/tcp/2428"]}}],"retain":[]}}"#
        )
    };
    let url = serve_in_pieces(vec![
        (body(A), 7),
        (body(A), 13),
        (body(A), body(A).len()),
        (body(C), 7),
    ])
    .await;
    let client = MdmaClient::builder(url).build().unwrap();
    let peer: PeerId = fleet_sidecar::testing::sandbox::PEER_ID.parse().unwrap();
    let poll = || client.should_join(&peer, None, NodeReport::default());
    let first = poll().await.unwrap();
    assert_eq!(first.assignments, set(&[A, B]));
    assert_eq!(
        first.admitter_addrs[&A.parse().unwrap()].as_ref(),
        ["/ip4/10.0.0.1/tcp/2428".to_string()]
    );
    assert_eq!(client.answers_reused(), 0);
    assert_eq!(poll().await.unwrap(), first, "split in 13-byte pieces");
    assert_eq!(poll().await.unwrap(), first, "in one piece");
    assert_eq!(client.answers_reused(), 2);
    let changed = poll().await.unwrap();
    assert_eq!(changed.assignments, set(&[B, C]));
    assert_eq!(client.answers_reused(), 2);
}

/// What the caller holds: the answer `held`, no namespace said joined.
fn holding(held: Option<&fleet_sidecar::mdma::AnswerDigest>) -> fleet_sidecar::mdma::Holding<'_> {
    fleet_sidecar::mdma::Holding {
        answer: held,
        joined: None,
    }
}

/// Told which answer it holds, the caller hears `Unchanged` for the same bytes (nothing
/// parsed or copied), and gets any other answer whole, with a digest of its own; a
/// refused answer gives no digest and changes nothing the caller holds.
#[tokio::test]
async fn the_caller_holding_an_answer_hears_only_that_it_is_unchanged() {
    use fleet_sidecar::testing::mdma::MdmaEmulator;
    use fleet_sidecar::{
        mdma::NodeReport, mdma::Polled, ControlPlane, MdmaClient, PeerId, PollError,
    };

    let mdma = MdmaEmulator::start(None).await.unwrap();
    let client = MdmaClient::builder(mdma.url()).build().unwrap();
    let peer: PeerId = fleet_sidecar::testing::sandbox::PEER_ID.parse().unwrap();
    let body = |a: &str| format!(r#"{{"assignments":[{{"group_id":"{a}"}}]}}"#);
    let poll = |body: String, held| {
        mdma.set_reply(PollReply::RawBody(body));
        client.should_join_if_changed(&peer, None, NodeReport::default(), holding(held))
    };
    let Polled::Changed { answer, digest } = poll(body(A), None).await.unwrap() else {
        panic!("nothing held: the answer comes whole");
    };
    assert_eq!(answer.assignments, set(&[A]));
    let held = digest.expect("MdmaClient gives a digest");
    for n in 1..=2 {
        assert!(matches!(
            poll(body(A), Some(&held)).await.unwrap(),
            Polled::Unchanged
        ));
        assert_eq!(client.answers_reused(), n);
    }
    // Held nothing: the same bytes come whole again.
    let Polled::Changed {
        answer: again,
        digest: same,
    } = poll(body(A), None).await.unwrap()
    else {
        panic!("nothing held: the answer comes whole");
    };
    assert_eq!((again, same), (answer, Some(held)));
    // A refused answer is an error whatever is held; then another answer comes whole.
    let not_hex = body(C).replacen(&C[..1], "g", 1);
    assert!(matches!(
        poll(not_hex, Some(&held)).await,
        Err(PollError::Malformed { .. })
    ));
    let Polled::Changed { answer, digest } = poll(body(C), Some(&held)).await.unwrap() else {
        panic!("a changed answer comes whole");
    };
    assert_eq!(answer.assignments, set(&[C]));
    assert_ne!(digest, Some(held));
}

/// A changed answer keeps no `admitter_addrs` for the namespaces the caller says it joined
/// (only a join uses them; at 10,000 × 8 they are about 12 MB), keeps the others', and
/// still validates every entry's: a malformed list in a joined one refuses the answer.
#[tokio::test]
async fn the_addresses_of_joined_namespaces_are_checked_but_not_kept() {
    use fleet_sidecar::testing::mdma::MdmaEmulator;
    use fleet_sidecar::{
        mdma::Holding, mdma::NodeReport, mdma::Polled, ControlPlane, MdmaClient, PeerId, PollError,
    };

    let mdma = MdmaEmulator::start(None).await.unwrap();
    let client = MdmaClient::builder(mdma.url()).build().unwrap();
    let peer: PeerId = fleet_sidecar::testing::sandbox::PEER_ID.parse().unwrap();
    let joined = set(&[A]);
    let poll = |body: String, held| {
        mdma.set_reply(PollReply::RawBody(body));
        client.should_join_if_changed(&peer, None, NodeReport::default(), held)
    };
    let joining = |joined| Holding {
        answer: None,
        joined,
    };
    let entry =
        |id: &str, addrs: &str| format!(r#"{{"group_id":"{id}","admitter_addrs":{addrs}}}"#);
    let body = |a: &str, b: &str| format!(r#"{{"assignments":[{},{}]}}"#, entry(A, a), entry(B, b));
    // An escaped address is read as well as one borrowed from the body.
    let both = body(
        r#"["/ip4/10.0.0.1/tcp/1"]"#,
        r#"["/ip4/10.0.0.2/tcp/\u0032","/dns4/x/tcp/3"]"#,
    );

    let Polled::Changed { answer, .. } = poll(both.clone(), joining(Some(&joined))).await.unwrap()
    else {
        panic!("nothing held: the answer comes");
    };
    assert_eq!(answer.assignments, set(&[A, B]));
    assert!(!answer.admitter_addrs.contains_key(&gid(A)), "{answer:?}");
    assert_eq!(
        answer.admitter_addrs.get(&gid(B)).map(|a| a.to_vec()),
        Some(vec![
            "/ip4/10.0.0.2/tcp/2".to_owned(),
            "/dns4/x/tcp/3".to_owned()
        ])
    );
    // Holding no joined set, every assignment keeps its addresses.
    let Polled::Changed { answer, .. } = poll(both, joining(None)).await.unwrap() else {
        panic!("nothing held: the answer comes");
    };
    assert_eq!(
        answer.admitter_addrs.get(&gid(A)).map(|a| a.to_vec()),
        Some(vec!["/ip4/10.0.0.1/tcp/1".to_owned()])
    );
    // A joined namespace's list is validated all the same.
    for bad in [r#"[1]"#, r#""/ip4/10.0.0.1/tcp/1""#, r#"{"a":"/x"}"#] {
        let refused = poll(body(bad, "[]"), joining(Some(&joined))).await;
        assert!(
            matches!(refused, Err(PollError::Malformed { .. })),
            "{bad}: {refused:?}"
        );
    }
}
