//! What the recovery envelopes MDMA keeps of each member account need from merod: the
//! accounts' devices in a group (`GET /admin-api/groups/{g}/member-devices`) and a plaintext
//! sealed to an account's root key (`POST /admin-api/groups/{g}/accounts/{a}/seal`, in cores
//! from 0.11.0-rc.34 on; an older core answers 404 with no body, which is remembered so it
//! is not asked again and again).

use std::time::Duration;

use serde::Serialize;
use serde_json::Value;

use super::groups::inner;
use super::{refusal_of, AnswerFault, MerodClient, MerodError, MerodOp};
use crate::ids::GroupId;
use crate::strict_json::StrictValue;

/// Bound of one seal call (merod derives a key and encrypts: fast, but not a read).
pub const SEAL_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a merod found without the seal route is not asked again, unless it is seen down
/// first (it restarts: it may have been upgraded).
pub const SEAL_ROUTE_RETRY: Duration = Duration::from_secs(3600);
/// Longest device id or signing key kept (merod's are 64 hex or 32 bytes in base58).
const MAX_DEVICE_FIELD: usize = 128;
/// Longest field of a sealed envelope kept (the ciphertext grows with the plaintext).
const MAX_SEALED_FIELD: usize = 256 * 1024;

/// One device of a member account, as merod lists it.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub struct MemberDevice {
    /// `deviceId`, trimmed and lowercased (hex).
    pub device_id: String,
    /// `signingKey`, trimmed, otherwise verbatim: older cores answer base58, where case
    /// is part of the value.
    pub signing_key: String,
}

/// One row of `member-devices`: an account and its devices.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemberDevices {
    /// `account`: the member's account, lowercase hex.
    pub account: String,
    /// `devices`, in merod's order; a row without a device id is left out.
    pub devices: Vec<MemberDevice>,
}

/// A plaintext sealed to an account's root key, as merod answers it (each field verbatim;
/// hex in the cores that have the route).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SealedEnvelope {
    /// `accountRootEpoch`: the epoch of the root key sealed to.
    pub account_root_epoch: u32,
    /// `ciphertext`.
    pub ciphertext: String,
    /// `ephemeralPublicKey`.
    pub ephemeral_public_key: String,
    /// `nonce`.
    pub nonce: String,
}

impl SealedEnvelope {
    /// The four fields as one compact JSON object with its keys sorted
    /// (`{"accountRootEpoch":…,"ciphertext":…,"ephemeralPublicKey":…,"nonce":…}`): the
    /// `ciphertext` string MDMA stores.
    pub fn to_json_string(&self) -> String {
        // The fields are declared in key order; a struct of strings and a number always
        // renders.
        serde_json::to_string(self).unwrap_or_default()
    }
}

impl MerodClient {
    /// The devices of the accounts of `group`:
    /// `GET /admin-api/groups/{id}/member-devices?offset=O&limit=1000` →
    /// `{"members": [{"account", "devices": [{"deviceId", "signingKey"}]}]}` (flat or under
    /// `data`), read whole like the other group lists, bounded by the members deadline
    /// (default 20 s) for all pages. An admin caller sees every account, a plain member only
    /// itself; a core that does not page answers everything at once, which reads the same.
    ///
    /// Errors: [`MerodError::Refused`] or [`MerodError::Status`] for a non-2xx (403: the node
    /// is not a member), [`MerodError::Answer`] when there is no `members` array, a row has
    /// no hex `account` or `devices` array, a device field is not a string, or the list
    /// cannot be read whole; transport and timeout.
    pub async fn member_devices(&self, group: GroupId) -> Result<Vec<MemberDevices>, MerodError> {
        let path = format!("admin-api/groups/{group}/member-devices");
        self.paged(
            MerodOp::MemberDevices,
            &path,
            parse_member_devices,
            |m: &MemberDevices| m.account.as_str(),
        )
        .await
    }

    /// Seals `plaintext` to the root key `account` (lowercase hex) holds in `group`:
    /// `POST /admin-api/groups/{id}/accounts/{account}/seal` `{"plaintext": "<hex>"}` →
    /// `{"data": {"accountRootEpoch", "ephemeralPublicKey", "nonce", "ciphertext"}}` (or the
    /// same flat), bounded by [`SEAL_TIMEOUT`]. `Ok(None)`: merod has no such route (a core
    /// before 0.11.0-rc.34 answers 404 with no body); [`MerodClient::lacks_seal_route`] then
    /// holds until merod is seen down or [`SEAL_ROUTE_RETRY`] passes.
    ///
    /// Errors: [`MerodError::Refused`] for merod's own refusals (404: the account has no
    /// root key in the group; 403: this node is not a member), [`MerodError::Status`] for
    /// another bare non-2xx, [`MerodError::Answer`] for a 2xx without the four fields or
    /// an `account` that is not hex; transport and timeout.
    pub async fn seal_to_account(
        &self,
        group: GroupId,
        account: &str,
        plaintext: &[u8],
    ) -> Result<Option<SealedEnvelope>, MerodError> {
        let op = MerodOp::Seal;
        let account = account.to_ascii_lowercase();
        let path = format!("admin-api/groups/{group}/accounts/{account}/seal");
        let answer_err = |reason: String| MerodError::Answer {
            op,
            url: self.url(&path).to_string(),
            reason,
        };
        if account.is_empty() || !account.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(answer_err(format!("the account {account:?} is not hex")));
        }
        let body = serde_json::json!({ "plaintext": hex::encode(plaintext) });
        let (status, answer) = self.raw(op, &path, Some(body), SEAL_TIMEOUT).await?;
        if !(200..300).contains(&status) {
            let refused = refusal_of(op, self.url(&path).as_str(), status, &answer);
            if matches!(refused, MerodError::Status { status: 404, .. }) {
                self.seal_missing.set(true);
                return Ok(None);
            }
            return Err(refused);
        }
        self.seal_missing.set(false);
        let StrictValue(value) =
            crate::strict_json::from_slice(&answer).map_err(|e| answer_err(e.to_string()))?;
        parse_sealed(&value)
            .map(Some)
            .map_err(|fault| answer_err(fault.to_string()))
    }

    /// Whether merod was last found without the seal route, less than [`SEAL_ROUTE_RETRY`]
    /// ago and not seen down since: a caller waits instead of asking again.
    pub fn lacks_seal_route(&self) -> bool {
        self.seal_missing.holds()
    }
}

