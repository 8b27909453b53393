//! Contract tests: every recorded merod answer in fixtures/merod/ that the sidecar consumes
//! is served verbatim (status and body) and read through the real client code path.

use std::path::PathBuf;

use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::Router;
use fleet_sidecar::GroupId;
use fleet_sidecar::{merod::NodeAccount, Admission, MerodClient, MerodError, Node, NodeKey};
use serde_json::Value;

fn fixture(name: &str) -> Value {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/merod")
        .join(format!("{name}.json"));
    let text = std::fs::read_to_string(&path).expect("fixture readable");
    serde_json::from_str(&text).expect("fixture is JSON")
}

/// A loopback server of `router`, stopped when dropped (registration's fake metadata server
/// uses it too).
pub(crate) struct ServerHandle {
    addr: std::net::SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl ServerHandle {
    pub(crate) fn url(&self) -> url::Url {
        format!("http://{}/", self.addr).parse().unwrap()
    }
}

impl Drop for ServerHandle {
    fn drop(&mut self) {
        self.task.abort();
    }
}

pub(crate) async fn serve(router: Router) -> std::io::Result<ServerHandle> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, router).await;
    });
    Ok(ServerHandle { addr, task })
}

/// A server answering every request with the fixture's recorded status and body.
async fn replay(name: &str) -> (ServerHandle, MerodClient, Value) {
    let f = fixture(name);
    let status = f["response"]["status"].as_u64().unwrap() as u16;
    let body = f["response"]["body"].to_string();
    let router = Router::new().fallback(move || {
        let body = body.clone();
        async move {
            (
                StatusCode::from_u16(status).unwrap(),
                [("content-type", "application/json")],
                body,
            )
                .into_response()
        }
    });
    let server = serve(router).await.unwrap();
    let client = MerodClient::new(&server.url()).unwrap();
    (server, client, f)
}

fn id_of(f: &Value) -> GroupId {
    let path = f["request"]["path"].as_str().unwrap();
    let from_body = f["request"]["body"]["groupId"].as_str();
    from_body
        .or_else(|| path.split('/').find(|p| p.len() == 64))
        .unwrap_or("abababababababababababababababababababababababababababababababab")
        .parse()
        .unwrap()
}

#[tokio::test]
async fn fleet_join_answers() {
    for (name, want) in [
        ("fleet-join-admitted", (true, "joined")),
        ("fleet-join-already-admitted", (true, "joined")),
        ("fleet-join-admitter-addrs", (true, "joined")),
        ("fleet-join-unknown-namespace", (false, "announced")),
    ] {
        let (_s, client, f) = replay(name).await;
        let got = client.fleet_join(id_of(&f), &[]).await.unwrap();
        assert_eq!(
            got,
            Admission {
                admitted: want.0,
                status: want.1.to_owned(),
                reasons: Vec::new(),
                refusals: Vec::new(),
                admitted_by: None,
            },
            "{name}"
        );
    }
}

#[tokio::test]
async fn fleet_join_refusals_are_errors_with_merod_s_message() {
    for name in [
        "fleet-join-no-content-type",
        "fleet-join-non-hex-id",
        "fleet-join-short-id",
        "fleet-join-snake-case-body",
    ] {
        let (_s, client, f) = replay(name).await;
        let id = "abababababababababababababababababababababababababababababababab"
            .parse()
            .unwrap();
        let err = client.fleet_join(id, &[]).await.unwrap_err().to_string();
        let message = f["response"]["body"]["error"].as_str().unwrap();
        assert!(err.contains(message), "{name}: {err}");
        assert!(err.contains("fleet-join"), "{name}: {err}");
    }
}

#[tokio::test]
async fn fleet_join_in_a_data_wrapper_is_read_too() {
    let inner = fixture("fleet-join-admitted")["response"]["body"].clone();
    let wrapped = serde_json::json!({ "data": inner });
    let got = fleet_sidecar::merod::parse_fleet_join(&wrapped).unwrap();
    assert!(got.admitted);
    assert!(
        fleet_sidecar::merod::parse_fleet_join(&serde_json::json!({"status": "joined"})).is_err()
    );
    assert!(
        fleet_sidecar::merod::parse_fleet_join(&serde_json::json!({"admitted": "true"})).is_err()
    );
}

