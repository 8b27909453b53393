//! Measures `parse_should_join` on a should-join answer with 10,000 assignments (each with an
//! ignored `admitter_addrs` field) against a plain `serde_json::Value` parse of the same body,
//! and prints the figures. Run in release: `cargo run --release --example should-join-parse`.

use std::time::Instant;

use fleet_sidecar::mdma::parse_should_join;

fn main() {
    let entries: Vec<String> = (0..10_000u32)
        .map(|i| {
            format!(r#"{{"group_id":"{i:064x}","admitter_addrs":["/ip4/10.0.0.1/tcp/4001"]}}"#)
        })
        .collect();
    let body = format!(r#"{{"assignments":[{}],"retain":[]}}"#, entries.join(","));
    let runs = 50;
    let time = |f: &dyn Fn()| {
        f();
        let t = Instant::now();
        for _ in 0..runs {
            f();
        }
        t.elapsed() / runs
    };
    let strict = time(&|| {
        let d = parse_should_join(body.as_bytes()).expect("valid body");
        assert_eq!(d.assignments.len(), 10_000);
    });
    let value = time(&|| {
        let v: serde_json::Value = serde_json::from_slice(body.as_bytes()).expect("JSON");
        assert!(v.is_object());
    });
    println!(
        "body {} bytes, 10000 entries: parse_should_join {:.2} ms (duplicate-key check + typed parse), serde_json::Value alone {:.2} ms; mean of {runs}",
        body.len(),
        strict.as_secs_f64() * 1e3,
        value.as_secs_f64() * 1e3
    );
}
