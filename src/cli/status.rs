//! `fleet-sidecar status`: the state file, read as a tool reads it (through
//! [`StateStore::inspect`], which reports what loading would repair, and never writes), and
//! the running daemon's live status when its listener is on.

use serde::Serialize;

use crate::config::Config;
use crate::state::{State, StateFile, StateStore};
use crate::telemetry::LiveStatus;

/// What `fleet-sidecar status --json` prints.
#[derive(Debug, Serialize)]
pub(crate) struct Report {
    /// The state file read.
    pub(crate) state_file: String,
    /// Its content (`null` when it does not exist yet).
    pub(crate) state: Option<State>,
    /// Why the state file could not be read, if so.
    pub(crate) state_error: Option<String>,
    /// What loading the file would repair to restore the state's invariants (the daemon
    /// makes these repairs, and logs them, at its next start); empty for a sound file.
    pub(crate) repairs: Vec<String>,
    /// Leave candidates per the state file alone, with why they wait.
    pub(crate) pending_leaves: std::collections::BTreeMap<String, String>,
    /// The running daemon's `/status`, when the listener is on and answered.
    pub(crate) live: Option<LiveStatus>,
    /// Why the live status is missing (listener off, or no answer).
    pub(crate) live_error: Option<String>,
    /// With `[registration]`: whether `token_file` is present (never its content).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) token_file: Option<String>,
}

/// Builds the report: the state file (read only, never written) and, when `status_listen`
/// is set, the live status from the running daemon (2 s bound).
pub(crate) async fn report(cfg: &Config) -> Report {
    let (state, repairs, state_error) = match StateStore::new(&cfg.state_file).inspect() {
        Ok(StateFile::Present(r)) => (
            Some(r.state),
            r.repairs.iter().map(ToString::to_string).collect(),
            None,
        ),
        Ok(StateFile::Missing) => (None, Vec::new(), None),
        Err(e) => (None, Vec::new(), Some(e.to_string())),
    };
    let pending_leaves = state
        .as_ref()
        .map(|s| {
            s.absent
                .iter()
                .map(|(id, absence)| {
                    let observed = s.absence_observed(id).unwrap_or_default();
                    let policy = &cfg.leave_policy;
                    let why = match policy
                        .grace_wait(observed)
                        .or_else(|| policy.stability_wait(absence.polls))
                    {
                        Some(wait) => wait.to_string(),
                        None => "due to leave (the live status tells whether the mass-withdrawal guard or a rate limit holds it)".to_owned(),
                    };
                    let line = format!(
                        "absent {} s over {} successful polls (as last written); {why}",
                        observed.as_secs(),
                        absence.polls
                    );
                    (id.to_string(), line)
                })
                .collect()
        })
        .unwrap_or_default();
    let (live, live_error) = match cfg.status_listen {
        None => (
            None,
            Some("status_listen is not set: no live status".to_owned()),
        ),
        Some(addr) => match crate::status::fetch::<LiveStatus>(addr).await {
            Ok(l) => (Some(l), None),
            Err(e) => (None, Some(e.to_string())),
        },
    };
    Report {
        state_file: cfg.state_file.display().to_string(),
        state,
        state_error,
        repairs,
        pending_leaves,
        live,
        live_error,
        token_file: cfg
            .registration
            .as_ref()
            .map(|r| crate::registration::token_file_presence(&r.token_file)),
    }
}

