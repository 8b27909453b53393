#!/usr/bin/env bash
# The instruction-count check: the workloads of examples/cycle-cost.rs under callgrind
# (valgrind), each counted only inside its `measured` function, compared with the counts
# committed in bench/cost-baseline.tsv. Instruction counts, unlike CPU time, do not move with
# the machine's load: a count more than 10 % (COST_TOLERANCE_PCT) above its baseline fails.
#
# Usage: scripts/cost-check.sh           check (exit 1 on a regression), print the figures
#        scripts/cost-check.sh --update  write the counts measured now as the baseline
#                                        (commit it with the reason in the message)
# Needs valgrind (Debian's package). The example is built in release with fat LTO off and 16
# codegen units (the settings .ci/run builds the package with, so the two builds share their
# dependencies); the baseline holds for those settings and this toolchain.
set -euo pipefail
cd "$(dirname "$0")/.."
baseline=bench/cost-baseline.tsv
tolerance=${COST_TOLERANCE_PCT:-10}
update=0
[ "${1:-}" = --update ] && update=1
command -v valgrind >/dev/null || { echo "cost-check: valgrind is not installed"; exit 2; }

export CARGO_PROFILE_RELEASE_LTO=false CARGO_PROFILE_RELEASE_CODEGEN_UNITS=16
cargo build --release --locked --quiet --example cycle-cost
bin=${CARGO_TARGET_DIR:-target}/release/examples/cycle-cost
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

# scenario and rounds: enough rounds that one cycle's jitter is small against the total.
scenarios="idle-3 10
idle-10000 5
idle-10000x8 3
accept-10000x8 3
walk-1000 1
scan-1000 5
scan-1000-one 3"

count() {
  valgrind --tool=callgrind --collect-atstart=no '--toggle-collect=*cycle_cost::measured*' \
    --callgrind-out-file="$out/$1.out" "$bin" "$1" "$2" >"$out/$1.log" 2>&1 \
    || { cat "$out/$1.log"; echo "cost-check: $1 failed under valgrind"; exit 1; }
  awk '/^totals:/ {print $2}' "$out/$1.out"
}

status=0
printf '%-16s %6s %16s %16s %8s\n' scenario rounds baseline now change
new=$(mktemp)
printf 'scenario\trounds\tinstructions\n' >"$new"
while read -r scenario rounds; do
  now=$(count "$scenario" "$rounds")
  printf '%s\t%s\t%s\n' "$scenario" "$rounds" "$now" >>"$new"
  base=$(awk -F'\t' -v s="$scenario" -v r="$rounds" '$1 == s && $2 == r {print $3}' "$baseline" 2>/dev/null || true)
  if [ -z "$base" ]; then
    printf '%-16s %6s %16s %16s %8s\n' "$scenario" "$rounds" "(none)" "$now" ""
    [ "$update" = 1 ] || status=1
    continue
  fi
  change=$(awk -v n="$now" -v b="$base" 'BEGIN {printf "%+.1f%%", (n - b) * 100 / b}')
  printf '%-16s %6s %16s %16s %8s\n' "$scenario" "$rounds" "$base" "$now" "$change"
  if awk -v n="$now" -v b="$base" -v t="$tolerance" 'BEGIN {exit !(n > b * (1 + t / 100))}'; then
    echo "cost-check: $scenario costs ${change} more instructions than bench/cost-baseline.tsv (over ${tolerance} %)"
    status=1
  fi
done <<<"$scenarios"
if [ "$update" = 1 ]; then
  mv "$new" "$baseline"
  echo "cost-check: wrote $baseline"
  exit 0
fi
rm -f "$new"
[ "$status" = 0 ] && echo "cost-check: no workload grew by more than ${tolerance} %"
exit "$status"
