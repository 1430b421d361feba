#!/usr/bin/env bash
# The test command: builds everything and runs every test with ctest. With
# --sanitize it builds again with AddressSanitizer + UndefinedBehaviorSanitizer
# (MESHRUN_SANITIZE, in ${MESHRUN_SANITIZE_BUILD_DIR:-build-sanitize}) and runs
# every test that executes meshrun's code there, multi-process ones included.
#   scripts/test.sh               the plain build (CI's command)
#   scripts/test.sh --sanitize    the sanitized build only
#   scripts/test.sh --both        the plain build, then the sanitized one
set -euo pipefail
cd "$(dirname "$0")/.."

mode="${1:---plain}"
case "$mode" in
  --plain | --sanitize | --both) ;;
  *)
    echo "usage: scripts/test.sh [--plain | --sanitize | --both]" >&2
    exit 2
    ;;
esac

if [ "$mode" != --sanitize ]; then
  scripts/build.sh
  ctest --test-dir "${MESHRUN_BUILD_DIR:-build}" --output-on-failure -j "$(nproc)"
fi

if [ "$mode" != --plain ]; then
  build_dir="${MESHRUN_SANITIZE_BUILD_DIR:-build-sanitize}"
  MESHRUN_BUILD_DIR="$build_dir" scripts/build.sh -DMESHRUN_SANITIZE=ON
  suppressions="$PWD/tests/sanitize"
  # Every report fails the test: ASan and LSan exit non-zero by default, UBSan
  # aborts (-fno-sanitize-recover). Allocation stacks are unwound without
  # frame pointers, which Open MPI's libraries lack: the suppressions match
  # a leak by the library in its stack, and a cut stack would not show it.
  export ASAN_OPTIONS="detect_leaks=1:check_initialization_order=1:strict_init_order=1:fast_unwind_on_malloc=1"
  export LSAN_OPTIONS="suppressions=$suppressions/lsan.supp:print_suppressions=0"
  export UBSAN_OPTIONS="suppressions=$suppressions/ubsan.supp:print_stacktrace=1"
  # The label 'unsanitized' marks tests that run no meshrun code (formatting,
  # the ABI baseline) or measure speed; tests/CMakeLists.txt says which.
  ctest --test-dir "$build_dir" --output-on-failure -j "$(nproc)" -LE unsanitized
fi
