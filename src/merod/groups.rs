//! What merod says about a namespace's groups, for the context inventory MDMA keeps of each
//! node: a group's subgroups, contexts, members and one member's capabilities, and the
//! storage every namespace takes (`GET /admin-api/usage`). Lists merod pages (contexts,
//! members) are read whole with [`PageWalk`] at merod's largest page, 1,000 rows, so a long
//! list is never mistaken for a short one.

use std::collections::BTreeMap;

use serde::Serialize;
use serde_json::Value;

use super::paging::{self, PageWalk};
use super::{AnswerFault, MerodClient, MerodError, MerodOp};
use crate::ids::GroupId;

/// Rows asked for per page of a group's contexts or members: merod's largest page.
pub const GROUP_PAGE: usize = 1000;
/// Most pages of a group's contexts or members read for one list (999,001 rows).
pub const GROUP_PAGES: usize = 1000;
/// Longest context id kept (merod's are 32 bytes in base58, at most 44 characters).
const MAX_CONTEXT_ID: usize = 128;

/// One row of a group's member list.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupMember {
    /// `identity`: the member's account, lowercase hex.
    pub identity: String,
    /// `role` as merod names it (`Admin`, `Member`, `ReadOnly`, `ReadOnlyTee`, `RelayTee`).
    pub role: String,
}

/// The storage one namespace takes on the node, in bytes, as `GET /admin-api/usage` counts
/// it (`bytes.state`, `privateState`, `delta`, `governance`, `total`). Serialized in
/// snake_case, as the inventory MDMA keeps has it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct StorageBytes {
    /// Shared context state.
    pub state: u64,
    /// Private context state.
    pub private_state: u64,
    /// Deltas kept for sync.
    pub delta: u64,
    /// Group governance records.
    pub governance: u64,
    /// All of it.
    pub total: u64,
}

/// One row of `GET /admin-api/usage`: the storage a namespace takes and the counts of its
/// tree merod gives beside it (`contextCount`, `memberCount`, `subgroupCount`; `None` when
/// the row has no such whole number, as older cores answer). The counts are what the jobs
/// compare between walks to tell which namespaces changed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct NamespaceUsage {
    /// `bytes`.
    pub bytes: StorageBytes,
    /// `contextCount`.
    pub contexts: Option<u64>,
    /// `memberCount`.
    pub members: Option<u64>,
    /// `subgroupCount`.
    pub subgroups: Option<u64>,
}

impl NamespaceUsage {
    /// A row of `bytes` with no counts.
    pub fn of_bytes(bytes: StorageBytes) -> Self {
        Self {
            bytes,
            ..Self::default()
        }
    }
}

impl MerodClient {
    /// The direct subgroups of `group` (`GET /admin-api/groups/{id}/subgroups`, unpaged:
    /// `{"subgroups": [{"groupId"}]}`, flat or under `data`; `group_id` is read too), in
    /// merod's order, bounded by the check deadline (default 10 s).
    ///
    /// Errors: [`MerodError::Refused`] or [`MerodError::Status`] for a non-2xx,
    /// [`MerodError::Answer`] when there is no `subgroups` array or a row has no 64-hex
    /// id; transport and timeout.
    pub async fn subgroups(&self, group: GroupId) -> Result<Vec<GroupId>, MerodError> {
        let path = format!("admin-api/groups/{group}/subgroups");
        self.get_parsed(MerodOp::Subgroups, &path, parse_subgroups)
            .await
    }

    /// The contexts of `group`: each row's `contextId` of
    /// `GET /admin-api/groups/{id}/contexts?offset=O&limit=1000` (`{"data": [{"contextId"}]}`),
    /// read whole (see the module docs), in merod's order, bounded by the members deadline
    /// (default 20 s) for all pages.
    ///
    /// Errors: [`MerodError::Answer`] when the list cannot be read whole (a page that does
    /// not advance, a shift, more than [`GROUP_PAGES`] pages) or a row has no context id;
    /// non-2xx, transport and timeout as usual.
    pub async fn group_contexts(&self, group: GroupId) -> Result<Vec<String>, MerodError> {
        let op = MerodOp::Contexts;
        let path = format!("admin-api/groups/{group}/contexts");
        self.paged(op, &path, parse_contexts, |id: &String| id.as_str())
            .await
    }

