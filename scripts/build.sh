#!/usr/bin/env bash
# Installs what is missing, then configures and builds meshrun into
# ${MESHRUN_BUILD_DIR:-build} with CMake and Ninja. Arguments are passed to
# the CMake configure step (scripts/test.sh gives -DMESHRUN_SANITIZE=ON).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
build_dir="${MESHRUN_BUILD_DIR:-build}"
cmake -S . -B "$build_dir" -G Ninja -DMESHRUN_WERROR=ON "$@"
cmake --build "$build_dir" -j "$(nproc)"
