#!/bin/sh
# Builds the Debian package: target/debian/fleet-sidecar_<version>-1_<arch>.deb.
#
#   scripts/build-deb.sh            (installs cargo-deb from crates.io first if it is missing)
#
# Steps: the release binary; from it, the man page and the shell completions (generated from
# the clap definition: `fleet-sidecar man`, `fleet-sidecar completions SHELL`) and the systemd
# unit with the packaged binary path /usr/bin; then cargo-deb with the metadata in
# Cargo.toml ([package.metadata.deb]). Extra arguments go to `cargo deb`.
set -eu
cd "$(dirname "$0")/.."

if ! cargo deb --version >/dev/null 2>&1; then
    echo "build-deb: cargo-deb is not installed; installing it (cargo install cargo-deb --locked, a few minutes)" >&2
    cargo install cargo-deb --locked
fi
target=${CARGO_TARGET_DIR:-target}
cargo build --release --locked --bin fleet-sidecar
bin="$target/release/fleet-sidecar"
out="$target/release/packaging"
mkdir -p "$out"
"$bin" man | gzip -9n >"$out/fleet-sidecar.1.gz"
"$bin" completions bash >"$out/fleet-sidecar.bash"
"$bin" completions zsh >"$out/_fleet-sidecar"
"$bin" completions fish >"$out/fleet-sidecar.fish"
sed 's#/usr/local/bin/fleet-sidecar#/usr/bin/fleet-sidecar#g' packaging/fleet-sidecar.service \
    >"$out/fleet-sidecar.service"
grep -q '^ExecStart=/usr/bin/fleet-sidecar ' "$out/fleet-sidecar.service"
cargo deb --no-build --locked "$@"
