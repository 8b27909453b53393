#!/usr/bin/env bash
# Side by side, in one run on one machine: the release daemon and the Bash reference loop
# (bench/reference/, written from the reference sidecar's description) against the same
# loopback emulators (the `fleet-emulators` binary, a separate process whose CPU is not
# counted). Reports, for each:
#   - CPU per idle cycle (every namespace confirmed) at 3, 10, 100, 1,000 and 10,000
#     namespaces: CPU time over a window, all threads (daemon, /proc/PID/task/*/schedstat)
#     or the loop and every child it waited for (reference, /proc/PID/stat fields 14-17),
#     divided by the should-join polls MDMA answered in that window;
#   - peak RSS: VmHWM (daemon); the largest process of the tree (reference, GNU time %M);
#   - assignment → fleet-join latency (3 namespaces, 1 s poll interval), as merod's
#     emulator receives the call;
#   - withdrawal → leave latency while 10 joins hang (merod never answers them).
# Prints a Markdown table with ratios and writes bench/cpu-vs-namespaces.tsv (for
# bench/plot.py). Usage: scripts/bench-vs-reference.sh [SECONDS_PER_WINDOW] (default 20).
# Env: SIZES (namespace counts; NxK: N namespaces with K admitter addresses each), TRIALS (assignment trials), BIN_DIR (binaries built
# elsewhere, e.g. an older commit's, instead of building these), EMU_BIN (the emulators'
# binary, default the one in BIN_DIR: a newer one answers as the fleet does for an older
# daemon), ADMITTERS (admitter addresses per assignment in MDMA's answer, default 0; the
# fleet sends 8), REFERENCE=0 (daemon only: idle figures, no reference, no latencies),
# WARM (seconds between the daemon's start and the window, default 3), CONFIG_DROP (tables
# removed from the emulators' config: an older daemon refuses a table it does not know),
# STATE_V3=1 (the seeded state file rewritten as version 3, for a daemon older than v4).
# The idle CPU is also split: the loop's (the median second's CPU per poll) and the
# background jobs' (the rest, per second); a window of 60 s or more holds one of each
# periodic job's runs.
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-20}
sizes=${SIZES:-"3 10 100 1000 10000"}
trials=${TRIALS:-5}
ref_leave_cap=${REF_LEAVE_CAP:-45}
command -v python3 >/dev/null || { echo "needs python3 (the reference loop uses it)"; exit 1; }
command -v curl >/dev/null || { echo "needs curl (the reference loop uses it)"; exit 1; }
[ -x /usr/bin/time ] || { echo "needs GNU time (/usr/bin/time) for the reference's peak RSS"; exit 1; }

if [ -z "${BIN_DIR:-}" ]; then
  cargo build --release --locked --quiet --features emulator --bin fleet-sidecar --bin fleet-emulators
fi
bin=${BIN_DIR:-${CARGO_TARGET_DIR:-target}/release}
with_reference=${REFERENCE:-1}
ref=bench/reference/fleet-sidecar.sh
tck=$(getconf CLK_TCK)
tsv=bench/cpu-vs-namespaces.tsv
work=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT

# Starts the emulators with $1 namespaces on a coprocess; sets the KEY=value it prints.
start_emulators() {
  # --admitters only when asked: an older revision's emulators do not know it.
  local extra=()
  [ "${2:-${ADMITTERS:-0}}" = 0 ] || extra=(--admitters "${2:-$ADMITTERS}")
  coproc EMU { exec "${EMU_BIN:-$bin/fleet-emulators}" --namespaces "$1" "${extra[@]}"; }
  pids+=("$EMU_PID")
  local line
  while read -r line <&"${EMU[0]}"; do
    [ "$line" = READY ] && break
    case "$line" in *=*) eval "${line%%=*}='${line#*=}'" ;; esac
  done
}
emu() { echo "$*" >&"${EMU[1]}"; }
polls() { emu polls; local l; read -r l <&"${EMU[0]}"; echo "${l#POLLS }"; }
stop_emulators() { eval "exec ${EMU[1]}>&-"; wait "$EMU_PID" 2>/dev/null || true; }
# Waits for a "$1 ID ms" line from the emulators (others are skipped) for at most $2 s;
# prints the ms, or ">cap" on timeout.
await() {
  local line end=$((SECONDS + $2))
  while [ "$SECONDS" -lt "$end" ]; do
    if read -r -t 1 line <&"${EMU[0]}"; then
      case "$line" in "$1 "*) echo "${line##* }"; return ;; esac
    fi
  done
  echo ">$(( $2 * 1000 ))"
}