/// The rows of a `member-devices` page.
fn parse_member_devices(body: &Value) -> Result<Vec<MemberDevices>, AnswerFault> {
    let rows = inner(body)
        .get("members")
        .and_then(Value::as_array)
        .ok_or(AnswerFault::Shape("no members array"))?;
    rows.iter()
        .map(|row| {
            let account = row
                .get("account")
                .and_then(Value::as_str)
                .map(|a| a.trim().to_ascii_lowercase())
                .filter(|a| !a.is_empty() && a.bytes().all(|b| b.is_ascii_hexdigit()))
                .ok_or(AnswerFault::Shape(
                    "a member-devices row without a hex account",
                ))?;
            let devices =
                row.get("devices")
                    .and_then(Value::as_array)
                    .ok_or(AnswerFault::Shape(
                        "a member-devices row without a devices array",
                    ))?;
            let mut kept = Vec::with_capacity(devices.len());
            for device in devices {
                let field = |name: &'static str| -> Result<String, AnswerFault> {
                    match device.get(name) {
                        None | Some(Value::Null) => Ok(String::new()),
                        Some(Value::String(s)) if s.trim().len() <= MAX_DEVICE_FIELD => {
                            Ok(s.trim().to_owned())
                        }
                        Some(_) => Err(AnswerFault::DeviceField(name)),
                    }
                };
                let device_id = field("deviceId")?.to_ascii_lowercase();
                let signing_key = field("signingKey")?;
                if !device_id.is_empty() {
                    kept.push(MemberDevice {
                        device_id,
                        signing_key,
                    });
                }
            }
            Ok(MemberDevices {
                account,
                devices: kept,
            })
        })
        .collect()
}

/// The envelope of a seal answer (`data` when it is an object, else the top level).
fn parse_sealed(body: &Value) -> Result<SealedEnvelope, AnswerFault> {
    let sealed = inner(body);
    let text = |name: &'static str| -> Result<String, AnswerFault> {
        match sealed.get(name).and_then(Value::as_str) {
            Some(s) if !s.is_empty() && s.len() <= MAX_SEALED_FIELD => Ok(s.to_owned()),
            _ => Err(AnswerFault::NoString(name)),
        }
    };
    let account_root_epoch = sealed
        .get("accountRootEpoch")
        .and_then(Value::as_u64)
        .and_then(|e| u32::try_from(e).ok())
        .ok_or(AnswerFault::Shape("no u32 accountRootEpoch"))?;
    Ok(SealedEnvelope {
        account_root_epoch,
        ciphertext: text("ciphertext")?,
        ephemeral_public_key: text("ephemeralPublicKey")?,
        nonce: text("nonce")?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const A: &str = "81bb72c445def32147e046289e7bb38fb7c6df978235dcc22a8706410e80342c";

    #[test]
    fn member_devices_keep_the_signing_key_verbatim_and_drop_rows_without_an_id() {
        // As rc.25 answers it: a base58 signing key, where case matters.
        let page = json!({"members": [{"account": A.to_ascii_uppercase(), "devices": [
            {"deviceId": " 6BF0 ", "signingKey": " Fvum43kcWzbpDArV95nmHtMH "},
            {"deviceId": "", "signingKey": "x"},
            {"signingKey": "y"},
        ]}, {"account": "ab", "devices": []}]});
        let rows = parse_member_devices(&page).unwrap();
        assert_eq!(rows[0].account, A);
        assert_eq!(
            rows[0].devices,
            [MemberDevice {
                device_id: "6bf0".into(),
                signing_key: "Fvum43kcWzbpDArV95nmHtMH".into()
            }]
        );
        assert!(rows[1].devices.is_empty());
        assert_eq!(parse_member_devices(&json!({"data": page})).unwrap(), rows);
        for bad in [
            json!({"data": []}),
            json!({"members": [{"account": "zz", "devices": []}]}),
            json!({"members": [{"account": A}]}),
            json!({"members": [{"account": A, "devices": [{"deviceId": 7}]}]}),
        ] {
            assert!(parse_member_devices(&bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_sealed_envelope_needs_its_four_fields_and_renders_sorted_and_compact() {
        let data = json!({"accountRootEpoch": 3, "ephemeralPublicKey": "e1", "nonce": "n1",
            "ciphertext": "c1"});
        let sealed = parse_sealed(&json!({ "data": data })).unwrap();
        assert_eq!(parse_sealed(&data).unwrap(), sealed);
        assert_eq!(
            sealed.to_json_string(),
            r#"{"accountRootEpoch":3,"ciphertext":"c1","ephemeralPublicKey":"e1","nonce":"n1"}"#
        );
        for bad in [
            json!({"accountRootEpoch": -1, "ephemeralPublicKey": "e", "nonce": "n", "ciphertext": "c"}),
            json!({"accountRootEpoch": 1, "ephemeralPublicKey": "", "nonce": "n", "ciphertext": "c"}),
            json!({"accountRootEpoch": 1, "nonce": "n", "ciphertext": "c"}),
        ] {
            assert!(parse_sealed(&bad).is_err(), "{bad}");
        }
    }
}
