#!/usr/bin/env bash
# The library's public API against the snapshots committed in api/: what a tool may rely on,
# for default features off (api/default-off.txt) and with the `testing` feature
# (api/testing.txt). Prints the difference and exits 1 when the API moved; a commit that
# changes the API on purpose runs this with --update, commits the snapshot with the reason in
# its message, and records the change under "Unreleased" in CHANGELOG.md.
#
# Usage: scripts/api-check.sh            check (exit 1 on a difference, 2 if it cannot run)
#        scripts/api-check.sh --install  the same, installing the tool first if it is missing
#        scripts/api-check.sh --update   write the API of the working tree as the snapshot
# Needs cargo-public-api $CARGO_PUBLIC_API_VERSION (cargo install --locked; --install puts it
# in target/ci-tools) and a nightly toolchain whose rustdoc JSON that version reads
# (rustup's `nightly`; 0.52.0 reads format 57, nightly 2026-05). The snapshot is also where
# the root's names are counted: at most 40 besides the modules.
set -euo pipefail
cd "$(dirname "$0")/.."
version=${CARGO_PUBLIC_API_VERSION:-0.52.0}
tools=$PWD/target/ci-tools
update=0 install=0
[ "${1:-}" = --update ] && update=1
[ "${1:-}" = --install ] && install=1

export PATH="$tools/bin:$PATH"
if ! cargo public-api --version 2>/dev/null | grep -qx "cargo-public-api $version"; then
  if [ "$install" = 1 ]; then
    echo "cargo-public-api $version is not installed; installing it into $tools"
    cargo install --locked --quiet --root "$tools" "cargo-public-api@$version"
  else
    echo "api-check: cargo-public-api $version is not installed" \
      "(cargo install --locked cargo-public-api@$version)"
    exit 2
  fi
fi
rustup run nightly rustc --version >/dev/null 2>&1 || { echo "api-check: no nightly toolchain (rustup toolchain install nightly)"; exit 2; }

out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
status=0
for spec in "default-off:--no-default-features" "testing:--no-default-features --features testing"; do
  name=${spec%%:*}
  # shellcheck disable=SC2086 # the flags are words
  cargo public-api -p fleet-sidecar ${spec#*:} --simplified --color never >"$out/$name.txt"
  if [ "$update" = 1 ]; then
    cp "$out/$name.txt" "api/$name.txt"
    echo "api/$name.txt: $(wc -l <"api/$name.txt") items"
  elif ! diff -u "api/$name.txt" "$out/$name.txt" >"$out/$name.diff"; then
    echo "the public API ($name) differs from api/$name.txt:"
    cat "$out/$name.diff"
    status=1
  else
    echo "api/$name.txt: the API is the snapshot ($(wc -l <"api/$name.txt") items)"
  fi
done
# The crate root keeps the names nearly every tool uses; the rest live in their modules.
root_names=$(grep -oE '^(#\[[^]]*\] )*pub (async )?(struct|enum|trait|fn|const|static|type|macro|union) fleet_sidecar::[A-Za-z0-9_]+([^:A-Za-z0-9_]|:[^:]|$)' \
  "$out/testing.txt" | sed -E 's/.* fleet_sidecar::([A-Za-z0-9_]+).*/\1/' | sort -u | wc -l)
echo "names at the crate root (modules aside): $root_names (at most ${API_ROOT_MAX:-40})"
if [ "$root_names" -gt "${API_ROOT_MAX:-40}" ]; then
  echo "the crate root has more than ${API_ROOT_MAX:-40} names: put the new ones in their module"
  status=1
fi
if [ "$status" != 0 ]; then
  echo "If the change is meant: scripts/api-check.sh --update, commit api/ with the reason, and" \
    "record it under \"Unreleased\" in CHANGELOG.md."
fi
exit "$status"