    /// The members of `group`: the rows of
    /// `GET /admin-api/groups/{id}/members?offset=O&limit=1000` (`{"members": [{"identity",
    /// "role"}]}`, flat or under `data`), read whole (see the module docs), bounded by the
    /// members deadline (default 20 s) for all pages.
    ///
    /// Errors: as [`MerodClient::group_contexts`].
    pub async fn group_members(&self, group: GroupId) -> Result<Vec<GroupMember>, MerodError> {
        let op = MerodOp::Members;
        let path = format!("admin-api/groups/{group}/members");
        self.paged(op, &path, parse_member_rows, |m: &GroupMember| {
            m.identity.as_str()
        })
        .await
    }

    /// The capability bits `account` (lowercase hex) holds in `group`
    /// (`GET /admin-api/groups/{id}/members/{account}/capabilities` →
    /// `{"data": {"capabilities": u32}}`), bounded by the check deadline (default 10 s).
    /// merod answers only for an effective member.
    ///
    /// Errors: [`MerodError::Refused`] or [`MerodError::Status`] for a non-2xx (a
    /// non-member), [`MerodError::Answer`] without a `u32` `capabilities`; transport and
    /// timeout.
    pub async fn member_capabilities(
        &self,
        group: GroupId,
        account: &str,
    ) -> Result<u32, MerodError> {
        let op = MerodOp::Capabilities;
        let account = account.to_ascii_lowercase();
        if account.is_empty() || !account.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(MerodError::Answer {
                op,
                url: self
                    .url(&format!("admin-api/groups/{group}/members"))
                    .to_string(),
                reason: format!("the account {account:?} is not hex"),
            });
        }
        let path = format!("admin-api/groups/{group}/members/{account}/capabilities");
        self.get_parsed(op, &path, |body| {
            inner(body)
                .get("capabilities")
                .and_then(Value::as_u64)
                .and_then(|c| u32::try_from(c).ok())
                .ok_or(AnswerFault::Shape("no u32 `capabilities`"))
        })
        .await
    }

    /// The storage of every namespace merod holds (`GET /admin-api/usage` →
    /// `{"namespaces": [{"namespaceId", "bytes": {"state", "privateState", "delta",
    /// "governance", "total"}}]}`, flat or under `data`), by namespace, bounded by the check
    /// deadline (default 10 s). A row without a 64-hex id or any of the five counts is
    /// left out. [`MerodClient::namespace_usage`] gives the tree's counts beside it.
    ///
    /// Errors: [`MerodError::Refused`] or [`MerodError::Status`] for a non-2xx,
    /// [`MerodError::Answer`] without a `namespaces` array; transport and timeout.
    pub async fn usage(&self) -> Result<BTreeMap<GroupId, StorageBytes>, MerodError> {
        let rows = self.namespace_usage().await?;
        Ok(rows.into_iter().map(|(id, row)| (id, row.bytes)).collect())
    }

    /// Every row of `GET /admin-api/usage` (see [`MerodClient::usage`]) with the counts of
    /// the namespace's tree beside its storage ([`NamespaceUsage`]), by namespace, in one
    /// call bounded by the check deadline (default 10 s).
    ///
    /// Errors: as [`MerodClient::usage`].
    pub async fn namespace_usage(&self) -> Result<BTreeMap<GroupId, NamespaceUsage>, MerodError> {
        let (op, path) = (MerodOp::Usage, "admin-api/usage");
        let url = self.url(path);
        self.bounded(op, path, self.deadlines.check, async {
            let req = self.connection.client.get(url.clone());
            let bytes = match self.send_raw(op, &url, req).await? {
                Ok(bytes) => bytes,
                Err(answer) => return Err(Self::refused(op, &url, &answer)),
            };
            usage::parse(&bytes).map_err(|reason| MerodError::Answer {
                op,
                url: url.to_string(),
                reason: reason.to_string(),
            })
        })
        .await
    }

    /// `GET path`, its 2xx body read by `parse`, within the check deadline.
    pub(super) async fn get_parsed<T>(
        &self,
        op: MerodOp,
        path: &str,
        parse: impl FnOnce(&Value) -> Result<T, AnswerFault>,
    ) -> Result<T, MerodError> {
        let url = self.url(path);
        self.bounded(op, path, self.deadlines.check, async {
            let answer = self
                .send(op, &url, self.connection.client.get(url.clone()))
                .await?;
            if !(200..300).contains(&answer.status) {
                return Err(Self::refused(op, &url, &answer));
            }
            // A body that is not JSON reads as `null`: say why it was not read instead.
            parse(&answer.body).map_err(|reason| MerodError::Answer {
                op,
                url: url.to_string(),
                reason: answer
                    .unreadable
                    .clone()
                    .unwrap_or_else(|| reason.to_string()),
            })
        })
        .await
    }

    /// Reads the offset-paged list at `path` whole ([`GROUP_PAGE`] rows a page, at most
    /// [`GROUP_PAGES`]; see [`MerodClient::paged_until`]).
    pub(super) async fn paged<T>(
        &self,
        op: MerodOp,
        path: &str,
        parse: impl Fn(&Value) -> Result<Vec<T>, AnswerFault>,
        key: impl Fn(&T) -> &str,
    ) -> Result<Vec<T>, MerodError> {
        self.paged_until(op, path, (GROUP_PAGE, GROUP_PAGES), parse, key, |_| false)
            .await
    }

    /// Reads the offset-paged list at `path` with [`PageWalk`] (`(page size, most pages)`),
    /// each page's rows from `parse`, each row keyed by `key` for the overlap check, within
    /// the members deadline: whole, or up to the first page after which `enough` (given
    /// the rows so far) holds. Every paged read of merod goes through here.
    pub(super) async fn paged_until<T>(
        &self,
        op: MerodOp,
        path: &str,
        (page_size, max_pages): (usize, usize),
        parse: impl Fn(&Value) -> Result<Vec<T>, AnswerFault>,
        key: impl Fn(&T) -> &str,
        enough: impl Fn(&[T]) -> bool,
    ) -> Result<Vec<T>, MerodError> {
        let base = self.url(path);
        let fault = |fault: paging::PageFault| MerodError::Answer {
            op,
            url: base.to_string(),
            reason: fault.to_string(),
        };
        self.bounded(op, path, self.deadlines.members, async {
            let mut walk = PageWalk::new(page_size, max_pages);
            let mut rows = Vec::new();
            loop {
                let offset = walk.next_page().map_err(fault)?;
                let mut url = base.clone();
                url.query_pairs_mut()
                    .append_pair("offset", &offset.to_string())
                    .append_pair("limit", &walk.size().to_string());
                let answer = self
                    .send(op, &base, self.connection.client.get(url))
                    .await?;
                if !(200..300).contains(&answer.status) {
                    return Err(Self::refused(op, &base, &answer));
                }
                let page = parse(&answer.body).map_err(|reason| MerodError::Answer {
                    op,
                    url: base.to_string(),
                    reason: reason.to_string(),
                })?;
                let step = walk.page(page.iter().map(&key)).map_err(fault)?;
                // After the first page, the first row is the anchor, read already.
                let anchor = usize::from(offset > 0);
                rows.extend(page.into_iter().skip(anchor));
                if step == paging::Step::Done || enough(&rows) {
                    return Ok(rows);
                }
            }
        })
        .await
    }
}

