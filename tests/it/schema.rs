//! The machine-readable contracts in proto/ (OpenAPI 3.1, JSON Schema 2020-12) hold for
//! every example in proto/, every merod recording in fixtures/merod/ and every state file
//! the daemon writes in these tests ([`assert_state_valid`]), so schema and code cannot
//! drift apart.

use std::path::{Path, PathBuf};

use serde_json::{json, Value};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// `path` parsed, refusing a key written twice in one object: JSON readers keep only one of
/// the two (serde_json the last), so a second copy of a path or schema would silently hide
/// the first from every check here.
fn read_json(path: &Path) -> Value {
    let text = std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    if let Err(e) = serde_json::from_str::<NoDuplicateKeys>(&text) {
        panic!("{}: {e}", path.display());
    }
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{} is not JSON: {e}", path.display()))
}

/// Any JSON document whose objects name each key once (deserializing it fails otherwise).
struct NoDuplicateKeys;

impl<'de> serde::Deserialize<'de> for NoDuplicateKeys {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(NoDuplicateKeys)
    }
}

impl<'de> serde::de::Visitor<'de> for NoDuplicateKeys {
    type Value = NoDuplicateKeys;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("JSON")
    }
    fn visit_bool<E>(self, _: bool) -> Result<Self, E> {
        Ok(self)
    }
    fn visit_i64<E>(self, _: i64) -> Result<Self, E> {
        Ok(self)
    }
    fn visit_u64<E>(self, _: u64) -> Result<Self, E> {
        Ok(self)
    }
    fn visit_f64<E>(self, _: f64) -> Result<Self, E> {
        Ok(self)
    }
    fn visit_str<E>(self, _: &str) -> Result<Self, E> {
        Ok(self)
    }
    fn visit_unit<E>(self) -> Result<Self, E> {
        Ok(self)
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Self, A::Error> {
        while seq.next_element::<NoDuplicateKeys>()?.is_some() {}
        Ok(self)
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Self, A::Error> {
        let mut seen = std::collections::HashSet::new();
        while let Some(key) = map.next_key::<String>()? {
            if !seen.insert(key.clone()) {
                return Err(serde::de::Error::custom(format!(
                    "key {key:?} written twice"
                )));
            }
            map.next_value::<NoDuplicateKeys>()?;
        }
        Ok(self)
    }
}

/// A 2020-12 validator for `schema` (itself checked against the meta-schema first).
fn validator(schema: &Value) -> jsonschema::Validator {
    if let Err(e) = jsonschema::meta::validate(schema) {
        panic!("not a valid JSON Schema: {e}");
    }
    jsonschema::draft202012::new(schema).expect("schema compiles")
}

/// The errors of `instance` against `v`, one per line (empty when valid).
fn errors(v: &jsonschema::Validator, instance: &Value) -> String {
    v.iter_errors(instance)
        .map(|e| format!("{} at {}", e, e.instance_path()))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The state file's schema (proto/state.schema.json).
fn state_validator() -> jsonschema::Validator {
    validator(&read_json(&root().join("proto/state.schema.json")))
}

/// Panics unless `bytes` (a state file the daemon wrote) is valid against
/// proto/state.schema.json, as version 4.
pub fn assert_state_valid(bytes: &[u8]) {
    let doc: Value = serde_json::from_slice(bytes).expect("the state file is JSON");
    let found = errors(&state_validator(), &doc);
    assert!(
        found.is_empty(),
        "state file {doc} breaks the schema:\n{found}"
    );
    assert_eq!(doc["version"], 4, "the daemon writes version 4");
}

/// A validator for `#/components/schemas/{name}` of an OpenAPI 3.1 document (whose schema
/// dialect is JSON Schema 2020-12): the document itself, with a root `$ref`.
fn component(doc: &Value, name: &str) -> jsonschema::Validator {
    component_at(doc, &format!("#/components/schemas/{name}"))
}

fn component_at(doc: &Value, pointer: &str) -> jsonschema::Validator {
    let mut schema = doc.clone();
    let map = schema
        .as_object_mut()
        .expect("an OpenAPI document is an object");
    map.insert("$ref".into(), json!(pointer));
    jsonschema::draft202012::new(&schema).expect("schema compiles")
}

fn openapi(name: &str) -> Value {
    let doc = read_json(&root().join("proto").join(name));
    assert_eq!(doc["openapi"], "3.1.0", "{name} is OpenAPI 3.1");
    doc
}

/// Every `examples` entry of every request and response body in `doc` validates against
/// that body's schema; `externalValue`s are files next to the document. Returns how many.
fn check_examples(doc: &Value, name: &str) -> usize {
    let mut checked = 0;
    for (path, item) in doc["paths"].as_object().expect("paths") {
        for (method, op) in item.as_object().expect("path item") {
            if method == "parameters" {
                continue;
            }
            let mut bodies = vec![(
                format!("{method} {path} request"),
                format!("/paths/{}/{method}/requestBody", escape(path)),
                &op["requestBody"],
            )];
            for (status, resp) in op["responses"].as_object().into_iter().flatten() {
                bodies.push((
                    format!("{method} {path} {status}"),
                    format!("/paths/{}/{method}/responses/{status}", escape(path)),
                    resp,
                ));
            }
            for (what, pointer, body) in bodies {
                let Some(media) = body["content"].get("application/json") else {
                    continue;
                };
                let v = component_at(doc, &format!("#{pointer}/content/application~1json/schema"));
                for (ex_name, ex) in media["examples"].as_object().into_iter().flatten() {
                    let value = match ex.get("externalValue") {
                        Some(file) => read_json(&root().join("proto").join(file.as_str().unwrap())),
                        None => ex["value"].clone(),
                    };
                    let found = errors(&v, &value);
                    assert!(
                        found.is_empty(),
                        "{name}: {what} example {ex_name}:\n{found}"
                    );
                    checked += 1;
                }
            }
        }
    }
    checked
}

/// One path template as a JSON Pointer token inside a URI fragment (`~`, `/`, and the
/// template braces, which a URI cannot hold, escaped).
fn escape(segment: &str) -> String {
    segment
        .replace('~', "~0")
        .replace('/', "~1")
        .replace('{', "%7B")
        .replace('}', "%7D")
}

#[test]
fn the_state_schema_accepts_every_version_the_code_reads_and_nothing_it_refuses() {
    let v = state_validator();
    for file in [
        "state-v4.json",
        "state-v3.json",
        "state-v2.json",
        "state-v1.json",
    ] {
        let text = std::fs::read(root().join("proto").join(file)).unwrap();
        let found = errors(&v, &serde_json::from_slice(&text).unwrap());
        assert!(found.is_empty(), "{file}:\n{found}");
        fleet_sidecar::state::parse_state(&text, Path::new(file)).expect("the code reads it");
    }
    let id = crate::common::A;
    let accepted = [
        json!([id]),
        json!({"version": 1, "confirmed": []}),
        json!({"version": 2, "admitted": [], "confirmed": []}),
        json!({"version": 3, "admitted": [], "confirmed": []}),
        json!({"version": 4, "admitted": [], "confirmed": []}),
        json!({"version": 4, "admitted": [id], "confirmed": [], "observed_ms": 5000,
               "absent": {(id): {"polls": 2, "since_ms": 1000}}, "recent_leaves_ms": [4000]}),
    ];
    for doc in accepted {
        assert!(v.is_valid(&doc), "{doc}");
    }
    // What parse_state refuses, the schema refuses too.
    let refused = [
        json!({}),
        json!({"version": 5, "admitted": [], "confirmed": []}),
        json!({"version": 2, "admitted": [], "confirmed": [], "joining": []}),
        json!({"version": 4, "admitted": [], "confirmed": [], "absent_polls": {}}),
        json!({"version": 3, "admitted": [], "confirmed": [], "absent": {}}),
        json!({"version": 4, "admitted": [], "confirmed": [], "observed_ms": -1}),
        json!({"version": 4, "admitted": [], "confirmed": [], "absent": {(id): 1}}),
        json!({"version": 4, "admitted": [], "confirmed": [], "absent": {(id): {"polls": 1}}}),
        json!({"version": 4, "admitted": [], "confirmed": [], "recent_leaves_ms": [1.5]}),
        json!({"version": 3, "admitted": [], "confirmed": [], "joining": ["abcd"]}),
        json!({"version": 2, "confirmed": []}),
        json!({"version": 2, "admitted": [], "confirmed": [], "extra": 1}),
        json!({"version": 1, "confirmed": [], "admitted": []}),
        json!({"version": 2, "admitted": ["abcd"], "confirmed": []}),
        json!({"version": 2, "admitted": [], "confirmed": [], "absent_polls": {"x": 1}}),
        json!({"version": 2, "admitted": [], "confirmed": [], "absent_polls": {(id): -1}}),
        json!(null),
        json!("x"),
    ];
    for doc in refused {
        assert!(!v.is_valid(&doc), "the schema accepts {doc}");
        let bytes = serde_json::to_vec(&doc).unwrap();
        assert!(
            fleet_sidecar::state::parse_state(&bytes, Path::new("t")).is_err(),
            "the code accepts {doc}"
        );
    }
}

#[test]
fn every_mdma_example_matches_the_openapi_document() {
    let doc = openapi("mdma.openapi.json");
    assert_eq!(check_examples(&doc, "mdma.openapi.json"), 5);
    // The shapes the sidecar refuses (mdma::parse_should_join) break the answer schema.
    let answer = component(&doc, "ShouldJoinAnswer");
    for bad in [
        json!({}),
        json!({"assignments": {}}),
        json!({"assignments": [{}]}),
        json!({"assignments": [{"group_id": "abcd"}]}),
        json!({"assignments": [], "retain": [1]}),
        json!([]),
    ] {
        assert!(!answer.is_valid(&bad), "the schema accepts {bad}");
        let bytes = serde_json::to_vec(&bad).unwrap();
        assert!(fleet_sidecar::mdma::parse_should_join(&bytes).is_err());
    }
    // The recovery envelopes' bodies, as the client renders them.
    let key = fleet_sidecar::mdma::RecoveryKey {
        peer_id: "12D3KooWJ6X2tBZEd8qKWvJyhtH2v2XyP4eQ9dcU2xZ8Y6YrjcVk"
            .parse()
            .unwrap(),
        account_id: "ab".repeat(32),
        namespace_id: "cd".repeat(32).parse().unwrap(),
    };
    let put = fleet_sidecar::mdma::RecoveryEnvelope {
        key: key.clone(),
        ciphertext: r#"{"accountRootEpoch":1}"#.to_owned(),
        version: 1,
    };
    let put = serde_json::to_value(put).unwrap();
    assert!(component(&doc, "RecoveryEnvelopeRequest").is_valid(&put));
    assert!(component(&doc, "RecoveryKeyRequest").is_valid(&serde_json::to_value(key).unwrap()));
    assert!(
        !component(&doc, "RecoveryKeyRequest").is_valid(&put),
        "a delete names only the key"
    );
    let request = component(&doc, "ShouldJoinRequest");
    assert!(request
        .is_valid(&json!({"peer_id": "12D3KooWJ6X2tBZEd8qKWvJyhtH2v2XyP4eQ9dcU2xZ8Y6YrjcVk"})));
    // A register body binds its quote only as "registration"; the fallback sends no binding.
    let register = component(&doc, "RegisterRequest");
    let mut body: Value = read_json(&root().join("proto/mdma-register.request.json"));
    assert!(register.is_valid(&body));
    body["quote_binding"] = json!("other");
    assert!(!register.is_valid(&body));
    body.as_object_mut().unwrap().remove("quote_binding");
    assert!(register.is_valid(&body));
    // A CSR, when sent, is one line of base64.
    body["csr"] = json!("MIIBDzCBtgIBADAYMRYwFAYDVQQDDA1yZWxheS5leGFtcGxl");
    assert!(register.is_valid(&body));
    for bad in [json!(""), json!("MIIB\nDzCB"), json!(null)] {
        body["csr"] = bad.clone();
        assert!(!register.is_valid(&body), "the schema accepts csr {bad}");
    }
}

/// The path template of `doc` that `path` (a concrete request path) matches.
fn template<'a>(doc: &'a Value, path: &str) -> Option<&'a str> {
    // The query (`?offset=…`) is not part of the path.
    let path = path.split('?').next().unwrap_or(path);
    let segments: Vec<&str> = path.split('/').collect();
    doc["paths"]
        .as_object()?
        .keys()
        .map(String::as_str)
        .find(|t| {
            let ts: Vec<&str> = t.split('/').collect();
            ts.len() == segments.len()
                && ts
                    .iter()
                    .zip(&segments)
                    .all(|(t, s)| t == s || (t.starts_with('{') && t.ends_with('}')))
        })
}

