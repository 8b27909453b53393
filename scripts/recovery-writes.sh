#!/usr/bin/env bash
# The recovery envelopes' disk writes at fleet scale: the release daemon against the loopback
# emulators holding N namespaces already confirmed, 3 member accounts each (the inventory
# off). Prints, for the first full pass (from the daemon's start until every envelope was
# written) and for a steady window after it: wall time, CPU, bytes written to disk
# (/proc/PID/io write_bytes: the record, its journal and the log), envelopes written, and the
# record's and journal's sizes. Changes nothing outside temp sandboxes.
# Usage: scripts/recovery-writes.sh [N] [STEADY_SECONDS] [BINARY]   (default 1000 60, this tree's)
# BINARY: another build of fleet-sidecar to measure with the same sandbox (a baseline).
set -euo pipefail
cd "$(dirname "$0")/.."
n=${1:-1000}
steady=${2:-60}
# The package's build settings (.ci/run): no fat LTO, which changes nothing measured here.
export CARGO_PROFILE_RELEASE_LTO=false CARGO_PROFILE_RELEASE_CODEGEN_UNITS=16
cargo build --release --locked --quiet --bin fleet-sidecar --example recovery-sandbox
bin=${3:-${CARGO_TARGET_DIR:-target}/release/fleet-sidecar}
sandbox=${CARGO_TARGET_DIR:-target}/release/examples/recovery-sandbox
tck=$(getconf CLK_TCK)
want=$((3 * n))
# Bounds every wait: a pass that has not ended by then is reported as it stands.
limit=${RECOVERY_WRITES_LIMIT:-3600}

out=$(mktemp)
"$sandbox" "$n" >"$out" &
emu=$!
trap 'kill "$emu" 2>/dev/null || true; rm -f "$out"' EXIT
for _ in $(seq 1200); do grep -q '^STATE=' "$out" && break; sleep 0.1; done
config=$(sed -n 's/^CONFIG=//p' "$out")
state=$(sed -n 's/^STATE=//p' "$out")
dir=$(dirname "$state")
log=$(sed -n 's/^log_file = "\(.*\)"$/\1/p' "$config")
start=$(date +%s.%N)
"$bin" --config "$config" run 2>/dev/null &
pid=$!
figures() {
    local u s w
    read -r u s < <(awk '{print $14, $15}' /proc/"$pid"/stat)
    w=$(awk '/^write_bytes/ {print $2}' /proc/"$pid"/io)
    echo "$(( (u + s) * 1000 / tck )) $w"
}
written() {
    local c
    c=$(grep -c 'Recovery envelope written' "$log" 2>/dev/null || true)
    echo "${c:-0}"
}
size() { stat -c %s "$1" 2>/dev/null || echo 0; }
deadline=$(( $(date +%s) + limit ))
while [ "$(written)" -lt "$want" ] && [ "$(date +%s)" -lt "$deadline" ]; do sleep 0.5; done
read -r cpu1 w1 < <(figures)
t1=$(date +%s.%N)
n1=$(written)
sleep "$steady"
read -r cpu2 w2 < <(figures)
n2=$(written)
kill -TERM "$pid"; wait "$pid" || true
echo "$n namespaces x 3 members ($want envelopes), $bin"
awk -v t0="$start" -v t1="$t1" -v c="$cpu1" -v w="$w1" -v e="$n1" 'BEGIN {
    printf "  first full pass: %.1f s, CPU %d ms, %.2f MB written to disk, %d envelopes written (%.0f bytes an envelope)\n",
        t1 - t0, c, w / 1e6, e, (e ? w / e : 0) }'
echo "  steady ${steady} s after it: CPU $(( cpu2 - cpu1 )) ms, $(( w2 - w1 )) bytes written to disk, $(( n2 - n1 )) envelopes written"
echo "  fleet-recovery.json $(size "$dir/fleet-recovery.json") bytes, fleet-recovery.journal $(size "$dir/fleet-recovery.journal") bytes"
