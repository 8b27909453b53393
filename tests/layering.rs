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
    &[
        "backoff", "merod", "metadata", "mrtd", "node_tls", "state", "status",
    ],
    &["mdma"],
    &["reconcile"],
    &["config"],
    &["identity", "logging", "telemetry"],
    &["jobs"],
    &["registration"],
    &["daemon", "fuzzing", "notify"],
    &["cli", "testing"],
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
    named_after(line, "crate::")
}

/// The names a line of code takes from below `prefix` (`crate::`, `super::`): `prefix` + `m`
/// or `prefix` + `{m, n::…}` gives `m` (and `n`).
fn named_after(line: &str, prefix: &str) -> Vec<String> {
    let ident = |s: &str| -> String {
        s.chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect()
    };
    let mut found = Vec::new();
    for (at, _) in line.match_indices(prefix) {
        // `crate::x::super::` is not this prefix: only a path that starts here.
        let before = line[..at].chars().next_back();
        if before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':') {
            continue;
        }
        let rest = &line[at + prefix.len()..];
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

/// Each module of `floors` (bottom first) with its floor's number.
fn floor_of(floors: &[&[&'static str]]) -> BTreeMap<&'static str, usize> {
    floors
        .iter()
        .enumerate()
        .flat_map(|(i, mods)| mods.iter().map(move |m| (*m, i)))
        .collect()
}

/// The floors of the loop's room, `src/daemon/`, bottom first. `daemon.rs` sits on top of
/// them all: it holds the entry points and re-exports, and a file below it names neither
/// `daemon.rs`'s own items (an arrow back up) nor a module on its own floor or above.
const DAEMON_FLOORS: &[&[&str]] = &[
    &["poll", "record", "roles"],
    &["planner"],
    &["deps", "tasks"],
    &["beside", "merod_view", "startup"],
    &["sidecar"],
];

/// The floors of the jobs' room, `src/jobs/`, bottom first. `jobs.rs`, the harness, sits
/// under them all: a job names the harness's items (`Job`, `Schedule`, `spawn`) and the
/// modules on floors below its own, never one on its own floor or above. The harness's own
/// test files are not jobs.
const JOBS_FLOORS: &[&[&str]] = &[
    &[
        "held",
        "limits",
        "node_files",
        "record_file",
        "relay",
        "trees",
        "units",
    ],
    &["install"],
    &[
        "account",
        "device_login",
        "inventory",
        "join_status",
        "logs_token",
        "readiness",
        "swarm",
        "tls_install",
    ],
    &["merod_watch", "recovery"],
];

/// Files of `src/jobs/` that belong to the harness, not to a job (its tests).
const HARNESS_FILES: &[&str] = &["canary", "tests"];

/// What each file of the room `src/{room}/` names of its siblings: module → the names it
/// takes from `super::` (or `crate::{room}::`), code only (doc comments and `mod tests`
/// left out).
fn room_edges(room: &str) -> BTreeMap<String, BTreeSet<String>> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src").join(room);
    let parent = format!("crate::{room}::");
    let mut out: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for entry in fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        assert!(
            path.extension().and_then(|e| e.to_str()) == Some("rs"),
            "{}: a directory or file the floors do not cover",
            path.display()
        );
        let module = path.file_stem().unwrap().to_str().unwrap().to_owned();
        let text = fs::read_to_string(&path).unwrap();
        let code = text.split("#[cfg(test)]\nmod tests").next().unwrap();
        let targets = out.entry(module).or_default();
        for line in code.lines() {
            let line = line.trim_start();
            if line.starts_with("//") {
                continue;
            }
            targets.extend(named_after(line, "super::"));
            targets.extend(named_after(line, &parent));
        }
    }
    out
}

/// The imports inside `src/{room}/` that do not go down its `floors`: a name not on a
/// floor is the room's root's own item, allowed only when `root_is_below`.
fn wrong_in_room(room: &str, floors: &[&[&'static str]], root_is_below: bool) -> Vec<String> {
    let floor_of = floor_of(floors);
    let mut wrong = Vec::new();
    for (module, targets) in room_edges(room) {
        if room == "jobs" && HARNESS_FILES.contains(&module.as_str()) {
            continue;
        }
        let Some(&own) = floor_of.get(module.as_str()) else {
            panic!("src/{room}/{module}.rs is on no floor: add it to the room's floors (and ARCHITECTURE.md)");
        };
        for target in targets {
            match floor_of.get(target.as_str()) {
                None if root_is_below => {}
                None => wrong.push(format!(
                    "{module} names {room}.rs's own {target} (an arrow back up)"
                )),
                Some(&floor) if floor >= own => wrong.push(format!(
                    "{module} (floor {own}) -> {target} (floor {floor})"
                )),
                Some(_) => {}
            }
        }
    }
    wrong
}

#[test]
fn inside_the_daemon_every_import_goes_down_and_none_back_up() {
    let wrong = wrong_in_room("daemon", DAEMON_FLOORS, false);
    assert!(
        wrong.is_empty(),
        "imports inside the daemon that do not go down: {wrong:#?}"
    );
}

#[test]
fn inside_the_jobs_every_import_goes_down_to_a_job_or_the_harness() {
    let wrong = wrong_in_room("jobs", JOBS_FLOORS, true);
    assert!(
        wrong.is_empty(),
        "imports inside the jobs that do not go down: {wrong:#?}"
    );
}

#[test]
fn the_room_scan_sees_sibling_and_parent_names() {
    assert_eq!(
        named_after("use super::{DaemonError, Deps, ALIVE_TURN};", "super::"),
        ["DaemonError", "Deps", "ALIVE_TURN"]
    );
    assert_eq!(
        named_after("let limit = super::limits::MDMA_DEADLINE;", "super::"),
        ["limits"]
    );
    assert!(named_after("use crate::x::super::y;", "super::").is_empty());
    let loop_room = room_edges("daemon");
    assert!(loop_room["sidecar"].contains("tasks"));
    let jobs = room_edges("jobs");
    assert!(jobs["merod_watch"].contains("readiness"));
    assert!(jobs["recovery"].contains("Job"));
}

#[test]
fn no_module_imports_one_on_its_floor_or_above() {
    let floor_of = floor_of(FLOORS);
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

/// Every `.rs` file below `dir`, with its text.
fn sources(dir: &Path, out: &mut Vec<(std::path::PathBuf, String)>) {
    for entry in fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().and_then(|e| e.to_str()) == Some("rs") {
            let text = fs::read_to_string(&path).unwrap();
            out.push((path, text));
        }
    }
}

#[test]
fn the_architecture_is_short_and_its_invariants_name_tests_that_exist() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let page = fs::read_to_string(root.join("ARCHITECTURE.md")).unwrap();
    assert!(
        page.len() <= 9 * 1024,
        "ARCHITECTURE.md is {} bytes",
        page.len()
    );
    let (_, invariants) = page.split_once("## Invariants").unwrap();
    let mut code = Vec::new();
    sources(&root.join("src"), &mut code);
    sources(&root.join("tests"), &mut code);
    let mut named = 0;
    let mut missing = Vec::new();
    for token in invariants.split('`').skip(1).step_by(2) {
        if let Some(file) = token.strip_suffix(".rs") {
            named += 1;
            let found = code.iter().any(|(p, _)| {
                p.file_stem().and_then(|s| s.to_str()) == Some(file.rsplit('/').next().unwrap())
            });
            if !found {
                missing.push(token.to_owned());
            }
        } else if token.contains("::")
            && token.split("::").all(|s| {
                !s.is_empty()
                    && s.chars()
                        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
            })
        {
            named += 1;
            let last = token.rsplit("::").next().unwrap();
            let needle = if last == "tests" {
                "mod tests".to_owned()
            } else {
                format!("fn {last}(")
            };
            if !code.iter().any(|(_, text)| text.contains(&needle)) {
                missing.push(token.to_owned());
            }
        }
    }
    assert!(named >= 15, "only {named} tests named");
    assert!(
        missing.is_empty(),
        "ARCHITECTURE.md names tests that do not exist: {missing:?}"
    );
}

/// The backticked words of `text`, a trailing `.rs` or `/` dropped.
fn backticked(text: &str) -> BTreeSet<String> {
    text.split('`')
        .skip(1)
        .step_by(2)
        .map(|t| t.trim_end_matches('/').trim_end_matches(".rs").to_owned())
        .collect()
}

/// The `//!` lines of a module's file: its own layout comment.
fn inner_doc(path: &Path) -> String {
    fs::read_to_string(path)
        .unwrap()
        .lines()
        .filter_map(|l| l.trim_start().strip_prefix("//!"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The modules of `src/` the maps leave out: a top-level module (`src/x.rs`, `src/x/`)
/// ARCHITECTURE.md's "Rooms" does not name (`x`, `x.rs` or `x/`, or a path in it), a
/// module of a room (`src/x/y.rs`) neither the room's own layout comment (the `//!` of
/// `src/x.rs` or `src/x/mod.rs`) names (`y` or `y.rs`) nor "Rooms" does (`x/y.rs`). Test
/// files (`tests.rs`) are not modules of the map.
fn off_the_map() -> Vec<String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let page = fs::read_to_string(root.join("ARCHITECTURE.md")).unwrap();
    let rooms = page
        .split_once("## Rooms")
        .and_then(|(_, rest)| rest.split("\n## ").next())
        .expect("ARCHITECTURE.md has a \"## Rooms\" section");
    let on_page = backticked(rooms);
    let src = root.join("src");
    let mut missing = Vec::new();
    for entry in fs::read_dir(&src).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_stem().unwrap().to_str().unwrap().to_owned();
        if ["lib", "main", "bin"].contains(&name.as_str()) {
            continue;
        }
        if path.is_file() {
            let top_named = on_page
                .iter()
                .any(|t| *t == name || t.starts_with(&format!("{name}/")));
            if !top_named {
                missing.push(format!("src/{name}.rs: not in ARCHITECTURE.md's Rooms"));
            }
            continue;
        }
        let room_root = [src.join(format!("{name}.rs")), path.join("mod.rs")]
            .into_iter()
            .find(|p| p.exists())
            .unwrap_or_else(|| panic!("src/{name}/ has no {name}.rs nor mod.rs"));
        let layout = backticked(&inner_doc(&room_root));
        for file in fs::read_dir(&path).unwrap() {
            let file = file.unwrap().path();
            let stem = file.file_stem().unwrap().to_str().unwrap().to_owned();
            if ["mod", "tests"].contains(&stem.as_str()) {
                continue;
            }
            let named = layout.contains(&stem)
                || layout.contains(&format!("{name}/{stem}"))
                || on_page.contains(&format!("{name}/{stem}"));
            if !named {
                missing.push(format!(
                    "src/{name}/{stem}.rs: not in {}'s layout comment nor ARCHITECTURE.md's Rooms",
                    room_root.strip_prefix(root).unwrap().display()
                ));
            }
        }
    }
    missing
}

#[test]
fn every_module_is_on_a_map() {
    let missing = off_the_map();
    assert!(missing.is_empty(), "modules off the map: {missing:#?}");
}
