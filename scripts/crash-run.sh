#!/usr/bin/env bash
# The recorded crash-consistency run: tests/it/crash.rs with 200 SIGKILLs (FLEET_CRASH_KILLS
# overrides), printing its figures; the result goes into RELIABILITY.md by hand.
set -euo pipefail
cd "$(dirname "$0")/.."
kills=${FLEET_CRASH_KILLS:-200}
echo "commit $(git rev-parse --short HEAD), $(nproc) cores, $(uname -sr)"
FLEET_CRASH_KILLS=$kills cargo test --locked --test it crash:: -- --nocapture 2>&1 |
  grep -E '^crash test|test result|panicked'