#[tokio::test]
async fn namespace_get_answers() {
    for (name, held) in [
        ("namespace-get-member", true),
        ("namespace-get-never-joined", false),
        ("namespace-get-after-leave", false),
    ] {
        let (_s, client, f) = replay(name).await;
        assert_eq!(
            client.holds_namespace(id_of(&f)).await.unwrap(),
            held,
            "{name}"
        );
    }
    // 200 for another namespace is not a yes.
    let (_s, client, _f) = replay("namespace-get-member").await;
    let other = "abababababababababababababababababababababababababababababababab"
        .parse()
        .unwrap();
    assert!(client.holds_namespace(other).await.is_err());
}

#[tokio::test]
async fn leave_answers() {
    let (_s, client, f) = replay("namespace-leave-member").await;
    client.leave_namespace(id_of(&f)).await.unwrap();
    for name in [
        "namespace-leave-again",
        "namespace-leave-never-joined",
        "namespace-leave-unknown",
        "namespace-leave-bad-id",
    ] {
        let (_s, client, f) = replay(name).await;
        let err = client
            .leave_namespace(id_of(&f))
            .await
            .unwrap_err()
            .to_string();
        let message = f["response"]["body"]["error"].as_str().unwrap();
        assert!(err.contains(message), "{name}: {err}");
    }
}

#[tokio::test]
async fn readiness_probe_answers() {
    let (_s, client, _f) = replay("peers").await;
    client.probe().await.unwrap();
}

#[test]
fn every_copied_fixture_is_covered() {
    let consumed = [
        "fleet-join-admitted",
        "fleet-join-already-admitted",
        "fleet-join-unknown-namespace",
        "fleet-join-no-content-type",
        "fleet-join-non-hex-id",
        "fleet-join-short-id",
        "fleet-join-snake-case-body",
        "namespace-get-member",
        "namespace-get-never-joined",
        "namespace-get-after-leave",
        "namespace-leave-member",
        "namespace-leave-again",
        "namespace-leave-never-joined",
        "namespace-leave-unknown",
        "namespace-leave-bad-id",
        "peers",
        "namespaces-list-member",
        "namespaces-list-empty",
        "namespaces-list-after-leave",
        "fleet-join-admitter-addrs",
        "identity-before-join",
        "identity-after-join",
        "group-members-member",
        "identity-after-leave",
        "registration-attest",
        "attest",
        "attest-short-nonce",
        "group-subgroups-member",
        "group-contexts-member",
        "group-contexts-never-joined",
        "group-capabilities-member",
        "usage-member",
        "group-member-devices-member",
        "seal-member",
    ];
    // Served by the merod emulator only, checked against it by
    // the_emulator_answers_every_recorded_request_in_the_recorded_shape (the sidecar does not
    // call these routes, or not with these parameters).
    let emulator_only = [
        "health",
        "ready",
        "group-members-never-joined",
        "group-members-after-leave",
        "namespaces-list-page-1",
        "namespaces-list-page-2",
        "namespaces-list-page-end",
    ];
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures/merod");
    for entry in std::fs::read_dir(dir).unwrap() {
        let name = entry.unwrap().file_name().into_string().unwrap();
        let Some(stem) = name.strip_suffix(".json") else {
            continue;
        };
        assert!(
            consumed.contains(&stem) || emulator_only.contains(&stem),
            "fixture {name} is copied but no test reads it"
        );
    }
}

/// The context inventory's reads, through the client, of what a real merod answered.
#[tokio::test]
async fn the_inventory_s_routes_read_what_merod_answered() {
    let (_s, client, f) = replay("group-subgroups-member").await;
    assert_eq!(client.subgroups(id_of(&f)).await.unwrap(), []);
    let (_s, client, f) = replay("group-contexts-member").await;
    assert!(client.group_contexts(id_of(&f)).await.unwrap().is_empty());
    let (_s, client, f) = replay("group-contexts-never-joined").await;
    assert!(matches!(
        client.group_contexts(id_of(&f)).await,
        Err(MerodError::Refused { status: 500, .. })
    ));
    let (_s, client, f) = replay("group-capabilities-member").await;
    let path = f["request"]["path"].as_str().unwrap();
    let account = path.split('/').rev().nth(1).unwrap();
    assert_eq!(
        client
            .member_capabilities(id_of(&f), account)
            .await
            .unwrap(),
        4
    );
    let (_s, client, f) = replay("usage-member").await;
    let usage = client.usage().await.unwrap();
    let ns = f["response"]["body"]["namespaces"][0]["namespaceId"]
        .as_str()
        .unwrap();
    assert_eq!(
        usage.get(&ns.parse().unwrap()),
        Some(&fleet_sidecar::merod::StorageBytes::default())
    );
    assert_eq!(usage.len(), 1);
}