start_daemon() {
  "$bin/fleet-sidecar" --config "$CONFIG" run 2>/dev/null &
  pid=$!
  child=$pid
  pids+=("$pid")
}
start_reference() {
  MDMA_URL=$MDMA_URL MEROD_URL=$MEROD_URL PEER_ID=$PEER_ID MRTD=$MRTD STATE_FILE=$REF_STATE \
    LOG_FILE=$DIR/reference.log /usr/bin/time -f %M -o "$work/ref-rss" "$ref" &
  child=$!
  pids+=("$child")
  # The loop itself is the child of GNU time.
  for _ in $(seq 50); do pid=$(pgrep -P "$child" || true); [ -n "$pid" ] && break; sleep 0.1; done
}
# Stops the daemon or the reference loop (and what the loop is running) and waits for it.
stop() {
  pkill -TERM -P "$pid" 2>/dev/null || true
  kill -TERM "$pid" 2>/dev/null || true
  wait "$child" 2>/dev/null || true
}

# CPU time in ns used so far by $pid. daemon: every live thread's run time from
# /proc/PID/task/*/schedstat (ns, not 10 ms ticks: an idle poll costs well under a tick).
# reference: user+system of the loop and of every child it waited for (/proc/PID/stat 14-17).
cpu_ns() {
  if [ "$1" = daemon ]; then
    cat /proc/"$pid"/task/*/schedstat 2>/dev/null | awk '{s+=$1} END {printf "%d\n", s}'
  else
    awk -v t="$tck" '{printf "%d\n", ($14+$15+$16+$17) * 1e9 / t}' "/proc/$pid/stat"
  fi
}

# Over a window of $secs s, sampled every second: CPU ms per should-join poll (all of it),
# the polls answered, the loop's CPU ms per poll and the background jobs' CPU ms per
# second. A second whose CPU is over twice the median second's and 1 ms more is a
# background job's (the 60 s inventory walk, the held refresh): the loop's figure is the
# CPU per poll of the other seconds, and what the busy seconds took beyond it is the
# background's, averaged over the whole window.
cpu_window() {
  local i samples=() median
  samples+=("$(cpu_ns "$1") $(polls)")
  for i in $(seq "$secs"); do
    sleep 1
    samples+=("$(cpu_ns "$1") $(polls)")
  done
  # Each second's CPU ms and polls.
  local seconds
  seconds=$(printf '%s\n' "${samples[@]}" |
    awk 'NR > 1 {printf "%.6f %d\n", ($1 - c) / 1e6, $2 - p} {c = $1; p = $2}')
  median=$(awk '{print $1}' <<<"$seconds" | sort -g |
    awk '{r[NR] = $1} END {print NR ? (NR % 2 ? r[(NR + 1) / 2] : (r[NR / 2] + r[NR / 2 + 1]) / 2) : 0}')
  awk -v secs="$secs" -v m="$median" '
    {cpu += $1; polls += $2}
    $1 > 2 * m + 1 {bc += $1; bp += $2; next}
    {qc += $1; qp += $2}
    END {
      loop = qp > 0 ? qc / qp : -1
      bg = loop >= 0 ? (bc - loop * bp) / secs : 0
      printf "%.3f %d %.3f %.3f\n", (polls > 0 ? cpu / polls : -1), polls, loop, (bg > 0 ? bg : 0)
    }' <<<"$seconds"
}

printf 'namespaces\tdaemon_cpu_ms_per_poll\treference_cpu_ms_per_poll\tdaemon_peak_rss_kib\treference_peak_rss_kib\tdaemon_polls\treference_polls\tdaemon_loop_ms_per_poll\tdaemon_background_ms_per_s\treference_loop_ms_per_poll\n' >"$tsv"
for size in $sizes; do
  n=${size%%x*}
  admitters=${ADMITTERS:-0}
  [ "$size" = "$n" ] || admitters=${size#*x}
  start_emulators "$n" "$admitters"
  # An older revision refuses a table it does not know: drop those.
  for table in ${CONFIG_DROP:-}; do
    python3 - "$CONFIG" "$table" <<'PY'
import re, sys
path, table = sys.argv[1], sys.argv[2]
text = open(path).read()
open(path, "w").write(re.sub(r"(?ms)^\[" + re.escape(table) + r"\]\n.*?(?=^\[|\Z)", "", text))
PY
  done
  if [ "${STATE_V3:-0}" = 1 ]; then
    # An older revision reads state files up to version 3: the same sets in that form.
    python3 - "$CONFIG" <<'PY'
import json, re, sys
path = re.search(r'(?m)^state_file = "(.*)"$', open(sys.argv[1]).read()).group(1)
doc = json.load(open(path))
keep = {k: doc[k] for k in ("admitted", "confirmed", "joining") if k in doc}
json.dump({"version": 3, **keep}, open(path, "w"))
PY
  fi
  start_daemon
  sleep "${WARM:-3}"
  read -r d_cpu d_polls d_loop d_bg < <(cpu_window daemon)
  d_rss=$(awk '/VmHWM/ {print $2}' "/proc/$pid/status")
  stop
  r_cpu=-1 r_polls=0 r_rss=0 r_loop=-1
  if [ "$with_reference" = 1 ]; then
    start_reference
    sleep 3
    read -r r_cpu r_polls r_loop _ < <(cpu_window reference)
    stop
    r_rss=$(tail -1 "$work/ref-rss" 2>/dev/null)
  fi
  stop_emulators
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$size" "$d_cpu" "$r_cpu" "$d_rss" "$r_rss" "$d_polls" "$r_polls" "$d_loop" "$d_bg" "$r_loop" >>"$tsv"
  echo "idle, $size namespaces: daemon $d_cpu ms/poll ($d_polls polls; loop $d_loop ms/poll, background $d_bg ms/s), peak RSS $d_rss KiB; reference $r_cpu ms/poll ($r_polls polls), peak RSS $r_rss KiB" >&2
done

# Latencies at 3 namespaces. $1: daemon|reference.
latencies() {
  start_emulators 3
  if [ "$1" = daemon ]; then start_daemon; else start_reference; fi
  sleep 3
  local joins=() i id
  for i in $(seq "$trials"); do
    id=$(printf 'a%063x' "$i")
    emu assign "$id"
    joins+=("$(await JOINED 10)")
    sleep "0.$(( RANDOM % 10 ))"
  done
  for i in $(seq 10); do
    id=$(printf 'b%063x' "$i")
    emu hang "$id"
    emu assign "$id"
  done
  sleep 2
  # Drop the JOINED lines of the hanging joins that arrived meanwhile.
  while read -r -t 0.5 _ <&"${EMU[0]}"; do :; done
  # The first generated namespace (fleet-emulators: 0xf1ee000000000000 + i, four times).
  emu withdraw "$(printf 'f1ee000000000000%.0s' 1 2 3 4)"
  local cap=10
  [ "$1" = reference ] && cap=$ref_leave_cap
  leave=$(await LEFT "$cap")
  stop
  stop_emulators
  join_list=$(printf '%s\n' "${joins[@]}")
}
[ "$with_reference" = 1 ] || exit 0
stats() { sort -n | awk '{a[NR]=$1} END {printf "median %.0f ms, max %.0f ms", a[int((NR+1)/2)], a[NR]}'; }
latencies daemon
d_join=$(stats <<<"$join_list"); d_leave=$leave
latencies reference
r_join=$(stats <<<"$join_list"); r_leave=$leave

host="$(nproc) cores, $(awk -F: '/model name/ {print $2; exit}' /proc/cpuinfo | sed 's/^ *//')"
echo
echo "Machine: $host; commit $(git rev-parse --short HEAD)$(git diff --quiet || echo '+dirty'); ${secs} s windows; $(date -u +%F)"
echo
echo "| work | fleet-sidecar | Bash reference | reference ÷ daemon |"
echo "|---|---|---|---|"
tail -n +2 "$tsv" | while IFS=$'\t' read -r n dc rc dr rr _ _; do
  ratio=$(awk -v a="$rc" -v b="$dc" 'BEGIN {print (a > 0 && b > 0) ? sprintf("%.0f×", a / b) : "n/a"}')
  rratio=$(awk -v a="$rr" -v b="$dr" 'BEGIN {print (a > 0 && b > 0) ? sprintf("%.1f×", a / b) : "n/a"}')
  echo "| idle cycle, $n namespaces: CPU per poll | $dc ms | $rc ms | $ratio |"
  echo "| idle cycle, $n namespaces: peak RSS | $dr KiB | $rr KiB (largest process) | $rratio |"
done
echo "| new assignment → fleet-join ($trials trials, 1 s interval) | $d_join | $r_join | |"
echo "| withdrawal → leave, 10 joins hanging | ${d_leave} ms | ${r_leave} ms | $(awk -v a="${r_leave#>}" -v b="$d_leave" 'BEGIN {print (b > 0) ? sprintf("%s%.0f×", (index("'"$r_leave"'", ">") ? ">" : ""), a / b) : "n/a"}') |"
