//! Device-key login through the whole daemon against the emulators: merod's node key kept
//! in `[device_login] key_file` while the marker exists, `mero-auth` restarted through the
//! [`UnitControl`] (systemd's D-Bus API in production; a stand-in that records here).

use std::collections::HashMap;
use std::os::unix::fs::PermissionsExt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use fleet_sidecar::daemon::{UnitControl, UnitError};
use fleet_sidecar::testing::mdma::PollReply;
use fleet_sidecar::testing::sandbox::Sandbox;

use crate::common::*;

const LIMIT: Duration = Duration::from_secs(30);
const AUTH: &str = "mero-auth.service";
/// The recorded rc.25 identity's base58 `publicKey`, as its 32 bytes in hex.
const RC25_KEY: &str = "6f74442edba9238bfaf0a993ccf53b117e36e350614a1b7ba7c8a8ecf7422c5f";

/// systemd as the job sees it: each restart recorded (the unit active from then on), the
/// next `refuse` restarts refused.
#[derive(Default)]
struct Units {
    restarted: Mutex<Vec<String>>,
    since: Mutex<HashMap<String, SystemTime>>,
    refuse: Mutex<u32>,
}

impl Units {
    fn restarts(&self) -> Vec<String> {
        self.restarted.lock().unwrap().clone()
    }
}

#[async_trait]
impl UnitControl for Units {
    async fn restart(&self, unit: &str) -> Result<(), UnitError> {
        {
            let mut refuse = self.refuse.lock().unwrap();
            if *refuse > 0 {
                *refuse -= 1;
                return Err(UnitError::Other("Access denied".to_owned()));
            }
        }
        self.restarted.lock().unwrap().push(unit.to_owned());
        self.since
            .lock()
            .unwrap()
            .insert(unit.to_owned(), SystemTime::now());
        Ok(())
    }
    async fn active_since(&self, unit: &str) -> Result<Option<SystemTime>, UnitError> {
        Ok(self.since.lock().unwrap().get(unit).copied())
    }
}

fn spawn(sb: &Sandbox, units: &Arc<Units>) -> Running {
    let cfg = sb.config("").expect("config");
    let mut deps = sb.deps(&cfg).expect("deps");
    deps.units = Arc::clone(units) as Arc<dyn UnitControl>;
    spawn_loop(cfg, deps)
}

fn failing(d: &Running) -> Option<String> {
    d.telemetry
        .snapshot()
        .jobs
        .get("device_login")
        .and_then(|j| j.failing.clone())
}

/// rc.25's base58 key is written as its bytes in hex (0600) and mero-auth restarted once;
/// polls after it neither write nor restart again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rc25s_base58_key_is_handed_over_as_hex_with_one_restart() {
    let sb = Sandbox::start(None).await.unwrap();
    sb.mdma.set_reply(PollReply::assign::<[&str; 0], &str>([]));
    sb.merod.set_minted(true);
    std::fs::write(sb.device_login_marker(), "").unwrap();
    let units = Arc::new(Units::default());
    let d = spawn(&sb, &units);
    eventually("mero-auth restarted", LIMIT, || {
        !units.restarts().is_empty()
    })
    .await;
    let file = sb.login_key_file();
    assert_eq!(
        std::fs::read_to_string(&file).unwrap(),
        format!("{RC25_KEY}\n")
    );
    let mode = std::fs::metadata(&file).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600);
    let mtime = std::fs::metadata(&file).unwrap().modified().unwrap();
    let polls = sb.mdma.polls().len();
    eventually("three more polls", LIMIT, || {
        sb.mdma.polls().len() >= polls + 3
    })
    .await;
    assert_eq!(units.restarts(), [AUTH], "one restart");
    assert_eq!(std::fs::metadata(&file).unwrap().modified().unwrap(), mtime);
    assert_eq!(failing(&d), None);
    d.stop().await;

    // The daemon again: the file holds the key and mero-auth started after it was written,
    // so login is on without a restart.
    let d = spawn(&sb, &units);
    eventually("the job's first check", LIMIT, || {
        d.telemetry
            .snapshot()
            .jobs
            .get("device_login")
            .is_some_and(|j| j.runs >= 1)
    })
    .await;
    assert_eq!(failing(&d), None);
    assert_eq!(units.restarts(), [AUTH], "no second restart");
    d.stop().await;
}

/// Without the marker nothing is written or restarted, whatever merod answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_marker_nothing_happens() {
    let sb = Sandbox::start(None).await.unwrap();
    sb.mdma.set_reply(PollReply::assign::<[&str; 0], &str>([]));
    sb.merod.set_minted(true);
    let units = Arc::new(Units::default());
    let d = spawn(&sb, &units);
    eventually("five polls", LIMIT, || sb.mdma.polls().len() >= 5).await;
    assert!(!sb.login_key_file().exists());
    assert!(units.restarts().is_empty());
    assert_eq!(failing(&d), None);
    d.stop().await;
}

/// A key that is not one records nothing and is said; a newer core's hex key is then
/// taken, lowercased, and a refused restart of mero-auth is retried with the back-off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_non_key_records_nothing_and_a_refused_restart_is_retried() {
    let sb = Sandbox::start(None).await.unwrap();
    sb.mdma.set_reply(PollReply::assign::<[&str; 0], &str>([]));
    sb.merod.set_minted(true);
    sb.merod.set_public_key(Some("abcdef"));
    std::fs::write(sb.device_login_marker(), "").unwrap();
    let units = Arc::new(Units::default());
    *units.refuse.lock().unwrap() = 1;
    let d = spawn(&sb, &units);
    eventually("the job failing", LIMIT, || {
        failing(&d).is_some_and(|f| f.contains("neither 64 hex characters nor base58"))
    })
    .await;
    assert!(!sb.login_key_file().exists());
    assert!(units.restarts().is_empty());

    let hex = "AB".repeat(32);
    sb.merod.set_public_key(Some(&hex));
    eventually("mero-auth restarted", LIMIT, || {
        !units.restarts().is_empty()
    })
    .await;
    assert_eq!(
        std::fs::read_to_string(sb.login_key_file()).unwrap(),
        format!("{}\n", "ab".repeat(32))
    );
    assert_eq!(units.restarts(), [AUTH], "one refused, then one done");
    eventually("the job recovered", LIMIT, || failing(&d).is_none()).await;
    d.stop().await;
}