#[test]
fn every_merod_recording_matches_the_openapi_document() {
    let doc = openapi("merod-admin.openapi.json");
    assert_eq!(check_examples(&doc, "merod-admin.openapi.json"), 2);
    let dir = root().join("fixtures/merod");
    let mut recordings = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "json") {
            continue;
        }
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let rec = read_json(&path);
        let (req, resp) = (&rec["request"], &rec["response"]);
        let method = req["method"].as_str().unwrap().to_lowercase();
        let t = template(&doc, req["path"].as_str().unwrap())
            .unwrap_or_else(|| panic!("{name}: path not in the document"));
        let op = &doc["paths"][t][&method];
        assert!(op.is_object(), "{name}: {method} {t} not in the document");
        let status = resp["status"].as_u64().unwrap();
        let key = op["responses"]
            .get(status.to_string())
            .map(|_| status.to_string())
            .unwrap_or_else(|| panic!("{name}: status {status} not documented"));
        // An empty answer (recorded as null): documented without a body.
        if resp["body"].is_null() {
            assert!(
                op["responses"][&key].get("content").is_none(),
                "{name}: recorded empty, documented with a body"
            );
            recordings += 1;
            continue;
        }
        let pointer = format!(
            "#/paths/{}/{method}/responses/{key}/content/application~1json/schema",
            escape(t)
        );
        let found = errors(&component_at(&doc, &pointer), &resp["body"]);
        assert!(
            found.is_empty(),
            "{name}: answer breaks the schema:\n{found}"
        );
        if req["content_type"] == "application/json" {
            let pointer = format!(
                "#/paths/{}/{method}/requestBody/content/application~1json/schema",
                escape(t)
            );
            let v = component_at(&doc, &pointer);
            if (200..300).contains(&status) {
                let found = errors(&v, &req["body"]);
                assert!(
                    found.is_empty(),
                    "{name}: request breaks the schema:\n{found}"
                );
            } else if status == 400 {
                assert!(
                    !v.is_valid(&req["body"]),
                    "{name}: merod refused a request the schema accepts"
                );
            }
        }
        recordings += 1;
    }
    assert!(recordings >= 18, "only {recordings} recordings found");
}

