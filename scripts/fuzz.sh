#!/usr/bin/env bash
# Fuzzes the readers of users' and disks' input with libFuzzer (tests/fuzz):
# each target replays its regression cases, then fuzzes for SECONDS from
# its seeds and the corpus grown by earlier runs. docs/testing.md says how
# to run it longer and what to do with a finding.
#
#   scripts/fuzz.sh SECONDS [TARGET...]   targets: config schedule_csv safetensors
#                                         checkpoint_index (default: all)
#   scripts/fuzz.sh --built SECONDS ...   the same with the targets already built (ctest)
#
# The fuzz targets are built in the sanitized tree (scripts/build.sh
# --sanitize, ${MESHRUN_SANITIZE_BUILD_DIR:-build-sanitize}), which has them
# where clang brings libFuzzer; its fuzz/ folder keeps the grown corpus and
# the findings. Exits 77 (ctest's skip) without libFuzzer.
set -euo pipefail
cd "$(dirname "$0")/.."

all_targets=(config schedule_csv safetensors checkpoint_index)
build_dir="${MESHRUN_SANITIZE_BUILD_DIR:-build-sanitize}"
fuzz_dir="$build_dir/fuzz"

built=false
if [ "${1:-}" = --built ]; then
  built=true
  shift
fi
seconds=${1:?usage: scripts/fuzz.sh [--built] SECONDS [TARGET...]}
shift
targets=("${all_targets[@]}")
if [ $# -gt 0 ]; then targets=("$@"); fi

if ! $built; then
  scripts/build.sh --sanitize "${targets[@]/#/--target=meshrun_fuzz_}"
fi
if ! grep -q '^MESHRUN_FUZZ:INTERNAL=ON' "$build_dir/CMakeCache.txt" 2>/dev/null; then
  echo "meshrun fuzz: skipped: $build_dir has no libFuzzer targets (a clang with libFuzzer builds" \
    "them; scripts/install-deps.sh installs one)"
  exit 77
fi

# libFuzzer's libstdc++ comes before the ASan runtime among the libraries a
# fuzz program loads, which ASan refuses: the runtime is preloaded.
LD_PRELOAD="$(clang++ -print-file-name=libclang_rt.asan-x86_64.so)"
export LD_PRELOAD

# The seeds of a target: its committed corpus, and for config the examples.
seeds() {
  if [ "$1" = config ]; then
    mkdir -p "$fuzz_dir/examples"
    cp examples/*.toml "$fuzz_dir/examples/"
    echo "$fuzz_dir/examples"
  else
    echo "tests/fuzz/corpus/$1"
  fi
}

for target in "${targets[@]}"; do
  program="$build_dir/bin/meshrun_fuzz_$target"
  corpus="$fuzz_dir/corpus/$target"
  artifacts="$fuzz_dir/artifacts/$target/"
  mkdir -p "$corpus" "$artifacts"
  regressions=(tests/fuzz/regressions/"$target"/*)
  if [ -e "${regressions[0]}" ]; then
    echo "meshrun fuzz: $target: replaying ${#regressions[@]} regression cases"
    "$program" -runs=0 -error_exitcode=1 -artifact_prefix="$artifacts" "${regressions[@]}"
  fi
  echo "meshrun fuzz: $target: fuzzing for $seconds s"
  # -timeout: one input past 10 s is a hang; -rss_limit_mb: past 2 GiB a leak
  # or an allocation that bad input should not cause. -error_exitcode:
  # libFuzzer's default, 77, is ctest's skip. New inputs go to the first
  # folder, the grown corpus, never to the seeds.
  mapfile -t seed_dirs < <(seeds "$target")
  "$program" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -error_exitcode=1 \
    -max_len=65536 -print_final_stats=1 -artifact_prefix="$artifacts" \
    "$corpus" "${seed_dirs[@]}"
done
