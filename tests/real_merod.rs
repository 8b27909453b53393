//! The unmodified daemon binary against a real merod pair on loopback.
//!
//! Runs only when `MEROD_BIN` names a merod built with the `mock-attestation` feature (see
//! docs/maintainers.md, "Checking against a new merod"); without it the test prints SKIPPED and
//! passes. `scripts/merod-lab.py` boots node A (owner and verifier) and node B (a mock-TEE
//! replica, the node the daemon manages) on free loopback ports and creates three
//! namespaces whose admission policy accepts B's mock quote. The MDMA side is the loopback
//! emulator. In order, against B:
//! 1. two assigned namespaces are joined through merod's real fleet-join, held by merod and
//!    confirmed to MDMA;
//! 2. an MDMA outage (error statuses, then an unreadable body) leaves nothing;
//! 3. a withdrawn namespace is left once its `leave_grace` (3 s) has passed, merod no longer
//!    holds it, and the state file is exactly the one namespace still assigned (and the one
//!    leave, stamped);
//! 4. attested registration (`[registration]`, run by the daemon once merod has minted the
//!    node's account at its first admission): merod answers `registration-attest` 404, the
//!    daemon falls back to `/admin-api/tee/attest`, registers with merod's mock quote over
//!    `sha256(challenge|peer_id|account|relay_url)`, unbound, and polls with the issued token.
//!
//! Needs `python3` (for the lab tool) when it runs; it takes about a minute.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fleet_sidecar::testing::mdma::{MdmaEmulator, PollReply, ISSUED_TOKEN};
use fleet_sidecar::testing::sandbox::MRTD_HEX;
use fleet_sidecar::{GroupId, MerodClient, Node, State, StateStore};
use serde_json::Value;
use sha2::{Digest, Sha256};

/// The withdrawal's leave policy: left after 3 s of absence and two successful polls
/// without it.
const LEAVE_POLICY: &str = "leave_grace = \"3s\"\nleave_after_polls = 2";
/// `leave_grace` above.
const LEAVE_GRACE: Duration = Duration::from_secs(3);
/// Failed polls back off up to 2 s, so an outage of 8 polls takes seconds, not a minute.
const BACKOFF: &str = "max_backoff = \"2s\"";
/// The relay URL the node registers with (given, so no metadata server is asked).
const RELAY: &str = "https://relay.fleet.test";
/// The enrolment token in the registration's `enrolment_token_file`.
const ENROLMENT: &str = "NEVER-LOGGED-TOKEN-enrolment";

/// A two-node lab started by `scripts/merod-lab.py`; stopped when dropped.
struct Lab {
    dir: tempfile::TempDir,
    script: PathBuf,
    info: Value,
}

