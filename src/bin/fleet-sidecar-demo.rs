//! `fleet-sidecar-demo`: the real daemon loop against loopback emulators of MDMA and merod,
//! playing a scripted scenario and printing a timeline (the README's first command).
//!
//! Scenario: a node with no credential in its config registers (attested registration: a
//! challenge, a quote from merod through the `tee/attest` fallback of 0.11.0-rc.25, the
//! issued token stored and used at once); two namespaces assigned, joined and confirmed; an MDMA outage (503, a non-JSON
//! body, a body without `assignments`, a malformed id) during which nothing is left; one
//! namespace withdrawn and left after `leave_after_polls` good polls and a `leave_grace` of
//! observed absence (a short one here; a node's default is 24 h); a new namespace whose
//! admission fails once (`admitted: false`) and succeeds on the retry. Exits 0 when every
//! step happened as it must, 1 otherwise.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;
use tracing::{error, info};

use fleet_sidecar::daemon;
use fleet_sidecar::testing::mdma::{PollReply, ISSUED_TOKEN};
use fleet_sidecar::testing::merod::JoinBehaviour;
use fleet_sidecar::testing::sandbox::Sandbox;

const A: &str = "38069a4cc4285c4245c84587ac60084ba53502a8b91c9b108bca40f10ec4d3df";
const B: &str = "4b1d5d2bd0c7e6a9a4b3f0e2c1d8e7f6a5b4c3d2e1f0a9b8c7d6e5f4a3b2c1d0";
const C: &str = "c0ffee00c0ffee00c0ffee00c0ffee00c0ffee00c0ffee00c0ffee00c0ffee00";
/// Longest a phase may take before the demo calls it a failure.
const PHASE_LIMIT: Duration = Duration::from_secs(20);

fn short(id: &str) -> &str {
    id.get(..8).unwrap_or(id)
}

/// A step of the scenario that did not happen in time.
#[derive(Debug, thiserror::Error)]
#[error("timed out waiting for: {0}")]
struct NotInTime(String);

type DemoResult = Result<(), Box<dyn std::error::Error + Send + Sync>>;

