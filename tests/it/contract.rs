//! Contract tests: every recorded merod answer in fixtures/merod/ that the sidecar consumes
//! is served verbatim (status and body) and read through the real client code path.

use std::path::PathBuf;

use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::Router;
use fleet_sidecar::GroupId;
use fleet_sidecar::{Admission, MerodClient, Node};
use serde_json::Value;

fn fixture(name: &str) -> Value {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/merod")
        .join(format!("{name}.json"));
    let text = std::fs::read_to_string(&path).expect("fixture readable");
    serde_json::from_str(&text).expect("fixture is JSON")
}

/// A loopback server of `router`, stopped when dropped.
struct ServerHandle {
    addr: std::net::SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl ServerHandle {
    fn url(&self) -> url::Url {
        format!("http://{}/", self.addr).parse().unwrap()
    }
}

impl Drop for ServerHandle {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn serve(router: Router) -> std::io::Result<ServerHandle> {
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
        ("fleet-join-unknown-namespace", (false, "announced")),
    ] {
        let (_s, client, f) = replay(name).await;
        let got = client.fleet_join(id_of(&f)).await.unwrap();
        assert_eq!(
            got,
            Admission {
                admitted: want.0,
                status: want.1.to_owned(),
                reasons: Vec::new(),
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
        let err = client.fleet_join(id).await.unwrap_err().to_string();
        let message = f["response"]["body"]["error"].as_str().unwrap();
        assert!(err.contains(message), "{name}: {err}");
        assert!(err.contains("fleet-join"), "{name}: {err}");
    }
}

#[tokio::test]
async fn fleet_join_in_a_data_wrapper_is_read_too() {
    let inner = fixture("fleet-join-admitted")["response"]["body"].clone();
    let wrapped = serde_json::json!({ "data": inner });
    let got = fleet_sidecar::parse_fleet_join(&wrapped).unwrap();
    assert!(got.admitted);
    assert!(fleet_sidecar::parse_fleet_join(&serde_json::json!({"status": "joined"})).is_err());
    assert!(fleet_sidecar::parse_fleet_join(&serde_json::json!({"admitted": "true"})).is_err());
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
    ];
    // Served by the merod emulator only (the sidecar does not call these routes).
    let emulator_only = ["health", "ready"];
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
}

/// The client bounds its own calls: a tool that reuses it cannot hang on a stuck merod.
#[tokio::test]
async fn every_call_has_its_own_deadline() {
    use fleet_sidecar::MerodOp;
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
        client.fleet_join(id).await.unwrap_err(),
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
    let merod = fleet_sidecar::emulator::merod::MerodEmulator::start()
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
