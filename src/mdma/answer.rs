//! The `should-join` body read in one pass, straight into the id sets: every key is
//! checked for repeats as it is read (borrowed from the body, so no `String` per key), each
//! `group_id` is decoded from the body into a [`GroupId`] (no `String` per id), and the
//! fields the sidecar ignores are walked for repeated keys without being built.
//!
//! An assignment's `admitter_addrs` are only needed to join it: for the namespaces the caller
//! says it has joined they are checked and dropped, borrowed from the body, never copied.
//!
//! It accepts exactly what the strict two-step reading accepts (no repeated key at any
//! depth, then the typed shape), except that it also insists on JSON objects where the
//! contract (docs/mdma.md) names objects: serde's derived readers would take an array in
//! field order for the answer or an entry; this reader refuses it.

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::sync::Arc;

use serde::de::{self, Deserialize, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};

use crate::ids::GroupId;
use crate::strict_json::{Key, NoDuplicates, SeenKeys};

/// What [`read`] gives.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct Read {
    pub(super) assignments: BTreeSet<GroupId>,
    pub(super) retain: BTreeSet<GroupId>,
    pub(super) admitter_addrs: BTreeMap<GroupId, Arc<[String]>>,
    /// `tls_certificate`, when a non-empty string.
    pub(super) tls_certificate: Option<String>,
    /// `logs_token`, when a non-empty string.
    pub(super) logs_token: Option<String>,
}

/// Reads one `should-join` document from `body` into `(assignments, retain,
/// admitter_addrs)`; the addresses of the assignments in `joined` are checked and not kept.
///
/// Errors: serde_json's error for the first fault (syntax, a repeated key, the wrong
/// shape, trailing data); the caller tells these kinds apart.
pub(super) fn read(
    body: &[u8],
    joined: Option<&BTreeSet<GroupId>>,
) -> Result<Read, serde_json::Error> {
    let mut de = serde_json::Deserializer::from_slice(body);
    // Room for as many entries as the body can hold (the shortest one,
    // `{"group_id":"<64 hex>"},`, is 80 bytes): the list is not regrown and copied.
    let sets = de.deserialize_map(Answer {
        entries: body.len() / 80,
        joined,
    })?;
    de.end()?;
    Ok(sets)
}

/// The top-level object: `assignments` (required), `retain`, `tls_certificate`, `logs_token`
/// (optional), anything else.
struct Answer<'j> {
    /// The most `assignments` entries the body can hold.
    entries: usize,
    /// The assignments whose addresses are not kept.
    joined: Option<&'j BTreeSet<GroupId>>,
}

impl<'de> Visitor<'de> for Answer<'_> {
    type Value = Read;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an object with an `assignments` array")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut seen = SeenKeys::default();
        let mut assignments = None;
        let mut retain = None;
        let mut tls_certificate = None;
        let mut logs_token = None;
        while let Some(key) = map.next_key_seed(Key)? {
            let field = match &*key {
                "assignments" => Field::Assignments,
                "retain" => Field::Retain,
                "tls_certificate" => Field::TlsCertificate,
                "logs_token" => Field::LogsToken,
                _ => Field::Other,
            };
            seen.insert(key)?;
            match field {
                Field::Assignments => {
                    assignments =
                        Some(map.next_value_seed(Ids(Entries(self.joined), self.entries))?)
                }
                Field::Retain => retain = Some(map.next_value_seed(Ids(Bare, 0))?),
                Field::TlsCertificate => tls_certificate = map.next_value_seed(Text)?,
                Field::LogsToken => logs_token = map.next_value_seed(Text)?,
                Field::Other => map.next_value_seed(NoDuplicates)?,
            }
        }
        let (assignments, admitter_addrs) =
            assignments.ok_or_else(|| de::Error::missing_field("assignments"))?;
        let retain = retain.map(|(ids, _)| ids).unwrap_or_default();
        Ok(Read {
            assignments,
            retain,
            admitter_addrs,
            tls_certificate,
            logs_token,
        })
    }
}

/// The fields of the answer the sidecar reads.
enum Field {
    Assignments,
    Retain,
    TlsCertificate,
    LogsToken,
    Other,
}

/// A delivered item (`tls_certificate`, `logs_token`): used only when it is a non-empty
/// string. Any other value is no delivery, not a malformed answer (it is still walked for
/// repeated keys, as every ignored value is).
#[derive(Clone, Copy)]
struct Text;