/// The report as text for a terminal.
pub(crate) fn render_text(r: &Report, now: f64) -> String {
    let mut out = format!("state file: {}\n", r.state_file);
    match (&r.state, &r.state_error) {
        (_, Some(e)) => out.push_str(&format!("  ERROR: {e}\n")),
        (None, None) => out.push_str("  (does not exist yet: nothing admitted)\n"),
        (Some(s), None) => {
            out.push_str(&format!(
                "  admitted: {}, confirmed: {}\n",
                s.admitted.len(),
                s.confirmed.len()
            ));
            for id in &s.admitted {
                let what = if s.confirmed.contains(id) {
                    "confirmed"
                } else {
                    "admitted, not confirmed"
                };
                out.push_str(&format!("  {id}  {what}\n"));
            }
            for id in &s.joining {
                out.push_str(&format!(
                    "  {id}  joining: fleet-join sent, admission not recorded (merod may hold it)\n"
                ));
            }
            for repair in &r.repairs {
                out.push_str(&format!(
                    "  repaired on read (the daemon repairs it at start): {repair}\n"
                ));
            }
        }
    }
    if let Some(t) = &r.token_file {
        out.push_str(&format!("{t}\n"));
    }
    let live_pending = r.live.as_ref().map(|l| &l.pending_leaves);
    match live_pending {
        Some(p) if !p.is_empty() => {
            out.push_str("pending leave (live):\n");
            for (id, why) in p {
                out.push_str(&format!("  {id}  {why}\n"));
            }
        }
        Some(_) => out.push_str("pending leave (live): none\n"),
        None if !r.pending_leaves.is_empty() => {
            out.push_str("pending leave (from the state file):\n");
            for (id, why) in &r.pending_leaves {
                out.push_str(&format!("  {id}  {why}\n"));
            }
        }
        None => out.push_str("pending leave: none\n"),
    }
    match (&r.live, &r.live_error) {
        (Some(l), _) => render_live(&mut out, l, now),
        (None, Some(e)) => out.push_str(&format!("live: {e}\n")),
        (None, None) => {}
    }
    out
}

