#!/usr/bin/env bash
# Fails when a C, C++ or CUDA source of the project is not clang-formatted
# (.clang-format at the root). Lists the files that differ.
set -euo pipefail
cd "$(dirname "$0")/.."
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  mapfile -t files < <(git ls-files -co --exclude-standard -- '*.c' '*.h' '*.cpp' '*.hpp' '*.cu')
else
  mapfile -t files < <(find abi core plugins strategies models tools tests examples \
    -type f \( -name '*.c' -o -name '*.h' -o -name '*.cpp' -o -name '*.hpp' -o -name '*.cu' \))
fi
# One clang-format process for every file: it names each file that differs
# in its diagnostics ("FILE:LINE:COL: error: code should be clang-formatted").
# Any other failure (no clang-format, a file it cannot read) fails too.
status=0
report=$(clang-format --dry-run --Werror "${files[@]}" 2>&1) || status=$?
violation=': error: code should be clang-formatted'
mapfile -t unformatted < <(grep -e "$violation" <<<"$report" | sed 's/:[0-9]*:[0-9]*: error: .*//' |
  sort -u)
if [ $status -ne 0 ] && [ ${#unformatted[@]} -eq 0 ]; then
  echo "clang-format failed (status $status):"
  echo "$report"
  exit 1
fi
if [ ${#unformatted[@]} -gt 0 ]; then
  echo "not clang-formatted (run clang-format -i on them):"
  printf '  %s\n' "${unformatted[@]}"
  exit 1
fi
echo "${#files[@]} files clang-formatted"
