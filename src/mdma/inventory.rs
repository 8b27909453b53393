//! The context inventory MDMA keeps of each node (`POST /api/fleet/inventory`): per namespace
//! the node holds, its groups with their contexts, whether the node can author in each, its
//! role, member and context counts and storage bytes.

use serde::{Deserialize, Serialize};

use super::{CallError, MdmaClient};
use crate::ids::{GroupId, PeerId};
use crate::merod::{StorageBytes, TeeRole};

/// One group of a namespace's tree (the namespace itself included) that holds contexts.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupInventory {
    /// `group_id`: 64 lowercase hex.
    pub group_id: GroupId,
    /// `context_ids`: the group's contexts as merod names them, sorted, each once.
    pub context_ids: Vec<String>,
    /// `authorship_ready`: the node is `RelayTee` in the namespace and merod answered its
    /// capabilities in this group (so it can author there).
    pub authorship_ready: bool,
}

/// What the node holds of one namespace, as MDMA keeps it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NamespaceInventory {
    /// `namespace_id`: 64 lowercase hex.
    pub namespace_id: GroupId,
    /// `groups`: the groups with at least one context, in walk order (breadth-first from the
    /// namespace).
    pub groups: Vec<GroupInventory>,
    /// `member_count`: rows of the namespace's member list; left out when it could not be
    /// read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub member_count: Option<u64>,
    /// `tee_role`: left out when the role could not be read (`None`); `null` when read and the
    /// node has no TEE role (`Some(None)`).
    #[serde(default, skip_serializing_if = "Option::is_none", with = "read_role")]
    pub tee_role: Option<Option<TeeRole>>,
    /// `context_count`: the distinct contexts, only when the tree was read whole.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context_count: Option<u64>,
    /// `bytes`: the namespace's storage from merod's usage; left out when unknown.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes: Option<StorageBytes>,
}

impl NamespaceInventory {
    /// Whether `self` and `other` say the same but for `bytes` (storage moves all the time:
    /// a change of bytes alone is not worth a report).
    pub fn same_but_bytes(&self, other: &Self) -> bool {
        // Field by field, not through copies with `bytes` cleared: a scan compares every
        // namespace the node holds with what was posted.
        let Self {
            namespace_id,
            groups,
            member_count,
            tee_role,
            context_count,
            bytes: _,
        } = self;
        *namespace_id == other.namespace_id
            && *groups == other.groups
            && *member_count == other.member_count
            && *tee_role == other.tee_role
            && *context_count == other.context_count
    }
}

/// `tee_role` as a field that can be absent, `null` or a role.
mod read_role {
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    use crate::merod::TeeRole;

    pub(super) fn serialize<S: Serializer>(
        role: &Option<Option<TeeRole>>,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        // Only called when present (`skip_serializing_if`).
        role.flatten().serialize(s)
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<Option<Option<TeeRole>>, D::Error> {
        Option::<TeeRole>::deserialize(d).map(Some)
    }
}

/// The body of `POST /api/fleet/inventory`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct InventoryReport {
    /// `peer_id`: the node.
    pub peer_id: PeerId,
    /// `namespaces`: what is reported.
    pub namespaces: Vec<NamespaceInventory>,
    /// `full`: `true` when these are all the namespaces the node holds whole (MDMA drops the
    /// rest of its copy); `false` adds or replaces only these (a partial read, or between
    /// full reports).
    pub full: bool,
}

impl MdmaClient {
    /// `POST /api/fleet/inventory` with `report`, through [`MdmaClient::post_json`] (the
    /// fleet token, the request timeout, the answer capped).
    ///
    /// Errors: [`CallError`] for no answer, a timeout, a status outside 2xx or an oversized
    /// answer.
    pub async fn report_inventory(&self, report: &InventoryReport) -> Result<(), CallError> {
        self.post_json("api/fleet/inventory", report)
            .await
            .map(drop)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn ns(role: Option<Option<TeeRole>>) -> NamespaceInventory {
        NamespaceInventory {
            namespace_id: "ab".repeat(32).parse().unwrap(),
            groups: vec![GroupInventory {
                group_id: "ab".repeat(32).parse().unwrap(),
                context_ids: vec!["c1".to_owned()],
                authorship_ready: false,
            }],
            member_count: None,
            tee_role: role,
            context_count: None,
            bytes: None,
        }
    }

    #[test]
    fn tee_role_is_absent_when_unread_null_when_none_and_named_otherwise() {
        let unread = serde_json::to_value(ns(None)).unwrap();
        assert!(unread.get("tee_role").is_none(), "{unread}");
        assert!(unread.get("member_count").is_none());
        assert!(unread.get("bytes").is_none());
        let none = serde_json::to_value(ns(Some(None))).unwrap();
        assert_eq!(none["tee_role"], json!(null));
        let relay = serde_json::to_value(ns(Some(Some(TeeRole::RelayTee)))).unwrap();
        assert_eq!(relay["tee_role"], json!("RelayTee"));
        assert_eq!(
            relay["groups"],
            json!([{"group_id": "ab".repeat(32), "context_ids": ["c1"], "authorship_ready": false}])
        );
        for value in [unread, none, relay] {
            let back: NamespaceInventory = serde_json::from_value(value.clone()).unwrap();
            assert_eq!(serde_json::to_value(back).unwrap(), value);
        }
    }

    #[test]
    fn bytes_alone_is_no_difference() {
        let a = ns(None);
        let mut b = a.clone();
        b.bytes = Some(StorageBytes {
            total: 7,
            ..StorageBytes::default()
        });
        assert!(a.same_but_bytes(&b));
        b.member_count = Some(2);
        assert!(!a.same_but_bytes(&b));
    }
}
