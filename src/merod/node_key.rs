//! The node's public key, as device-key login needs it: `publicKey` of
//! `GET /admin-api/identity`. Cores from about 0.11.0-rc.29 on answer it as 64 hex
//! characters; 0.11.0-rc.25 answers the same 32 bytes in base58 (its `PublicKey` prints
//! through its `Hash` type). Both are read; anything else is not a key.

use std::fmt;

use serde::Serialize;
use serde_json::Value;

use super::{MerodClient, MerodError, MerodOp, IDENTITY_PATH};

/// Longest `publicKey` looked at: base58 of 32 bytes is at most 44 characters, hex 64, and
/// base58 decoding costs the square of the length.
const MAX_KEY_TEXT: usize = 128;

/// A node's public key: 32 bytes (ed25519). Shown (`Display`, `Debug`) as 64 lowercase hex
/// characters, the form `mero-auth`'s `[account_proof] node_key` takes.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct NodeKey([u8; 32]);

/// Why a `publicKey` is not a node key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum NodeKeyError {
    /// Neither 64 hex characters nor base58 that decodes to exactly 32 bytes.
    #[error("publicKey is neither 64 hex characters nor base58 of 32 bytes ({chars} characters)")]
    NotAKey {
        /// Its length in characters, trimmed (the text itself is not repeated).
        chars: usize,
    },
}

impl NodeKey {
    /// Reads `text`, trimmed: 64 hex characters (any case) are the key's bytes; otherwise
    /// base58 (Bitcoin's alphabet) that decodes to exactly 32 bytes.
    ///
    /// Errors: [`NodeKeyError::NotAKey`] for anything else (empty, 31 or 33 bytes, another
    /// alphabet, longer than 128 characters).
    pub fn parse(text: &str) -> Result<Self, NodeKeyError> {
        let text = text.trim();
        let not_a_key = || NodeKeyError::NotAKey {
            chars: text.chars().count(),
        };
        let mut bytes = [0u8; 32];
        if text.len() == 64 && text.bytes().all(|b| b.is_ascii_hexdigit()) {
            hex::decode_to_slice(text, &mut bytes).map_err(|_| not_a_key())?;
            return Ok(Self(bytes));
        }
        if text.is_empty() || text.len() > MAX_KEY_TEXT {
            return Err(not_a_key());
        }
        match bs58::decode(text).onto(&mut bytes[..]) {
            Ok(32) => Ok(Self(bytes)),
            _ => Err(not_a_key()),
        }
    }

    /// The key's 32 bytes.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }
}

impl fmt::Display for NodeKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&hex::encode(self.0))
    }
}

impl Serialize for NodeKey {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl fmt::Debug for NodeKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "NodeKey({self})")
    }
}

impl MerodClient {
    /// The node's public key: `data.publicKey` of `GET /admin-api/identity` read by
    /// [`NodeKey::parse`] (64 hex, or base58 of 32 bytes), bounded by the check deadline
    /// (default 10 s). `Ok(None)`: merod's own 404, the node holds no device yet.
    ///
    /// Errors: [`MerodError::Answer`] for an answer without a string `data.publicKey` or
    /// one that is not a key; [`MerodError::Refused`] or [`MerodError::Status`] for another
    /// non-2xx (a 404 from a proxy or a core without the route included); transport and
    /// timeout as usual.
    pub async fn node_key(&self) -> Result<Option<NodeKey>, MerodError> {
        let Some(value) = self.identity_answer().await? else {
            return Ok(None);
        };
        let answer_err = |reason: String| MerodError::Answer {
            op: MerodOp::Identity,
            url: self.url(IDENTITY_PATH).to_string(),
            reason,
        };
        let text = value
            .pointer("/data/publicKey")
            .and_then(Value::as_str)
            .ok_or_else(|| answer_err("no string data.publicKey".to_owned()))?;
        NodeKey::parse(text)
            .map(Some)
            .map_err(|e| answer_err(e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The key rc.25 answered in the recorded `identity-after-join`, and its bytes.
    const RC25: &str = "8W55hTWXwYgpV5hwnZ3f25G5H1Yt5Qb3bRMwFTFDEyin";
    const RC25_HEX: &str = "6f74442edba9238bfaf0a993ccf53b117e36e350614a1b7ba7c8a8ecf7422c5f";

    #[test]
    fn hex_is_taken_lowercased_and_base58_of_32_bytes_as_its_bytes() {
        let hex = NodeKey::parse(RC25_HEX).unwrap();
        assert_eq!(hex.to_string(), RC25_HEX);
        assert_eq!(NodeKey::parse(&RC25_HEX.to_ascii_uppercase()).unwrap(), hex);
        assert_eq!(NodeKey::parse(&format!(" {RC25_HEX}\n")).unwrap(), hex);
        assert_eq!(NodeKey::parse(RC25).unwrap(), hex, "rc.25's base58");
        assert_eq!(format!("{hex:?}"), format!("NodeKey({RC25_HEX})"));
        assert_eq!(
            serde_json::to_string(&hex).unwrap(),
            format!("\"{RC25_HEX}\"")
        );
        // Base58 of the all-zero key is 32 '1's; of 0xff.. is 44 characters.
        assert_eq!(
            NodeKey::parse(&"1".repeat(32)).unwrap().as_bytes(),
            &[0u8; 32]
        );
        let ff = bs58::encode([0xffu8; 32]).into_string();
        assert_eq!(NodeKey::parse(&ff).unwrap().as_bytes(), &[0xffu8; 32]);
    }

    #[test]
    fn anything_else_is_not_a_key() {
        let b58 = |n: usize| bs58::encode(vec![7u8; n]).into_string();
        for (text, chars) in [
            (String::new(), 0),
            ("   ".to_owned(), 0),
            (RC25_HEX[..63].to_owned(), 63),
            (format!("{RC25_HEX}0"), 65),
            (format!("{}g", &RC25_HEX[..63]), 64),
            (b58(31), b58(31).len()),
            (b58(33), b58(33).len()),
            // '0', 'O', 'I' and 'l' are not in base58's alphabet.
            (format!("0{}", &RC25[1..]), RC25.len()),
            (format!("l{}", &RC25[1..]), RC25.len()),
            ("1".repeat(31), 31),
            ("z".repeat(129), 129),
            ("é".repeat(40), 40),
        ] {
            assert_eq!(
                NodeKey::parse(&text),
                Err(NodeKeyError::NotAKey { chars }),
                "{text:?}"
            );
        }
    }
}
