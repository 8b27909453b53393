//! A fleet-inventory tool's test, written on the public API alone with the `testing` fakes
//! (default features off): list what merod holds (two pages of the listing), read the MRTD
//! without side effects, post the inventory to MDMA with the config's token, and see each
//! failure the fakes can inject reach the tool as a typed error.

use std::os::unix::fs::PermissionsExt;
use std::time::Duration;

use fleet_sidecar::testing::mdma::{CallReply, MdmaEmulator};
use fleet_sidecar::testing::merod::{ListBehaviour, MerodEmulator};
use fleet_sidecar::{
    read_mrtd_bounded, resolve_admin_url, CallError, ConfigError, MdmaClient, MerodClient,
    RequestError, ToolConfig,
};
use serde_json::{json, Value};

const TOKEN: &str = "NEVER-LOGGED-TOKEN-inventory";

/// A node's config file for the tool, pointing at the two fakes.
fn node(dir: &std::path::Path, mdma: &MdmaEmulator, merod: &MerodEmulator) -> ToolConfig {
    let token = dir.join("token");
    std::fs::write(&token, format!("{TOKEN}\n")).unwrap();
    std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o600)).unwrap();
    let mrtd = dir.join("mrtd");
    std::fs::write(&mrtd, [0x5a; 48]).unwrap();
    let config = dir.join("fleet-sidecar.toml");
    std::fs::write(
        &config,
        format!(
            "mdma_url = \"{}\"\nfleet_token_file = \"{}\"\nstate_file = \"{}\"\n\
             [merod]\nadmin_url = \"{}\"\n[tdx]\nmrtd_path = \"{}\"\n",
            mdma.url(),
            token.display(),
            dir.join("state.json").display(),
            merod.url(),
            mrtd.display(),
        ),
    )
    .unwrap();
    ToolConfig::load(&config).unwrap()
}

fn id(n: u32) -> String {
    format!("{n:064x}")
}

#[tokio::test]
async fn an_inventory_tool_lists_reads_and_posts_against_the_fakes() {
    let mdma = MdmaEmulator::start(Some(TOKEN.to_owned())).await.unwrap();
    let merod = MerodEmulator::start().await.unwrap();
    for n in 0..150 {
        merod.hold(&id(n));
    }
    mdma.set_answer(
        "/api/fleet/inventory",
        CallReply::Json(200, json!({"stored": 150})),
    );
    let dir = tempfile::tempdir().unwrap();
    let cfg = node(dir.path(), &mdma, &merod);

    let admin = resolve_admin_url(&cfg.merod).url;
    let held = MerodClient::new(&admin)
        .unwrap()
        .list_namespaces()
        .await
        .unwrap();
    assert_eq!(held.len(), 150, "both pages of the listing");

    let tdx = cfg.tdx.without_side_effects();
    let reading =
        tokio::task::spawn_blocking(move || read_mrtd_bounded(&tdx, Duration::from_secs(5)))
            .await
            .unwrap()
            .unwrap();

    let body = json!({
        "mrtd": reading.mrtd,
        "source": reading.source,
        "namespaces": held,
    });
    let client = MdmaClient::from_tool_config(&cfg).unwrap();
    let answer = client
        .post_json("api/fleet/inventory", &body)
        .await
        .unwrap();
    assert_eq!(answer.status, 200);
    assert_eq!(answer.json::<Value>().unwrap(), json!({"stored": 150}));

    let requests = mdma.requests();
    assert_eq!(requests.len(), 1);
    assert_eq!(requests[0].method, "POST");
    assert_eq!(requests[0].token.as_deref(), Some(TOKEN));
    let sent: Value = serde_json::from_str(&requests[0].body).unwrap();
    assert_eq!(sent["mrtd"], "5a".repeat(48));
    assert_eq!(sent["source"], "sysfs");
    assert_eq!(sent["namespaces"][149], id(149));
}

