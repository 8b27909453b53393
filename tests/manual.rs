//! The operator's manual (`docs/operator/`) says what the code does, key for key and metric
//! for metric: every config key the parser accepts is in the configuration table and every
//! row names a key it accepts; every metric the daemon declares is named in the manual and
//! every metric the manual names is declared; every alert of the shipped rules has its
//! runbook.

use std::collections::BTreeSet;
use std::fs;
use std::path::Path;

use fleet_sidecar::daemon::Telemetry;
use fleet_sidecar::Config;

fn read(rel: &str) -> String {
    fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(rel)).unwrap()
}

/// The keys the config parser accepts at the top (`table` empty) or in `[table]`: the list
/// serde gives when it refuses an unknown one.
fn accepted_keys(table: &str) -> BTreeSet<String> {
    let text = if table.is_empty() {
        "not_a_key = 1\n".to_owned()
    } else {
        format!("[{table}]\nnot_a_key = 1\n")
    };
    let Err(err) = Config::from_toml(&text, Path::new("probe.toml")) else {
        panic!("an unknown key in [{table}] is accepted");
    };
    let err = err.to_string();
    // serde names two keys as "expected `a` or `b`", more as "expected one of `a`, `b`".
    let list = match err.split_once("expected one of ") {
        Some((_, list)) => list.replace(" or ", ", "),
        None => err
            .split_once("expected ")
            .unwrap_or_else(|| panic!("no list of keys in: {err}"))
            .1
            .replace(" or ", ", "),
    };
    list.split(", ")
        .map(|k| k.trim().trim_matches('`').to_owned())
        .collect()
}

#[test]
fn the_configuration_table_lists_exactly_the_keys_the_parser_accepts() {
    const TABLES: [&str; 8] = [
        "merod",
        "tdx",
        "registration",
        "tls",
        "logs_token",
        "inventory",
        "recovery",
        "device_login",
    ];
    let mut code = BTreeSet::new();
    for key in accepted_keys("") {
        if TABLES.contains(&key.as_str()) {
            code.insert(format!("[{key}]"));
        } else {
            code.insert(key);
        }
    }
    for table in TABLES {
        code.extend(
            accepted_keys(table)
                .into_iter()
                .map(|k| format!("[{table}] {k}")),
        );
    }
    let page = read("docs/operator/configuration.md");
    let documented: BTreeSet<String> = page
        .lines()
        .filter_map(|l| l.strip_prefix("| `"))
        .filter_map(|l| l.split_once("` |").map(|(k, _)| k.to_owned()))
        .collect();
    // A table is documented by its own row or by the rows of its keys.
    let missing: Vec<_> = code
        .iter()
        .filter(|k| !documented.contains(*k))
        .filter(|k| {
            !(k.starts_with('[')
                && k.ends_with(']')
                && documented.iter().any(|d| d.starts_with(k.as_str())))
        })
        .collect();
    let unknown: Vec<_> = documented.difference(&code).collect();
    assert!(
        missing.is_empty() && unknown.is_empty(),
        "not in docs/operator/configuration.md: {missing:?}; documented but not accepted: {unknown:?}"
    );
    assert!(code.len() > 30, "the probe found the keys: {code:?}");
}

