//! JSON from outside (MDMA, merod, the state file) read so that an ambiguous document fails
//! closed: an object naming the same key twice, at any depth and in fields the sidecar
//! ignores too, is an error rather than "the last one wins" (serde_json's default, and what
//! `#[derive(Deserialize)]` does for unknown fields). Keys are compared after unescaping, so
//! `"group_id"` and `"group\u005fid"` are the same key.

use std::borrow::Cow;
use std::collections::HashSet;
use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use serde_json::{Map, Number, Value};

/// Checks that no object in `bytes` (one JSON document) repeats a key, without building the
/// document. Errors: serde_json's error (`duplicate key "…"` with line and column), or a
/// syntax error.
pub(crate) fn reject_duplicate_keys(bytes: &[u8]) -> Result<(), serde_json::Error> {
    let mut de = serde_json::Deserializer::from_slice(bytes);
    NoDuplicates.deserialize(&mut de)?;
    de.end()
}

/// Reads `bytes` as a `T` after [`reject_duplicate_keys`]: an ambiguous document is an
/// error. Errors: serde_json's error (a repeated key, syntax, or the wrong shape).
pub(crate) fn from_slice<T: serde::de::DeserializeOwned>(
    bytes: &[u8],
) -> Result<T, serde_json::Error> {
    reject_duplicate_keys(bytes)?;
    serde_json::from_slice(bytes)
}

/// Walks any JSON value without building it, failing on a repeated key (also used by the
/// typed readers for the fields they ignore).
#[derive(Clone, Copy)]
pub(crate) struct NoDuplicates;

impl<'de> DeserializeSeed<'de> for NoDuplicates {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for NoDuplicates {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_bool<E>(self, _: bool) -> Result<(), E> {
        Ok(())
    }
    fn visit_i64<E>(self, _: i64) -> Result<(), E> {
        Ok(())
    }
    fn visit_u64<E>(self, _: u64) -> Result<(), E> {
        Ok(())
    }
    fn visit_f64<E>(self, _: f64) -> Result<(), E> {
        Ok(())
    }
    fn visit_str<E>(self, _: &str) -> Result<(), E> {
        Ok(())
    }
    fn visit_unit<E>(self) -> Result<(), E> {
        Ok(())
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while seq.next_element_seed(self)?.is_some() {}
        Ok(())
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let mut seen = SeenKeys::default();
        while let Some(key) = map.next_key_seed(Key)? {
            seen.insert(key)?;
            map.next_value_seed(self)?;
        }
        Ok(())
    }
}

/// An object key after unescaping: borrowed from the document when it holds no escape,
/// so reading a key allocates nothing in the common case.
#[derive(Clone, Copy)]
pub(crate) struct Key;

impl<'de> DeserializeSeed<'de> for Key {
    type Value = Cow<'de, str>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Cow<'de, str>, D::Error> {
        d.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for Key {
    type Value = Cow<'de, str>;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an object key")
    }
    fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Cow<'de, str>, E> {
        Ok(Cow::Borrowed(v))
    }
    fn visit_str<E>(self, v: &str) -> Result<Cow<'de, str>, E> {
        Ok(Cow::Owned(v.to_owned()))
    }
    fn visit_string<E>(self, v: String) -> Result<Cow<'de, str>, E> {
        Ok(Cow::Owned(v))
    }
}

/// The keys of one object seen so far, compared after unescaping. A few keys are kept in a
/// list (no hashing, and no allocation until the first key); past [`SeenKeys::LINEAR`] they
/// move to a hash set, so an object with very many keys stays linear in time.
#[derive(Default)]
pub(crate) struct SeenKeys<'de> {
    few: Vec<Cow<'de, str>>,
    many: HashSet<Cow<'de, str>>,
}

impl<'de> SeenKeys<'de> {
    /// Keys kept in the list before the hash set takes over.
    const LINEAR: usize = 16;

    /// Forgets every key (the next object starts empty), keeping the memory for reuse.
    pub(crate) fn clear(&mut self) {
        self.few.clear();
        self.many.clear();
    }

    /// Records `key`. Errors: `duplicate key "…"` when this object named it before.
    pub(crate) fn insert<E: de::Error>(&mut self, key: Cow<'de, str>) -> Result<(), E> {
        let repeated = if self.many.is_empty() && self.few.len() < Self::LINEAR {
            self.few.contains(&key)
        } else {
            if self.many.is_empty() {
                self.many.extend(self.few.drain(..));
            }
            self.many.contains(&key)
        };
        if repeated {
            return Err(E::custom(format!("duplicate key {key:?}")));
        }
        if self.many.is_empty() {
            self.few.push(key);
        } else {
            self.many.insert(key);
        }
        Ok(())
    }
}