/// The HTTP status a post to `path` is refused with (the error's text never holds the token).
async fn refused_with(client: &MdmaClient, path: &str) -> u16 {
    let err = client.post_json(path, &json!({})).await.unwrap_err();
    assert!(!err.to_string().contains(TOKEN), "{err}");
    match err {
        CallError::Request(RequestError::Status { status, .. }) => status,
        other => panic!("not refused with a status: {other}"),
    }
}

#[tokio::test]
async fn the_fakes_inject_failures_and_hangs_the_tool_sees_as_typed_errors() {
    let mdma = MdmaEmulator::start(Some(TOKEN.to_owned())).await.unwrap();
    let merod = MerodEmulator::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let cfg = node(dir.path(), &mdma, &merod);

    // merod: a listing that never answers is a timeout, a 500 is a status.
    let quick = MerodClient::builder(resolve_admin_url(&cfg.merod).url)
        .check_timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    merod.set_list(ListBehaviour::Hang);
    assert!(quick.list_namespaces().await.unwrap_err().is_timeout());
    merod.set_list(ListBehaviour::Error { status: 500 });
    let err = quick.list_namespaces().await.unwrap_err();
    assert!(err.to_string().contains("HTTP 500"), "{err}");
    // A failure in the middle of a walk over pages fails the whole listing.
    for n in 0..150 {
        merod.hold(&id(n));
    }
    merod.set_list(ListBehaviour::ErrorAfterPages {
        pages: 1,
        status: 503,
    });
    let err = quick.list_namespaces().await.unwrap_err();
    assert_eq!(err.kind(), "status", "{err}");
    assert_eq!(serde_json::to_value(&err).unwrap()["kind"], "status");

    // MDMA: no scripted answer is a 404 (on a route the emulator does not have), a hang a
    // timeout, a path leaving the base refused.
    let creds = cfg.mdma_credentials().unwrap();
    let client = MdmaClient::builder(cfg.mdma_url.clone().unwrap())
        .token(creds.token.unwrap())
        .timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    assert_eq!(refused_with(&client, "api/fleet/notes").await, 404);
    mdma.set_answer("api/fleet/inventory", CallReply::Hang);
    let err = client
        .post_json("/api/fleet/inventory", &json!({}))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, CallError::Request(e) if e.is_timeout()),
        "{err}"
    );
    for path in ["https://elsewhere.example/x", "../x", "", "api?x=1"] {
        let err = client.post_json(path, &json!({})).await.unwrap_err();
        assert!(matches!(err, CallError::Path { .. }), "{path}: {err}");
    }
    // A wrong token is the fake's 401.
    let stranger = MdmaClient::builder(cfg.mdma_url.clone().unwrap())
        .build()
        .unwrap();
    mdma.set_answer("api/fleet/inventory", CallReply::Json(200, json!({})));
    assert_eq!(refused_with(&stranger, "api/fleet/inventory").await, 401);

    // A refusal keeps the start of MDMA's answer (its reason), never the token.
    let reason = json!({"error": "unknown node", "echo": TOKEN});
    mdma.set_answer("api/fleet/inventory", CallReply::Json(403, reason));
    assert_eq!(refused_with(&client, "api/fleet/inventory").await, 403);
    let err = client
        .post_json("api/fleet/inventory", &json!({}))
        .await
        .unwrap_err();
    let CallError::Request(RequestError::Status { body, .. }) = &err else {
        panic!("not refused with a status: {err}")
    };
    assert!(body.contains(r#""error":"unknown node""#), "{body}");
    assert!(
        body.contains("[redacted]") && !body.contains(TOKEN),
        "{body}"
    );
    assert!(err.to_string().contains("HTTP 403: {"), "{err}");

    // A config without mdma_url cannot build the client, and says so in a tool's words.
    let bare = ToolConfig::from_toml("", std::path::Path::new("t.toml")).unwrap();
    let err = MdmaClient::from_tool_config(&bare).unwrap_err();
    assert!(matches!(err, ConfigError::NoMdmaUrl { .. }), "{err}");
    assert_eq!(
        err.to_string(),
        "config file t.toml: mdma_url is not set, so there is no MDMA to call"
    );
}