impl Lab {
    fn up(merod_bin: &std::ffi::OsStr, namespaces: usize) -> Lab {
        let dir = tempfile::Builder::new()
            .prefix("fleet-sidecar-real-merod-")
            .tempdir()
            .expect("temp dir");
        let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("scripts/merod-lab.py");
        let lab_dir = dir.path().join("lab");
        let out = Command::new("python3")
            .arg(&script)
            .arg("up")
            .arg(&lab_dir)
            .args(["--namespaces", &namespaces.to_string(), "--ports", "auto"])
            .env("MEROD_BIN", merod_bin)
            .stdin(Stdio::null())
            .output()
            .expect("python3 runs scripts/merod-lab.py");
        // From here on a drop stops whatever was started.
        let mut lab = Lab {
            dir,
            script,
            info: Value::Null,
        };
        assert!(
            out.status.success(),
            "merod-lab.py up failed:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let text = std::fs::read_to_string(lab_dir.join("lab.json")).expect("lab.json");
        lab.info = serde_json::from_str(&text).expect("lab.json is JSON");
        lab
    }

    fn lab_dir(&self) -> PathBuf {
        self.dir.path().join("lab")
    }

    fn namespaces(&self) -> Vec<String> {
        self.info["namespaces"]
            .as_array()
            .expect("namespaces")
            .iter()
            .map(|v| v.as_str().expect("an id").to_owned())
            .collect()
    }

    fn str(&self, key: &str) -> &str {
        self.info[key]
            .as_str()
            .unwrap_or_else(|| panic!("lab.{key}"))
    }

    /// The last warnings, errors and fleet-join / leave lines of node `node`'s log (colour
    /// codes removed), for a failure message.
    fn log_tail(&self, node: &str) -> String {
        let text =
            std::fs::read_to_string(self.lab_dir().join(format!("{node}.log"))).unwrap_or_default();
        let mut plain = String::with_capacity(text.len());
        let mut chars = text.chars();
        while let Some(c) = chars.next() {
            if c == '\u{1b}' {
                // An escape sequence: ESC [ ... letter.
                for c in chars.by_ref() {
                    if c.is_ascii_alphabetic() {
                        break;
                    }
                }
            } else {
                plain.push(c);
            }
        }
        let wanted: Vec<&str> = plain
            .lines()
            .filter(|l| {
                l.contains(" WARN ")
                    || l.contains(" ERROR ")
                    || l.contains("fleet_join")
                    || l.contains("leave")
            })
            .collect();
        wanted[wanted.len().saturating_sub(30)..].join("\n")
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        let _ = Command::new("python3")
            .arg(&self.script)
            .arg("down")
            .arg(self.lab_dir())
            .stdin(Stdio::null())
            .output();
    }
}

/// The daemon binary, killed when dropped.
struct Daemon(Child);

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

fn gid(s: &str) -> GroupId {
    s.parse().expect("merod's ids are group ids")
}

/// Waits until `f` holds, checking every 250 ms; panics naming `what` after `limit`.
async fn eventually<F, Fut>(what: &str, limit: Duration, why: impl Fn() -> String, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = Instant::now();
    while !f().await {
        assert!(
            start.elapsed() < limit,
            "timed out after {limit:?} waiting for: {what}\n{}",
            why()
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_daemon_joins_confirms_outlasts_an_outage_and_leaves_against_a_real_merod() {
    let Some(merod_bin) = std::env::var_os("MEROD_BIN") else {
        println!("SKIPPED: MEROD_BIN is not set (a merod built with mock-attestation)");
        return;
    };
    let run = Scenario::start(merod_bin).await;
    run.joins_and_confirms().await;
    run.reports_the_node().await;
    run.writes_merods_key_for_device_login().await;
    run.posts_the_inventory().await;
    run.idles_the_recovery_job_without_a_seal_route().await;
    run.outlasts_an_outage().await;
    run.leaves_the_withdrawn_namespace().await;
    run.registers_through_the_attest_fallback().await;
    run.stops_on_sigterm().await;
}

/// One run of the scenario: the daemon, the MDMA emulator, node B and the daemon's files.
/// The daemon is declared first so that it is dropped (killed) first.
struct Scenario {
    daemon: Daemon,
    mdma: MdmaEmulator,
    /// Node B's admin API.
    merod: MerodClient,
    lab: Lab,
    /// Assigned throughout, and assigned then withdrawn.
    kept: String,
    withdrawn: String,
    state_file: PathBuf,
    log_file: PathBuf,
    started: Instant,
}

impl Scenario {
    /// Boots the lab, writes the daemon's config and files in its directory, and starts the
    /// daemon against node B with both namespaces assigned.
    async fn start(merod_bin: std::ffi::OsString) -> Scenario {
        let started = Instant::now();
        let lab = tokio::task::spawn_blocking(move || Lab::up(&merod_bin, 3))
            .await
            .expect("lab task");
        let ns = lab.namespaces();
        let (kept, withdrawn) = (ns[0].clone(), ns[1].clone());
        let merod =
            MerodClient::new(&lab.str("b_admin_url").parse().expect("a URL")).expect("client");
        let mdma = MdmaEmulator::start(None).await.expect("MDMA emulator");
        mdma.set_reply(PollReply::assign([kept.clone(), withdrawn.clone()]));

        let work = lab.dir.path();
        // The MRTD the daemon reports to MDMA (read from a sysfs-style file; the mock
        // quote's all-zero one would be refused as a wrong read).
        let mrtd: Vec<u8> = (0u8..48).collect();
        std::fs::write(work.join("mrtd"), mrtd).expect("mrtd");
        let state_file = work.join("state.json");
        let log_file = work.join("fleet-sidecar.log");
        let config = work.join("fleet-sidecar.toml");
        std::fs::write(work.join("enrolment-token"), ENROLMENT).expect("enrolment token");
        std::fs::write(
            &config,
            format!(
                "mdma_url = \"{mdma}\"\npoll_interval = \"1s\"\nstate_file = \"{state}\"\nlog_file = \"{log}\"\nlog_target = \"stderr\"\n{BACKOFF}\n{LEAVE_POLICY}\n\n[merod]\nhome = \"{home}\"\nnode = \"b\"\n\n[tdx]\nmrtd_path = \"{mrtd}\"\nsources = [\"sysfs\"]\n\n[registration]\ntoken_file = \"{token}\"\nenrolment_token_file = \"{enrolment}\"\nrelay_url = \"{RELAY}\"\nretry_interval = \"1s\"\n\n[tls]\ndir = \"{tls}\"\n\n[logs_token]\nfile = \"{logs_token}\"\n\n[device_login]\nmarker = \"{marker}\"\nkey_file = \"{login_key}\"\nrestart_units = []\n",
                mdma = mdma.url(),
                state = state_file.display(),
                log = log_file.display(),
                home = lab.str("home"),
                mrtd = work.join("mrtd").display(),
                token = work.join("fleet/fleet-token").display(),
                enrolment = work.join("enrolment-token").display(),
                tls = work.join("tls").display(),
                logs_token = work.join("provided_token").display(),
                marker = work.join("device-key-login").display(),
                login_key = work.join("login-node-key").display(),
            ),
        )
        .expect("config");
        // A node built with delegated access: device-key login is on (no unit to restart
        // here).
        std::fs::write(work.join("device-key-login"), "").expect("marker");
        let daemon = Daemon(
            Command::new(env!("CARGO_BIN_EXE_fleet-sidecar"))
                .arg("--config")
                .arg(&config)
                .arg("run")
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("the daemon starts"),
        );
        let run = Scenario {
            daemon,
            mdma,
            merod,
            lab,
            kept,
            withdrawn,
            state_file,
            log_file,
            started,
        };
        run.step(&format!("lab up: B at {}", run.lab.str("b_admin_url")));
        run
    }

    fn step(&self, what: &str) {
        println!("[{:>5.1} s] {what}", self.started.elapsed().as_secs_f64());
    }

    /// The daemon's and node B's last log lines, for a failure message.
    fn why(&self) -> String {
        format!(
            "--- daemon log ---\n{}\n--- node B log ---\n{}",
            tail(&self.log_file, 60),
            self.lab.log_tail("b")
        )
    }

    fn work(&self) -> &Path {
        self.lab.dir.path()
    }

    /// The daemon's state file as it is now.
    fn state(&self) -> State {
        StateStore::new(&self.state_file)
            .load()
            .expect("the state file reads")
            .unwrap_or_default()
    }

    /// What merod holds now.
    async fn held(&self) -> BTreeSet<GroupId> {
        self.merod
            .list_namespaces()
            .await
            .expect("merod lists its namespaces")
    }

    fn both(&self) -> BTreeSet<GroupId> {
        [gid(&self.kept), gid(&self.withdrawn)].into()
    }

    fn no_route_lines(&self) -> usize {
        std::fs::read_to_string(&self.log_file)
            .unwrap_or_default()
            .lines()
            .filter(|l| l.contains("merod has no seal route"))
            .count()
    }

    /// 1. Joins through merod's real fleet-join, then confirms.
    async fn joins_and_confirms(&self) {
        let (mdma, lab) = (&self.mdma, &self.lab);
        eventually(
            "both namespaces confirmed to MDMA",
            Duration::from_secs(120),
            || self.why(),
            || async { mdma.confirmed().len() == 2 },
        )
        .await;
        self.step("joined and confirmed two");
        assert_eq!(
            mdma.confirmed(),
            [self.kept.clone(), self.withdrawn.clone()].into()
        );
        for c in mdma.confirms() {
            assert_eq!(c.peer_id.as_deref(), Some(lab.str("b_peer_id")), "{c:?}");
        }
        let both = self.both();
        assert_eq!(self.held().await, both, "merod holds what was confirmed");
        for poll in mdma.polls() {
            assert_eq!(poll.peer_id.as_deref(), Some(lab.str("b_peer_id")));
            assert_eq!(poll.mrtd.as_deref(), Some(MRTD_HEX));
        }
        let s = self.state();
        assert_eq!((&s.admitted, &s.confirmed), (&both, &both), "{s:?}");
        assert!(s.joining.is_empty(), "{s:?}");
    }

    /// The node's report: merod's account once it holds one (read for the confirms'
    /// roles), `""` before; no certificate or logs token in the lab.
    async fn reports_the_node(&self) {
        let mdma = &self.mdma;
        eventually(
            "a poll carrying merod's account",
            Duration::from_secs(30),
            || self.why(),
            || async {
                mdma.polls().last().is_some_and(|p| {
                    p.executor_account.as_deref().is_some_and(|a| {
                        a.len() == 64
                            && a.bytes()
                                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
                    })
                })
            },
        )
        .await;
        let reported = mdma.polls().last().cloned().unwrap();
        println!(
            "real merod: executor_account {:?}, tls_cert_not_after {:?}, logs_token_fp {:?}, swarm_addrs {:?}",
            reported.executor_account, reported.tls_cert_not_after, reported.logs_token_fp, reported.swarm_addrs
        );
        let status = self
            .merod
            .network_status()
            .await
            .expect("rc.25 answers GET /admin-api/network/status");
        println!("real merod: network/status {status:?}");
        assert_eq!(status.local_peer_id, self.lab.str("b_peer_id"));
        assert!(mdma
            .polls()
            .iter()
            .all(|p| p.executor_account.is_some() && p.tls_cert_not_after.is_some()));
    }

    /// Device-key login: rc.25 answers `publicKey` in base58 (which the Bash sidecar never
    /// takes); the key file holds its 32 bytes as hex.
    async fn writes_merods_key_for_device_login(&self) {
        let login_key = self.work().join("login-node-key");
        eventually(
            "merod's node key written for device-key login",
            Duration::from_secs(30),
            || self.why(),
            || async { std::fs::read_to_string(&login_key).is_ok_and(|t| !t.is_empty()) },
        )
        .await;
        let written = std::fs::read_to_string(&login_key).unwrap();
        let identity = self.identity().await;
        let answered = identity["data"]["publicKey"].as_str().expect("publicKey");
        let bytes = bs58::decode(answered)
            .into_vec()
            .expect("rc.25's key is base58");
        assert_eq!(bytes.len(), 32, "{answered}");
        assert_eq!(written, format!("{}\n", hex::encode(&bytes)));
        println!(
            "real merod: publicKey {answered:?} written as {:?}",
            written.trim_end()
        );
    }

    /// Node B's `GET /admin-api/identity`.
    async fn identity(&self) -> Value {
        http()
            .get(format!("{}admin-api/identity", self.lab.str("b_admin_url")))
            .send()
            .await
            .expect("merod answers")
            .json()
            .await
            .expect("identity JSON")
    }

    /// The context inventory of both, walked in the real merod and posted in full.
    async fn posts_the_inventory(&self) {
        let inventory_of_both = || {
            self.mdma.inventories().into_iter().rev().find_map(|p| {
                let body = serde_json::Value::Object(p.body?);
                let listed: BTreeSet<String> = body["namespaces"]
                    .as_array()?
                    .iter()
                    .filter_map(|n| n["namespace_id"].as_str().map(str::to_owned))
                    .collect();
                let both = [self.kept.clone(), self.withdrawn.clone()].into();
                (p.status == 200 && listed == both).then_some(body)
            })
        };
        eventually(
            "an inventory post of both namespaces",
            Duration::from_secs(60),
            || self.why(),
            || async { inventory_of_both().is_some() },
        )
        .await;
        let posted = inventory_of_both().unwrap();
        println!("real merod: inventory posted {posted}");
        assert_eq!(posted["full"], serde_json::json!(true));
        for ns in posted["namespaces"].as_array().unwrap() {
            assert_eq!(ns["tee_role"], serde_json::json!("ReadOnlyTee"), "{ns}");
            assert!(ns["member_count"].as_u64().is_some_and(|n| n >= 2), "{ns}");
            assert!(ns["bytes"]["total"].is_u64(), "{ns}");
            assert!(ns["context_count"].is_u64(), "read whole: {ns}");
        }
    }

    /// The recovery envelopes: rc.25 has no seal route. The job reads a namespace whole
    /// (member-devices included), asks once, says so once and idles; MDMA gets nothing.
    async fn idles_the_recovery_job_without_a_seal_route(&self) {
        eventually(
            "the recovery job saying merod has no seal route",
            Duration::from_secs(60),
            || self.why(),
            || async { self.no_route_lines() == 1 },
        )
        .await;
        assert!(
            self.mdma.recovery_calls().is_empty(),
            "no envelope without a seal"
        );
        let said = std::fs::read_to_string(&self.log_file).unwrap_or_default();
        println!(
            "real merod: the recovery job idles: {}",
            said.lines()
                .find(|l| l.contains("merod has no seal route"))
                .unwrap_or_default()
        );
    }

    /// 2. An MDMA outage: failed polls, then an answer that cannot be read. Nothing is left.
    async fn outlasts_an_outage(&self) {
        let mdma = &self.mdma;
        let before = mdma.polls().len();
        mdma.set_reply(PollReply::Status(503));
        assert!(
            mdma.wait_for_polls(before + 4, Duration::from_secs(60))
                .await,
            "the daemon keeps polling through the outage\n{}",
            self.why()
        );
        mdma.set_reply(PollReply::RawBody("<html>bad gateway</html>".into()));
        assert!(
            mdma.wait_for_polls(before + 8, Duration::from_secs(60))
                .await,
            "the daemon keeps polling through the outage\n{}",
            self.why()
        );
        let both = self.both();
        assert_eq!(
            self.held().await,
            both,
            "an outage leaves nothing\n{}",
            self.why()
        );
        let s = self.state();
        assert_eq!((&s.admitted, &s.confirmed), (&both, &both), "{s:?}");
        self.step("an MDMA outage of 8 polls left nothing");
    }

    /// 3. A withdrawal is left once the policy allows, and the state is exact.
    async fn leaves_the_withdrawn_namespace(&self) {
        let (kept, withdrawn) = (gid(&self.kept), gid(&self.withdrawn));
        let withdrawn_at = Instant::now();
        self.mdma.set_reply(PollReply::assign([self.kept.clone()]));
        eventually(
            "the withdrawn namespace left and forgotten",
            Duration::from_secs(90),
            || self.why(),
            || async {
                let s = self.state();
                !s.admitted.contains(&withdrawn) && !s.joining.contains(&withdrawn)
            },
        )
        .await;
        let took = withdrawn_at.elapsed();
        self.step(&format!(
            "withdrawal left after {:.1} s",
            took.as_secs_f64()
        ));
        assert!(
            took >= LEAVE_GRACE,
            "left after {took:?}, before leave_grace"
        );
        assert!(
            !self.merod.holds_namespace(withdrawn).await.expect("check"),
            "merod holds nothing of the withdrawn namespace"
        );
        let only: BTreeSet<GroupId> = [kept].into();
        assert_eq!(self.held().await, only);
        let s = self.state();
        assert_eq!(
            (&s.admitted, &s.confirmed, s.joining.len(), s.absent.len()),
            (&only, &only, 0, 0),
            "the state is exactly the namespace still assigned: {s:?}"
        );
        assert_eq!(s.recent_leaves_ms.len(), 1, "one leave, stamped: {s:?}");
        assert!(s.recent_leaves_ms[0] <= s.observed_ms, "{s:?}");
        // Left through merod's own leave: B's account is in the kept namespace's member
        // list, and the withdrawn one no longer lists it (merod answers 500 to a
        // non-member).
        let (status, body) = self.members(&self.kept).await;
        assert_eq!(status, 200, "{body}");
        assert!(
            body["members"]
                .as_array()
                .expect("members")
                .iter()
                .any(|m| m["role"] == "ReadOnlyTee"),
            "{body}"
        );
        assert_eq!(self.members(&self.withdrawn).await.0, 500);
    }

    /// Node B's first page of the members of namespace `id`: the status and the body.
    async fn members(&self, id: &str) -> (u16, Value) {
        let url = format!(
            "{}admin-api/groups/{id}/members?offset=0&limit=1000",
            self.lab.str("b_admin_url")
        );
        let r = http().get(url).send().await.expect("merod answers");
        let status = r.status().as_u16();
        (status, r.json::<Value>().await.unwrap_or(Value::Null))
    }

    /// 4. Attested registration, by the daemon: merod minted the account at the first
    ///    admission; registration-attest is absent on this core (404), so the quote came
    ///    from /admin-api/tee/attest, unbound; the issued token is used at once.
    async fn registers_through_the_attest_fallback(&self) {
        let (mdma, lab) = (&self.mdma, &self.lab);
        eventually(
            "a poll accepted with the issued token",
            Duration::from_secs(60),
            || self.why(),
            || async {
                mdma.polls()
                    .iter()
                    .any(|p| p.token.as_deref() == Some(ISSUED_TOKEN) && p.status == 200)
            },
        )
        .await;
        let regs = mdma.registrations();
        assert_eq!(regs.len(), 1, "one registration");
        let body = Value::Object(regs[0].body.clone().expect("a JSON body"));
        let identity = self.identity().await;
        let account = identity["data"]["accountId"].as_str().expect("accountId");
        let challenge = mdma.challenges()[0].clone();
        assert_eq!(body["peer_id"], lab.str("b_peer_id"));
        assert_eq!(body["executor_account"], account);
        assert_eq!(body["relay_url"], RELAY);
        assert_eq!(body["challenge"], challenge.as_str());
        assert_eq!(body["enrolment_token"], ENROLMENT);
        assert!(
            body.get("quote_binding").is_none(),
            "the fallback quote is unbound: {body}"
        );
        let nonce = hex::encode(Sha256::digest(
            format!("{challenge}|{}|{account}|{RELAY}", lab.str("b_peer_id")).as_bytes(),
        ));
        // merod's mock quote depends only on the report data: asking for one over the same
        // nonce gives the quote the daemon sent, whose report data is the nonce and 32 zero
        // bytes.
        let post = |route: &'static str| {
            let url = format!("{}admin-api/tee/{route}", lab.str("b_admin_url"));
            let nonce = nonce.clone();
            async move {
                let r = http()
                    .post(url)
                    .json(&serde_json::json!({ "nonce": nonce }))
                    .send()
                    .await
                    .expect("merod answers");
                let status = r.status().as_u16();
                (status, r.json::<Value>().await.unwrap_or(Value::Null))
            }
        };
        assert_eq!(
            post("registration-attest").await.0,
            404,
            "absent on this core"
        );
        let (status, quote) = post("attest").await;
        assert_eq!(status, 200, "{quote}");
        assert_eq!(
            body["quote"], quote["data"]["quoteB64"],
            "the daemon sent merod's quote"
        );
        assert_eq!(
            quote["data"]["quote"]["body"]["reportdata"].as_str(),
            Some(format!("{nonce}{}", "0".repeat(64)).as_str()),
            "{quote}"
        );
        assert_eq!(
            std::fs::read_to_string(self.work().join("fleet/fleet-token")).expect("token file"),
            ISSUED_TOKEN
        );
        self.step("registered through the attest fallback; polls carry the issued token");
    }

    /// The daemon stops cleanly on SIGTERM, having asked a merod without the seal route
    /// once only.
    async fn stops_on_sigterm(mut self) {
        assert_eq!(
            self.no_route_lines(),
            1,
            "merod without the seal route is not asked again and again\n{}",
            self.why()
        );
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.daemon.0.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        )
        .expect("signal the daemon");
        let stopped = Instant::now();
        let status = loop {
            if let Some(status) = self.daemon.0.try_wait().expect("daemon status") {
                break status;
            }
            assert!(
                stopped.elapsed() < Duration::from_secs(20),
                "the daemon stops"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        assert!(status.success(), "{status}\n{}", self.why());
        self.step("done");
    }
}

/// A loopback client that no proxy setting reaches.
fn http() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .build()
        .expect("client")
}