/// A `serde_json::Value` that refused to be built from an object repeating a key (for
/// answers read through calimero-client, which deserializes the body itself).
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct StrictValue(pub Value);

impl<'de> Deserialize<'de> for StrictValue {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(BuildStrict).map(StrictValue)
    }
}

struct BuildStrict;

impl<'de> Visitor<'de> for BuildStrict {
    type Value = Value;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::Number(v.into()))
    }
    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::Number(v.into()))
    }
    fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
        Ok(Number::from_f64(v).map_or(Value::Null, Value::Number))
    }
    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_owned()))
    }
    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }
    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_none<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        StrictValue::deserialize(d).map(|v| v.0)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut out = Vec::new();
        while let Some(StrictValue(v)) = seq.next_element()? {
            out.push(v);
        }
        Ok(Value::Array(out))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut out = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            let StrictValue(v) = map.next_value()?;
            if out.contains_key(&key) {
                return Err(de::Error::custom(format!("duplicate key {key:?}")));
            }
            out.insert(key, v);
        }
        Ok(Value::Object(out))
    }
}

/// A non-negative whole number as another backend may write it: a JSON integer, or a float
/// with no fractional part (`1733150000000.0`, as Python's and JavaScript's encoders can
/// write an integer), up to 2^53, below which every whole float is exact. A fraction, a
/// negative, a larger float, or anything not a number is refused: the value is read leniently
/// in form, never in meaning.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct WholeNumber(pub(crate) u64);

impl WholeNumber {
    /// The largest float taken: every whole number up to 2^53 is exact as an `f64`.
    const MAX_EXACT_FLOAT: f64 = 9_007_199_254_740_992.0;
}

impl<'de> Deserialize<'de> for WholeNumber {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(WholeNumberVisitor)
    }
}

struct WholeNumberVisitor;

impl Visitor<'_> for WholeNumberVisitor {
    type Value = WholeNumber;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a non-negative whole number")
    }
    fn visit_u64<E>(self, v: u64) -> Result<WholeNumber, E> {
        Ok(WholeNumber(v))
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<WholeNumber, E> {
        u64::try_from(v)
            .map(WholeNumber)
            .map_err(|_| E::invalid_value(de::Unexpected::Signed(v), &self))
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<WholeNumber, E> {
        if v.fract() == 0.0 && (0.0..=WholeNumber::MAX_EXACT_FLOAT).contains(&v) {
            // Whole, non-negative and at most 2^53: the cast is exact.
            #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
            Ok(WholeNumber(v as u64))
        } else {
            Err(E::invalid_value(de::Unexpected::Float(v), &self))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_whole_number_is_read_from_an_integer_or_a_whole_float_and_nothing_else() {
        let read = |s: &str| serde_json::from_str::<WholeNumber>(s).map(|w| w.0);
        assert_eq!(read("1733150000000").unwrap(), 1_733_150_000_000);
        assert_eq!(read("1733150000000.0").unwrap(), 1_733_150_000_000);
        assert_eq!(read("1.73315e12").unwrap(), 1_733_150_000_000);
        assert_eq!(read("0.0").unwrap(), 0);
        assert_eq!(read("-0.0").unwrap(), 0);
        assert_eq!(read("18446744073709551615").unwrap(), u64::MAX);
        assert_eq!(read("9007199254740992.0").unwrap(), 1 << 53);
        for refused in [
            "1733150000000.5",
            "-1",
            "-1.0",
            "9007199254740994.0",
            "1e300",
            "\"1733150000000\"",
            "null",
            "true",
        ] {
            let err = read(refused).unwrap_err().to_string();
            assert!(
                err.contains("a non-negative whole number"),
                "{refused}: {err}"
            );
        }
    }

    #[test]
    fn a_repeated_key_at_any_depth_is_refused_and_distinct_keys_pass() {
        for bad in [
            r#"{"a":1,"a":1}"#,
            r#"{"a":1,"b":{"c":[{"d":1,"d":2}]}}"#,
            r#"[{"x":{"y":null,"y":null}}]"#,
            r#"{"group_id":"a","group\u005fid":"b"}"#,
        ] {
            assert!(reject_duplicate_keys(bad.as_bytes()).is_err(), "{bad}");
            assert!(serde_json::from_str::<StrictValue>(bad).is_err(), "{bad}");
        }
        for good in [
            r#"{"a":1,"b":{"a":1},"c":[{"a":1},{"a":2}]}"#,
            "[]",
            "null",
            r#""s""#,
            "1.5",
        ] {
            reject_duplicate_keys(good.as_bytes()).unwrap();
            let strict: StrictValue = serde_json::from_str(good).unwrap();
            assert_eq!(strict.0, serde_json::from_str::<Value>(good).unwrap());
        }
        assert!(
            reject_duplicate_keys(b"{} {}").is_err(),
            "one document only"
        );
    }
}