/// The recovery envelopes' reads, through the client, of what a real merod answered: the
/// node's own devices with the base58 signing key as it is, and no seal route on rc.25.
#[tokio::test]
async fn the_recovery_routes_read_what_merod_answered() {
    let (_s, client, f) = replay("group-member-devices-member").await;
    let rows = client.member_devices(id_of(&f)).await.unwrap();
    let recorded = &f["response"]["body"]["members"][0];
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].account, recorded["account"].as_str().unwrap());
    let key = recorded["devices"][0]["signingKey"].as_str().unwrap();
    assert_ne!(key, key.to_ascii_lowercase(), "a base58 key with capitals");
    assert_eq!(rows[0].devices[0].signing_key, key);
    let (_s, client, f) = replay("seal-member").await;
    let path = f["request"]["path"].as_str().unwrap();
    let account = path.split('/').rev().nth(1).unwrap();
    assert!(!client.lacks_seal_route());
    assert_eq!(
        client
            .seal_to_account(id_of(&f), account, b"{}")
            .await
            .unwrap(),
        None,
        "no route on rc.25"
    );
    assert!(client.lacks_seal_route(), "remembered");
}

#[tokio::test]
async fn the_role_is_read_from_the_member_list() {
    let (_s, client, f) = replay("group-members-member").await;
    let rows = f["response"]["body"]["members"].as_array().unwrap();
    let ns = id_of(&f);
    let ours = rows[1]["identity"].as_str().unwrap();
    assert_eq!(
        client.tee_role(ns, ours).await.unwrap(),
        Some(fleet_sidecar::TeeRole::ReadOnlyTee)
    );
    let owner = rows[0]["identity"].as_str().unwrap();
    assert_eq!(
        client.tee_role(ns, owner).await.unwrap(),
        None,
        "Admin is no TEE role"
    );
    assert_eq!(
        client.tee_role(ns, &"0".repeat(64)).await.unwrap(),
        None,
        "no row"
    );
}

#[tokio::test]
async fn fleet_join_with_admitter_addrs_answers_as_ever() {
    let (_s, client, f) = replay("fleet-join-admitter-addrs").await;
    let addrs: Vec<String> =
        serde_json::from_value(f["request"]["body"]["admitterAddrs"].clone()).unwrap();
    let got = client.fleet_join(id_of(&f), &addrs).await.unwrap();
    assert!(got.admitted && got.refusals.is_empty(), "{got:?}");
    assert!(!client.admitter_addrs_refused());
}

