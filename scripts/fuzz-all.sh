#!/usr/bin/env bash
# Runs every fuzz target for FUZZ_RUNS executions (default 1,000,000) on its corpus with a
# 1 s hang limit and a 1 GiB RSS limit, then minimizes the corpus; prints one line a target:
# runs, seconds, libFuzzer's edge coverage (cov) and features (ft), corpus size, peak RSS.
# Needs a nightly toolchain and cargo-fuzz (`cargo install cargo-fuzz`); see FUZZING.md.
set -euo pipefail
cd "$(dirname "$0")/../fuzz"
runs=${FUZZ_RUNS:-1000000}
targets=${*:-should_join fleet_join namespace_get state_file sidecar_config merod_config sysfs_mrtd tdreport quote}
echo "commit $(git rev-parse --short HEAD), $(nproc) cores, $(cargo +nightly --version)"
for t in $targets; do
  log=$(mktemp)
  start=$(date +%s.%N)
  cargo +nightly fuzz run "$t" "corpus/$t" -- -runs="$runs" -timeout=1 -rss_limit_mb=1024 \
    -max_len=16384 -print_final_stats=1 >"$log" 2>&1 || { tail -40 "$log"; exit 1; }
  secs=$(echo "$(date +%s.%N) - $start" | bc)
  done_line=$(grep -E '^#[0-9]+\s+DONE' "$log" | tail -1)
  cargo +nightly fuzz cmin "$t" "corpus/$t" >/dev/null 2>&1
  printf '%s: %s runs in %.0f s | %s | corpus after cmin: %s files\n' "$t" "$runs" "$secs" \
    "$(echo "$done_line" | grep -Eo 'cov: [0-9]+ ft: [0-9]+|rss: [0-9]+Mb' | tr '\n' ' ')" \
    "$(ls "corpus/$t" | wc -l)"
  rm -f "$log"
done
