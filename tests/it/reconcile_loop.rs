//! The loop's retry and recovery rules over HTTP against the emulators.

use std::time::Duration;

use fleet_sidecar::testing::mdma::PollReply;
use fleet_sidecar::testing::merod::{JoinBehaviour, LeaveBehaviour};
use fleet_sidecar::testing::sandbox::{Sandbox, MRTD_HEX, PEER_ID};

use crate::common::*;

const LIMIT: Duration = Duration::from_secs(20);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn joins_confirms_and_records_both() {
    let sb = Sandbox::start(None).await.unwrap();
    sb.mdma.set_reply(PollReply::assign([A, B]));
    let d = start(&sb, "");
    eventually("both confirmed", LIMIT, || {
        load(&sb).confirmed == set(&[A, B])
    })
    .await;
    d.stop().await;
    assert_eq!(sb.mdma.confirmed(), strings(&[A, B]));
    let poll = &sb.mdma.polls()[0];
    assert_eq!(poll.peer_id.as_deref(), Some(PEER_ID));
    assert_eq!(poll.mrtd.as_deref(), Some(MRTD_HEX));
    // fleet-join went out as merod wants it: camelCase body, JSON content type.
    let join = first_fleet_join(&sb);
    assert!(join.body.contains("\"groupId\""), "{}", join.body);
    assert_eq!(join.status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_confirm_is_retried_then_confirmed() {
    let sb = Sandbox::start(None).await.unwrap();
    sb.mdma.fail_next_confirms(A, 2);
    sb.mdma.set_reply(PollReply::assign([A]));
    let d = start(&sb, "");
    eventually("A admitted", LIMIT, || load(&sb).admitted.contains(&gid(A))).await;
    eventually("A confirmed", LIMIT, || {
        load(&sb).confirmed.contains(&gid(A))
    })
    .await;
    d.stop().await;
    let confirms: Vec<u16> = sb.mdma.confirms().iter().map(|c| c.status).collect();
    assert_eq!(confirms, vec![503, 503, 200]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admitted_false_is_retried() {
    let sb = Sandbox::start(None).await.unwrap();
    sb.merod.set_join(
        A,
        JoinBehaviour::RefuseThenAdmit {
            refusals: 2,
            delay: Duration::from_millis(100),
        },
    );
    sb.mdma.set_reply(PollReply::assign([A]));
    let d = start(&sb, "");
    eventually("A confirmed", LIMIT, || {
        load(&sb).confirmed.contains(&gid(A))
    })
    .await;
    d.stop().await;
    assert_eq!(sb.merod.joins(A), 3);
    assert_eq!(sb.mdma.confirms().len(), 1, "confirmed only once admitted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_join_error_is_retried_and_never_confirmed() {
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
    eventually("two join attempts", LIMIT, || sb.merod.joins(A) >= 2).await;
    assert!(sb.mdma.confirms().is_empty());
    sb.merod.set_join(
        A,
        JoinBehaviour::Admit {
            delay: Duration::ZERO,
        },
    );
    eventually("A confirmed", Duration::from_secs(70), || {
        load(&sb).confirmed.contains(&gid(A))
    })
    .await;
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admitted_true_without_membership_is_not_recorded() {
    let sb = Sandbox::start(None).await.unwrap();
    sb.merod.set_join(
        A,
        JoinBehaviour::AdmitWithoutHolding {
            delay: Duration::ZERO,
        },
    );
    sb.mdma.set_reply(PollReply::assign([A]));
    let d = start(&sb, "");
    eventually("a join attempt", LIMIT, || sb.merod.joins(A) >= 1).await;
    // Three more polls, each a chance to record or confirm it, counted at the emulator.
    let seen = sb.mdma.polls().len();
    eventually("three more polls", LIMIT, || {
        sb.mdma.polls().len() >= seen + 3
    })
    .await;
    d.stop().await;
    let s = load(&sb);
    assert!(!s.admitted.contains(&gid(A)) && !s.confirmed.contains(&gid(A)));
    assert!(sb.mdma.confirms().is_empty(), "never confirmed to MDMA");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_re_added_namespace_is_joined_again() {
    let sb = Sandbox::start(None).await.unwrap();
    sb.mdma.set_reply(PollReply::assign([A]));
    let d = start(&sb, REFERENCE);
    eventually("A confirmed", LIMIT, || {
        load(&sb).confirmed.contains(&gid(A))
    })
    .await;
    sb.mdma.set_reply(PollReply::assign::<[&str; 0], &str>([]));
    eventually("A left", LIMIT, || !sb.merod.held().contains(A)).await;
    eventually("A forgotten", LIMIT, || load(&sb).admitted.is_empty()).await;
    sb.mdma.set_reply(PollReply::assign([A]));
    eventually("A confirmed again", LIMIT, || {
        load(&sb).confirmed.contains(&gid(A))
    })
    .await;
    d.stop().await;
    assert_eq!(sb.merod.joins(A), 2);
    assert_eq!(
        sb.mdma
            .confirms()
            .iter()
            .filter(|c| c.status == 200)
            .count(),
        2
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_resumes_from_the_state_file() {
    let sb = Sandbox::start(None).await.unwrap();
    sb.mdma.set_reply(PollReply::assign([A, B]));
    let d = start(&sb, REFERENCE);
    eventually("both confirmed", LIMIT, || {
        load(&sb).confirmed == set(&[A, B])
    })
    .await;
    d.stop().await;
    let polls = sb.mdma.polls().len();
    // A new process: nothing is joined again; a withdrawal is still honoured.
    sb.mdma.set_reply(PollReply::assign([A]));
    let d = start(&sb, REFERENCE);
    eventually("B left", LIMIT, || !sb.merod.held().contains(B)).await;
    assert!(sb.mdma.polls().len() > polls);
    d.stop().await;
    assert_eq!(
        sb.merod.joins(A),
        1,
        "confirmed before the restart: not joined again"
    );
    assert_eq!(load(&sb).confirmed, set(&[A]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_token_header_is_sent_exactly_when_configured() {
    let with = Sandbox::start(Some("NEVER-LOGGED-TOKEN-123"))
        .await
        .unwrap();
    with.mdma.set_reply(PollReply::assign([A]));
    let d = start(&with, "");
    eventually("A confirmed", LIMIT, || with.mdma.confirmed().contains(A)).await;
    d.stop().await;
    assert!(with
        .mdma
        .polls()
        .iter()
        .all(|p| p.token.as_deref() == Some("NEVER-LOGGED-TOKEN-123")));
    assert!(with.mdma.polls().iter().all(|p| p.status == 200));
    assert!(with
        .mdma
        .confirms()
        .iter()
        .all(|c| c.token.as_deref() == Some("NEVER-LOGGED-TOKEN-123")));

    let without = Sandbox::start(None).await.unwrap();
    without.mdma.set_reply(PollReply::assign([A]));
    let d = start(&without, "");
    eventually("A confirmed", LIMIT, || {
        without.mdma.confirmed().contains(A)
    })
    .await;
    d.stop().await;
    assert!(without.mdma.polls().iter().all(|p| p.token.is_none()));
    assert!(without.mdma.confirms().iter().all(|c| c.token.is_none()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leave_that_merod_refuses_because_nothing_is_held_counts_as_left() {
    // State says A is held, merod does not hold it (left by hand): leave answers 500,
    // the membership check says 404, the namespace counts as left.
    let sb = Sandbox::start(None).await.unwrap();
    seed(&sb, &[A], &[A]);
    sb.mdma.set_reply(PollReply::assign::<[&str; 0], &str>([]));
    let d = start(&sb, REFERENCE);
    eventually("A forgotten", LIMIT, || load(&sb).admitted.is_empty()).await;
    d.stop().await;
    let leave = sb
        .merod
        .calls()
        .into_iter()
        .find(|c| c.path.ends_with("/leave"))
        .unwrap();
    assert_eq!(leave.status, 500);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_leave_stays_a_candidate_and_is_retried() {
    let sb = Sandbox::start(None).await.unwrap();
    sb.merod.hold(A);
    seed(&sb, &[A], &[A]);
    sb.merod.set_leave(A, LeaveBehaviour::Error { status: 500 });
    sb.mdma.set_reply(PollReply::assign::<[&str; 0], &str>([]));
    let d = start(&sb, REFERENCE);
    eventually("two leave attempts", LIMIT, || sb.merod.leaves(A) >= 2).await;
    assert!(
        load(&sb).admitted.contains(&gid(A)),
        "still held: still tracked"
    );
    sb.merod.set_leave(
        A,
        LeaveBehaviour::Normal {
            delay: Duration::ZERO,
        },
    );
    eventually("A left", LIMIT, || !sb.merod.held().contains(A)).await;
    eventually("A forgotten", LIMIT, || load(&sb).admitted.is_empty()).await;
    d.stop().await;
}

/// merod's own reads, never its answer to a leave, say a namespace is gone: a leave
/// refused the way today's core refuses (403, 409, 503, `{"error": …}`) leaves the
/// namespace held and recorded, backs off and is retried, and is recorded as gone once a
/// leave goes through. One of them (409) has a membership answer that lags (merod's own
/// 404 while its list has it): a refused leave of it is not taken as done either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leave_refused_with_403_409_or_503_backs_off_and_is_retried() {
    let sb = Sandbox::start(None).await.unwrap();
    let refused = [(A, 403), (B, 409), (C, 503)];
    for (id, status) in refused {
        sb.merod.hold(id);
        sb.merod.set_leave(id, LeaveBehaviour::Error { status });
    }
    sb.merod.set_membership_lag(B, true);
    sb.merod.hold(D);
    seed(&sb, &[A, B, C, D], &[A, B, C, D]);
    sb.mdma.set_reply(PollReply::assign([D]));
    // Every attempt takes from the leave budgets: 12 attempts must fit in a minute.
    let d = start(&sb, &format!("{REFERENCE}\nmax_leaves_per_minute = 100"));
    let at = |id: &str| {
        sb.merod
            .calls()
            .into_iter()
            .filter(|c| c.path == format!("/admin-api/namespaces/{id}/leave"))
            .map(|c| c.at)
            .collect::<Vec<_>>()
    };
    // Retried 2 s, then 2-4 s, then 4-8 s later (jittered; plus up to a poll each).
    eventually("four leaves of each", Duration::from_secs(40), || {
        refused.iter().all(|(id, _)| sb.merod.leaves(id) >= 4)
    })
    .await;
    for (id, status) in refused {
        let times = at(id);
        let gaps: Vec<_> = times.windows(2).map(|w| w[1] - w[0]).collect();
        assert!(
            gaps.iter().all(|g| *g >= Duration::from_millis(1900))
                && gaps[2] >= Duration::from_millis(3900),
            "a leave refused with {status} backs off: {gaps:?}"
        );
        assert!(
            sb.merod.held().contains(id),
            "{status}: merod still holds it"
        );
        assert!(
            load(&sb).admitted.contains(&gid(id)),
            "{status}: still held, still recorded"
        );
    }
    for (id, _) in refused {
        sb.merod.set_leave(
            id,
            LeaveBehaviour::Normal {
                delay: Duration::ZERO,
            },
        );
    }
    eventually("all three forgotten once left", LIMIT, || {
        load(&sb).admitted == [gid(D)].into()
    })
    .await;
    assert!(refused.iter().all(|(id, _)| !sb.merod.held().contains(*id)));
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_heartbeat_does_not_wait_for_merod_but_joins_do() {
    let sb = Sandbox::start(None).await.unwrap();
    sb.merod.set_ready(false);
    sb.mdma.set_reply(PollReply::assign([A]));
    let d = start(&sb, "");
    // Three readiness probes refused (backing off from 1 s), counted at the merod emulator.
    let probes = || {
        sb.merod
            .calls()
            .iter()
            .filter(|c| c.path == "/admin-api/peers")
            .count()
    };
    eventually("three readiness probes", LIMIT, || probes() >= 3).await;
    // MDMA hears from the node meanwhile (the poll is its heartbeat), but nothing is joined.
    assert!(sb.mdma.polls().len() >= 2, "polls while merod is down");
    assert_eq!(sb.merod.joins(A), 0, "no join before merod answers");
    let live = d.telemetry.snapshot();
    assert!(live.merod_not_answering.is_some(), "{live:?}");
    assert!(live
        .summary(fleet_sidecar::daemon::unix_now())
        .starts_with("waiting for merod"));
    sb.merod.set_ready(true);
    eventually("A confirmed", LIMIT, || {
        load(&sb).confirmed.contains(&gid(A))
    })
    .await;
    assert!(d.telemetry.snapshot().merod_not_answering.is_none());
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreadable_mrtd_polls_with_the_peer_id_only() {
    let sb = Sandbox::start(None).await.unwrap();
    std::fs::remove_file(sb.dir().join("mrtd-sha384")).unwrap();
    sb.mdma.set_reply(PollReply::assign([A]));
    let d = start(&sb, "");
    assert!(sb.mdma.wait_for_polls(2, LIMIT).await);
    d.stop().await;
    let polls = sb.mdma.polls();
    assert!(polls
        .iter()
        .all(|p| p.mrtd.is_none() && p.peer_id.as_deref() == Some(PEER_ID)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_is_joined_or_confirmed_before_it_is_on_disk() {
    let sb = Sandbox::start(None).await.unwrap();
    sb.mdma.set_reply(PollReply::assign::<[&str; 0], &str>([]));
    let d = start(&sb, "");
    eventually("the first state write", LIMIT, || sb.state_file().exists()).await;
    // The state directory becomes unwritable (a file where the directory was).
    let state_dir = sb.state_file().parent().unwrap().to_owned();
    std::fs::remove_dir_all(&state_dir).unwrap();
    std::fs::write(&state_dir, "not a directory").unwrap();
    sb.mdma.set_reply(PollReply::assign([A]));
    // A join is recorded before it is sent: while that cannot be written, none is sent.
    let polls = sb.mdma.polls().len();
    eventually("three more polls", LIMIT, || {
        sb.mdma.polls().len() >= polls + 3
    })
    .await;
    assert_eq!(
        sb.merod.joins(A),
        0,
        "a join sent while it could not be recorded"
    );
    assert!(
        sb.mdma.confirms().is_empty(),
        "confirmed although the admission was not persisted"
    );
    std::fs::remove_file(&state_dir).unwrap();
    std::fs::create_dir(&state_dir).unwrap();
    eventually("A confirmed", LIMIT, || {
        load(&sb).confirmed.contains(&gid(A))
    })
    .await;
    d.stop().await;
    assert_eq!(sb.mdma.confirms().len(), 1);
}
