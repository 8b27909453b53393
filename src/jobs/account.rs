//! The node's executor account: merod's `GET /admin-api/identity` `accountId`, trimmed and
//! lowercased. merod answers 404 until it holds an account (rc.25 mints it at the first
//! namespace join), so a job asks every [`ASK_EVERY`] while it is unknown, then keeps it and
//! ends: it does not change while merod keeps its data. Every poll reports it as
//! `executor_account` (`""` while unknown), and the role read before a confirm takes it from
//! the same place.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::info;

use super::limits::IDENTITY_DEADLINE;
use crate::backoff::{Backoff, Jitter};
use crate::jobs::{self, Job, Schedule};
use crate::merod::{MerodError, Node, NodeAccount};
use crate::outcome::Timed;
use crate::telemetry::Telemetry;

/// How often the account is asked for while unknown.
pub(crate) const ASK_EVERY: Duration = Duration::from_secs(15);

/// The node's account once read; kept, never read again.
#[derive(Debug)]
pub(crate) struct AccountCache {
    account: Mutex<Option<String>>,
    /// When the daemon started asking (for the line saying how long it took).
    since: Instant,
    telemetry: Option<Arc<Telemetry>>,
}

impl Default for AccountCache {
    fn default() -> Self {
        Self {
            account: Mutex::new(None),
            since: Instant::now(),
            telemetry: None,
        }
    }
}

impl AccountCache {
    /// An empty cache that shows the account in `telemetry` once known.
    pub(crate) fn shown_in(telemetry: Arc<Telemetry>) -> Self {
        Self {
            telemetry: Some(telemetry),
            ..Self::default()
        }
    }

    /// The account, once known.
    pub(crate) fn get(&self) -> Option<String> {
        self.account
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Keeps `account`; the first time, says so (once) and shows it.
    pub(crate) fn set(&self, account: String) {
        let mut kept = self.account.lock().unwrap_or_else(PoisonError::into_inner);
        if kept.is_none() {
            info!(
                executor_account = %account,
                "executor account known: {account} (readable after {} s)",
                self.since.elapsed().as_secs()
            );
            if let Some(t) = &self.telemetry {
                t.update(|st| st.executor_account = Some(account.clone()));
            }
            *kept = Some(account);
        }
    }
}

/// Why the account is still unknown after a run.
#[derive(Debug, thiserror::Error)]
pub(crate) enum AccountUnread {
    /// `GET /admin-api/identity` failed.
    #[error("GET /admin-api/identity: {0}")]
    Merod(#[source] MerodError),
}

impl Timed for AccountUnread {
    fn is_timeout(&self) -> bool {
        match self {
            AccountUnread::Merod(e) => e.is_timeout(),
        }
    }
}

struct AccountJob {
    merod: Arc<dyn Node>,
    cache: Arc<AccountCache>,
}

impl Job for AccountJob {
    type Output = ();
    type Error = AccountUnread;
    const NAME: &'static str = "executor_account";
    const FAILING: &'static str = "the executor account cannot be read";
    const EFFECT: &'static str = "polls report executor_account as \"\"; asked again in 15 s";
    const RECOVERED: &'static str = "the executor account can be read again";

    fn schedule(&self) -> Schedule {
        Schedule::every(ASK_EVERY, IDENTITY_DEADLINE).backoff(Backoff::new(
            ASK_EVERY,
            ASK_EVERY,
            Jitter::None,
        ))
    }

    async fn run(&mut self) -> Result<(), AccountUnread> {
        if self.cache.get().is_some() {
            return Ok(());
        }
        match self.merod.identity().await {
            Ok(NodeAccount::Account(a)) => {
                self.cache.set(a);
                Ok(())
            }
            // merod holds no account yet: asked again at the next turn.
            Ok(NodeAccount::NotMinted) => Ok(()),
            Err(e) => Err(AccountUnread::Merod(e)),
        }
    }

    fn finished(&self) -> bool {
        self.cache.get().is_some()
    }
}

/// Starts asking merod for the account into `cache` until it is known.
pub(crate) fn spawn(
    merod: Arc<dyn Node>,
    cache: Arc<AccountCache>,
    telemetry: Arc<Telemetry>,
    shutdown: CancellationToken,
) {
    jobs::spawn(AccountJob { merod, cache }, telemetry, shutdown);
}
