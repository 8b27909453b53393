//! The code and its tests say why, not which issue or round asked: a comment that reads
//! "issue 19" or "third round" tells a reader nothing once the tracker moves on. The
//! comments of every file under `src/`, `tests/`, `benches/` and `examples/` are read.

use std::fs;
use std::path::{Path, PathBuf};

/// Ordinals that make a "third round" or "second wave".
const ORDINALS: &[&str] = &[
    "first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth", "tenth",
];

/// Where the comment in `line` (after `//`, any case) names history: "issue N", "issues
/// N", "issue #N", "round N", or an ordinal before "round" or "wave".
fn history_in(line: &str) -> Option<String> {
    let (_, comment) = line.split_once("//")?;
    let lower = comment.to_lowercase();
    let words: Vec<&str> = lower
        .split(|c: char| !(c.is_alphanumeric() || c == '#'))
        .filter(|w| !w.is_empty())
        .collect();
    for pair in words.windows(2) {
        let (a, b) = (pair[0], pair[1]);
        let numbered = b
            .trim_start_matches('#')
            .starts_with(|c: char| c.is_ascii_digit());
        let named = matches!(a, "issue" | "issues" | "round") && numbered;
        let ordinal = ORDINALS.contains(&a) && matches!(b, "round" | "wave");
        if named || ordinal {
            return Some(format!("{a} {b}"));
        }
    }
    None
}

fn files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            files(&path, out);
        } else {
            out.push(path);
        }
    }
}

#[test]
fn no_file_of_the_code_or_its_tests_names_an_issue_or_a_round() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut all = Vec::new();
    for dir in ["src", "tests", "benches", "examples"] {
        files(&root.join(dir), &mut all);
    }
    let this = Path::new(file!()).file_name().unwrap();
    let mut found = Vec::new();
    for path in all {
        if path.file_name() == Some(this) {
            continue;
        }
        let Ok(text) = fs::read_to_string(&path) else {
            continue;
        };
        for (n, line) in text.lines().enumerate() {
            if let Some(what) = history_in(line) {
                let rel = path.strip_prefix(root).unwrap();
                found.push(format!("{}:{}: {what}", rel.display(), n + 1));
            }
        }
    }
    assert!(
        found.is_empty(),
        "history instead of why (say what the code guards against): {found:#?}"
    );
}

#[test]
fn the_scan_finds_each_way_of_naming_history_and_nothing_else() {
    for line in [
        "// issue 19.8: SIGHUP",
        "//! Reliability, third round: faults",
        "/// Item 3 of Issue 24",
        "// see issues #12 and 13",
        "// the second wave's figures",
        "// (round 2)",
    ] {
        assert!(history_in(line).is_some(), "{line}");
    }
    for line in [
        "// a round of role checks after each read",
        "// the issued token",
        "// a round robin of re-reads",
        "let issue = 3;",
        "// every 10th attempt",
    ] {
        assert_eq!(history_in(line), None, "{line}");
    }
}
