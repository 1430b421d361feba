#!/usr/bin/env bash
# Builds the libFuzzer targets (tests/fuzz) with clang and fuzzes each for
# SECONDS, after replaying its regression cases. docs/testing.md says how to
# run it longer and what to do with a crash.
#
#   scripts/fuzz.sh SECONDS [TARGET...]   targets: config schedule_csv safetensors
#                                         checkpoint_index (default: all)
#   scripts/fuzz.sh --build-only
#
# The build and the grown corpus live in ${MESHRUN_FUZZ_DIR:-build/fuzz}.
# Exits 77 (ctest's skip) when clang or libFuzzer is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

all_targets=(config schedule_csv safetensors checkpoint_index)
fuzz_dir="${MESHRUN_FUZZ_DIR:-${MESHRUN_BUILD_DIR:-build}/fuzz}"

skip() {
  echo "meshrun fuzz: skipped: $1 (scripts/install-deps.sh installs clang)"
  exit 77
}

command -v clang++ >/dev/null || skip "clang++ is not installed"
[ -f "$(clang++ -print-file-name=libclang_rt.fuzzer-x86_64.a)" ] ||
  skip "clang++ has no libFuzzer (libclang_rt.fuzzer-x86_64.a)"

build() {
  local launcher=()
  command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
  cmake -S tests/fuzz/libfuzzer -B "$fuzz_dir" -G Ninja -DCMAKE_CXX_COMPILER=clang++ \
    "${launcher[@]}" >/dev/null
  cmake --build "$fuzz_dir" -j "$(nproc)" --target "${@/#/fuzz_}"
}

# The seeds of a target: its committed corpus, and for config the examples.
seeds() {
  if [ "$1" = config ]; then echo "$fuzz_dir/examples"; else echo "tests/fuzz/corpus/$1"; fi
}

run() {
  local target=$1 seconds=$2
  local regressions=(tests/fuzz/regressions/"$target"/*)
  local artifacts="$fuzz_dir/artifacts/$target/"
  mkdir -p "$fuzz_dir/corpus/$target" "$artifacts"
  if [ -e "${regressions[0]}" ]; then
    echo "meshrun fuzz: $target: replaying ${#regressions[@]} regression cases"
    "$fuzz_dir/fuzz_$target" -error_exitcode=1 -artifact_prefix="$artifacts" "${regressions[@]}"
  fi
  echo "meshrun fuzz: $target: fuzzing for $seconds s"
  # -timeout: one input past 10 s is a hang; -rss_limit_mb: past 2 GiB a leak
  # or an allocation that bad input should not cause.
  mapfile -t seed_dirs < <(seeds "$target")
  # -error_exitcode: libFuzzer's default, 77, is ctest's skip.
  "$fuzz_dir/fuzz_$target" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
    -error_exitcode=1 -max_len=65536 -print_final_stats=1 -artifact_prefix="$artifacts" \
    "$fuzz_dir/corpus/$target" "${seed_dirs[@]}"
}

if [ "${1:-}" = --build-only ]; then
  build "${all_targets[@]}"
  exit 0
fi
seconds=${1:?usage: scripts/fuzz.sh SECONDS [TARGET...] | --build-only}
shift
targets=("${all_targets[@]}")
if [ $# -gt 0 ]; then targets=("$@"); fi
build "${targets[@]}"
mkdir -p "$fuzz_dir/examples"
cp examples/*.toml "$fuzz_dir/examples/"
for target in "${targets[@]}"; do run "$target" "$seconds"; done
