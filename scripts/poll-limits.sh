#!/usr/bin/env bash
# The physical limits beside the idle poll at fleet scale (examples/poll-limits.rs): one
# keep-alive loopback exchange of the fleet's 9.5 MB answer (HTTPS and HTTP), the same
# through MdmaClient holding the answer's digest, and hashing 9.5 MB in memory (BLAKE3,
# SHA-256). CPU ms of the client's thread per exchange or pass.
# Usage: scripts/poll-limits.sh [ROUNDS] (default 20). Prints a TSV.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --locked --quiet --example poll-limits
"${CARGO_TARGET_DIR:-target}"/release/examples/poll-limits "${1:-20}" | column -t -s $'\t'