/// Every `fleet_sidecar_…` name in `text`.
fn metric_names(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = text;
    while let Some(at) = rest.find("fleet_sidecar_") {
        let tail = &rest[at..];
        let end = tail
            .find(|c: char| !(c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'))
            .unwrap_or(tail.len());
        out.insert(tail[..end].trim_end_matches('_').to_owned());
        rest = &tail[end..];
    }
    out
}

#[test]
fn the_manual_names_every_metric_the_daemon_declares_and_no_other() {
    // Each family is declared once, `registry.register("<name>", …)` on the registry whose
    // prefix is `fleet_sidecar`; a fresh telemetry exports only the families with samples.
    let source = read("src/telemetry.rs");
    let families: BTreeSet<String> = source
        .split("registry.register(")
        .skip(1)
        .filter_map(|after| after.split('"').nth(1))
        .map(|name| format!("fleet_sidecar_{name}"))
        .collect();
    assert!(families.len() > 20, "{families:?}");
    let exported = metric_names(&Telemetry::new().encode_metrics());
    assert!(
        exported
            .iter()
            .all(|n| families.iter().any(|f| n.starts_with(f.as_str()))),
        "the source scan misses a family: {exported:?} vs {families:?}"
    );
    let mut manual = String::new();
    for entry in fs::read_dir(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/operator")).unwrap()
    {
        manual += &fs::read_to_string(entry.unwrap().path()).unwrap();
    }
    // The Ansible role's variables share the prefix (ansible-lint asks for the role's name):
    // they are the ones its defaults declare, and not metrics.
    let role_variables: BTreeSet<String> =
        read("packaging/ansible/roles/fleet_sidecar/defaults/main.yml")
            .lines()
            .filter_map(|l| l.split_once(':').map(|(k, _)| k.to_owned()))
            .filter(|k| k.starts_with("fleet_sidecar_"))
            .collect();
    assert!(role_variables.len() > 5, "{role_variables:?}");
    let named: BTreeSet<String> = metric_names(&manual)
        .difference(&role_variables)
        .cloned()
        .collect();
    // A counter's samples end in `_total`, a histogram's in `_bucket`, `_count`, `_sum`.
    let family_of = |name: &str| -> Option<String> {
        [name, name.trim_end_matches("_total")]
            .into_iter()
            .chain(
                ["_bucket", "_count", "_sum"]
                    .iter()
                    .filter_map(|s| name.strip_suffix(s)),
            )
            .find(|n| families.contains(*n))
            .map(str::to_owned)
    };
    let unknown: Vec<_> = named.iter().filter(|n| family_of(n).is_none()).collect();
    let covered: BTreeSet<String> = named.iter().filter_map(|n| family_of(n)).collect();
    let undocumented: Vec<_> = families.difference(&covered).collect();
    assert!(
        unknown.is_empty() && undocumented.is_empty(),
        "named in docs/operator/ but not declared: {unknown:?}; declared but not in docs/operator/: {undocumented:?}"
    );
}

#[test]
fn every_alert_of_the_shipped_rules_has_its_runbook() {
    let rules = read("packaging/monitoring/fleet-sidecar.rules.yml");
    let alerts: Vec<&str> = rules
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- alert: "))
        .map(str::trim)
        .collect();
    assert!(alerts.len() >= 10, "{alerts:?}");
    let page = read("docs/operator/monitoring.md");
    let missing: Vec<_> = alerts
        .iter()
        .filter(|a| !page.lines().any(|l| l == format!("### {a}")))
        .collect();
    assert!(
        missing.is_empty(),
        "no runbook (a `### <alert>` section) in docs/operator/monitoring.md: {missing:?}"
    );
}

/// GitHub's anchor of a heading: lowercase, spaces to `-`, other punctuation dropped.
fn anchor(heading: &str) -> String {
    heading
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '_' || c == '-' => Some(c),
            _ => None,
        })
        .collect()
}

#[test]
fn every_link_between_the_docs_resolves_to_a_file_and_heading() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut pages = vec![
        root.join("README.md"),
        root.join("ARCHITECTURE.md"),
        root.join("RELIABILITY.md"),
        root.join("bench/RESULTS.md"),
    ];
    for dir in ["docs", "docs/operator"] {
        for entry in fs::read_dir(root.join(dir)).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().and_then(|e| e.to_str()) == Some("md") {
                pages.push(path);
            }
        }
    }
    let mut broken = Vec::new();
    for page in &pages {
        let text = fs::read_to_string(page).unwrap();
        // Code blocks hold examples, not links.
        let prose: String = text.split("```").step_by(2).collect();
        for (at, _) in prose.match_indices("](") {
            let Some(target) = prose[at + 2..].split(')').next() else {
                continue;
            };
            if target.starts_with("http") || target.contains(' ') {
                continue;
            }
            let (path, heading) = target.split_once('#').unwrap_or((target, ""));
            let file = if path.is_empty() {
                page.clone()
            } else {
                page.parent().unwrap().join(path)
            };
            let ok = file.exists()
                && (heading.is_empty()
                    || fs::read_to_string(&file).is_ok_and(|t| {
                        t.lines()
                            .filter_map(|l| {
                                l.trim_start_matches('#')
                                    .strip_prefix(' ')
                                    .filter(|_| l.starts_with('#'))
                            })
                            .any(|h| anchor(h) == heading)
                    }));
            if !ok {
                broken.push(format!(
                    "{}: {target}",
                    page.strip_prefix(root).unwrap().display()
                ));
            }
        }
    }
    assert!(pages.len() > 10, "{pages:?}");
    assert!(broken.is_empty(), "links that lead nowhere: {broken:#?}");
}
