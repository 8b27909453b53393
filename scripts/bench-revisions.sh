#!/usr/bin/env bash
# Several revisions' release daemons side by side in one run: the idle figures of
# scripts/bench-vs-reference.sh (CPU per poll, peak RSS; daemon only), revision after
# revision, round after round, so each round sees the same machine.
# Usage: scripts/bench-revisions.sh SECONDS_PER_WINDOW ROUNDS REV...
# Each REV is built once (release, --features emulator) into $BENCH_DIR/REV/ (default
# target/bench-revisions), in a throwaway clone; each daemon runs against its own emulators.
# Env: SIZES (namespace counts, default "3 10000"; NxK: with K admitter addresses each),
# CONFIG_DROP_<REV> (tables that revision's daemon does not know, dropped from the config
# of the emulators it runs against), STATE_V3_<REV>=1 (that revision reads state files up to
# version 3). A revision whose emulators cannot send admitter
# addresses runs against the last REV's emulators. Prints the table and writes it to
# $BENCH_DIR/figures.tsv.
set -euo pipefail
cd "$(dirname "$0")/.."
secs=$1; rounds=$2; shift 2
repo=$PWD
dir=${BENCH_DIR:-$repo/target/bench-revisions}
mkdir -p "$dir"
for rev in "$@"; do
  [ -x "$dir/$rev/fleet-sidecar" ] && continue
  [ -d "$dir/clone" ] || git clone -q "$repo" "$dir/clone"
  # A clone made by an earlier run lacks the commits made since.
  git -C "$dir/clone" fetch -q "$repo" '+refs/heads/*:refs/remotes/origin/*'
  git -C "$dir/clone" checkout -q --detach "$rev"
  (cd "$dir/clone" && cargo build --release --locked --quiet --features emulator --bin fleet-sidecar --bin fleet-emulators)
  mkdir -p "$dir/$rev"
  cp "$dir/clone/target/release/fleet-sidecar" "$dir/clone/target/release/fleet-emulators" "$dir/$rev/"
done
# bench-vs-reference.sh writes bench/cpu-vs-namespaces.tsv beside itself: run a copy.
mkdir -p "$dir/run/scripts" "$dir/run/bench"
cp scripts/bench-vs-reference.sh "$dir/run/scripts/"
out=$dir/figures.tsv
echo -e "round\trev\tnamespaces\tcpu_ms_per_poll\tpeak_rss_kib\tpolls\tloop_ms_per_poll\tbackground_ms_per_s\tload1" >"$out"
newest=${*: -1}
cd "$dir/run"
for r in $(seq "$rounds"); do
  for rev in "$@"; do
    rm -f bench/cpu-vs-namespaces.tsv
    emu=$dir/$rev/fleet-emulators
    "$emu" --help 2>&1 | grep -q -- --admitters || emu=$dir/$newest/fleet-emulators
    drop=CONFIG_DROP_$rev v3=STATE_V3_$rev
    if ! BIN_DIR=$dir/$rev EMU_BIN=$emu CONFIG_DROP="${!drop:-}" STATE_V3="${!v3:-0}" REFERENCE=0 SIZES="${SIZES:-3 10000}" \
      scripts/bench-vs-reference.sh "$secs" 2>/dev/null; then
      echo "round $r, $rev: the bench failed" >&2
      continue
    fi
    tail -n +2 bench/cpu-vs-namespaces.tsv | while IFS=$'\t' read -r n dc _ dr _ dp _ dl db _; do
      echo -e "$r\t$rev\t$n\t$dc\t$dr\t$dp\t$dl\t$db\t$(cut -d' ' -f1 /proc/loadavg)" >>"$out"
    done
  done
done
column -t "$out"
