//! The shipped unit (`packaging/fleet-sidecar.service`, byte for byte; only `ExecStart=` and
//! test settings come from a drop-in) under a real systemd: the machine's own systemd booted
//! as PID 1 of private namespaces by `scripts/run-unit-under-systemd.sh`, sharing the host
//! network so the daemon reaches the loopback emulators. Every assertion is on what systemd
//! reports (`systemctl show`, the journal) or on files inside its namespaces.
//!
//! Needs root; skipped with a printed `SKIPPED` line otherwise. Run alone with
//! `cargo test --locked --test systemd`. Each test boots its own systemd (about a second),
//! so they run in parallel.

// A test binary has no audience: the harness's helpers are `pub` for this module, which the
// crate's `unreachable_pub` lint (Cargo.toml) would otherwise ask to spell `pub(crate)`.
#![allow(unreachable_pub)]

mod ansible;
mod deliveries;
mod device_login;
mod harness;
mod package;

use std::time::{Duration, Instant};

use fleet_sidecar::testing::mdma::PollReply;
use fleet_sidecar::testing::sandbox::MRTD_HEX;
use harness::{
    brief, exec_start, prop, restarts, skipped, Boot, Node, CREDENTIAL, CREDENTIAL_PATH, LOG_FILE,
    STATE_FILE, UNIT,
};

const A: &str = "38069a4cc4285c4245c84587ac60084ba53502a8b91c9b108bca40f10ec4d3df";
const B: &str = "abababababababababababababababababababababababababababababababab";
/// The fleet token (the marker .ci/run checks never reaches any output).
const TOKEN: &str = "NEVER-LOGGED-TOKEN-systemd";
/// The test drop-in's watchdog: short, so a kill shows within seconds.
const WATCHDOG: Duration = Duration::from_secs(3);
/// How long "no watchdog kill" is watched: two watchdog periods.
const NO_KILL_SPAN: Duration = Duration::from_secs(6);
/// The shipped unit's values.
const RESTART_SEC: f64 = 5.0;
const TIMEOUT_STOP: Duration = Duration::from_secs(30);
/// Generous bound for anything that should take a second or two.
const SOON: Duration = Duration::from_secs(20);

/// Boots, or prints why the suite cannot run here and returns `None`.
async fn boot(test: &str) -> Option<Boot> {
    if skipped(test) {
        return None;
    }
    match Boot::up().await {
        Ok(b) => Some(b),
        Err(e) => {
            eprintln!("SKIPPED systemd test {test}: {e}");
            None
        }
    }
}

fn active(p: &harness::Props) -> bool {
    prop(p, "ActiveState") == "active"
}

/// The ExecStartPost= probe: runs inside the unit's sandbox (same namespaces, capability
/// bounding set and seccomp filter as the daemon) and prints one `sandbox-probe:` line
/// per check to the journal. Always exits 0.
fn probe_script(node: &Node) -> String {
    let merod_config = node.path("calimero/default/config.toml");
    format!(
        r#"for d in /usr /etc /var/lib /var/log {node} {merod} /var/lib/calimero /mnt/data /mnt/data/fleet /mnt/data/tls /etc/vector /etc/vmagent; do
  if ( : > "$d/.sandbox-probe" ) 2>/dev/null; then rm -f "$d/.sandbox-probe"; echo "sandbox-probe: writable $d"; else echo "sandbox-probe: read-only $d"; fi
done
if head -c1 {merod_config} >/dev/null 2>&1; then echo "sandbox-probe: readable merod config"; fi
if [ -e /dev/tdx_guest ]; then
  if ( exec 3<>/dev/tdx_guest ) 2>/dev/null; then echo "sandbox-probe: tdx_guest opens"; else echo "sandbox-probe: tdx_guest denied"; fi
else echo "sandbox-probe: no /dev/tdx_guest here"; fi
exit 0
"#,
        node = node.dir.path().display(),
        merod = node.path("calimero").display(),
        merod_config = merod_config.display(),
    )
}

/// Behaviours 1 (start-up), 2 (no watchdog kill while merod is down or MDMA out),
/// 3 (stop), 4 (sandbox, no seccomp denial over a full scenario) and 6 (credentials).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn start_up_sandbox_outage_and_stop_under_the_shipped_unit() {
    let Some(sysd) = boot("start_up_sandbox_outage_and_stop").await else {
        return;
    };
    let node = Node::start(Some(TOKEN)).await;
    node.merod.set_ready(false);
    node.mdma.set_reply(PollReply::assign([A, B]));
    start_with_the_credential_and_the_probe(&sysd, &node).await;
    let pid = start_up_waits_for_merod(&sysd, &node).await;
    polls_carry_the_credential_and_the_mrtd(&sysd, &node).await;
    an_mdma_outage_kills_nothing(&sysd, &node, &pid).await;
    a_leave_then_a_log_reopen(&sysd, &node).await;
    stop_exits_0_with_the_state_persisted(&sysd).await;
    the_sandbox_as_the_probe_saw_it(&sysd, &node).await;
}

