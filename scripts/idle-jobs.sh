#!/usr/bin/env bash
# The idle daemon at fleet scale with every job on against the loop alone: the release
# daemon on fleet-emulators (N namespaces already confirmed, K admitter addresses each, merod
# without the seal route, as rc.25), first with its default config (every job on), then with
# [inventory] and [recovery] off. Each run settles for SETTLE seconds (the first whole walk of
# every namespace), then a window of SECONDS: CPU ms (utime + stime) per poll (one a second)
# and the window's own peak RSS (VmHWM reset through clear_refs). Changes nothing outside
# temp sandboxes.
# Usage: scripts/idle-jobs.sh [N] [K] [SECONDS] [SETTLE]   (default 10000 8 60 150)
set -euo pipefail
cd "$(dirname "$0")/.."
n=${1:-10000}
k=${2:-8}
secs=${3:-60}
settle=${4:-150}
export CARGO_PROFILE_RELEASE_LTO=false CARGO_PROFILE_RELEASE_CODEGEN_UNITS=16
cargo build --release --locked --quiet --features emulator --bin fleet-sidecar --bin fleet-emulators
bin=${CARGO_TARGET_DIR:-target}/release
tck=$(getconf CLK_TCK)

one_run() {
  local label=$1 out fifo emu pid u0 s0 u1 s1 hwm
  out=$(mktemp)
  fifo=$(mktemp -u)
  mkfifo "$fifo"
  # The emulators stop at the end of their input: the fifo is held open until the run ends.
  "$bin/fleet-emulators" --namespaces "$n" --admitters "$k" <"$fifo" >"$out" &
  emu=$!
  exec 9>"$fifo"
  for _ in $(seq 600); do grep -q '^READY' "$out" && break; sleep 0.2; done
  local config
  config=$(sed -n 's/^CONFIG=//p' "$out")
  if [ "$label" = "loop alone" ]; then
    printf '\n[inventory]\nenabled = false\n\n[recovery]\nenabled = false\n' >>"$config"
  fi
  "$bin/fleet-sidecar" --config "$config" run 2>/dev/null &
  pid=$!
  sleep "$settle"
  read -r u0 s0 < <(awk '{print $14, $15}' /proc/"$pid"/stat)
  echo 5 >/proc/"$pid"/clear_refs
  sleep "$secs"
  read -r u1 s1 < <(awk '{print $14, $15}' /proc/"$pid"/stat)
  hwm=$(awk '/VmHWM/ {print $2}' /proc/"$pid"/status)
  kill -TERM "$pid"; wait "$pid" || true
  exec 9>&-
  wait "$emu" || true
  rm -f "$fifo" "$out"
  awk -v l="$label" -v c=$(( (u1 + s1 - u0 - s0) * 1000 / tck )) -v s="$secs" -v h="$hwm" \
    'BEGIN {printf "  %s: CPU %d ms in %d s (%.1f ms a poll), peak RSS in the window %.1f MiB\n", l, c, s, c / s, h / 1024}'
}

echo "$n namespaces x $k admitter addresses, idle, $bin/fleet-sidecar"
one_run "every job on"
one_run "loop alone"