async fn until(what: &str, mut done: impl FnMut() -> bool) -> Result<(), NotInTime> {
    let start = Instant::now();
    while !done() {
        if start.elapsed() > PHASE_LIMIT {
            return Err(NotInTime(what.to_owned()));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(())
}

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_timer(tracing_subscriber::fmt::time::uptime())
        .with_target(false)
        .with_ansi(false)
        .init();
    match scenario().await {
        Ok(()) => {
            info!("demo: every step happened as it must");
            ExitCode::SUCCESS
        }
        Err(e) => {
            error!("demo FAILED: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn scenario() -> DemoResult {
    let sb = Sandbox::start(None).await?;
    // The outage's failed polls back off up to max_backoff (default 10 s); 2 s keeps the
    // demo short while still showing the backoff. Likewise a 4 s leave_grace (24 h by
    // default) shows the grace without waiting a day.
    let enrolment = sb.dir().join("enrolment-token");
    std::fs::write(&enrolment, "demo-enrolment")?;
    let token_file = sb.dir().join("fleet").join("fleet-token");
    let cfg = sb.config(&format!(
        "max_backoff = \"2s\"\nleave_grace = \"4s\"\n[registration]\ntoken_file = \"{}\"\nenrolment_token_file = \"{}\"\nrelay_url = \"\"\nretry_interval = \"1s\"",
        token_file.display(),
        enrolment.display()
    ))?;
    let deps = sb.deps(&cfg)?;
    info!(
        "demo: MDMA emulator at {}, merod emulator at {}, state in {}",
        sb.mdma.url(),
        sb.merod.url(),
        sb.state_file().display()
    );

    info!("== phase 0: no token in the config: the node registers (MDMA refuses its polls until then)");
    // MDMA accepts only tokens it issued; merod has an account (a node that took part in a
    // namespace before: rc.25 answers /admin-api/identity 404 until then).
    sb.mdma
        .set_token(Some("a token this node does not hold".to_owned()));
    sb.merod.set_minted(true);
    let shutdown = CancellationToken::new();
    let daemon = tokio::spawn(daemon::run(cfg, deps, shutdown.clone()));
    until("a poll accepted with the issued token", || {
        sb.mdma
            .polls()
            .iter()
            .any(|p| p.status == 200 && p.token.as_deref() == Some(ISSUED_TOKEN))
    })
    .await?;
    let attests: Vec<String> = sb
        .merod
        .calls()
        .iter()
        .filter(|c| c.path.starts_with("/admin-api/tee/"))
        .map(|c| format!("{} {}", c.path, c.status))
        .collect();
    info!(
        "demo: registered ({} challenge, quote via {}); the token is in {} and polls carry it",
        sb.mdma.challenges().len(),
        attests.join(" then "),
        token_file.display()
    );

    info!("== phase 1: MDMA assigns A={} and B={}", short(A), short(B));
    sb.merod.set_join(
        A,
        JoinBehaviour::Admit {
            delay: Duration::from_millis(1500),
        },
    );
    sb.merod.set_join(
        B,
        JoinBehaviour::Admit {
            delay: Duration::from_millis(500),
        },
    );
    sb.mdma.set_reply(PollReply::assign([A, B]));
    until("A and B confirmed", || {
        let c = sb.mdma.confirmed();
        c.contains(A) && c.contains(B)
    })
    .await?;
    info!("demo: A and B are held by merod and confirmed to MDMA");

    info!("== phase 2: MDMA outage (503, 503, non-JSON, no assignments, a malformed id) — then B withdrawn");
    let polls_before = sb.mdma.polls().len();
    sb.mdma.queue_replies([
        PollReply::Status(503),
        PollReply::Status(503),
        PollReply::RawBody("<html>502 Bad Gateway</html>".to_owned()),
        PollReply::RawBody("{\"status\":\"ok\"}".to_owned()),
        PollReply::RawBody(format!(
            "{{\"assignments\":[{{\"group_id\":\"{A}\"}},{{\"group_id\":\"not-hex\"}}]}}"
        )),
    ]);
    sb.mdma.set_reply(PollReply::assign([A]));
    until("the five failed polls", || {
        sb.mdma.polls().len() >= polls_before + 5
    })
    .await?;
    if sb.merod.leaves(A) + sb.merod.leaves(B) != 0 {
        return Err("a namespace was left during the outage".into());
    }
    info!("demo: outage over: nothing was left during it");

    info!("== phase 3: B stays withdrawn; it is left after 3 consecutive good polls and 4 s of observed absence (leave_grace)");
    let withdrawn = Instant::now();
    until("B left", || !sb.merod.held().contains(B)).await?;
    let waited = withdrawn.elapsed();
    if waited < Duration::from_secs(3) {
        return Err(
            format!("B was left {waited:?} after its withdrawal, before its 4 s grace").into(),
        );
    }
    info!(
        "demo: B left {:.1} s after the outage ended, its grace over",
        waited.as_secs_f64()
    );

    info!(
        "== phase 4: MDMA assigns C={}; its first admission fails (admitted: false)",
        short(C)
    );
    sb.merod.set_join(
        C,
        JoinBehaviour::RefuseThenAdmit {
            refusals: 1,
            delay: Duration::from_millis(500),
        },
    );
    sb.mdma.set_reply(PollReply::assign([A, C]));
    until("C confirmed", || sb.mdma.confirmed().contains(C)).await?;
    until("C recorded as confirmed", || {
        std::fs::read_to_string(sb.state_file()).is_ok_and(|s| s.contains(C))
    })
    .await?;
    info!(
        "demo: C admitted on attempt {} and confirmed",
        sb.merod.joins(C)
    );

    shutdown.cancel();
    match daemon.await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => return Err(e.into()),
        Err(e) => return Err(e.into()),
    }
    let state = std::fs::read_to_string(sb.state_file())?;
    info!(
        "== final state file {}:\n{state}",
        sb.state_file().display()
    );
    info!(
        "merod holds: {:?}",
        sb.merod.held().iter().map(|s| short(s)).collect::<Vec<_>>()
    );
    let want: std::collections::BTreeSet<String> = [A, C].iter().map(|s| s.to_string()).collect();
    if sb.merod.held() != want {
        return Err(format!("merod holds {:?}, expected A and C", sb.merod.held()).into());
    }
    Ok(())
}