/// `data` when it is an object, else the body: merod answers some lists flat and some
/// wrapped, and versions differ.
pub(super) fn inner(body: &Value) -> &Value {
    match body.get("data") {
        Some(d) if d.is_object() => d,
        _ => body,
    }
}

/// The rows of a members page (see [`super::parse_members`]).
pub(super) fn parse_member_rows(body: &Value) -> Result<Vec<GroupMember>, AnswerFault> {
    super::parse_members(body).map(|rows| {
        rows.into_iter()
            .map(|(identity, role)| GroupMember { identity, role })
            .collect()
    })
}

fn parse_subgroups(body: &Value) -> Result<Vec<GroupId>, AnswerFault> {
    let rows = inner(body)
        .get("subgroups")
        .and_then(Value::as_array)
        .ok_or(AnswerFault::Shape("no subgroups array"))?;
    rows.iter()
        .map(|row| {
            let id = row
                .get("groupId")
                .or_else(|| row.get("group_id"))
                .and_then(Value::as_str)
                .ok_or(AnswerFault::Shape(
                    "a subgroup row without a string groupId",
                ))?;
            id.parse().map_err(|source| AnswerFault::BadGroupId {
                what: "subgroup groupId",
                value: id.to_owned(),
                source,
            })
        })
        .collect()
}

fn parse_contexts(body: &Value) -> Result<Vec<String>, AnswerFault> {
    let rows = body
        .get("data")
        .and_then(Value::as_array)
        .ok_or(AnswerFault::Shape("no data array"))?;
    rows.iter()
        .map(|row| {
            let id = row
                .get("contextId")
                .or_else(|| row.get("context_id"))
                .and_then(Value::as_str)
                .ok_or(AnswerFault::Shape(
                    "a context row without a string contextId",
                ))?;
            let fine = !id.is_empty()
                && id.len() <= MAX_CONTEXT_ID
                && id.bytes().all(|b| b.is_ascii_alphanumeric());
            if fine {
                Ok(id.to_owned())
            } else {
                Err(AnswerFault::BadContextId(id.to_owned()))
            }
        })
        .collect()
}