/// Starts the unit with the fleet token as a credential and the sandbox probe after it.
async fn start_with_the_credential_and_the_probe(sysd: &Boot, node: &Node) {
    let config = node.config(&format!(
        "fleet_token_file = \"{CREDENTIAL_PATH}\"\nmax_backoff = \"2s\"\nleave_grace = \"0s\""
    ));
    let probe = node.path("probe.sh");
    std::fs::write(&probe, probe_script(node)).expect("probe script");
    sysd.drop_in(&format!(
        "{}WatchdogSec={}s\nLoadCredential={CREDENTIAL}:{}\n\
         # A SystemCallFilter= denial kills (SIGSYS, in the journal) instead of failing with EPERM.\n\
         SystemCallErrorNumber=kill\nExecStartPost=/bin/sh {}\n",
        exec_start(&config),
        WATCHDOG.as_secs(),
        node.path("token").display(),
        probe.display()
    ))
    .await;
    // As a node image has them.
    sysd.run(&[
        "mkdir",
        "-p",
        "/mnt/data/tls",
        "/etc/vector",
        "/etc/vmagent",
    ])
    .await;
    sysd.run(&["systemctl", "start", "--no-block", UNIT]).await;
}

/// Behaviour 1, start-up: activating while merod does not answer (no start deadline), with the
/// waiting reason as StatusText, and no watchdog kill meanwhile; active with both
/// namespaces confirmed once it answers. Gives the daemon's PID.
async fn start_up_waits_for_merod(sysd: &Boot, node: &Node) -> String {
    let first = sysd
        .until("the daemon started", SOON, |p| {
            prop(p, "StatusText").starts_with("waiting for merod")
        })
        .await;
    let pid = prop(&first, "MainPID").to_owned();
    sysd.holds("activating while merod is down", NO_KILL_SPAN, |p| {
        prop(p, "ActiveState") == "activating"
            && prop(p, "MainPID") == pid
            && restarts(p) == 0
            && prop(p, "StatusText").starts_with("waiting for merod")
    })
    .await;
    // The heartbeat does not wait for merod: MDMA is polled meanwhile.
    assert!(
        !node.mdma.polls().is_empty(),
        "no poll while merod was down"
    );
    node.merod.set_ready(true);
    sysd.until("active once merod answers", SOON, active).await;
    let p = sysd
        .until("A and B confirmed in StatusText", SOON, |p| {
            prop(p, "StatusText").starts_with("2 confirmed, last poll ok")
        })
        .await;
    assert_eq!(prop(&p, "MainPID"), pid, "{}", brief(&p));
    let state = sysd
        .until_file(STATE_FILE, SOON, |s| s.contains(A) && s.contains(B))
        .await;
    assert!(state.contains("confirmed"), "{state}");
    assert_eq!(node.mdma.confirmed().len(), 2);

    pid
}

/// Behaviour 6: the token came from the credential: every poll carried it, and MDMA (which
/// refuses any other) answered. And behaviour 4: the MRTD path was readable, the polls
/// carry it.
async fn polls_carry_the_credential_and_the_mrtd(sysd: &Boot, node: &Node) {
    let polls = node.mdma.polls();
    assert!(polls.iter().all(|p| p.token.as_deref() == Some(TOKEN)));
    // systemd's own restriction of the credential: 0400, owned by the service user (root),
    // in a directory only that user may enter.
    let modes = sysd
        .run(&[
            "stat",
            "-c",
            "%a %U",
            CREDENTIAL_PATH,
            CREDENTIAL_PATH.trim_end_matches(CREDENTIAL),
        ])
        .await;
    assert_eq!(modes, "400 root\n500 root\n");
    assert!(polls.iter().all(|p| p.mrtd.as_deref() == Some(MRTD_HEX)));
}

/// Behaviour 2, an MDMA outage: failed polls keep feeding the watchdog.
async fn an_mdma_outage_kills_nothing(sysd: &Boot, node: &Node, pid: &str) {
    node.mdma.set_reply(PollReply::Status(503));
    sysd.holds(
        "no watchdog kill during an MDMA outage",
        NO_KILL_SPAN,
        |p| active(p) && prop(p, "MainPID") == pid && restarts(p) == 0,
    )
    .await;
    let p = sysd.show().await;
    assert!(
        prop(&p, "StatusText").contains("poll(s) failed"),
        "{}",
        brief(&p)
    );
}

