#!/usr/bin/env bash
# The context inventory's cost at fleet scale: the release daemon against the loopback
# emulators holding N namespaces already confirmed (each with a subgroup and three contexts),
# run twice side by side for the same window from its start, [inventory] enabled = false
# then true. Prints CPU time, peak RSS and the inventory posts seen. Changes nothing outside
# temp sandboxes. Usage: scripts/inventory-cost.sh [N] [SECONDS]   (default 10000 150)
set -euo pipefail
cd "$(dirname "$0")/.."
n=${1:-10000}
secs=${2:-150}
cargo build --release --locked --quiet --bin fleet-sidecar --example inventory-sandbox
bin=${CARGO_TARGET_DIR:-target}/release
tck=$(getconf CLK_TCK)

run() {
    local enabled=$1 out emu pid config log
    out=$(mktemp)
    "$bin/examples/inventory-sandbox" "$n" "$enabled" >"$out" &
    emu=$!
    for _ in $(seq 600); do grep -q '^STATE=' "$out" && break; sleep 0.1; done
    config=$(sed -n 's/^CONFIG=//p' "$out")
    log=$(sed -n 's/^log_file = "\(.*\)"$/\1/p' "$config")
    "$bin/fleet-sidecar" --config "$config" run 2>/dev/null &
    pid=$!
    sleep "$secs"
    read -r u s < <(awk '{print $14, $15}' /proc/$pid/stat)
    hwm=$(awk '/VmHWM/ {print $2}' /proc/$pid/status)
    posts=$(grep -c 'reported the context inventory' "$log" || true)
    failing=$(grep -c 'inventory cannot be reported' "$log" || true)
    kill -TERM "$pid"; wait "$pid" || true
    kill "$emu" 2>/dev/null || true; wait "$emu" 2>/dev/null || true
    rm -f "$out"
    echo "  [inventory] enabled = $enabled: CPU $(( (u + s) * 1000 / tck )) ms (user $(( u*1000/tck )), system $(( s*1000/tck ))), peak RSS ${hwm} KiB, inventory posts ${posts}, failures ${failing}"
}

echo "$n namespaces confirmed, ${secs} s from the daemon's start, 1 s polls:"
run false
run true
