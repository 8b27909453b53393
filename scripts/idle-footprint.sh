#!/usr/bin/env bash
# Measures the daemon's steady-state footprint: CPU time and peak RSS of the release
# binary over N seconds (default 60) of idle polling (1 s cadence, every namespace already
# confirmed) against the loopback emulators. Prints the figures; changes nothing outside a
# temp sandbox. Usage: scripts/idle-footprint.sh [SECONDS]
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-60}
cargo build --release --locked --quiet --bin fleet-sidecar --example sandbox
bin=${CARGO_TARGET_DIR:-target}/release
out=$(mktemp)
"$bin/examples/sandbox" >"$out" &
emu=$!
trap 'kill "$emu" 2>/dev/null || true; [ -n "${pid:-}" ] && kill "$pid" 2>/dev/null || true; rm -f "$out"' EXIT
for _ in $(seq 50); do grep -q '^STATE=' "$out" && break; sleep 0.1; done
config=$(sed -n 's/^CONFIG=//p' "$out")
state=$(sed -n 's/^STATE=//p' "$out")
"$bin/fleet-sidecar" --config "$config" run 2>/dev/null &
pid=$!
# Let it join and confirm, then measure from a settled start.
for _ in $(seq 100); do [ -s "$state" ] && grep -q confirmed "$state" && break; sleep 0.1; done
sleep 2
tck=$(getconf CLK_TCK)
read -r u0 s0 < <(awk '{print $14, $15}' /proc/$pid/stat)
t0=$(date +%s.%N)
sleep "$secs"
read -r u1 s1 < <(awk '{print $14, $15}' /proc/$pid/stat)
t1=$(date +%s.%N)
hwm=$(awk '/VmHWM/ {print $2}' /proc/$pid/status)
rss=$(awk '/VmRSS/ {print $2}' /proc/$pid/status)
threads=$(awk '/Threads/ {print $2}' /proc/$pid/status)
cpu_ms=$(( ( (u1 - u0) + (s1 - s0) ) * 1000 / tck ))
wall=$(awk -v a="$t0" -v b="$t1" 'BEGIN {printf "%.1f", b - a}')
echo "idle polling for ${wall} s (1 s poll interval):"
echo "  CPU time: ${cpu_ms} ms (user $(( (u1-u0)*1000/tck )) ms, system $(( (s1-s0)*1000/tck )) ms) = $(awk -v c="$cpu_ms" -v w="$wall" 'BEGIN {printf "%.3f", c / 10 / w}') % of one core"
echo "  peak RSS (VmHWM): ${hwm} KiB; RSS now: ${rss} KiB; threads: ${threads}"
kill -TERM "$pid"; wait "$pid" || true