/// A leave (B withdrawn, left after leave_after_polls good polls; no grace in this
/// config), then a SIGHUP reopen.
async fn a_leave_then_a_log_reopen(sysd: &Boot, node: &Node) {
    node.mdma.set_reply(PollReply::assign([A]));
    sysd.until_file(STATE_FILE, SOON, |s| s.contains(A) && !s.contains(B))
        .await;
    assert_eq!(node.merod.leaves(B), 1);
    sysd.run(&["systemctl", "kill", "--kill-who=main", "-s", "HUP", UNIT])
        .await;
    let log = sysd
        .until_file(LOG_FILE, SOON, |s| s.contains("log file reopened"))
        .await;
    assert!(log.contains("fleet-sidecar starting"), "{log}");
}

/// Behaviour 3, stop: within TimeoutStopSec, exit 0, state persisted, STOPPING=1 seen.
async fn stop_exits_0_with_the_state_persisted(sysd: &Boot) {
    let t = Instant::now();
    sysd.run(&["systemctl", "stop", UNIT]).await;
    let stop_took = t.elapsed();
    eprintln!("systemctl stop took {stop_took:?}");
    assert!(stop_took < TIMEOUT_STOP, "stop took {stop_took:?}");
    // (An inactive unit is garbage-collected at once, resetting its properties: the exit
    // status is read from systemd's journal lines.)
    let p = sysd.show().await;
    assert_eq!(prop(&p, "ActiveState"), "inactive", "{}", brief(&p));
    let journal = sysd.journal().await;
    let has = |s: &str| journal.lines().any(|l| l.contains(s));
    assert!(
        has("Main process exited, code=exited, status=0/SUCCESS")
            && has("Deactivated successfully"),
        "{journal}"
    );
    assert!(!has("restart counter is at"), "{journal}");
    let state = sysd.read(STATE_FILE).await.expect("state file persisted");
    assert!(state.contains(A) && !state.contains(B), "{state}");

    assert!(has("READY=1"), "READY=1 not seen:\n{journal}");
    assert!(has("STOPPING=1"), "STOPPING=1 not seen:\n{journal}");
    // This tool's /mnt is an overlay on tmpfs: the start-up log calls it out, and the daemon
    // ran all the same.
    // (Read by the daemon's identifier, not its unit: see `daemon_journal`.)
    let own = sysd.daemon_journal().await;
    assert!(
        own.contains("the state file's directory is on a RAM filesystem (overlay at /mnt"),
        "the daemon's journal lines:\n{own}\n\nits log file:\n{}",
        sysd.read(LOG_FILE).await.unwrap_or_default()
    );
    assert!(!has("Watchdog timeout"), "{journal}");
}

/// Behaviour 4, the sandbox, as the probe saw it from inside; no seccomp denial over the whole scenario.
async fn the_sandbox_as_the_probe_saw_it(sysd: &Boot, node: &Node) {
    // The probe's lines are read from the whole journal: journald may attribute the output
    // of a short-lived process to no unit (its cgroup is gone when the line is read).
    let all = sysd.journal_all().await;
    let has = |s: &str| all.lines().any(|l| l.contains(s));
    for line in [
        "sandbox-probe: read-only /usr",
        "sandbox-probe: read-only /etc",
        "sandbox-probe: read-only /var/lib",
        "sandbox-probe: read-only /var/log",
        &format!("sandbox-probe: read-only {}", node.dir.path().display()),
        &format!(
            "sandbox-probe: read-only {}",
            node.path("calimero").display()
        ),
        "sandbox-probe: writable /var/lib/calimero",
        "sandbox-probe: read-only /mnt/data",
        "sandbox-probe: writable /mnt/data/fleet",
        // The TLS directory a certificate is installed in, the logs token's and its
        // shippers' configs.
        "sandbox-probe: writable /mnt/data/tls",
        "sandbox-probe: writable /etc/vector",
        "sandbox-probe: writable /etc/vmagent",
        "sandbox-probe: readable merod config",
    ] {
        assert!(has(line), "missing `{line}`:\n{all}");
    }
    // The device opens where it exists (this tool's private /dev never has it).
    assert!(
        has("sandbox-probe: tdx_guest opens") || has("sandbox-probe: no /dev/tdx_guest here"),
        "{all}"
    );
    // No seccomp denial over the whole scenario (joins, confirms, a leave, the reopen): the
    // filter kills with SIGSYS here, which systemd logs as `status=31/SYS` (a shell's
    // child as "Bad system call"); and the daemon never saw EPERM.
    assert!(!has("status=31/SYS") && !has("Bad system call"), "{all}");
    let log = sysd.read(LOG_FILE).await.unwrap_or_default();
    assert!(!log.contains("Operation not permitted"), "{log}");
    assert!(!all.contains(TOKEN) && !log.contains(TOKEN));
}

