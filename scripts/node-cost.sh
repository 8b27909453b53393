#!/usr/bin/env bash
# The whole node agent at fleet scale: the release daemon with every job on (the loop, the
# inventory, the recovery envelopes, the node report) against the loopback emulators holding
# N namespaces already confirmed, 3 member accounts each, merod with its seal route. Prints,
# for the first full pass (from the daemon's start until every envelope was written and the
# inventory posted) and for a steady window after it: CPU (ms, and % of one core), peak RSS,
# bytes written to disk (/proc/PID/io write_bytes), merod and MDMA requests a second (as the
# emulators counted them). Beside scripts/inventory-cost.sh and scripts/recovery-writes.sh.
# Changes nothing outside temp sandboxes.
# Usage: scripts/node-cost.sh [N] [STEADY_SECONDS] [BINARY]   (default 1000 300, this tree's)
set -euo pipefail
cd "$(dirname "$0")/.."
n=${1:-1000}
steady=${2:-300}
# The package's build settings (.ci/run): no fat LTO.
export CARGO_PROFILE_RELEASE_LTO=false CARGO_PROFILE_RELEASE_CODEGEN_UNITS=16
cargo build --release --locked --quiet --bin fleet-sidecar --example recovery-sandbox
bin=${3:-${CARGO_TARGET_DIR:-target}/release/fleet-sidecar}
sandbox=${CARGO_TARGET_DIR:-target}/release/examples/recovery-sandbox
tck=$(getconf CLK_TCK)
want=$((3 * n))
# Bounds every wait: a first pass that has not ended by then is reported as it stands.
limit=${NODE_COST_LIMIT:-3600}

out=$(mktemp)
"$sandbox" "$n" all >"$out" &
emu=$!
trap 'kill "$emu" 2>/dev/null || true; rm -f "$out"' EXIT
for _ in $(seq 1200); do grep -q '^STATE=' "$out" && break; sleep 0.1; done
config=$(sed -n 's/^CONFIG=//p' "$out")
log=$(sed -n 's/^log_file = "\(.*\)"$/\1/p' "$config")
count() {
    local c
    c=$(grep -c "$1" "$log" 2>/dev/null || true)
    echo "${c:-0}"
}
# CPU ms, bytes written, merod requests, MDMA requests (the emulators' counts since they
# started: nothing calls them before the daemon), now (s).
sample() {
    local u s w req
    read -r u s < <(awk '{print $14, $15}' /proc/"$pid"/stat)
    w=$(awk '/^write_bytes/ {print $2}' /proc/"$pid"/io)
    req=$(grep '^REQUESTS ' "$out" | tail -1 | sed 's/REQUESTS merod=\([0-9]*\) mdma=\([0-9]*\)/\1 \2/')
    echo "$(( (u + s) * 1000 / tck )) $w ${req:-0 0} $(date +%s.%N)"
}
"$bin" --config "$config" run 2>/dev/null &
pid=$!
t0=$(date +%s.%N)
deadline=$(( $(date +%s) + limit ))
while { [ "$(count 'Recovery envelope written')" -lt "$want" ] || [ "$(count 'reported the context inventory')" -lt 1 ]; } \
    && [ "$(date +%s)" -lt "$deadline" ]; do sleep 0.5; done
read -r c1 w1 m1 a1 t1 < <(sample)
hwm1=$(awk '/VmHWM/ {print $2}' /proc/"$pid"/status)
# The steady window's own peak: writing 5 to clear_refs resets VmHWM to the RSS now.
echo 5 >/proc/"$pid"/clear_refs
sleep "$steady"
read -r c2 w2 m2 a2 t2 < <(sample)
hwm=$(awk '/VmHWM/ {print $2}' /proc/"$pid"/status)
kill -TERM "$pid"; wait "$pid" || true
echo "$n namespaces x 3 members, every job on, $bin"
awk -v t0="$t0" -v t1="$t1" -v t2="$t2" -v c1="$c1" -v c2="$c2" -v w1="$w1" -v w2="$w2" \
    -v m1="$m1" -v m2="$m2" -v a1="$a1" -v a2="$a2" -v hwm1="$hwm1" -v hwm="$hwm" 'BEGIN {
    d1 = t1 - t0; d2 = t2 - t1
    printf "  first full pass: %.1f s, CPU %d ms (%.1f %% of a core), %.2f MB written, merod %.1f req/s, MDMA %.1f req/s, peak RSS %.1f MiB\n",
        d1, c1, c1 / 10 / d1, w1 / 1e6, m1 / d1, a1 / d1, hwm1 / 1024
    printf "  steady %.0f s: CPU %d ms (%.2f %% of a core), %.3f MiB written, merod %.1f req/s, MDMA %.1f req/s\n",
        d2, c2 - c1, (c2 - c1) / 10 / d2, (w2 - w1) / 1048576, (m2 - m1) / d2, (a2 - a1) / d2
    printf "  peak RSS in the steady window %.1f MiB\n", hwm / 1024 }'
