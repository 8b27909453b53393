//! The recovery envelopes MDMA keeps of each member account of each namespace a node holds
//! (`PUT` and `DELETE /api/fleet/recovery-envelope`): the account's groups, contexts and
//! devices, sealed to the account's root key, so a member who lost every device can recover
//! the account from the cloud.

use serde::Serialize;

use super::{CallError, MdmaClient, RequestMethod};
use crate::ids::{GroupId, PeerId};

/// The MDMA route of the recovery envelopes.
const ROUTE: &str = "api/fleet/recovery-envelope";

/// Which envelope: this node's, of one account in one namespace. The body of
/// `DELETE /api/fleet/recovery-envelope`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct RecoveryKey {
    /// `peer_id`: the node that wrote it.
    pub peer_id: PeerId,
    /// `account_id`: the member account, lowercase hex.
    pub account_id: String,
    /// `namespace_id`: 64 lowercase hex.
    pub namespace_id: GroupId,
}

/// The body of `PUT /api/fleet/recovery-envelope`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct RecoveryEnvelope {
    /// Whose envelope.
    #[serde(flatten)]
    pub key: RecoveryKey,
    /// `ciphertext`: the sealed envelope as one JSON string
    /// ([`crate::merod::SealedEnvelope::to_json_string`]).
    pub ciphertext: String,
    /// `version`: 1 for a new envelope, then one more than the last one MDMA took.
    pub version: u64,
}

impl MdmaClient {
    /// `PUT /api/fleet/recovery-envelope` with `envelope`, through
    /// [`MdmaClient::send_json`] (the fleet token, the request timeout).
    ///
    /// Errors: [`CallError`] for no answer, a timeout or a status outside 2xx (409: MDMA
    /// holds this version or a newer one).
    pub async fn put_recovery_envelope(
        &self,
        envelope: &RecoveryEnvelope,
    ) -> Result<(), CallError> {
        self.send_json(RequestMethod::Put, ROUTE, envelope)
            .await
            .map(drop)
    }

    /// `DELETE /api/fleet/recovery-envelope` with `key` as its body (MDMA answers 2xx when
    /// there is no such envelope too).
    ///
    /// Errors: [`CallError`] for no answer, a timeout or a status outside 2xx.
    pub async fn delete_recovery_envelope(&self, key: &RecoveryKey) -> Result<(), CallError> {
        self.send_json(RequestMethod::Delete, ROUTE, key)
            .await
            .map(drop)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_put_body_is_flat_and_the_delete_body_is_the_key() {
        let key = RecoveryKey {
            peer_id: "12D3KooWNXNMakaAKyWpBemRiWWqusgQCrxvwjtJdRQMzLScTJDT"
                .parse()
                .unwrap(),
            account_id: "ab".repeat(32),
            namespace_id: "cd".repeat(32).parse().unwrap(),
        };
        let put = RecoveryEnvelope {
            key: key.clone(),
            ciphertext: r#"{"accountRootEpoch":1}"#.to_owned(),
            version: 3,
        };
        assert_eq!(
            serde_json::to_value(&put).unwrap(),
            json!({"peer_id": "12D3KooWNXNMakaAKyWpBemRiWWqusgQCrxvwjtJdRQMzLScTJDT",
                "account_id": "ab".repeat(32), "namespace_id": "cd".repeat(32),
                "ciphertext": r#"{"accountRootEpoch":1}"#, "version": 3})
        );
        assert_eq!(
            serde_json::to_value(&key).unwrap(),
            json!({"peer_id": "12D3KooWNXNMakaAKyWpBemRiWWqusgQCrxvwjtJdRQMzLScTJDT",
                "account_id": "ab".repeat(32), "namespace_id": "cd".repeat(32)})
        );
    }
}
