#!/usr/bin/env bash
# Compiles every public header alone, twice included, in a file of its own:
# each C header as strict C11 and as C++17, each C++ header as C++17, with
# warnings as errors. docs/design.md, ABI rule 1: the ABI headers are plain C11.
#
#   compile_headers.sh C_COMPILER CXX_COMPILER INCLUDE_DIR
set -euo pipefail

if (($# != 3)); then
  echo "usage: $0 C_COMPILER CXX_COMPILER INCLUDE_DIR" >&2
  exit 1
fi
cc="$1" cxx="$2" include_dir="$3"

tmp="$(mktemp -d "${TMPDIR:-/tmp}/meshrun-headers.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT

c_flags=(-std=c11 -pedantic -Werror -Wall -Wextra -Wstrict-prototypes -fsyntax-only)
cxx_flags=(-std=c++17 -pedantic -Werror -Wall -Wextra -fsyntax-only)

failed=0
compile() {
  local header="$1" language="$2" compiler="$3"
  shift 3
  local source="$tmp/${header##*/}.$language"
  printf '#include "meshrun/%s"\n#include "meshrun/%s"\n' "${header##*/}" "${header##*/}" >"$source"
  if "$compiler" "$@" -I"$include_dir" "$source"; then
    echo "ok: meshrun/${header##*/} as $language"
  else
    echo "FAILED: meshrun/${header##*/} does not compile alone as $language ($compiler $*)" >&2
    failed=1
  fi
}

shopt -s nullglob
headers=("$include_dir"/meshrun/*.h)
if ((${#headers[@]} == 0)); then
  echo "no headers in $include_dir/meshrun" >&2
  exit 1
fi
for header in "${headers[@]}"; do
  compile "$header" c "$cc" "${c_flags[@]}"
  compile "$header" cpp "$cxx" "${cxx_flags[@]}"
done
for header in "$include_dir"/meshrun/*.hpp; do
  compile "$header" cpp "$cxx" "${cxx_flags[@]}"
done
exit "$failed"
