//! Leave safety and a heartbeat that never stalls, over HTTP.

use std::time::Duration;

use fleet_sidecar::testing::mdma::PollReply;
use fleet_sidecar::testing::merod::{JoinBehaviour, LeaveBehaviour};
use fleet_sidecar::testing::sandbox::Sandbox;

use crate::common::*;

const LIMIT: Duration = Duration::from_secs(20);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hanging_join_delays_neither_polls_nor_another_leave() {
    let sb = Sandbox::start(None).await.unwrap();
    sb.merod.set_join(A, JoinBehaviour::Hang);
    sb.merod.hold(C);
    seed(&sb, &[C], &[C]);
    sb.mdma.set_reply(PollReply::assign([A, B]));
    let d = start(
        &sb,
        "leave_after_polls = 1\nleave_grace = \"0s\"\njoin_timeout = \"10m\"",
    );
    eventually("B confirmed", LIMIT, || {
        load(&sb).confirmed.contains(&gid(B))
    })
    .await;
    eventually("C left", LIMIT, || !sb.merod.held().contains(C)).await;
    let from = sb.mdma.polls().len();
    assert!(sb.mdma.wait_for_polls(from + 6, LIMIT).await);
    d.stop().await;
    let polls = sb.mdma.polls();
    let gaps: Vec<Duration> = polls.windows(2).map(|w| w[1].at - w[0].at).collect();
    let worst = gaps.iter().max().copied().unwrap_or_default();
    eprintln!(
        "poll gaps while a fleet-join hung: worst {worst:?}, {} polls",
        polls.len()
    );
    assert!(
        // The exact 1 s cadence is pinned under the paused clock (time_rules.rs); over real HTTP
        // on a shared machine the point is that polls never wait for the hung join.
        worst < Duration::from_millis(3000),
        "polls kept their 1 s cadence while a fleet-join hung (worst gap {worst:?}, all {gaps:?})"
    );
    assert_eq!(
        sb.merod.joins(A),
        1,
        "one join in flight per namespace, never a second"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admitted_but_unconfirmed_then_withdrawn_is_left() {
    let sb = Sandbox::start(None).await.unwrap();
    sb.mdma.fail_next_confirms(A, 1000);
    sb.mdma.set_reply(PollReply::assign([A]));
    let d = start(
        &sb,
        "leave_after_polls = 2\nleave_grace = \"0s\"\nmass_drop_hold = \"1s\"",
    );
    eventually("A admitted", LIMIT, || load(&sb).admitted.contains(&gid(A))).await;
    assert!(!load(&sb).confirmed.contains(&gid(A)));
    sb.mdma.set_reply(PollReply::assign::<[&str; 0], &str>([]));
    eventually("A left", LIMIT, || !sb.merod.held().contains(A)).await;
    eventually("A forgotten", LIMIT, || load(&sb).admitted.is_empty()).await;
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retain_is_kept_and_not_joined() {
    let sb = Sandbox::start(None).await.unwrap();
    sb.merod.hold(A);
    seed(&sb, &[A], &[A]);
    sb.mdma.set_reply(PollReply::assign_retain([B], [A, C]));
    let d = start(&sb, REFERENCE);
    eventually("B confirmed", LIMIT, || {
        load(&sb).confirmed.contains(&gid(B))
    })
    .await;
    assert!(
        sb.mdma
            .wait_for_polls(sb.mdma.polls().len() + 3, LIMIT)
            .await
    );
    d.stop().await;
    assert_eq!(sb.merod.leaves(A), 0, "retained: never left");
    assert_eq!(
        sb.merod.joins(C),
        0,
        "retained but not held: never newly joined"
    );
    // Retained: kept (admitted), but out of `confirmed`, which follows what MDMA assigns.
    assert_eq!(load(&sb).confirmed, set(&[B]));
    assert_eq!(load(&sb).admitted, set(&[A, B]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mass_drop_is_held_then_honoured_after_the_hold() {
    let sb = Sandbox::start(None).await.unwrap();
    for id in [A, B, C, D] {
        sb.merod.hold(id);
    }
    seed(&sb, &[A, B, C, D], &[A, B, C, D]);
    sb.mdma.set_reply(PollReply::assign([A]));
    let started = std::time::Instant::now();
    let d = start(
        &sb,
        "leave_after_polls = 1\nleave_grace = \"0s\"\nmass_drop_hold = \"4s\"",
    );
    assert!(sb.mdma.wait_for_polls(3, LIMIT).await);
    assert_eq!(
        sb.merod.held(),
        strings(&[A, B, C, D]),
        "held during the hold"
    );
    eventually("B, C, D left", LIMIT, || sb.merod.held() == strings(&[A])).await;
    assert!(
        started.elapsed() >= Duration::from_secs(4),
        "not before the hold ended"
    );
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reverted_mass_drop_leaves_nothing() {
    let sb = Sandbox::start(None).await.unwrap();
    for id in [A, B, C, D] {
        sb.merod.hold(id);
    }
    seed(&sb, &[A, B, C, D], &[A, B, C, D]);
    sb.mdma
        .queue_replies([PollReply::assign([A]), PollReply::assign([A])]);
    sb.mdma.set_reply(PollReply::assign([A, B, C, D]));
    let d = start(
        &sb,
        "leave_after_polls = 1\nleave_grace = \"0s\"\nmass_drop_hold = \"3s\"",
    );
    assert!(sb.mdma.wait_for_polls(7, LIMIT).await);
    d.stop().await;
    assert_eq!(sb.merod.held(), strings(&[A, B, C, D]));
    assert_eq!(
        sb.merod.leaves(B) + sb.merod.leaves(C) + sb.merod.leaves(D),
        0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leave_that_times_out_is_retried() {
    let sb = Sandbox::start(None).await.unwrap();
    sb.merod.hold(A);
    seed(&sb, &[A], &[A]);
    sb.merod.set_leave(A, LeaveBehaviour::Hang);
    sb.mdma.set_reply(PollReply::assign::<[&str; 0], &str>([]));
    let d = start(&sb, "leave_after_polls = 1\nleave_grace = \"0s\"\nmass_drop_hold = \"1s\"\nleave_timeout = \"1s\"");
    eventually("two leave attempts", LIMIT, || sb.merod.leaves(A) >= 2).await;
    assert!(
        load(&sb).admitted.contains(&gid(A)),
        "unknown outcome: still a candidate"
    );
    sb.merod.set_leave(
        A,
        LeaveBehaviour::Normal {
            delay: Duration::ZERO,
        },
    );
    eventually("A left", LIMIT, || load(&sb).admitted.is_empty()).await;
    d.stop().await;
}

/// The binary as operators run it (its own runtime, not the tests') keeps polling on its
/// cadence while a fleet-join hangs, and a withdrawal is still left meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_keeps_polling_and_leaving_while_a_join_hangs() {
    let sb = Sandbox::start(None).await.unwrap();
    sb.merod.set_join(A, JoinBehaviour::Hang);
    sb.merod.hold(C);
    seed(&sb, &[C], &[C]);
    sb.mdma.set_reply(PollReply::assign([A]));
    let cfg = sb
        .write_config(
            "leave_after_polls = 1\nleave_grace = \"0s\"\nmass_drop_hold = \"1s\"\njoin_timeout = \"10m\"",
        )
        .unwrap();
    let mut child = spawn_daemon(&cfg, false, &[]);
    eventually("the join hangs", LIMIT, || sb.merod.joins(A) == 1).await;
    eventually("C left", LIMIT, || !sb.merod.held().contains(C)).await;
    let from = sb.mdma.polls().len();
    let polled = sb.mdma.wait_for_polls(from + 5, LIMIT).await;
    let _ = child.kill();
    let _ = child.wait();
    assert!(polled, "the binary stopped polling while a fleet-join hung");
    let polls = sb.mdma.polls();
    let worst = polls[from..]
        .windows(2)
        .map(|w| w[1].at - w[0].at)
        .max()
        .unwrap_or_default();
    // Over real HTTP on a shared machine: the point is that polls never wait for the join.
    assert!(
        worst < Duration::from_millis(3000),
        "worst poll gap {worst:?} while a fleet-join hung"
    );
    assert_eq!(sb.merod.joins(A), 1, "one join in flight, never a second");
}
