#!/usr/bin/env bash
# The recorded soak: tests/it/soak.rs with 100,000 cycles (FLEET_SOAK_CYCLES overrides),
# writing the RSS/fd samples to bench/soak.csv and their plot to bench/soak.svg.
set -euo pipefail
cd "$(dirname "$0")/.."
cycles=${FLEET_SOAK_CYCLES:-100000}
mkdir -p bench
echo "commit $(git rev-parse --short HEAD), $(nproc) cores, $(uname -sr)"
FLEET_SOAK_CYCLES=$cycles FLEET_SOAK_CSV="$PWD/bench/soak.csv" \
  cargo test --locked --test it soak::soak_the_loop -- --ignored --nocapture 2>&1 |
  grep -E '^soak|test result|panicked'
python3 scripts/plot-soak.py bench/soak.csv bench/soak.svg
echo "wrote bench/soak.csv and bench/soak.svg"
