//! Every confirm to MDMA passes one gate: sent only while the latest successful poll
//! assigns the namespace, checked when it is sent; and a role that could not be read is
//! unknown, never "no role". Under tokio's paused clock with the in-memory fakes, whose
//! member list answers slowly or fails, and whose MDMA records a confirm of a namespace its
//! latest good poll does not assign as a violation.

use std::time::Duration;

use fleet_sidecar::{GroupId, TeeRole};
use tokio::time::Instant;

use crate::common::*;
use crate::fakes::Fake;

/// As slow a member list as the one seen in the field (the role read before a confirm).
const SLOW_MEMBERS: Duration = Duration::from_secs(8);

/// Sleeps (paused clock) until `f` gives a value; panics after 10 min of daemon time.
async fn until<T>(what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let limit = Instant::now() + Duration::from_secs(600);
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < limit, "{what}: not within 10 min");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The confirms of `g` the fake received.
fn confirms_of(fake: &Fake, g: GroupId) -> Vec<Option<TeeRole>> {
    fake.with(|w| {
        w.confirms
            .iter()
            .filter(|(c, _)| *c == g)
            .map(|(_, r)| *r)
            .collect()
    })
}

/// When the first read of `g`'s member list started.
async fn first_role_read(fake: &Fake, g: GroupId) -> Instant {
    until("a role read", || {
        fake.with(|w| {
            w.role_reads
                .iter()
                .find(|(r, _)| *r == g)
                .map(|(_, at)| *at)
        })
    })
    .await
}

/// Runs the loop on `fake`; once `g`'s member list is being read (slowly), MDMA withdraws
/// every namespace a second into the read; 20 s later nothing may have confirmed `g`.
async fn withdraw_during_the_role_read(node: &NodeDir, fake: &Fake, g: GroupId) {
    let running = fake.run(node.config(""));
    first_role_read(fake, g).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    fake.with(|w| w.assignments.clear());
    // The read ends 7 s later; the poll that withdrew `g` came within a second.
    tokio::time::sleep(Duration::from_secs(20)).await;
    running.stop().await;
    assert_eq!(confirms_of(fake, g), [], "no confirm after the withdrawal");
    fake.with(|w| assert!(w.violations.is_empty(), "{:?}", w.violations));
}

#[tokio::test(start_paused = true)]
async fn a_withdrawal_during_a_join_s_role_read_stops_its_confirm() {
    let node = NodeDir::new();
    let fake = Fake::default();
    let a = id(1);
    fake.with(|w| {
        w.assignments.insert(a);
        w.members_delay = SLOW_MEMBERS;
    });
    // Admitted and recorded; withdrawn during the role read before the confirm.
    withdraw_during_the_role_read(&node, &fake, a).await;
    let state = node.state();
    assert!(state.admitted.contains(&a) && !state.confirmed.contains(&a));
}

#[tokio::test(start_paused = true)]
async fn a_withdrawal_during_the_role_re_check_after_a_restart_stops_its_confirm() {
    let node = NodeDir::new();
    let fake = Fake::default();
    let a = id(1);
    // A restart: A is recorded as confirmed, and merod holds it.
    node.seed(&[a].into(), &[a].into());
    fake.with(|w| {
        w.held.insert(a);
        w.assignments.insert(a);
        w.members_delay = SLOW_MEMBERS;
    });
    // Withdrawn during the role re-check that follows the first held read.
    withdraw_during_the_role_read(&node, &fake, a).await;
}

#[tokio::test(start_paused = true)]
async fn a_member_read_that_fails_confirms_nothing_and_changes_no_role() {
    let node = NodeDir::new();
    let fake = Fake::default();
    let (a, b) = (id(1), id(2));
    // A restart with A confirmed: its re-check cannot read the role.
    node.seed(&[a].into(), &[a].into());
    fake.with(|w| {
        w.held.insert(a);
        w.assignments = [a, b].into();
        w.role = Some(TeeRole::RelayTee);
        w.members_fail = true;
    });
    let running = fake.run(node.config(""));
    first_role_read(&fake, a).await;
    first_role_read(&fake, b).await;
    tokio::time::sleep(Duration::from_secs(30)).await;
    // Not re-confirmed as "no role"; B, joined, is admitted but not confirmed either.
    assert_eq!(
        confirms_of(&fake, a),
        [],
        "A re-confirmed on an unread role"
    );
    assert_eq!(confirms_of(&fake, b), [], "B confirmed on an unread role");
    let state = node.state();
    assert!(state.admitted.contains(&b) && !state.confirmed.contains(&b));

    // The member list answers again: both are confirmed with the role read.
    fake.with(|w| w.members_fail = false);
    until("B confirmed", || {
        node.state().confirmed.contains(&b).then_some(())
    })
    .await;
    until("A confirmed again", || {
        (!confirms_of(&fake, a).is_empty()).then_some(())
    })
    .await;
    assert_eq!(confirms_of(&fake, a), [Some(TeeRole::RelayTee)]);
    assert_eq!(confirms_of(&fake, b), [Some(TeeRole::RelayTee)]);

    // It fails again over several held refreshes: the role told stands, nothing is sent.
    fake.with(|w| w.members_fail = true);
    let reads = fake.with(|w| w.role_reads.len());
    tokio::time::sleep(Duration::from_secs(300)).await;
    running.stop().await;
    assert!(
        fake.with(|w| w.role_reads.len()) >= reads + 2,
        "the role was read again meanwhile"
    );
    assert_eq!(confirms_of(&fake, a), [Some(TeeRole::RelayTee)]);
    assert_eq!(confirms_of(&fake, b), [Some(TeeRole::RelayTee)]);
    fake.with(|w| assert!(w.violations.is_empty(), "{:?}", w.violations));
}

#[tokio::test(start_paused = true)]
async fn every_confirm_sent_is_counted_once_whichever_path_sent_it() {
    let node = NodeDir::new();
    let fake = Fake::default();
    let (a, b) = (id(1), id(2));
    // B comes back from a restart (its role re-check confirms it); A is joined, its first
    // confirm refused.
    node.seed(&[b].into(), &[b].into());
    fake.with(|w| {
        w.held.insert(b);
        w.assignments = [a, b].into();
        w.role = Some(TeeRole::RelayTee);
        w.confirm_script = vec![false, true, true, true, true, true];
    });
    let running = fake.run(node.config(""));
    tokio::time::sleep(Duration::from_secs(60)).await;
    let metrics = running.telemetry.encode_metrics();
    running.stop().await;
    let ok = metric(&metrics, "fleet_sidecar_confirms_total{outcome=\"ok\"}");
    let error = metric(&metrics, "fleet_sidecar_confirms_total{outcome=\"error\"}");
    let sent = fake.with(|w| w.confirms.len());
    assert_eq!((ok, error), (2.0, 1.0), "{metrics}");
    assert_eq!(sent, 3, "A refused once, then A and B accepted");
    assert!(node.state().confirmed.contains(&a));
}
