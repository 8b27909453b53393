//! Replays every fuzz target's committed corpus (`fuzz/corpus/<target>/`) and its
//! regression inputs (`fuzz/regressions/<target>/`, crashes the fuzzer once found) through
//! the real parser, on stable and without cargo-fuzz: a parser that panics on any of them
//! fails this test. See FUZZING.md.

use std::path::Path;

use fleet_sidecar::fuzzing::TARGETS;

fn inputs(dir: &Path) -> Vec<std::path::PathBuf> {
    match std::fs::read_dir(dir) {
        Ok(entries) => entries
            .map(|e| e.expect("corpus entry").path())
            .filter(|p| p.is_file())
            .collect(),
        Err(_) => Vec::new(),
    }
}

#[test]
fn every_target_survives_its_corpus_and_regressions() {
    let fuzz = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz");
    for (name, target) in TARGETS {
        let corpus = inputs(&fuzz.join("corpus").join(name));
        assert!(!corpus.is_empty(), "fuzz/corpus/{name} holds no input");
        for file in corpus
            .iter()
            .chain(&inputs(&fuzz.join("regressions").join(name)))
        {
            let data = std::fs::read(file).expect("corpus file readable");
            let outcome = std::panic::catch_unwind(|| target(&data));
            assert!(outcome.is_ok(), "{name} panicked on {}", file.display());
        }
    }
}

#[test]
fn every_fuzz_target_has_a_corpus_and_a_cargo_fuzz_binary() {
    let fuzz = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz");
    let manifest = std::fs::read_to_string(fuzz.join("Cargo.toml")).expect("fuzz/Cargo.toml");
    for (name, _) in TARGETS {
        assert!(
            manifest.contains(&format!("name = \"{name}\"")),
            "fuzz/Cargo.toml has no [[bin]] {name}"
        );
        assert!(fuzz
            .join("fuzz_targets")
            .join(format!("{name}.rs"))
            .is_file());
    }
}
