//! merod reached at the first of its `[server].listen` addresses that answers: each is
//! probed in order (an IPv6-first `listen` on a host where `::1` is not served, a first
//! address merod does not bind, …), and the calls go to the one that answered. When a call
//! to it cannot reach merod (connection refused or reset), the addresses are probed again, so
//! a merod that moved to another of its addresses is followed without a restart.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use tracing::info;

use super::{
    Admission, MerodClient, MerodError, NetworkStatus, Node, NodeAccount, TeeRole, PROBE_TIMEOUT,
};
use crate::ids::GroupId;

/// merod behind several admin URLs, in the order of `[server].listen`: [`Node::probe`]
/// tries each in order and the first that answers takes every later call (until a probe
/// finds another). A call that cannot reach the chosen address ([`MerodError::is_unreachable`])
/// fails as it did, and the addresses are probed again before it returns, so the next call
/// (its retry, after its back-off) goes to the one merod answers on now. A single URL
/// behaves as its [`MerodClient`].
#[derive(Debug)]
pub(crate) struct ListenCandidates {
    /// `[server].listen[0]`'s client, then the later ones.
    clients: Vec<MerodClient>,
    /// Index of the client that answered last; `usize::MAX` before any answered.
    chosen: AtomicUsize,
}

impl ListenCandidates {
    /// `first`, then `rest`, in the order to try; `first` is used until a probe answers.
    pub(crate) fn new(first: MerodClient, rest: Vec<MerodClient>) -> Self {
        let mut clients = vec![first];
        clients.extend(rest);
        Self {
            clients,
            chosen: AtomicUsize::new(usize::MAX),
        }
    }

    /// The client of the address the last answering probe chose (`[server].listen[0]`'s
    /// before any answered): where every call goes, the loop's and those beside it
    /// (registration's identity and quotes), so all follow the one choice.
    pub(crate) fn current(&self) -> &MerodClient {
        let i = self.chosen.load(Ordering::Relaxed);
        self.clients.get(i).unwrap_or(&self.clients[0])
    }
}

/// What reaches one merod: a client itself, or the [`ListenCandidates`]' chosen one. The
/// jobs' read traits are implemented once over it, so that a job reads through the loop's
/// choice of address or a plain client alike.
pub(crate) trait OnMerod: Send + Sync {
    /// The client the next call goes to.
    fn merod(&self) -> &MerodClient;
}

impl OnMerod for MerodClient {
    fn merod(&self) -> &MerodClient {
        self
    }
}

/// merod at the `[server].listen` address the loop chose.
impl OnMerod for ListenCandidates {
    fn merod(&self) -> &MerodClient {
        self.current()
    }
}

impl ListenCandidates {
    /// A call's outcome, returned unchanged; when it could not reach the chosen address
    /// and there are others, they are probed again first (within [`PROBE_TIMEOUT`]) so the
    /// next call goes where merod answers now. The call itself is not repeated: whether a
    /// reset one reached merod is unknown, and its own retry (with its back-off) decides.
    async fn follow<T>(&self, outcome: Result<T, MerodError>) -> Result<T, MerodError> {
        if let Err(e) = &outcome {
            if self.clients.len() > 1 && e.is_unreachable() {
                info!("merod's admin API did not take a call at {} ({e}): probing its [server].listen addresses again", self.current().admin_url());
                if let Err(probe) = self.probe().await {
                    info!("no [server].listen address of merod answers yet: {probe}");
                }
            }
        }
        outcome
    }
}

/// How long a probe of each of `n` addresses may take: an equal share of [`PROBE_TIMEOUT`].
fn share(n: usize) -> Duration {
    PROBE_TIMEOUT / u32::try_from(n.max(1)).unwrap_or(u32::MAX)
}

#[async_trait]
impl Node for ListenCandidates {
    /// Probes each address in order, each within an equal share of [`PROBE_TIMEOUT`] (so
    /// one that hangs does not use up the whole probe), and keeps the first that answers,
    /// logging which. Errors: the first address's error when none answered.
    async fn probe(&self) -> Result<(), MerodError> {
        let share = share(self.clients.len());
        let mut first_error = None;
        for (i, client) in self.clients.iter().enumerate() {
            let outcome = match tokio::time::timeout(share, client.probe()).await {
                Ok(r) => r,
                Err(_) => Err(MerodError::Timeout {
                    op: super::MerodOp::Peers,
                    url: client.admin_url().to_string(),
                    after: share,
                }),
            };
            match outcome {
                Ok(()) => {
                    if self.chosen.swap(i, Ordering::Relaxed) != i && self.clients.len() > 1 {
                        info!(
                            merod = %client.admin_url(),
                            "merod's admin API answered at [server].listen[{i}] {}{}",
                            client.admin_url(),
                            if i > 0 { " (the earlier addresses did not answer)" } else { "" }
                        );
                    }
                    return Ok(());
                }
                Err(e) if first_error.is_none() => first_error = Some(e),
                Err(_) => {}
            }
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    async fn fleet_join(
        &self,
        group_id: GroupId,
        admitter_addrs: &[String],
    ) -> Result<Admission, MerodError> {
        let r = self.current().fleet_join(group_id, admitter_addrs).await;
        self.follow(r).await
    }

    async fn leave_namespace(&self, group_id: GroupId) -> Result<(), MerodError> {
        let r = self.current().leave_namespace(group_id).await;
        self.follow(r).await
    }

    async fn holds_namespace(&self, group_id: GroupId) -> Result<bool, MerodError> {
        let r = self.current().holds_namespace(group_id).await;
        self.follow(r).await
    }

    async fn list_namespaces(&self) -> Result<BTreeSet<GroupId>, MerodError> {
        let r = self.current().list_namespaces().await;
        self.follow(r).await
    }

    async fn identity(&self) -> Result<NodeAccount, MerodError> {
        let r = self.current().identity().await;
        self.follow(r).await
    }

    async fn network_status(&self) -> Result<NetworkStatus, MerodError> {
        let r = self.current().network_status().await;
        self.follow(r).await
    }

    async fn tee_role(
        &self,
        group_id: GroupId,
        account: &str,
    ) -> Result<Option<TeeRole>, MerodError> {
        let r = self.current().tee_role(group_id, account).await;
        self.follow(r).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_address_gets_an_equal_share_of_the_probe() {
        assert_eq!(share(1), PROBE_TIMEOUT);
        assert_eq!(share(2), PROBE_TIMEOUT / 2);
        assert_eq!(share(0), PROBE_TIMEOUT);
    }
}
