#!/usr/bin/env bash
# The plugin-author path end to end: install this build to a fresh prefix,
# build examples/c_plugin against it with find_package(meshrun), and load the
# plugin by name from the installed meshrun.
#
#   out_of_tree_plugin.sh SOURCE_DIR BUILD_DIR CMAKE C_COMPILER [NINJA]
#
# Set MESHRUN_KEEP_TMP=1 to keep the temporary folder for inspection.
set -euo pipefail

if (($# < 4 || $# > 5)); then
  echo "usage: $0 SOURCE_DIR BUILD_DIR CMAKE C_COMPILER [NINJA]" >&2
  exit 1
fi
source_dir="$1" build_dir="$2" cmake="$3" c_compiler="$4" ninja="${5:-}"

source "$(dirname "${BASH_SOURCE[0]}")/out_of_tree_steps.sh"
plugin_dir="$tmp/plugin-build"
plugin="$plugin_dir/meshrun_strategy_example_c.so"

step "install the build" "$cmake" --install "$build_dir" --prefix "$prefix"

configure=("$cmake" -S "$source_dir/examples/c_plugin" -B "$plugin_dir" -G Ninja
  "-DCMAKE_PREFIX_PATH=$prefix" "-DCMAKE_C_COMPILER=$c_compiler" -DCMAKE_C_FLAGS=-Werror)
if [[ -n "$ninja" ]]; then
  configure+=("-DCMAKE_MAKE_PROGRAM=$ninja")
fi
step "configure examples/c_plugin against the installed package" "${configure[@]}"
meshrun_dir="$(sed -n 's/^meshrun_DIR:PATH=//p' "$plugin_dir/CMakeCache.txt")"
[[ "$meshrun_dir" == "$prefix"/* ]] ||
  fail "find_package(meshrun) found '$meshrun_dir', not the package installed in $prefix"
step "build examples/c_plugin" "$cmake" --build "$plugin_dir"

echo "== check the plugin file"
[[ -f "$plugin" ]] || fail "the build did not produce $plugin"
exports="$(nm -D --defined-only "$plugin" | awk '{print $NF}')"
[[ "$exports" == meshrun_plugin_get_api ]] ||
  fail "$plugin must export only meshrun_plugin_get_api; it exports: $exports"
dynamic="$(readelf --dynamic "$plugin")"
if [[ "$dynamic" == *"NEEDED"*"[libmeshrun"* ]]; then
  fail "$plugin links libmeshrun; a plugin reaches the runtime only through host services"
fi

echo "== meshrun plugins --kind strategy lists example_c from MESHRUN_PLUGIN_PATH"
listing="$(MESHRUN_PLUGIN_PATH="$plugin_dir" "$prefix/bin/meshrun" plugins --kind strategy)" ||
  fail "meshrun plugins exited with an error"
grep -Eq "^strategy +example_c +1\.[0-9]+ +1\.0\.0 +$plugin\$" <<<"$listing" ||
  fail "meshrun plugins does not list example_c from $plugin; it printed:"$'\n'"$listing"

echo "== meshrun plan loads strategy example_c by name"
printf '[distributed]\nstrategy = "example_c"\n' >"$tmp/example_c.toml"
plan="$(MESHRUN_PLUGIN_PATH="$plugin_dir" "$prefix/bin/meshrun" plan "$tmp/example_c.toml" \
  --world-size 8 --json)" || fail "meshrun plan with strategy example_c exited with an error"
check_plan='
import json, sys
plan = json.load(sys.stdin)
strategy = plan["plugins"]["strategy"]
assert strategy["name"] == "example_c" and strategy["file"] == sys.argv[1], strategy
assert plan["mesh_family"] == "fsdp2", plan["mesh_family"]
assert plan["axes"]["dp_shard"] == 8, plan["axes"]
'
/usr/bin/python3 -c "$check_plan" "$plugin" <<<"$plan" ||
  fail "meshrun plan did not load example_c as expected; it printed:"$'\n'"$plan"

conformance="$prefix/bin/meshrun-conformance"
[[ -x "$conformance" ]] || fail "$conformance was not installed (tests/conformance installs it)"
step "the installed meshrun-conformance passes on the plugin" "$conformance" --plugin "$plugin"

echo "== cmake --install puts the plugin into MESHRUN_PLUGIN_INSTALL_DIR, found without a path"
step "install the plugin" "$cmake" --install "$plugin_dir"
listing="$("$prefix/bin/meshrun" plugins --kind strategy)" || fail "meshrun plugins exited with an error"
grep -Eq "^strategy +example_c +.* $prefix/.*/meshrun_strategy_example_c\.so\$" <<<"$listing" ||
  fail "the installed plugin is not listed from $prefix; meshrun plugins printed:"$'\n'"$listing"

echo "out-of-tree C plugin: all checks passed"
