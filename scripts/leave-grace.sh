#!/usr/bin/env bash
# Measures on the release binary, against the loopback emulators (src/bin/fleet-emulators.rs),
# when a withdrawn namespace (1 of 4 held) is left:
#   1. leave_grace = "12s", the daemon stopped 8 s after the withdrawal and started again;
#   2. leave_grace = "60s", the wall clock stepped +2 days 10 s after the withdrawal
#      (libfaketime: Debian's faketime package; skipped without it).
# Prints the milliseconds from the withdrawal to merod receiving the leave. Changes nothing
# outside temp sandboxes. Usage: scripts/leave-grace.sh
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --locked --quiet --features emulator --bin fleet-sidecar --bin fleet-emulators
bin=${CARGO_TARGET_DIR:-target}/release
# The 4th id fleet-emulators generates (namespace_id(3)).
id=$(printf 'f1ee000000000003%.0s' 1 2 3 4)
pid=
cleanup() { [ -n "$pid" ] && kill "$pid" 2>/dev/null || true; }
trap cleanup EXIT

# Starts the emulators; sets CONFIG and STATE, with `$1` prepended to the daemon's config.
start_emulators() {
  coproc EMU { "$bin/fleet-emulators" --namespaces 4; }
  CONFIG= STATE=
  while read -r line <&"${EMU[0]}"; do
    case $line in
      CONFIG=*) CONFIG=${line#CONFIG=} ;;
      STATE=*) STATE=${line#STATE=} ;;
      READY) break ;;
    esac
  done
  printf '%s\n%s' "$1" "$(cat "$CONFIG")" >"$CONFIG.new" && mv "$CONFIG.new" "$CONFIG"
}

# Waits for the emulators' LEFT line and prints its milliseconds.
left_after() {
  local line
  while read -r -t 180 line <&"${EMU[0]}"; do
    case $line in LEFT*) echo "${line##* }"; return ;; esac
  done
  echo "no leave within 180 s"
}

echo "== 1. leave_grace = 12s, restarted 8 s into the grace"
start_emulators $'leave_grace = "12s"\nleave_after_polls = 1'
"$bin/fleet-sidecar" --config "$CONFIG" run 2>/dev/null &
pid=$!
sleep 3
echo "withdraw $id" >&"${EMU[1]}"
sleep 8
kill -TERM "$pid"; wait "$pid" || true
observed=$(python3 -c "import json,sys; s=json.load(open(sys.argv[1])); print((s['observed_ms']-s['absent'][sys.argv[2]]['since_ms'])/1000)" "$STATE" "$id")
echo "stopped 8 s after the withdrawal; absence observed and persisted: ${observed} s"
"$bin/fleet-sidecar" --config "$CONFIG" run 2>/dev/null &
pid=$!
echo "left $(left_after) ms after the withdrawal"
kill -TERM "$pid"; wait "$pid" || true
pid=
emu=$EMU_PID
exec {EMU[1]}>&-
wait "$emu" 2>/dev/null || true

lib=
for l in "/usr/lib/$(uname -m)-linux-gnu/faketime/libfaketimeMT.so.1" /usr/lib/faketime/libfaketimeMT.so.1; do
  [ -e "$l" ] && lib=$l && break
done
if [ -z "$lib" ]; then
  echo "== 2. SKIPPED: libfaketime not installed (apt-get install faketime)"
  exit 0
fi
echo "== 2. leave_grace = 60s, wall clock +2 days 10 s into the grace"
start_emulators $'leave_grace = "60s"\nleave_after_polls = 1'
control=$(mktemp)
echo "+0" >"$control"
LD_PRELOAD=$lib FAKETIME_TIMESTAMP_FILE=$control FAKETIME_NO_CACHE=1 FAKETIME_DONT_FAKE_MONOTONIC=1 \
  "$bin/fleet-sidecar" --config "$CONFIG" run 2>/dev/null &
pid=$!
sleep 3
echo "withdraw $id" >&"${EMU[1]}"
sleep 10
echo "+2d" >"$control"
echo "stepped the wall clock: the daemon now reads $(LD_PRELOAD=$lib FAKETIME_TIMESTAMP_FILE=$control FAKETIME_DONT_FAKE_MONOTONIC=1 date -u +%FT%TZ)"
echo "left $(left_after) ms after the withdrawal"
kill -TERM "$pid"; wait "$pid" || true
pid=
rm -f "$control"
