#!/usr/bin/env bash
# Installs what is missing, then configures and builds meshrun with CMake and
# Ninja, warnings as errors (the project's own builds; docs/testing.md):
#
#   scripts/build.sh [--target=T ...] [CMAKE_ARGS...]
#       the plain build in ${MESHRUN_BUILD_DIR:-build}: Release (-O3), what
#       users build and every benchmark times
#   scripts/build.sh --sanitize [--target=T ...] [CMAKE_ARGS...]
#       the sanitized build in ${MESHRUN_SANITIZE_BUILD_DIR:-build-sanitize}:
#       AddressSanitizer + UBSan, with clang where it is installed (its
#       libFuzzer makes the fuzz targets), else the default compiler
#
# --target=T builds T only (repeatable; default: everything).
# MESHRUN_SKIP_INSTALL_DEPS=1 skips the Debian packages' install (a machine
# that has them from elsewhere: scripts/gpu-deps.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
[ "${MESHRUN_SKIP_INSTALL_DEPS:-0}" = 1 ] || scripts/install-deps.sh

build_dir="${MESHRUN_BUILD_DIR:-build}"
configure=(-DCMAKE_BUILD_TYPE=Release)
targets=()
cmake_args=()
for argument in "$@"; do
  case "$argument" in
    --sanitize)
      build_dir="${MESHRUN_SANITIZE_BUILD_DIR:-build-sanitize}"
      configure=(-DCMAKE_BUILD_TYPE=RelWithDebInfo -DMESHRUN_SANITIZE=ON)
      if command -v clang++ >/dev/null; then
        configure+=(-DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++)
      fi
      ;;
    --target=*) targets+=(--target "${argument#--target=}") ;;
    *) cmake_args+=("$argument") ;;
  esac
done
cmake -S . -B "$build_dir" -G Ninja -DMESHRUN_WERROR=ON "${configure[@]}" "${cmake_args[@]}"
cmake --build "$build_dir" -j "$(nproc)" "${targets[@]}"