/// Behaviour 2: a stalled loop is killed by the watchdog and restarted, and the restarted
/// daemon resumes from the state file without re-joining what is confirmed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_daemon_is_killed_by_the_watchdog_and_resumes_from_state() {
    let Some(sysd) = boot("watchdog").await else {
        return;
    };
    let node = Node::start(None).await;
    node.mdma.set_reply(PollReply::assign([A]));
    let config = node.config("max_backoff = \"2s\"");
    sysd.drop_in(&format!(
        "{}WatchdogSec={}s\n",
        exec_start(&config),
        WATCHDOG.as_secs()
    ))
    .await;
    sysd.run(&["systemctl", "start", "--no-block", UNIT]).await;
    sysd.until("active", SOON, active).await;
    sysd.until_file(STATE_FILE, SOON, |s| s.contains(A)).await;
    let p = sysd
        .until("A confirmed", SOON, |p| {
            prop(p, "StatusText").starts_with("1 confirmed")
        })
        .await;
    let pid = prop(&p, "MainPID").to_owned();
    assert_eq!(node.merod.joins(A), 1);

    sysd.run(&["systemctl", "kill", "--kill-who=main", "-s", "STOP", UNIT])
        .await;
    let stopped = Instant::now();
    let p = sysd
        .until("a watchdog kill", SOON, |p| prop(p, "Result") == "watchdog")
        .await;
    // WatchdogSec after the last WATCHDOG=1, which came up to a poll interval before SIGSTOP.
    eprintln!("watchdog kill seen {:?} after SIGSTOP", stopped.elapsed());
    assert_ne!(prop(&p, "ActiveState"), "failed", "{}", brief(&p));
    let p = sysd
        .until("restarted", SOON, |p| {
            restarts(p) >= 1 && active(p) && prop(p, "MainPID") != pid
        })
        .await;
    let journal = sysd.journal().await;
    assert!(journal.contains("Watchdog timeout"), "{journal}");
    assert!(
        journal.contains("Failed with result 'watchdog'"),
        "{journal}"
    );

    // Resumed from the state file: polls go on, A is not joined again.
    let polls = node.mdma.polls().len();
    assert!(
        node.mdma.wait_for_polls(polls + 3, SOON).await,
        "the restarted daemon polls: {}",
        brief(&p)
    );
    assert_eq!(
        node.merod.joins(A),
        1,
        "A was joined again after the restart"
    );
    let p = sysd.show().await;
    assert!(
        prop(&p, "StatusText").starts_with("1 confirmed"),
        "{}",
        brief(&p)
    );
}

/// Behaviour 5: exit 78 on a broken config is restarted every RestartSec= (never reaching
/// the start limit) and says why in the journal once per start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_config_exits_78_and_is_restarted_every_restart_sec() {
    let Some(sysd) = boot("config_error").await else {
        return;
    };
    let node = Node::start(None).await;
    let config = node.path("broken.toml");
    std::fs::write(
        &config,
        "mdma_url = \"http://127.0.0.1:9\"\nno_such_key = 1\n",
    )
    .expect("broken config");
    sysd.drop_in(&exec_start(&config)).await;
    sysd.run(&["systemctl", "start", "--no-block", UNIT]).await;

    let exit_line = "fleet-sidecar.service: Main process exited, code=exited, status=78/CONFIG";
    let exits = |j: &str| j.lines().filter(|l| l.contains(exit_line)).count();
    let start = Instant::now();
    loop {
        let j = sysd.journal_all().await;
        if exits(&j) >= 3 {
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(40), "{j}");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let p = sysd.show().await;
    assert!(restarts(&p) >= 2, "{}", brief(&p));
    assert_ne!(
        prop(&p, "ActiveState"),
        "failed",
        "start limit hit: {}",
        brief(&p)
    );

    // The daemon's stderr may reach the journal after systemd's exit line; the next start
    // is RestartSec away, so a second's wait completes the last start's lines. The whole
    // journal is read (this boot runs nothing else): journald may attribute the output of a
    // process that exited at once to no unit.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let journal = sysd.journal_all().await;
    // Per start (starts are separated by "Scheduled restart job"): one line saying why.
    for (n, start) in journal.split("Scheduled restart job").enumerate() {
        let why = start.lines().filter(|l| l.contains("no_such_key")).count();
        assert_eq!(why, 1, "start {n}: one line saying why:\n{journal}");
    }
    let exit_times: Vec<f64> = journal
        .lines()
        .filter(|l| l.contains(exit_line))
        .map(|l| {
            l.split_whitespace()
                .next()
                .and_then(|t| t.parse().ok())
                .expect("short-unix timestamp")
        })
        .collect();
    for pair in exit_times.windows(2) {
        let gap = pair[1] - pair[0];
        assert!(
            (RESTART_SEC - 0.1..RESTART_SEC + 3.0).contains(&gap),
            "starts {gap:.2} s apart, RestartSec is {RESTART_SEC} s:\n{journal}"
        );
    }
}
