#!/usr/bin/env bash
# The test command (CI's, through .ci/run). docs/testing.md says which tier
# catches what and how long each takes on 2 cores.
#
#   scripts/test.sh          the quick tier, before every commit (about 14
#                            minutes from a fresh clone): the plain build
#                            (build/, Release, -Werror) runs every test but
#                            those labelled `sanitized`, which the sanitized
#                            build (build-sanitize/: clang, ASan + UBSan,
#                            libFuzzer) builds and runs: unit, parser, ABI,
#                            fuzz-regression and plugin-loading tests and a
#                            multi-rank training run per strategy, at nice 19
#                            beside the plain tests
#   scripts/test.sh --full   the full sweep: every test in a sanitized build
#                            of everything and in a Release build compiled
#                            file by file (build-full/: no unity, so a
#                            missing #include shows), with the slow sweeps
#                            (larger sizes, minutes of fuzzing)
#
# Extra arguments go to both ctest runs (-R REGEX, --output-on-failure, ...).
set -euo pipefail
cd "$(dirname "$0")/.."

mode=quick
if [ "${1:-}" = --full ]; then
  mode=full
  shift
elif [ "${1:-}" != "" ] && [ "${1#-}" = "$1" ]; then
  echo "usage: scripts/test.sh [--full] [ctest arguments...]" >&2
  exit 2
fi
sweep=-DMESHRUN_FULL_SWEEP=$([ $mode = full ] && echo ON || echo OFF)
jobs=$(nproc)

# Every report fails its test: ASan and LSan exit non-zero by default, UBSan
# aborts (-fno-sanitize-recover). Allocation stacks are unwound by frame
# pointers, the fast way; the suppressions still match Open MPI's leaks,
# since a sanitized meshrun never unmaps the library that allocated. The
# runtime does not follow __tls_get_addr: on this glibc it can record a
# bogus range for a loaded plugin's dynamic TLS, and its leak check then
# crashes at exit ("Tracer caught signal 11" after "DTLS ... at 0x14ab-"),
# depending only on the memory layout (the conformance run of a model in
# some build folders). Not scanning those blocks can only report a leak
# that is none, never hide one.
sanitizer_options() {
  local suppressions="$PWD/tests/sanitize"
  export ASAN_OPTIONS="detect_leaks=1:check_initialization_order=1:strict_init_order=1:fast_unwind_on_malloc=1:intercept_tls_get_addr=0"
  export LSAN_OPTIONS="suppressions=$suppressions/lsan.supp:print_suppressions=0"
  export UBSAN_OPTIONS="suppressions=$suppressions/ubsan.supp:print_stacktrace=1"
}

plain_dir="${MESHRUN_BUILD_DIR:-build}"
sanitize_dir="${MESHRUN_SANITIZE_BUILD_DIR:-build-sanitize}"
status=0
if [ $mode = quick ]; then
  scripts/build.sh "$sweep" -DMESHRUN_PLAIN_TIER=ON
  scripts/build.sh --sanitize "$sweep" --target=meshrun_sanitized_tier
  # The sanitized tests run beside the plain ones at the lowest priority:
  # the plain tests' ranks leave most of a core idle while they start and
  # wait, and the sanitized tests take that time instead of their own.
  sanitized_log="$sanitize_dir/Testing/quick-tier.log"
  mkdir -p "$(dirname "$sanitized_log")"
  (
    sanitizer_options
    exec nice -n 19 ctest --test-dir "$sanitize_dir" -L sanitized -j "$jobs" \
      --output-on-failure "$@" >"$sanitized_log" 2>&1
  ) &
  sanitized=$!
  ctest --test-dir "$plain_dir" -LE sanitized -j "$jobs" --output-on-failure "$@" || status=$?
  sanitized_status=0
  wait $sanitized || sanitized_status=$?
  cat "$sanitized_log"
  [ $sanitized_status = 0 ] || status=$sanitized_status
else
  full_dir="${MESHRUN_FULL_BUILD_DIR:-build-full}"
  MESHRUN_BUILD_DIR="$full_dir" scripts/build.sh "$sweep" -DCMAKE_UNITY_BUILD=OFF \
    -DMESHRUN_PLAIN_TIER=OFF
  scripts/build.sh --sanitize "$sweep"
  ctest --test-dir "$full_dir" -j "$jobs" --output-on-failure "$@" || status=$?
  sanitizer_options
  ctest --test-dir "$sanitize_dir" -j "$jobs" --output-on-failure "$@" || status=$?
fi
exit $status
