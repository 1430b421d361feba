#!/usr/bin/env bash
# Two architectures composed from the installed model kit, end to end:
# install this build to a fresh prefix, build examples/kit_models/qwen2 (C++)
# and examples/kit_models/phi (C) against it with find_package(meshrun),
# check each is a plugin of at most 400 lines that links the kit and not the
# runtime, run the installed meshrun-conformance on both, and train them
# with the installed `meshrun train` (kit_models.py: every parallelism
# against 1 rank, the export against PyTorch).
#
#   out_of_tree_kit_models.sh SOURCE_DIR BUILD_DIR CMAKE C_COMPILER CXX_COMPILER [NINJA]
#
# Set MESHRUN_KEEP_TMP=1 to keep the temporary folder for inspection.
set -euo pipefail

if (($# < 5 || $# > 6)); then
  echo "usage: $0 SOURCE_DIR BUILD_DIR CMAKE C_COMPILER CXX_COMPILER [NINJA]" >&2
  exit 1
fi
source_dir="$1" build_dir="$2" cmake="$3" c_compiler="$4" cxx_compiler="$5" ninja="${6:-}"

source "$(dirname "${BASH_SOURCE[0]}")/out_of_tree_steps.sh"
meshrun="$prefix/bin/meshrun"

step "install the build" "$cmake" --install "$build_dir" --prefix "$prefix"

# build NAME SOURCE: configures and builds examples/kit_models/NAME.
plugin_path=""
build() {
  local name="$1" source="$2" example="$source_dir/examples/kit_models/$1" out="$tmp/$1"
  local configure=("$cmake" -S "$example" -B "$out" -G Ninja "-DCMAKE_PREFIX_PATH=$prefix"
    "-DCMAKE_C_COMPILER=$c_compiler" "-DCMAKE_CXX_COMPILER=$cxx_compiler"
    -DCMAKE_C_FLAGS=-Werror -DCMAKE_CXX_FLAGS=-Werror -DCMAKE_BUILD_TYPE=Release)
  if [[ -n "$ninja" ]]; then
    configure+=("-DCMAKE_MAKE_PROGRAM=$ninja")
  fi
  step "configure examples/kit_models/$name against the installed package" "${configure[@]}"
  step "build examples/kit_models/$name" "$cmake" --build "$out"
  local plugin="$out/meshrun_model_$name.so" lines
  [[ -f "$plugin" ]] || fail "the build did not produce $plugin"
  lines="$(wc -l <"$example/$source")"
  echo "== $source is $lines lines"
  ((lines <= 400)) || fail "$source has $lines lines; a kit model fits in 400"
  [[ "$(nm -D --defined-only "$plugin" | awk '{print $NF}')" == meshrun_plugin_get_api ]] ||
    fail "$plugin must export only meshrun_plugin_get_api"
  local needed
  needed="$(readelf --dynamic "$plugin" | grep NEEDED)"
  [[ "$needed" == *"[libmeshrun_kit.so]"* ]] || fail "$plugin does not link the kit: $needed"
  [[ "$needed" != *"[libmeshrun.so"* ]] || fail "$plugin links libmeshrun, the runtime: $needed"
  step "the installed meshrun-conformance passes on $name" \
    "$prefix/bin/meshrun-conformance" --plugin "$plugin"
  plugin_path="$plugin_path${plugin_path:+:}$out"
}
build qwen2 qwen2.cpp
build phi phi.c

export MESHRUN_PLUGIN_PATH="$plugin_path"
echo "== meshrun plugins --kind model lists both"
listing="$("$meshrun" plugins --kind model)" || fail "meshrun plugins exited with an error"
for name in qwen2 phi; do
  grep -Eq "^model +$name " <<<"$listing" || fail "meshrun plugins does not list $name:"$'\n'"$listing"
done

/usr/bin/python3 "$source_dir/tests/abi/kit_models.py" "$meshrun" ||
  fail "the kit models' training checks failed (above)"
echo "out-of-tree kit models: all checks passed"