/// The live part of the report: what the running daemon says of itself.
fn render_live(out: &mut String, l: &LiveStatus, now: f64) {
    out.push_str(&format!("live: {}: {}\n", l.phase, l.summary(now)));
    if let Some(p) = &l.peer_id {
        out.push_str(&format!("  peer id: {p}\n"));
    }
    match (&l.mrtd, &l.mrtd_source) {
        (Some(m), Some(src)) => out.push_str(&format!("  mrtd: {m} ({src})\n")),
        _ => out.push_str("  mrtd: unreadable (polling with the PeerId only)\n"),
    }
    out.push_str(&format!("  fleet token: {}\n", l.fleet_token));
    if let Some(reg) = &l.registration {
        out.push_str(&format!("  registration: {reg}\n"));
    }
    out.push_str(&format!(
        "  desired: {}, joining: {}, leaving: {}, mass-withdrawal guard: {}\n",
        l.desired.len(),
        l.joining.len(),
        l.leaving.len(),
        l.mass_drop
    ));
    if let Some(fs) = &l.state_ram_filesystem {
        out.push_str(&format!(
            "  ERROR: the state file is on a RAM filesystem ({fs}): lost at reboot\n"
        ));
    }
    for id in &l.orphans {
        out.push_str(&format!(
            "  {id}  orphan: merod holds it, neither in the state, assigned nor retained (left only with leave_orphans = true)\n"
        ));
    }
    match &l.held_namespaces {
        Some(h) => out.push_str(&format!(
            "  merod holds: {} namespaces (read {:.0} s ago{})\n",
            h.count,
            (now - h.read_at).max(0.0),
            if h.reported {
                ""
            } else {
                "; not reported to MDMA"
            }
        )),
        None => out.push_str("  merod holds: unknown (no good read yet, or the last failed)\n"),
    }
    let reported = |v: &str, unknown: &str| {
        if v.is_empty() {
            format!("\"\" ({unknown})")
        } else {
            v.to_owned()
        }
    };
    out.push_str(&format!(
        "  executor_account: {}\n",
        l.executor_account.as_deref().unwrap_or(
            "\"\" (merod holds no account yet: it has it once the node takes part in a namespace)"
        )
    ));
    if let Some(v) = &l.relay_url {
        out.push_str(&format!(
            "  relay_url: {}\n",
            reported(
                v,
                "none: no [registration] relay_url, and the metadata's relay-url is unset or not read yet"
            )
        ));
    }
    out.push_str(&match &l.swarm_addrs {
        Some(a) if !a.is_empty() => format!("  swarm_addrs: {}\n", a.join(" ")),
        Some(_) => "  swarm_addrs: [] (merod has no external address)\n".to_owned(),
        None => {
            "  swarm_addrs: [] (not read yet, or the last read failed: not reported)\n".to_owned()
        }
    });
    if let Some(v) = &l.tls_cert_not_after {
        out.push_str(&format!(
            "  tls_cert_not_after: {}\n",
            reported(
                v,
                "no certificate, a self-signed placeholder, or unreadable: MDMA sends one"
            )
        ));
    }
    if let Some(v) = &l.logs_token_fp {
        out.push_str(&format!(
            "  logs_token_fp: {}\n",
            reported(v, "no logs token")
        ));
    }
    for (name, j) in &l.jobs {
        let good = j.last_good_at.map_or_else(
            || "no good run yet".to_owned(),
            |at| format!("last good {:.0} s ago", (now - at).max(0.0)),
        );
        match &j.failing {
            Some(why) => out.push_str(&format!("  job {name}: failing ({why}); {good}\n")),
            None => out.push_str(&format!("  job {name}: ok, {good} ({} runs)\n", j.runs)),
        }
    }
    for (id, j) in &l.join_outcomes {
        let why = j
            .reason
            .as_deref()
            .map(|r| format!(": {r}"))
            .unwrap_or_default();
        out.push_str(&format!(
            "  {id}  last join {} after {} attempt(s){why}\n",
            j.state, j.attempts
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::GroupId;
    use crate::state::Absence;
    use std::path::Path;

    /// A config with this state file and the `extra` lines.
    fn config(state_file: &Path, extra: &str) -> Config {
        let text = format!(
            "mdma_url = \"https://m\"\nstate_file = \"{}\"\n{extra}",
            state_file.display()
        );
        Config::from_toml(&text, Path::new("c.toml")).unwrap()
    }

    #[tokio::test]
    async fn pending_leaves_from_the_state_file_say_how_far_along_they_are() {
        let dir = tempfile::tempdir().unwrap();
        let state_file = dir.path().join("s.json");
        let (a, b) = (GroupId::from_bytes([1; 32]), GroupId::from_bytes([2; 32]));
        let c = GroupId::from_bytes([3; 32]);
        let state = State {
            admitted: [a, b].into(),
            confirmed: [a, b].into(),
            joining: [c].into(),
            observed_ms: 20_000,
            absent: [
                (
                    a,
                    Absence {
                        polls: 1,
                        since_ms: 0,
                    },
                ),
                (
                    b,
                    Absence {
                        polls: 3,
                        since_ms: 0,
                    },
                ),
                (
                    c,
                    Absence {
                        polls: 3,
                        since_ms: 15_000,
                    },
                ),
            ]
            .into(),
            recent_leaves_ms: Vec::new(),
        };
        StateStore::new(&state_file).save(&state).unwrap();
        let r = report(&config(&state_file, "leave_grace = \"10s\"")).await;
        assert_eq!(
            r.pending_leaves[&a.to_string()],
            "absent 20 s over 1 successful polls (as last written); absent from 1 of the 3 successful polls needed"
        );
        assert_eq!(
            r.pending_leaves[&c.to_string()],
            "absent 5 s over 3 successful polls (as last written); waiting for leave_grace: absence observed for 5 s of 10 s"
        );
        assert!(r.pending_leaves[&b.to_string()].contains("due to leave"));
        assert!(r.live.is_none() && r.live_error.is_some());
        assert!(render_text(&r, 0.0).contains(&format!(
            "  {c}  joining: fleet-join sent, admission not recorded"
        )));
    }

    #[test]
    fn the_live_part_names_orphans_and_a_state_on_a_ram_filesystem() {
        let orphan = GroupId::from_bytes([9; 32]);
        let r = Report {
            state_file: "/dev/shm/s.json".to_owned(),
            state: None,
            state_error: None,
            repairs: Vec::new(),
            pending_leaves: Default::default(),
            token_file: None,
            live: Some(LiveStatus {
                orphans: vec![orphan],
                state_ram_filesystem: Some("tmpfs at /dev/shm".to_owned()),
                ..LiveStatus::default()
            }),
            live_error: None,
        };
        let text = render_text(&r, 0.0);
        assert!(
            text.contains(&format!("  {orphan}  orphan: merod holds it")),
            "{text}"
        );
        assert!(
            text.contains("ERROR: the state file is on a RAM filesystem (tmpfs at /dev/shm)"),
            "{text}"
        );
    }

    #[tokio::test]
    async fn the_report_reads_the_state_as_a_tool_does_and_names_its_repairs() {
        let dir = tempfile::tempdir().unwrap();
        let state_file = dir.path().join("s.json");
        let a = "ab".repeat(32);
        // Confirmed but not admitted: loading adds it to admitted.
        let doc = format!(
            "{{\"version\": 3, \"admitted\": [], \"confirmed\": [\"{a}\"], \"joining\": [], \"absent_polls\": {{}}}}"
        );
        std::fs::write(&state_file, &doc).unwrap();
        let r = report(&config(&state_file, "")).await;
        assert_eq!(
            r.repairs,
            [format!(
                "{a} is confirmed but was not admitted: added to admitted"
            )]
        );
        assert!(r
            .state
            .as_ref()
            .unwrap()
            .admitted
            .contains(&a.parse().unwrap()));
        assert!(render_text(&r, 0.0).contains("repaired on read"));
        // Read only: the file is as it was.
        assert_eq!(std::fs::read_to_string(&state_file).unwrap(), doc);
    }

    #[test]
    fn the_live_part_shows_what_merod_holds_and_why_joins_wait() {
        let c = GroupId::from_bytes([3; 32]);
        let live = LiveStatus {
            held_namespaces: Some(crate::telemetry::HeldStatus {
                count: 600,
                read_at: 90.0,
                reported: false,
            }),
            join_outcomes: [(
                c,
                crate::telemetry::JoinReport {
                    state: "refused".into(),
                    reason: Some("12D3KooWA: MRTD not allowed".into()),
                    attempts: 4,
                },
            )]
            .into(),
            jobs: [
                (
                    "held".to_owned(),
                    crate::telemetry::JobStatus {
                        runs: 3,
                        last_run_at: 95.0,
                        last_good_at: Some(95.0),
                        failing: None,
                    },
                ),
                (
                    "merod_readiness".to_owned(),
                    crate::telemetry::JobStatus {
                        runs: 7,
                        last_run_at: 99.0,
                        last_good_at: None,
                        failing: Some("connection refused".to_owned()),
                    },
                ),
            ]
            .into(),
            tls_cert_not_after: Some(String::new()),
            logs_token_fp: Some("ab".repeat(32)),
            relay_url: Some("https://relay.example".to_owned()),
            ..LiveStatus::default()
        };
        let r = Report {
            state_file: "s.json".into(),
            state: None,
            state_error: None,
            repairs: Vec::new(),
            pending_leaves: Default::default(),
            live: Some(live),
            live_error: None,
            token_file: None,
        };
        let text = render_text(&r, 100.0);
        assert!(
            text.contains("merod holds: 600 namespaces (read 10 s ago; not reported to MDMA)"),
            "{text}"
        );
        assert!(
            text.contains("  tls_cert_not_after: \"\" (no certificate"),
            "{text}"
        );
        assert!(
            text.contains("  executor_account: \"\" (merod holds no account yet"),
            "{text}"
        );
        assert!(
            text.contains("  relay_url: https://relay.example\n"),
            "{text}"
        );
        assert!(
            text.contains(&format!("  logs_token_fp: {}\n", "ab".repeat(32))),
            "{text}"
        );
        assert!(
            text.contains(&format!(
                "  {c}  last join refused after 4 attempt(s): 12D3KooWA: MRTD not allowed"
            )),
            "{text}"
        );
        // Every job, the same way.
        assert!(
            text.contains("  job held: ok, last good 5 s ago (3 runs)\n"),
            "{text}"
        );
        assert!(
            text.contains("  job merod_readiness: failing (connection refused); no good run yet\n"),
            "{text}"
        );
    }
}
