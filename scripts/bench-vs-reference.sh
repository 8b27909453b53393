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
# Env: SIZES (namespace counts), TRIALS (assignment trials), BIN_DIR (binaries built
# elsewhere, e.g. an older commit's, instead of building these), EMU_BIN (the emulators'
# binary, default the one in BIN_DIR: a newer one answers as the fleet does for an older
# daemon), ADMITTERS (admitter addresses per assignment in MDMA's answer, default 0; the
# fleet sends 8), REFERENCE=0 (daemon only: idle figures, no reference, no latencies).
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
  [ "${ADMITTERS:-0}" = 0 ] || extra=(--admitters "$ADMITTERS")
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

# CPU ms per should-join poll over a window of $secs s, and the polls answered in it.
cpu_window() {
  local c0 c1 p0 p1
  c0=$(cpu_ns "$1")
  p0=$(polls)
  sleep "$secs"
  c1=$(cpu_ns "$1")
  p1=$(polls)
  awk -v c=$((c1 - c0)) -v p=$((p1 - p0)) 'BEGIN {printf "%.3f %d\n", (p > 0 ? c / 1e6 / p : -1), p}'
}

printf 'namespaces\tdaemon_cpu_ms_per_poll\treference_cpu_ms_per_poll\tdaemon_peak_rss_kib\treference_peak_rss_kib\tdaemon_polls\treference_polls\n' >"$tsv"
for n in $sizes; do
  start_emulators "$n"
  start_daemon
  sleep 3
  read -r d_cpu d_polls < <(cpu_window daemon)
  d_rss=$(awk '/VmHWM/ {print $2}' "/proc/$pid/status")
  stop
  r_cpu=-1 r_polls=0 r_rss=0
  if [ "$with_reference" = 1 ]; then
    start_reference
    sleep 3
    read -r r_cpu r_polls < <(cpu_window reference)
    stop
    r_rss=$(tail -1 "$work/ref-rss" 2>/dev/null)
  fi
  stop_emulators
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$n" "$d_cpu" "$r_cpu" "$d_rss" "$r_rss" "$d_polls" "$r_polls" >>"$tsv"
  echo "idle, $n namespaces: daemon $d_cpu ms/poll ($d_polls polls), peak RSS $d_rss KiB; reference $r_cpu ms/poll ($r_polls polls), peak RSS $r_rss KiB" >&2
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