impl<'de> DeserializeSeed<'de> for Text {
    type Value = Option<String>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Option<String>, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Text {
    type Value = Option<String>;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_str<E>(self, v: &str) -> Result<Option<String>, E> {
        Ok((!v.is_empty()).then(|| v.to_owned()))
    }
    fn visit_bool<E>(self, _: bool) -> Result<Option<String>, E> {
        Ok(None)
    }
    fn visit_i64<E>(self, _: i64) -> Result<Option<String>, E> {
        Ok(None)
    }
    fn visit_u64<E>(self, _: u64) -> Result<Option<String>, E> {
        Ok(None)
    }
    fn visit_f64<E>(self, _: f64) -> Result<Option<String>, E> {
        Ok(None)
    }
    fn visit_unit<E>(self) -> Result<Option<String>, E> {
        Ok(None)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Option<String>, A::Error> {
        NoDuplicates.visit_seq(seq).map(|()| None)
    }
    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Option<String>, A::Error> {
        NoDuplicates.visit_map(map).map(|()| None)
    }
}

/// One element of an id array as read: its id, and for an `assignments` entry the admitter
/// addresses kept for it, if any; `None` past the array's end.
type Next = Option<(GroupId, Option<Arc<[String]>>)>;

/// How one element of an id array is written.
trait Element: Copy {
    /// Reads the next element; `keys` is scratch space reused across elements.
    fn next<'de, A: SeqAccess<'de>>(
        self,
        seq: &mut A,
        keys: &mut SeenKeys<'de>,
    ) -> Result<Next, A::Error>;
}

/// `retain`: an array of 64-hex strings.
#[derive(Clone, Copy)]
struct Bare;

impl Element for Bare {
    fn next<'de, A: SeqAccess<'de>>(
        self,
        seq: &mut A,
        _: &mut SeenKeys<'de>,
    ) -> Result<Next, A::Error> {
        Ok(seq.next_element::<GroupId>()?.map(|id| (id, None)))
    }
}

/// `assignments`: an array of objects, each with a 64-hex `group_id` and maybe
/// `admitter_addrs` (not kept for the namespaces it holds).
#[derive(Clone, Copy)]
struct Entries<'j>(Option<&'j BTreeSet<GroupId>>);

impl Element for Entries<'_> {
    fn next<'de, A: SeqAccess<'de>>(
        self,
        seq: &mut A,
        keys: &mut SeenKeys<'de>,
    ) -> Result<Next, A::Error> {
        let Some((id, listed)) = seq.next_element_seed(Entry { keys })? else {
            return Ok(None);
        };
        let kept = match self.0 {
            Some(joined) if joined.contains(&id) => Arc::default(),
            _ => super::keep_admitter_addrs(listed.unwrap_or_default()),
        };
        Ok(Some((id, (!kept.is_empty()).then_some(kept))))
    }
}

/// An array of ids, collected into a set; the number is the room to make at first.
struct Ids<E>(E, usize);

impl<'de, E: Element> DeserializeSeed<'de> for Ids<E> {
    type Value = (BTreeSet<GroupId>, BTreeMap<GroupId, Arc<[String]>>);
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de, E: Element> Visitor<'de> for Ids<E> {
    type Value = (BTreeSet<GroupId>, BTreeMap<GroupId, Arc<[String]>>);
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an array of namespace ids")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut keys = SeenKeys::default();
        let mut ids = Vec::with_capacity(self.1);
        let mut addrs = BTreeMap::new();
        while let Some((id, kept)) = self.0.next(&mut seq, &mut keys)? {
            ids.push(id);
            // A repeated entry's addresses are its last ones (as the two-step reading does).
            match kept {
                Some(kept) => {
                    addrs.insert(id, kept);
                }
                None if !addrs.is_empty() => {
                    addrs.remove(&id);
                }
                None => {}
            }
        }
        // Sorted and built in bulk (an answer in id order is already sorted).
        Ok((ids.into_iter().collect(), addrs))
    }
}

/// One `assignments` entry: its `group_id` and `admitter_addrs` (`null` or an array of
/// strings); other keys are checked and ignored.
struct Entry<'k, 'de> {
    keys: &'k mut SeenKeys<'de>,
}

/// An entry as read: its id and its `admitter_addrs`, if given (borrowed from the body
/// unless escaped).
type EntryRead<'de> = (GroupId, Option<Vec<Addr<'de>>>);

impl<'de> DeserializeSeed<'de> for Entry<'_, 'de> {
    type Value = EntryRead<'de>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<EntryRead<'de>, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for Entry<'_, 'de> {
    type Value = EntryRead<'de>;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an assignment object with a `group_id`")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<EntryRead<'de>, A::Error> {
        self.keys.clear();
        let mut group_id = None;
        let mut addrs = None;
        while let Some(key) = map.next_key_seed(Key)? {
            let field = match &*key {
                "group_id" => 1,
                "admitter_addrs" => 2,
                _ => 0,
            };
            self.keys.insert(key)?;
            match field {
                1 => group_id = Some(map.next_value::<GroupId>()?),
                2 => addrs = map.next_value::<Option<Vec<Addr<'de>>>>()?,
                _ => map.next_value_seed(NoDuplicates)?,
            }
        }
        let id = group_id.ok_or_else(|| de::Error::missing_field("group_id"))?;
        Ok((id, addrs))
    }
}

/// One string of `admitter_addrs`, borrowed from the body when it holds no escape.
pub(super) struct Addr<'de>(Cow<'de, str>);

impl AsRef<str> for Addr<'_> {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl From<Addr<'_>> for String {
    fn from(a: Addr<'_>) -> String {
        a.0.into_owned()
    }
}

impl<'de> Deserialize<'de> for Addr<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_str(AddrVisitor)
    }
}

struct AddrVisitor;

impl<'de> Visitor<'de> for AddrVisitor {
    type Value = Addr<'de>;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a string")
    }
    fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Addr<'de>, E> {
        Ok(Addr(Cow::Borrowed(v)))
    }
    fn visit_str<E>(self, v: &str) -> Result<Addr<'de>, E> {
        Ok(Addr(Cow::Owned(v.to_owned())))
    }
}
