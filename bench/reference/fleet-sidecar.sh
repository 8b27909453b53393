#!/usr/bin/env bash
# The reference fleet HA sidecar loop, written from spec/fleet-ha-sidecar.txt ("The reconcile
# loop"), as a benchmark yardstick only: curl -sf --max-time 10 for MDMA, python3 for every
# JSON check, meroctl (here the stand-in next to this file) for merod. Not product code.
# Env: MDMA_URL, PEER_ID, MRTD, STATE_FILE (bare JSON array of confirmed ids), LOG_FILE,
#      MEROCTL (default: ./meroctl next to this file), FLEET_TOKEN (optional).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
MEROCTL=${MEROCTL:-$here/meroctl}
MEROD_HOME=${MEROD_HOME:-/mnt/data/calimero}
POLL_INTERVAL=1
LOG_FILE=${LOG_FILE:-/dev/null}

log() { echo "$(date -u +%FT%TZ) $*" >>"$LOG_FILE"; }

meroctl() { "$MEROCTL" --home "$MEROD_HOME" --node default --output-format json "$@"; }

wait_for_merod() { until meroctl peers >/dev/null 2>&1; do sleep 1; done; }

# 0 + the validated body on HTTP 200 with {"assignments": [...]}; 1 with no output otherwise.
poll_mdma() {
  local body
  local token=()
  [ -n "${FLEET_TOKEN:-}" ] && token=(-H "X-Fleet-Token: $FLEET_TOKEN")
  body=$(curl -sf --max-time 10 -X POST -H 'Content-Type: application/json' "${token[@]}" \
    -d "{\"peer_id\":\"$PEER_ID\",\"mrtd\":\"$MRTD\"}" "${MDMA_URL%/}/api/fleet/should-join") || return 1
  printf '%s' "$body" | python3 -c '
import json, sys
d = json.load(sys.stdin)
assert isinstance(d, dict) and isinstance(d.get("assignments"), list)
' 2>/dev/null || return 1
  printf '%s' "$body"
}

desired_ids() {
  python3 -c '
import json, sys
d = json.load(sys.stdin)
for g in sorted({a["group_id"] for a in d["assignments"]}): print(g)'
}

load_confirmed() {
  [ -s "$STATE_FILE" ] || return 0
  python3 -c '
import json, sys
for g in sorted(json.load(open(sys.argv[1]))): print(g)' "$STATE_FILE"
}

save_confirmed() {
  python3 -c '
import json, sys, os
ids = sorted(l.strip() for l in sys.stdin if l.strip())
tmp = sys.argv[1] + ".tmp"
with open(tmp, "w") as f: json.dump(ids, f)
os.replace(tmp, sys.argv[1])' "$STATE_FILE"
}

join_group() {
  local out
  out=$(meroctl tee fleet-join "$1") || return 1
  printf '%s' "$out" | python3 -c '
import json, sys
d = json.load(sys.stdin)
d = d.get("data", d) if isinstance(d, dict) else {}
sys.exit(0 if d.get("admitted") is True else 1)' 2>/dev/null
}

confirm_assignment() {
  curl -sf --max-time 10 -X POST -H 'Content-Type: application/json' \
    -d "{\"peer_id\":\"$PEER_ID\",\"group_id\":\"$1\"}" "${MDMA_URL%/}/api/fleet/confirm" >/dev/null
}

leave_group() {
  meroctl namespace leave "$1" >/dev/null 2>&1 || log "leave $1: benign error"
}

wait_for_merod
while true; do
  if body=$(poll_mdma); then
    desired=$(printf '%s' "$body" | desired_ids)
    confirmed=$(load_confirmed)
    for g in $(comm -23 <(printf '%s\n' "$desired" | sed '/^$/d') <(printf '%s\n' "$confirmed" | sed '/^$/d')); do
      if join_group "$g" && confirm_assignment "$g"; then
        confirmed=$(printf '%s\n%s\n' "$confirmed" "$g" | sed '/^$/d' | sort -u)
        printf '%s\n' "$confirmed" | save_confirmed
        log "joined and confirmed $g"
      else
        log "join of $g not admitted or not confirmed; retrying next cycle"
      fi
    done
    for g in $(comm -13 <(printf '%s\n' "$desired" | sed '/^$/d') <(printf '%s\n' "$confirmed" | sed '/^$/d')); do
      leave_group "$g"
      log "left $g"
    done
    comm -12 <(printf '%s\n' "$desired" | sed '/^$/d') <(printf '%s\n' "$confirmed" | sed '/^$/d') | save_confirmed
  else
    log "poll failed; cycle skipped"
  fi
  sleep "$POLL_INTERVAL"
done
