//! The recovery envelopes against the loopback emulators: MDMA's route through the client,
//! and the job beside the loop (sealed per member through merod, written with a version,
//! rewritten only on a change, deleted for members and namespaces gone, idle on a merod
//! without the seal route).

use fleet_sidecar::emulator::mdma::MdmaEmulator;
use fleet_sidecar::{
    CallError, FleetToken, MdmaClient, RecoveryEnvelope, RecoveryKey, RequestError, RequestMethod,
};

const A: &str = "38069a4cc4285c4245c84587ac60084ba53502a8b91c9b108bca40f10ec4d3df";
const PEER: &str = "12D3KooWNXNMakaAKyWpBemRiWWqusgQCrxvwjtJdRQMzLScTJDT";

/// PUT takes a version above the one held (409 otherwise, named as a PUT), DELETE drops
/// the envelope and answers 200 even when none is held.
#[tokio::test]
async fn the_client_puts_and_deletes_envelopes_and_a_stale_version_is_a_409() {
    let mdma = MdmaEmulator::start(Some("t0ken".to_owned())).await.unwrap();
    let client = MdmaClient::new(&mdma.url(), Some(FleetToken::new("t0ken")), None).unwrap();
    let key = RecoveryKey {
        peer_id: PEER.parse().unwrap(),
        account_id: "ab".repeat(32),
        namespace_id: A.parse().unwrap(),
    };
    let put = |version| RecoveryEnvelope {
        key: key.clone(),
        ciphertext: "{}".to_owned(),
        version,
    };
    client.put_recovery_envelope(&put(1)).await.unwrap();
    let err = client.put_recovery_envelope(&put(1)).await.unwrap_err();
    assert!(
        matches!(
            &err,
            CallError::Request(RequestError::Status { status: 409, method, .. }) if *method == RequestMethod::Put
        ),
        "{err}"
    );
    assert!(err.to_string().starts_with("PUT http://"), "{err}");
    client.put_recovery_envelope(&put(2)).await.unwrap();
    assert_eq!(mdma.recovery_envelopes().len(), 1);
    client.delete_recovery_envelope(&key).await.unwrap();
    client.delete_recovery_envelope(&key).await.unwrap();
    assert!(mdma.recovery_envelopes().is_empty());
    let methods: Vec<(String, u16)> = mdma
        .recovery_calls()
        .into_iter()
        .map(|c| (c.method, c.status))
        .collect();
    assert_eq!(
        methods,
        [
            ("PUT".to_owned(), 200),
            ("PUT".to_owned(), 409),
            ("PUT".to_owned(), 200),
            ("DELETE".to_owned(), 200),
            ("DELETE".to_owned(), 200)
        ]
    );
}