#[test]
fn the_bash_sidecar_schema_and_the_import_agree_on_its_files() {
    use fleet_sidecar::state::bash_import::{parse_admitted, parse_leave_pending};
    let doc = read_json(&root().join("proto/bash-sidecar.schema.json"));
    let admitted = component_at(&doc, "#/$defs/admitted");
    let pending = component_at(&doc, "#/$defs/leavePending");
    let dir = root().join("fixtures/bash-sidecar");
    let file = |name: &str| std::fs::read(dir.join(name)).unwrap();
    let json = |bytes: &[u8]| serde_json::from_slice::<Value>(bytes).unwrap();
    let sample = file("fleet-admitted.json");
    assert!(errors(&admitted, &json(&sample)).is_empty());
    parse_admitted(&sample, Path::new("fleet-admitted.json")).expect("the code reads it");
    let sample = file("fleet-leave-pending.json");
    assert!(errors(&pending, &json(&sample)).is_empty());
    parse_leave_pending(&sample, Path::new("p")).expect("the code reads it");
    // The confirmed file beside them is the state schema's bare array.
    assert!(state_validator().is_valid(&json(&file("fleet-confirmed.json"))));

    let id = crate::common::A;
    for doc in [json!([]), json!([id, id.to_uppercase()])] {
        assert!(admitted.is_valid(&doc), "{doc}");
        parse_admitted(&serde_json::to_vec(&doc).unwrap(), Path::new("a")).unwrap();
    }
    for doc in [json!({}), json!([1]), json!(["abcd"]), json!(null)] {
        assert!(!admitted.is_valid(&doc), "the schema accepts {doc}");
        assert!(parse_admitted(&serde_json::to_vec(&doc).unwrap(), Path::new("a")).is_err());
    }
    for doc in [
        json!({}),
        json!({"absent_since": {(id): 1}, "recent_leaves": [0], "suspicious": true, "deferred": [id]}),
    ] {
        assert!(pending.is_valid(&doc), "{doc}");
        parse_leave_pending(&serde_json::to_vec(&doc).unwrap(), Path::new("p")).unwrap();
    }
    for doc in [
        json!([]),
        json!({"absent_since": {(id): -1}}),
        json!({"absent_since": {(id): 1.5}}),
        json!({"absent_since": {"abcd": 1}}),
        json!({"recent_leaves": ["x"]}),
        json!({"suspicious": 1}),
        json!({"other": 1}),
    ] {
        assert!(!pending.is_valid(&doc), "the schema accepts {doc}");
        assert!(
            parse_leave_pending(&serde_json::to_vec(&doc).unwrap(), Path::new("p")).is_err(),
            "the code accepts {doc}"
        );
    }
}

#[test]
fn a_key_written_twice_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("twice.json");
    std::fs::write(
        &path,
        r#"{"paths": {"/a": {}, "/b": [1, {"x": 1, "x": 2}]}}"#,
    )
    .unwrap();
    let refused = std::panic::catch_unwind(|| read_json(&path)).unwrap_err();
    let text = refused.downcast_ref::<String>().unwrap();
    assert!(text.contains(r#"key "x" written twice"#), "{text}");
    std::fs::write(&path, r#"{"paths": {"/a": {"x": 1}, "/b": [{"x": 2}]}}"#).unwrap();
    assert_eq!(read_json(&path)["paths"]["/b"][0]["x"], 2);
}

#[test]
fn every_json_file_in_proto_and_fixtures_names_each_key_once() {
    fn walk(dir: &Path, n: &mut usize) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(&path, n);
            } else if path.extension().is_some_and(|e| e == "json") {
                read_json(&path);
                *n += 1;
            }
        }
    }
    let mut n = 0;
    walk(&root().join("proto"), &mut n);
    walk(&root().join("fixtures"), &mut n);
    assert!(n > 40, "only {n} JSON files found");
}