/// `GET /admin-api/usage` read row by row: at 10,000 namespaces a `serde_json::Value` of it
/// is about 16 MB of small blocks, which the heap then keeps resident; here only one row is
/// built at a time.
mod usage {
    use std::collections::BTreeMap;
    use std::fmt;

    use serde::de::{self, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
    use serde::Deserialize;
    use serde_json::Value;

    use super::{AnswerFault, NamespaceUsage, StorageBytes};
    use crate::ids::GroupId;

    /// The storage of each namespace in `body` (`{"data": {"namespaces": [...]}}`, or the
    /// rows at the top level when `data` is not an object); rows missing an id or a count
    /// are left out.
    ///
    /// Errors: why it is not such an answer (not JSON, a repeated key, no `namespaces`
    /// array).
    pub(super) fn parse(body: &[u8]) -> Result<BTreeMap<GroupId, NamespaceUsage>, AnswerFault> {
        crate::strict_json::reject_duplicate_keys(body)?;
        let doc: Doc = serde_json::from_slice(body)?;
        let rows = match doc.data {
            Some(Object(Some(Inner { namespaces }))) => namespaces,
            _ => doc.namespaces,
        };
        match rows {
            Some(Rows(Some(rows))) => Ok(rows),
            _ => Err(AnswerFault::Shape("no namespaces array")),
        }
    }

    #[derive(Deserialize)]
    struct Doc {
        #[serde(default)]
        data: Option<Object<Inner>>,
        #[serde(default)]
        namespaces: Option<Rows>,
    }

    #[derive(Deserialize)]
    struct Inner {
        #[serde(default)]
        namespaces: Option<Rows>,
    }

    /// A value that is `T` when it is an object (`None` for any other value, read and
    /// dropped).
    struct Object<T>(Option<T>);

    impl<'de, T: Deserialize<'de>> Deserialize<'de> for Object<T> {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            d.deserialize_any(ObjectVisitor(std::marker::PhantomData))
        }
    }

    struct ObjectVisitor<T>(std::marker::PhantomData<T>);

    impl<'de, T: Deserialize<'de>> Visitor<'de> for ObjectVisitor<T> {
        type Value = Object<T>;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("any JSON value")
        }
        fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Object<T>, A::Error> {
            T::deserialize(de::value::MapAccessDeserializer::new(map)).map(|t| Object(Some(t)))
        }
        fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Object<T>, A::Error> {
            IgnoredAny.visit_seq(seq).map(|_| Object(None))
        }
        fn visit_bool<E>(self, _: bool) -> Result<Object<T>, E> {
            Ok(Object(None))
        }
        fn visit_i64<E>(self, _: i64) -> Result<Object<T>, E> {
            Ok(Object(None))
        }
        fn visit_u64<E>(self, _: u64) -> Result<Object<T>, E> {
            Ok(Object(None))
        }
        fn visit_f64<E>(self, _: f64) -> Result<Object<T>, E> {
            Ok(Object(None))
        }
        fn visit_str<E>(self, _: &str) -> Result<Object<T>, E> {
            Ok(Object(None))
        }
        fn visit_unit<E>(self) -> Result<Object<T>, E> {
            Ok(Object(None))
        }
    }

    /// `namespaces`: the rows read one at a time into the map when it is an array (`None`
    /// for any other value).
    struct Rows(Option<BTreeMap<GroupId, NamespaceUsage>>);

    impl<'de> Deserialize<'de> for Rows {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            d.deserialize_any(RowsVisitor)
        }
    }

    struct RowsVisitor;

    impl<'de> Visitor<'de> for RowsVisitor {
        type Value = Rows;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("any JSON value")
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Rows, A::Error> {
            let mut out = BTreeMap::new();
            // Each row is small: built, read and dropped before the next.
            while let Some(row) = seq.next_element::<Value>()? {
                if let Some((id, usage)) = row_of(&row) {
                    out.insert(id, usage);
                }
            }
            Ok(Rows(Some(out)))
        }
        fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Rows, A::Error> {
            IgnoredAny.visit_map(map).map(|_| Rows(None))
        }
        fn visit_bool<E>(self, _: bool) -> Result<Rows, E> {
            Ok(Rows(None))
        }
        fn visit_i64<E>(self, _: i64) -> Result<Rows, E> {
            Ok(Rows(None))
        }
        fn visit_u64<E>(self, _: u64) -> Result<Rows, E> {
            Ok(Rows(None))
        }
        fn visit_f64<E>(self, _: f64) -> Result<Rows, E> {
            Ok(Rows(None))
        }
        fn visit_str<E>(self, _: &str) -> Result<Rows, E> {
            Ok(Rows(None))
        }
        fn visit_unit<E>(self) -> Result<Rows, E> {
            Ok(Rows(None))
        }
    }

    /// One row: its namespace, its five byte counts (`None` when one is missing) and the
    /// tree's counts it has.
    fn row_of(row: &Value) -> Option<(GroupId, NamespaceUsage)> {
        let id = row.get("namespaceId")?.as_str()?.parse::<GroupId>().ok()?;
        let bytes = row.get("bytes")?;
        let count = |name: &str| bytes.get(name).and_then(Value::as_u64);
        let tree = |name: &str| row.get(name).and_then(Value::as_u64);
        Some((
            id,
            NamespaceUsage {
                bytes: StorageBytes {
                    state: count("state")?,
                    private_state: count("privateState")?,
                    delta: count("delta")?,
                    governance: count("governance")?,
                    total: count("total")?,
                },
                contexts: tree("contextCount"),
                members: tree("memberCount"),
                subgroups: tree("subgroupCount"),
            },
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const G: &str = "9268b01003bdd5a5bbcf7d63a37935a5a86b59efbe8fed02a0f306b9643754d1";

    #[test]
    fn subgroups_are_read_by_either_spelling_flat_or_wrapped_and_must_be_ids() {
        let upper = G.to_ascii_uppercase();
        let flat = json!({"subgroups": [{"groupId": upper, "name": "x"}, {"group_id": G}]});
        let ids = parse_subgroups(&flat).unwrap();
        assert_eq!(ids.len(), 2);
        assert!(ids.iter().all(|g| g.to_string() == G));
        assert_eq!(parse_subgroups(&json!({"data": flat})).unwrap(), ids);
        assert!(parse_subgroups(&json!({"subgroups": [{"groupId": "x"}]})).is_err());
        assert!(parse_subgroups(&json!({"data": []})).is_err());
    }

    #[test]
    fn contexts_are_ids_from_data_and_anything_else_fails_the_page() {
        let page = json!({"data": [{"contextId": "7Vj9sTq2", "name": "a"}, {"context_id": "b"}]});
        assert_eq!(parse_contexts(&page).unwrap(), ["7Vj9sTq2", "b"]);
        for bad in [
            json!({"data": [{"contextId": ""}]}),
            json!({"data": [{"contextId": "a/../b"}]}),
            json!({"data": [{"name": "a"}]}),
            json!({"contexts": []}),
        ] {
            assert!(parse_contexts(&bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn usage_rows_missing_a_count_or_an_id_are_left_out() {
        let bytes =
            json!({"state": 1, "privateState": 2, "delta": 3, "governance": 4, "total": 10});
        let body = json!({"namespaces": [
            {"namespaceId": G, "contextCount": 1, "bytes": bytes},
            {"namespaceId": "ab".repeat(32), "bytes": {"state": 1}},
            {"namespaceId": "nope", "bytes": bytes},
        ]});
        let usage = usage::parse(body.to_string().as_bytes()).unwrap();
        assert_eq!(usage.len(), 1);
        let row = usage[&G.parse::<GroupId>().unwrap()];
        // The tree's counts it has; those it lacks are unknown, not zero.
        assert_eq!(
            (row.contexts, row.members, row.subgroups),
            (Some(1), None, None)
        );
        let got = row.bytes;
        assert_eq!(
            got,
            StorageBytes {
                state: 1,
                private_state: 2,
                delta: 3,
                governance: 4,
                total: 10
            }
        );
        assert_eq!(
            serde_json::to_value(got).unwrap(),
            json!({"state": 1, "private_state": 2, "delta": 3, "governance": 4, "total": 10})
        );
        // Wrapped in `data`, or at the top level when `data` is not an object.
        let wrapped = json!({"data": body.clone()}).to_string();
        assert_eq!(usage::parse(wrapped.as_bytes()).unwrap(), usage);
        let beside = json!({"data": [1], "namespaces": body["namespaces"]}).to_string();
        assert_eq!(usage::parse(beside.as_bytes()).unwrap(), usage);
        for bad in [
            json!({"data": []}).to_string(),
            json!({"data": {"rows": []}, "namespaces": body["namespaces"]}).to_string(),
            json!({"namespaces": {"a": 1}}).to_string(),
            json!([1]).to_string(),
            r#"{"namespaces": [], "namespaces": []}"#.to_owned(),
            "not json".to_owned(),
        ] {
            assert!(usage::parse(bad.as_bytes()).is_err(), "{bad}");
        }
    }
}