#[tokio::test]
async fn namespace_listings() {
    let (_s, client, _f) = replay("namespaces-list-member").await;
    let held = client
        .list_namespaces()
        .await
        .expect("a recorded listing reads");
    let want: GroupId = "38069a4cc4285c4245c84587ac60084ba53502a8b91c9b108bca40f10ec4d3df"
        .parse()
        .unwrap();
    assert_eq!(held, [want].into());

    let (_s, client, _f) = replay("namespaces-list-empty").await;
    assert!(client.list_namespaces().await.unwrap().is_empty());

    // After leaving one of two: the other, as recorded.
    let (_s, client, f) = replay("namespaces-list-after-leave").await;
    let want: GroupId = f["response"]["body"]["data"][0]["namespaceId"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(client.list_namespaces().await.unwrap(), [want].into());
}

/// The client bounds its own calls: a tool that reuses it cannot hang on a stuck merod.
#[tokio::test]
async fn every_call_has_its_own_deadline() {
    use fleet_sidecar::merod::MerodOp;
    use std::time::{Duration, Instant};

    let router = Router::new().fallback(|| async {
        tokio::time::sleep(Duration::from_secs(3600)).await;
        StatusCode::OK
    });
    let server = serve(router).await.unwrap();
    let short = Duration::from_millis(200);
    let client = MerodClient::builder(server.url())
        .probe_timeout(short)
        .join_timeout(short)
        .leave_timeout(short)
        .check_timeout(short)
        .build()
        .unwrap();
    let id: GroupId = "ab".repeat(32).parse().unwrap();
    let started = Instant::now();
    let errors = [
        client.probe().await.unwrap_err(),
        client.fleet_join(id, &[]).await.unwrap_err(),
        client.leave_namespace(id).await.unwrap_err(),
        client.holds_namespace(id).await.unwrap_err(),
        client.list_namespaces().await.unwrap_err(),
    ];
    let ops: Vec<MerodOp> = errors.iter().map(|e| e.op()).collect();
    assert_eq!(
        ops,
        [
            MerodOp::Peers,
            MerodOp::FleetJoin,
            MerodOp::Leave,
            MerodOp::GetNamespace,
            MerodOp::ListNamespaces
        ]
    );
    for e in &errors {
        assert!(e.is_timeout(), "{e}");
        assert!(
            e.to_string().contains(&server.url().to_string()[..20]),
            "{e}"
        );
    }
    // Five calls bounded at 0.2 s each: far from the daemon's default deadlines.
    assert!(started.elapsed() < Duration::from_secs(30));
}

/// merod answers at most `limit` (default 100) entries a page: the listing pages through.
#[tokio::test]
async fn a_listing_longer_than_a_page_is_read_whole() {
    let merod = fleet_sidecar::testing::merod::MerodEmulator::start()
        .await
        .unwrap();
    let ids: Vec<String> = (0..250u32).map(|n| format!("{n:064x}")).collect();
    for id in &ids {
        merod.hold(id);
    }
    let client = MerodClient::new(&merod.url()).unwrap();
    let held = client.list_namespaces().await.unwrap();
    let want: std::collections::BTreeSet<GroupId> =
        ids.iter().map(|s| s.parse().unwrap()).collect();
    assert_eq!(held, want);
    let pages = merod
        .calls()
        .iter()
        .filter(|c| c.path == "/admin-api/namespaces")
        .count();
    assert_eq!(pages, 3, "100 + 100 + 50");
}

/// A merod that ignores `offset` answers the first page for ever: the listing ends at the
/// second page as an error, instead of looping until its deadline (about 900 requests in
/// 25 s before) and then reporting nothing either way.
#[tokio::test]
async fn a_listing_whose_pages_do_not_advance_is_an_error_at_once() {
    use fleet_sidecar::testing::merod::{ListBehaviour, MerodEmulator};
    let merod = MerodEmulator::start().await.unwrap();
    for n in 0..250u32 {
        merod.hold(&format!("{n:064x}"));
    }
    merod.set_list(ListBehaviour::IgnoresOffset);
    let client = MerodClient::new(&merod.url()).unwrap();
    let err = client.list_namespaces().await.unwrap_err();
    assert!(!err.is_timeout(), "{err}");
    assert!(err.to_string().contains("is `offset` ignored?"), "{err}");
    let pages = merod
        .calls()
        .iter()
        .filter(|c| c.path == "/admin-api/namespaces")
        .count();
    assert_eq!(pages, 2);
}

/// A namespace left between two pages shifts the rest: read as offsets alone, the first id
/// of the second page (held throughout) was skipped and the list looked whole. Pages that
/// overlap by one row see the shift, and the listing is an error rather than a wrong list.
#[tokio::test]
async fn a_listing_that_shifts_between_pages_is_not_taken_as_whole() {
    use fleet_sidecar::testing::merod::{ListBehaviour, MerodEmulator};
    let merod = MerodEmulator::start().await.unwrap();
    let ids: Vec<String> = (0..150u32).map(|n| format!("{n:064x}")).collect();
    for id in &ids {
        merod.hold(id);
    }
    merod.set_list(ListBehaviour::LeftAfterFirstPage(ids[3].clone()));
    let client = MerodClient::new(&merod.url()).unwrap();
    let err = client.list_namespaces().await.unwrap_err();
    assert!(
        err.to_string()
            .contains("the list changed while it was read"),
        "{err}"
    );
    // Read again, the list is whole as it now is.
    merod.set_list(ListBehaviour::Normal);
    let held = client.list_namespaces().await.unwrap();
    assert_eq!(held.len(), 149);
    assert!(held.contains(&ids[100].parse().unwrap()));
}

/// A JSON value's shape: object keys with their shapes, the distinct shapes of an array's
/// elements, the type of a scalar (the rule `scripts/record-merod.py` compares by).
fn shape(v: &Value) -> Value {
    match v {
        Value::Object(map) => {
            Value::Object(map.iter().map(|(k, v)| (k.clone(), shape(v))).collect())
        }
        Value::Array(items) => {
            let mut shapes: Vec<Value> = Vec::new();
            for s in items.iter().map(shape) {
                if !shapes.contains(&s) {
                    shapes.push(s);
                }
            }
            Value::Array(shapes)
        }
        Value::Bool(_) => "bool".into(),
        Value::Number(_) => "number".into(),
        Value::String(_) => "string".into(),
        Value::Null => "null".into(),
    }
}

/// Whether `got` has the recorded shape `want`; an empty array on either side matches any
/// array (it has no element to take a shape from).
fn same_shape(want: &Value, got: &Value) -> bool {
    match (want, got) {
        (Value::Object(w), Value::Object(g)) => {
            w.len() == g.len()
                && w.iter()
                    .all(|(k, v)| g.get(k).is_some_and(|h| same_shape(v, h)))
        }
        (Value::Array(w), Value::Array(g)) if w.is_empty() || g.is_empty() => true,
        (Value::Array(w), Value::Array(g)) => {
            w.len() == g.len() && w.iter().all(|v| g.iter().any(|h| same_shape(v, h)))
        }
        _ => want == got,
    }
}

/// The merod emulator put in the state the node was in when `name` was recorded.
fn prepare(merod: &fleet_sidecar::testing::merod::MerodEmulator, name: &str, f: &Value) {
    use fleet_sidecar::testing::merod::JoinBehaviour;
    let id = || id_of(f).to_string();
    match name {
        "fleet-join-already-admitted"
        | "namespace-get-member"
        | "group-members-member"
        | "group-subgroups-member"
        | "group-contexts-member"
        | "group-capabilities-member"
        | "group-member-devices-member"
        | "namespace-leave-member" => merod.hold(&id()),
        "usage-member" => {
            for row in f["response"]["body"]["namespaces"].as_array().unwrap() {
                merod.hold(row["namespaceId"].as_str().unwrap());
            }
        }
        // The account was minted by the first admission and outlives the leave.
        "identity-after-join" | "identity-after-leave" => merod.set_minted(true),
        // Held: what the recorded listing names.
        "namespaces-list-member" | "namespaces-list-after-leave" => {
            for entry in f["response"]["body"]["data"].as_array().unwrap() {
                merod.hold(entry["namespaceId"].as_str().unwrap());
            }
        }
        // Recorded holding two namespaces, asking one a page.
        "namespaces-list-page-1" | "namespaces-list-page-2" | "namespaces-list-page-end" => {
            merod.hold(&"1".repeat(64));
            merod.hold(&"2".repeat(64));
        }
        "fleet-join-unknown-namespace" => merod.set_join(
            &id(),
            JoinBehaviour::RefuseThenAdmit {
                refusals: 1,
                delay: std::time::Duration::ZERO,
            },
        ),
        // Everything else was recorded on a node holding nothing of the namespace asked.
        _ => {}
    }
}

/// The emulator answers each recorded request with the recorded
/// status, content type and body shape, so a shape a new core records (and a maintainer
/// commits) fails here until the emulator learns it.
#[tokio::test]
async fn the_emulator_answers_every_recorded_request_in_the_recorded_shape() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures/merod");
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| {
            e.unwrap()
                .file_name()
                .into_string()
                .unwrap()
                .strip_suffix(".json")
                .map(str::to_owned)
        })
        .collect();
    names.sort();
    let http = reqwest::Client::builder().no_proxy().build().unwrap();
    let mut wrong = Vec::new();
    for name in &names {
        let f = fixture(name);
        let merod = fleet_sidecar::testing::merod::MerodEmulator::start()
            .await
            .unwrap();
        prepare(&merod, name, &f);
        let req = &f["request"];
        let url = merod.url().join(req["path"].as_str().unwrap()).unwrap();
        let method: reqwest::Method = req["method"].as_str().unwrap().parse().unwrap();
        let mut call = http.request(method, url);
        if let Some(ct) = req["content_type"].as_str() {
            call = call.header("content-type", ct);
        }
        call = match &req["body"] {
            Value::Null => call,
            Value::String(text) => call.body(text.clone()),
            body => call.body(body.to_string()),
        };
        let answer = call.send().await.unwrap();
        let status = answer.status().as_u16();
        let content_type = answer.headers().get("content-type").map(|v| {
            v.to_str()
                .unwrap()
                .split(';')
                .next()
                .unwrap()
                .trim()
                .to_owned()
        });
        let text = answer.text().await.unwrap();
        let body: Value = if text.is_empty() {
            Value::Null
        } else {
            serde_json::from_str(&text).unwrap_or(Value::String(text))
        };
        let recorded = &f["response"];
        let want_ct = recorded["content_type"]
            .as_str()
            .map(|c| c.split(';').next().unwrap().trim().to_owned());
        if status != recorded["status"].as_u64().unwrap() as u16
            || content_type != want_ct
            || !same_shape(&shape(&recorded["body"]), &shape(&body))
        {
            wrong.push(format!(
                "{name}: recorded {} {want_ct:?} {}, emulator {status} {content_type:?} {}",
                recorded["status"],
                shape(&recorded["body"]),
                shape(&body)
            ));
        }
    }
    assert!(
        wrong.is_empty(),
        "answers of another shape:\n{}",
        wrong.join("\n")
    );
}

