#!/usr/bin/env bash
# The test command: builds everything and runs every test with ctest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build.sh
ctest --test-dir "${MESHRUN_BUILD_DIR:-build}" --output-on-failure -j "$(nproc)"
