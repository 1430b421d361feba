#!/usr/bin/env bash
# The test command (CI's, through .ci/run): builds everything with
# AddressSanitizer + UndefinedBehaviorSanitizer (MESHRUN_SANITIZE, in
# ${MESHRUN_SANITIZE_BUILD_DIR:-build-sanitize}) and runs every test with
# ctest there, multi-process ones included. The tests that need optimized
# code (the Release build without warnings, the time limits, the main job's
# example) build and run a Release copy themselves (tests/build).
#   scripts/test.sh            the sanitized build (CI's command)
#   scripts/test.sh --plain    the same tests on the plain build (build/), faster
#   scripts/test.sh --both     the plain build, then the sanitized one
set -euo pipefail
cd "$(dirname "$0")/.."

mode="${1:---sanitize}"
case "$mode" in
  --plain | --sanitize | --both) ;;
  *)
    echo "usage: scripts/test.sh [--sanitize | --plain | --both]" >&2
    exit 2
    ;;
esac

if [ "$mode" != --sanitize ]; then
  scripts/build.sh -DMESHRUN_SANITIZE=OFF
  ctest --test-dir "${MESHRUN_BUILD_DIR:-build}" --output-on-failure -j "$(nproc)"
fi

if [ "$mode" != --plain ]; then
  build_dir="${MESHRUN_SANITIZE_BUILD_DIR:-build-sanitize}"
  MESHRUN_BUILD_DIR="$build_dir" scripts/build.sh -DMESHRUN_SANITIZE=ON
  suppressions="$PWD/tests/sanitize"
  # Every report fails the test: ASan and LSan exit non-zero by default, UBSan
  # aborts (-fno-sanitize-recover). Allocation stacks are unwound by frame
  # pointers, the fast way; the suppressions still match Open MPI's leaks,
  # since a sanitized meshrun never unmaps the library that allocated.
  export ASAN_OPTIONS="detect_leaks=1:check_initialization_order=1:strict_init_order=1:fast_unwind_on_malloc=1"
  export LSAN_OPTIONS="suppressions=$suppressions/lsan.supp:print_suppressions=0"
  export UBSAN_OPTIONS="suppressions=$suppressions/ubsan.supp:print_stacktrace=1"
  ctest --test-dir "$build_dir" --output-on-failure -j "$(nproc)"
fi