#[tokio::test]
async fn identity_answers_not_minted_before_a_namespace_and_the_account_after() {
    let (_s, client, _f) = replay("identity-before-join").await;
    assert_eq!(client.identity().await.unwrap(), NodeAccount::NotMinted);
    for name in ["identity-after-join", "identity-after-leave"] {
        let (_s, client, f) = replay(name).await;
        let want = f["response"]["body"]["data"]["accountId"].as_str().unwrap();
        assert_eq!(
            client.identity().await.unwrap(),
            NodeAccount::Account(want.to_owned()),
            "{name}"
        );
    }
}

#[tokio::test]
async fn the_node_key_is_rc25s_base58_as_hex_a_newer_cores_hex_and_nothing_else() {
    let (_s, client, _f) = replay("identity-before-join").await;
    assert_eq!(client.node_key().await.unwrap(), None, "not minted: no key");
    // rc.25, recorded: base58 of 32 bytes, read as those bytes.
    let (_s, client, _f) = replay("identity-after-join").await;
    let key = client.node_key().await.unwrap().expect("a key");
    assert_eq!(
        key.to_string(),
        "6f74442edba9238bfaf0a993ccf53b117e36e350614a1b7ba7c8a8ecf7422c5f"
    );
    // rc.29 on: 64 hex, lowercased.
    let (_s, client) = answering(
        200,
        r#"{"data":{"accountId":"ab","publicKey":"6F74442EDBA9238BFAF0A993CCF53B117E36E350614A1B7BA7C8A8ECF7422C5F"}}"#,
    )
    .await;
    assert_eq!(client.node_key().await.unwrap(), Some(key));
    // Anything else is an error, never a key: another length, no field, another 404.
    for (status, body) in [
        (200, r#"{"data":{"publicKey":"abc"}}"#),
        (200, r#"{"data":{"publicKey":7}}"#),
        (200, r#"{"data":{}}"#),
        (404, r#"{"error":"Not found"}"#),
    ] {
        let (_s, client) = answering(status, body).await;
        let got = client.node_key().await;
        assert!(got.is_err(), "{body}: {got:?}");
    }
    assert!(NodeKey::parse("8W55hTWXwYgpV5hwnZ3f25G5H1Yt5Qb3bRMwFTFDEyin").is_ok());
}

/// A server answering every request with `status` and `body`.
async fn answering(status: u16, body: &'static str) -> (ServerHandle, MerodClient) {
    let router = Router::new().fallback(move || async move {
        (
            StatusCode::from_u16(status).unwrap(),
            [("content-type", "application/json")],
            body,
        )
            .into_response()
    });
    let server = serve(router).await.unwrap();
    let client = MerodClient::new(&server.url()).unwrap();
    (server, client)
}

#[tokio::test]
async fn a_404_of_another_shape_is_not_an_answer_about_the_account() {
    let (_s, client) = answering(404, r#"{"error":"Not found"}"#).await;
    assert!(matches!(
        client.identity().await,
        Err(MerodError::Refused { status: 404, .. })
    ));
    // An account id that would break the nonce's fields is refused.
    let (_s, client) = answering(200, r#"{"data":{"accountId":"a|b"}}"#).await;
    assert!(matches!(
        client.identity().await,
        Err(MerodError::Answer { .. })
    ));
    let (_s, client) = answering(200, r#"{"data":{"accountId":"  ABC  "}}"#).await;
    assert_eq!(
        client.identity().await.unwrap(),
        NodeAccount::Account("abc".to_owned())
    );
}

#[tokio::test]
async fn quotes_are_read_under_data_or_at_the_top_and_a_404_is_the_fallback_signal() {
    let nonce = "ab".repeat(32);
    let (_s, client) = answering(200, r#"{"data":{"quoteB64":"UVVPVEU="}}"#).await;
    assert_eq!(client.attest(&nonce).await.unwrap(), "UVVPVEU=");
    assert_eq!(
        client.registration_attest(&nonce).await.unwrap().as_deref(),
        Some("UVVPVEU=")
    );
    let (_s, client) = answering(200, r#"{"quoteB64":"VE9Q"}"#).await;
    assert_eq!(client.attest(&nonce).await.unwrap(), "VE9Q");
    let (_s, client) = answering(200, r#"{"data":{"quoteB64":""}}"#).await;
    assert!(matches!(
        client.attest(&nonce).await,
        Err(MerodError::Answer { .. })
    ));
    // As recorded from rc.25: the quote over the nonce, and a short nonce refused.
    let (_s, recorded, f) = replay("attest").await;
    let recorded_nonce = &f["request"]["body"]["nonce"].as_str().unwrap();
    assert_eq!(
        recorded.attest(recorded_nonce).await.unwrap(),
        f["response"]["body"]["data"]["quoteB64"].as_str().unwrap()
    );
    let (_s, recorded, _f) = replay("attest-short-nonce").await;
    assert!(matches!(
        recorded.attest("abcd").await,
        Err(MerodError::Refused { status: 400, .. })
    ));
    // As recorded from rc.25 (404, empty, no content type): absent, fall back.
    let (_s, recorded, _f) = replay("registration-attest").await;
    assert_eq!(recorded.registration_attest(&nonce).await.unwrap(), None);
    // registration-attest: only a 404 means "absent, fall back"; a 400 is a failure.
    let (_s, client) = answering(404, r#"{"error":"Not found"}"#).await;
    assert_eq!(client.registration_attest(&nonce).await.unwrap(), None);
    let (_s, client) = answering(400, r#"{"error":"bad nonce"}"#).await;
    assert!(matches!(
        client.registration_attest(&nonce).await,
        Err(MerodError::Refused { status: 400, .. })
    ));
}

/// `GET /admin-api/network/status` as the emulator answers it (flat, as core 0.11 does).
#[tokio::test]
async fn network_status_gives_the_peer_id_and_external_addresses() {
    use fleet_sidecar::testing::merod::MerodEmulator;
    let merod = MerodEmulator::start().await.unwrap();
    let client = MerodClient::new(&merod.url()).unwrap();
    let status = client.network_status().await.unwrap();
    assert!(status.external_addrs.is_empty() && status.swarm_addrs().is_empty());
    merod.set_external_addrs(&["/ip4/1.2.3.4/udp/2528/quic-v1"]);
    let status = client.network_status().await.unwrap();
    assert_eq!(
        status.swarm_addrs(),
        [format!(
            "/ip4/1.2.3.4/udp/2528/quic-v1/p2p/{}",
            fleet_sidecar::testing::sandbox::PEER_ID
        )]
    );
}

/// Newer cores refuse with `{"error", "type"?, "data"?}` (400, 403, 404, 409, 503): every call
/// keeps the status, the message and the type, in the error and in its text (the log line).
#[tokio::test]
async fn a_typed_refusal_keeps_its_status_message_and_type_on_every_call() {
    let body = r#"{"error":"stale counter","type":"StaleCounter","data":{"expected":4}}"#;
    let (_s, client) = answering(409, body).await;
    let id = GroupId::from_bytes([7; 32]);
    let nonce = "ab".repeat(32);
    let errors: Vec<(&str, MerodError)> = vec![
        ("identity", client.identity().await.unwrap_err()),
        ("attest", client.attest(&nonce).await.unwrap_err()),
        (
            "registration-attest",
            client.registration_attest(&nonce).await.unwrap_err(),
        ),
        ("list", client.list_namespaces().await.unwrap_err()),
        ("get", client.holds_namespace(id).await.unwrap_err()),
        ("fleet-join", client.fleet_join(id, &[]).await.unwrap_err()),
        ("leave", client.leave_namespace(id).await.unwrap_err()),
        ("members", client.tee_role(id, "ab").await.unwrap_err()),
    ];
    for (call, err) in errors {
        match &err {
            MerodError::Refused {
                status: 409,
                message,
                kind: Some(kind),
                ..
            } if message == "stale counter" && kind == "StaleCounter" => {}
            other => panic!("{call}: {other:?}"),
        }
        let text = err.to_string();
        assert!(
            text.contains("HTTP 409: stale counter (type StaleCounter)"),
            "{call}: {text}"
        );
    }
    // The older shape, without a type, and a body that says nothing.
    let (_s, client) = answering(503, r#"{"error":"undecidable"}"#).await;
    assert!(matches!(
        client.list_namespaces().await,
        Err(MerodError::Refused {
            status: 503,
            kind: None,
            ..
        })
    ));
    let (_s, client) = answering(503, "").await;
    assert!(matches!(
        client.leave_namespace(id).await,
        Err(MerodError::Status { status: 503, .. })
    ));
}

/// The group lists the inventory reads are paged at merod's largest page and read whole,
/// past 100 rows (where a reader of one default page stops) and past one page of 1,000;
/// a server that ignores `offset` is an error, never a list read twice or cut short.
#[tokio::test]
async fn group_lists_are_read_whole_past_one_page_and_a_non_advancing_page_fails() {
    use fleet_sidecar::testing::merod::MerodEmulator;
    let merod = MerodEmulator::start().await.unwrap();
    let ns = "c".repeat(64);
    let sub = "d".repeat(64);
    merod.hold(&ns);
    merod.set_subgroups(&ns, &[&sub]);
    let contexts: Vec<String> = (0..2500).map(|i| format!("ctx{i:05}")).collect();
    merod.set_contexts(&sub, &contexts);
    merod.set_extra_members(1500);
    let client = MerodClient::new(&merod.url()).unwrap();
    let ns_id: GroupId = ns.parse().unwrap();
    let sub_id: GroupId = sub.parse().unwrap();
    assert_eq!(client.subgroups(ns_id).await.unwrap(), [sub_id]);
    assert_eq!(client.group_contexts(sub_id).await.unwrap(), contexts);
    assert_eq!(
        merod.inventory_calls("contexts"),
        3,
        "1,000 a page, overlapping by one"
    );
    // The extra rows, then the owner and the node.
    assert_eq!(client.group_members(ns_id).await.unwrap().len(), 1502);

    merod.set_ignores_offset(true);
    let err = client.group_contexts(sub_id).await.unwrap_err().to_string();
    assert!(err.contains("repeats the one before"), "{err}");
    let err = client.group_members(ns_id).await.unwrap_err().to_string();
    assert!(err.contains("repeats the one before"), "{err}");
    // A group outside every held namespace: merod's bare 500.
    let other: GroupId = "e".repeat(64).parse().unwrap();
    assert!(matches!(
        client.group_contexts(other).await,
        Err(MerodError::Refused { status: 500, .. })
    ));
}

/// A merod that serves fewer rows a page than asked (500 where 1,000 were asked): every
/// group list is still read whole, never its first page taken as all of it; a list of 100
/// rows or more shorter than a page asked costs one read more, a shorter one none.
#[tokio::test]
async fn group_lists_of_a_merod_capping_its_pages_are_read_whole() {
    use fleet_sidecar::testing::merod::MerodEmulator;
    let merod = MerodEmulator::start().await.unwrap();
    let ns = "c".repeat(64);
    merod.hold(&ns);
    let contexts: Vec<String> = (0..1200).map(|i| format!("ctx{i:05}")).collect();
    merod.set_contexts(&ns, &contexts);
    merod.set_extra_members(700);
    let accounts: Vec<String> = (0..600).map(|i| format!("{i:064x}")).collect();
    let rows: Vec<(&str, &[(&str, &str)])> =
        accounts.iter().map(|a| (a.as_str(), &[][..])).collect();
    merod.set_member_devices(&ns, &rows);
    merod.set_page_cap(Some(500));
    let client = MerodClient::new(&merod.url()).unwrap();
    let id: GroupId = ns.parse().unwrap();
    assert_eq!(client.group_contexts(id).await.unwrap(), contexts);
    assert_eq!(
        merod.inventory_calls("contexts"),
        3,
        "500, then 499 new, then the last 201"
    );
    // The extra rows, then the owner and the node.
    assert_eq!(client.group_members(id).await.unwrap().len(), 702);
    assert_eq!(client.member_devices(id).await.unwrap().len(), 600);
    // No cap: a list of 150 rows costs one read more (its page could have been a cap),
    // one of 3 rows none.
    merod.set_page_cap(None);
    let short: Vec<String> = (0..150).map(|i| format!("ctx{i:05}")).collect();
    merod.set_contexts(&ns, &short);
    let before = merod.inventory_calls("contexts");
    assert_eq!(client.group_contexts(id).await.unwrap(), short);
    assert_eq!(merod.inventory_calls("contexts") - before, 2);
    merod.set_contexts(&ns, &short[..3]);
    let before = merod.inventory_calls("contexts");
    assert_eq!(client.group_contexts(id).await.unwrap(), short[..3]);
    assert_eq!(merod.inventory_calls("contexts") - before, 1);
}
