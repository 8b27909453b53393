//! The crate's layering: every module of `src/` sits on a floor, and a module imports only
//! from floors below its own (so no import runs up a floor, and none loops). An edge is any
//! `crate::<module>` in code (doc comments and `#[cfg(test)] mod tests` left out), in the
//! module's file and the files under its directory. ARCHITECTURE.md names the floors.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::Path;

/// The floors, bottom first.
const FLOORS: &[&[&str]] = &[
    &["dropped", "durable", "ids", "net", "outcome", "strict_json"],
    &["backoff", "merod", "mrtd", "state"],
    &["mdma"],
    &["reconcile"],
    &["config"],
    &["identity", "logging", "telemetry"],
    &["registration"],
    &["daemon", "fuzzing", "notify"],
    &["cli", "emulator"],
];

/// The `crate::` edges of every module: module → modules it names.
fn edges() -> BTreeMap<String, BTreeSet<String>> {
    let mut out: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut stack = vec![src.clone()];
    while let Some(dir) = stack.pop() {
        for entry in fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
                continue;
            }
            if path.extension().and_then(|e| e.to_str()) != Some("rs") {
                continue;
            }
            let rel = path.strip_prefix(&src).unwrap();
            let first = rel.components().next().unwrap().as_os_str();
            let module = first.to_str().unwrap().trim_end_matches(".rs").to_owned();
            if ["lib", "main", "bin"].contains(&module.as_str()) {
                continue;
            }
            let text = fs::read_to_string(&path).unwrap();
            let code = text.split("#[cfg(test)]\nmod tests").next().unwrap();
            let targets = out.entry(module.clone()).or_default();
            for line in code.lines() {
                let line = line.trim_start();
                if line.starts_with("//") {
                    continue;
                }
                for used in named_modules(line) {
                    if used != module {
                        targets.insert(used);
                    }
                }
            }
        }
    }
    out
}

/// The modules a line of code names as `crate::m` or `crate::{m, n::…}`.
fn named_modules(line: &str) -> Vec<String> {
    let ident = |s: &str| -> String {
        s.chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect()
    };
    let mut found = Vec::new();
    for (at, _) in line.match_indices("crate::") {
        let rest = &line[at + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            // Top-level names of the group only (`a::{b, c}` inside names `a`).
            let mut depth = 0;
            let mut start = true;
            for (i, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => start = true,
                    c if start && depth == 0 && !c.is_whitespace() => {
                        found.push(ident(&group[i..]));
                        start = false;
                    }
                    _ => {}
                }
            }
        } else {
            found.push(ident(rest));
        }
    }
    found.retain(|m| !m.is_empty() && m != "self");
    found
}

#[test]
fn no_module_imports_one_on_its_floor_or_above() {
    let floor_of: BTreeMap<&str, usize> = FLOORS
        .iter()
        .enumerate()
        .flat_map(|(i, mods)| mods.iter().map(move |m| (*m, i)))
        .collect();
    let edges = edges();
    let mut upward = Vec::new();
    for (module, targets) in &edges {
        let Some(&own) = floor_of.get(module.as_str()) else {
            panic!("src/{module} is on no floor: add it to FLOORS (and ARCHITECTURE.md)");
        };
        for target in targets {
            let Some(&floor) = floor_of.get(target.as_str()) else {
                panic!("{module} names crate::{target}, which is on no floor");
            };
            if floor >= own {
                upward.push(format!(
                    "{module} (floor {own}) -> {target} (floor {floor})"
                ));
            }
        }
    }
    assert!(
        upward.is_empty(),
        "imports that do not go down: {upward:#?}"
    );
}

#[test]
fn the_scan_sees_plain_and_grouped_imports() {
    assert_eq!(named_modules("use crate::ids::GroupId;"), ["ids"]);
    assert_eq!(
        named_modules("use crate::{notify, telemetry::{self, Telemetry}};"),
        ["notify", "telemetry"]
    );
    assert_eq!(
        named_modules("let x = crate::backoff::RETRY.wait(1, 0.0);"),
        ["backoff"]
    );
    // The modules it found in this crate include the daemon and what it stands on.
    let edges = edges();
    assert!(edges["daemon"].contains("reconcile"));
    assert!(edges["daemon"].contains("telemetry"));
}
