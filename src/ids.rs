//! Identifiers that cross the wire: namespace (root group) ids and libp2p PeerIds.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A namespace id, which is the id of the namespace's root group: 32 bytes, written as
/// 64 hex chars.
///
/// MDMA sends it as `group_id` (docs/mdma.md) and merod accepts either case
/// (docs/merod-admin.md); it is parsed case-insensitively and always printed (`Display`)
/// and serialized (`Serialize`, a JSON string) as 64 lowercase hex chars, so two spellings
/// of one id compare equal.
///
/// ```
/// let id: fleet_sidecar::GroupId = "AB".repeat(32).parse().unwrap();
/// assert_eq!(id.to_string(), "ab".repeat(32));
/// assert_eq!(serde_json::to_string(&id).unwrap(), format!("\"{}\"", "ab".repeat(32)));
/// ```
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct GroupId([u8; 32]);

/// In tests: the id whose 32 bytes are all `n` (`id(1)` prints as `"01" * 32`).
#[cfg(test)]
pub(crate) fn test_id(n: u8) -> GroupId {
    GroupId::from_bytes([n; 32])
}

/// Why a string is not a [`GroupId`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum GroupIdError {
    /// Not exactly 64 characters.
    #[error("group id must be 64 hex chars, got {0} chars")]
    Length(usize),
    /// 64 characters, but not all hex digits.
    #[error("group id is not hex")]
    NotHex,
}

impl GroupId {
    /// The id from its 32 raw bytes.
    pub const fn from_bytes(bytes: [u8; 32]) -> Self {
        Self(bytes)
    }

    /// The 32 raw bytes.
    pub const fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }
}

impl FromStr for GroupId {
    type Err = GroupIdError;

    /// Parses 64 hex chars, either case. Errors: [`GroupIdError`].
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.len() != 64 {
            return Err(GroupIdError::Length(s.chars().count()));
        }
        let mut bytes = [0u8; 32];
        hex::decode_to_slice(s, &mut bytes).map_err(|_| GroupIdError::NotHex)?;
        Ok(Self(bytes))
    }
}

impl fmt::Display for GroupId {
    /// 64 lowercase hex chars.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&hex::encode(self.0))
    }
}

impl fmt::Debug for GroupId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "GroupId({self})")
    }
}

impl Serialize for GroupId {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for GroupId {
    /// A string of 64 hex chars, either case, read in place (no intermediate `String`).
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_str(GroupIdVisitor)
    }
}

struct GroupIdVisitor;

impl serde::de::Visitor<'_> for GroupIdVisitor {
    type Value = GroupId;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a string")
    }
    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<GroupId, E> {
        v.parse().map_err(E::custom)
    }
}

/// The node's libp2p PeerId in its base58 text form (e.g. `12D3KooW…`, 52 chars), as merod
/// writes it to `[identity].peer_id` of its `config.toml`.
///
/// Kept as text: the sidecar only forwards it to MDMA. Parsing rejects what cannot be a
/// base58 PeerId (empty, non-base58 chars, implausible length) so a damaged config is caught
/// before it is sent. `Display` and `Serialize` (a JSON string) give the text as read.
///
/// ```
/// let peer: fleet_sidecar::PeerId = "12D3KooWJ6X2tBZEd8qKWvJyhtH2v2XyP4eQ9dcU2xZ8Y6YrjcVk".parse().unwrap();
/// assert_eq!(serde_json::to_string(&peer).unwrap(), format!("\"{peer}\""));
/// ```
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(transparent)]
pub struct PeerId(String);

/// Why a string is not a [`PeerId`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PeerIdError {
    /// Empty, or too short or too long to be a base58 multihash (accepted: 32..=128 chars).
    #[error("peer id has an implausible length of {0} chars")]
    Length(usize),
    /// Holds a char outside the base58 (bitcoin) alphabet.
    #[error("peer id holds {0:?}, which is not a base58 char")]
    NotBase58(char),
}

impl PeerId {
    /// The base58 text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl FromStr for PeerId {
    type Err = PeerIdError;

    /// Checks the base58 alphabet and a plausible length (32..=128 chars).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        const BASE58: &str = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz";
        if let Some(bad) = s.chars().find(|c| !BASE58.contains(*c)) {
            return Err(PeerIdError::NotBase58(bad));
        }
        if !(32..=128).contains(&s.len()) {
            return Err(PeerIdError::Length(s.len()));
        }
        Ok(Self(s.to_owned()))
    }
}

impl fmt::Display for PeerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for PeerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PeerId({})", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: &str = "38069a4cc4285c4245c84587ac60084ba53502a8b91c9b108bca40f10ec4d3df";

    #[test]
    fn group_id_round_trips_lowercase() {
        let id: GroupId = ID.parse().unwrap();
        assert_eq!(id.to_string(), ID);
        let upper: GroupId = ID.to_uppercase().parse().unwrap();
        assert_eq!(upper, id);
        assert_eq!(upper.to_string(), ID);
    }

    #[test]
    fn group_id_rejects_bad_text() {
        assert_eq!("abcd".parse::<GroupId>(), Err(GroupIdError::Length(4)));
        assert_eq!("z".repeat(64).parse::<GroupId>(), Err(GroupIdError::NotHex));
        assert!(format!("{ID}0").parse::<GroupId>().is_err());
        // 64 bytes but multi-byte chars: a length error, never a panic on a char boundary.
        assert!("é".repeat(32).parse::<GroupId>().is_err());
    }

    #[test]
    fn group_id_serde_is_a_string() {
        let id: GroupId = ID.parse().unwrap();
        let json = serde_json::to_string(&id).unwrap();
        assert_eq!(json, format!("\"{ID}\""));
        assert_eq!(serde_json::from_str::<GroupId>(&json).unwrap(), id);
        assert!(serde_json::from_str::<GroupId>("\"abcd\"").is_err());
    }

    #[test]
    fn peer_id_checks_alphabet_and_length() {
        let p = "12D3KooWJ6X2tBZEd8qKWvJyhtH2v2XyP4eQ9dcU2xZ8Y6YrjcVk";
        assert_eq!(p.parse::<PeerId>().unwrap().as_str(), p);
        assert_eq!("".parse::<PeerId>(), Err(PeerIdError::Length(0)));
        assert_eq!(
            "12D3KooW0abc".parse::<PeerId>(),
            Err(PeerIdError::NotBase58('0'))
        );
        assert!(format!("{p} ").parse::<PeerId>().is_err());
    }
}
