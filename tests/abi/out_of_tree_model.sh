#!/usr/bin/env bash
# A third-party model in plain C, end to end: install this build to a fresh
# prefix, build examples/c_model against it with find_package(meshrun), drive
# the plugin through the model ABI from a ctypes host (c_model_stage.py), and
# train it with the installed `meshrun train`, which finds it by model_type
# on MESHRUN_PLUGIN_PATH, under DDP, FSDP2 and a two-stage pipeline.
#
#   out_of_tree_model.sh SOURCE_DIR BUILD_DIR CMAKE C_COMPILER [NINJA]
#
# Tolerance: a run on 2 ranks sees the same sequences as the run on 1 rank
# and computes in float32; only the order in which gradients are summed
# differs (over micro-batches and ranks; the pipeline keeps the 1-rank
# order). Those roundings (~1e-7 relative) pass through a few AdamW steps,
# so each step's loss and the val_loss must agree to a relative 1e-5
# (measured: 9e-8) and the exported weights to 1e-4 of the largest weight
# (measured: 4e-6; AdamW divides each gradient by its own magnitude, which
# magnifies the rounding of the smallest).
#
# Set MESHRUN_KEEP_TMP=1 to keep the temporary folder for inspection.
set -euo pipefail

if (($# < 4 || $# > 5)); then
  echo "usage: $0 SOURCE_DIR BUILD_DIR CMAKE C_COMPILER [NINJA]" >&2
  exit 1
fi
source_dir="$1" build_dir="$2" cmake="$3" c_compiler="$4" ninja="${5:-}"

source "$(dirname "${BASH_SOURCE[0]}")/out_of_tree_steps.sh"
example="$source_dir/examples/c_model"
plugin_dir="$tmp/plugin-build"
plugin="$plugin_dir/meshrun_model_byte_mlp.so"
meshrun="$prefix/bin/meshrun"

step "install the build" "$cmake" --install "$build_dir" --prefix "$prefix"

configure=("$cmake" -S "$example" -B "$plugin_dir" -G Ninja
  "-DCMAKE_PREFIX_PATH=$prefix" "-DCMAKE_C_COMPILER=$c_compiler" -DCMAKE_C_FLAGS=-Werror)
if [[ -n "$ninja" ]]; then
  configure+=("-DCMAKE_MAKE_PROGRAM=$ninja")
fi
step "configure examples/c_model against the installed package" "${configure[@]}"
meshrun_dir="$(sed -n 's/^meshrun_DIR:PATH=//p' "$plugin_dir/CMakeCache.txt")"
[[ "$meshrun_dir" == "$prefix"/* ]] ||
  fail "find_package(meshrun) found '$meshrun_dir', not the package installed in $prefix"
step "build examples/c_model" "$cmake" --build "$plugin_dir"
# As a plugin author's own build might: strict C11 against the installed
# headers, whatever the example's CMakeLists says.
step "byte_mlp.c compiles with -std=c11 -Wall -Wextra -Werror -pedantic" \
  "$c_compiler" -std=c11 -Wall -Wextra -Werror -pedantic -fsyntax-only \
  "-I$prefix/include" "$example/byte_mlp.c"

echo "== check the plugin file"
[[ -f "$plugin" ]] || fail "the build did not produce $plugin"
exports="$(nm -D --defined-only "$plugin" | awk '{print $NF}')"
[[ "$exports" == meshrun_plugin_get_api ]] ||
  fail "$plugin must export only meshrun_plugin_get_api; it exports: $exports"
if [[ "$(readelf --dynamic "$plugin")" == *"NEEDED"*"[libmeshrun"* ]]; then
  fail "$plugin links libmeshrun; a plugin reaches the runtime only through host services"
fi

export MESHRUN_PLUGIN_PATH="$plugin_dir"
echo "== meshrun plugins --kind model lists byte_mlp from MESHRUN_PLUGIN_PATH"
listing="$("$meshrun" plugins --kind model)" || fail "meshrun plugins exited with an error"
grep -Eq "^model +byte_mlp +1\.[0-9]+ +1\.0\.0 +$plugin\$" <<<"$listing" ||
  fail "meshrun plugins does not list byte_mlp from $plugin; it printed:"$'\n'"$listing"

step "the installed meshrun-conformance passes on the plugin" \
  "$prefix/bin/meshrun-conformance" --plugin "$plugin"
step "the model ABI from a ctypes host (c_model_stage.py)" \
  /usr/bin/python3 "$source_dir/tests/abi/c_model_stage.py" "$plugin"

config="$example/byte_mlp.toml"
runs="$tmp/runs"
# Trains the shipped config for a few steps: train NAME NPROC [OVERRIDE...].
train() {
  local name="$1" nproc="$2"
  shift 2
  step "meshrun train on $nproc rank(s): $name" "$meshrun" train "$config" \
    --nproc-per-node "$nproc" --output "$runs/$name" train.steps=6 train.val_every=3 "$@"
}
fsdp2=(distributed.strategy=fsdp2 distributed.mp_policy.param_dtype=float32)
train one_rank 1
train ddp 2
train fsdp2 2 "${fsdp2[@]}"
train pipeline 2 "${fsdp2[@]}" distributed.pp_size=2 distributed.pipeline.pp_schedule=1f1b \
  distributed.pipeline.pp_batch_size=16 distributed.pipeline.pp_microbatch_size=4

echo "== the loss falls; every 2-rank run matches the 1-rank run; the export has the model's names"
compare='
import json, os, struct, sys
from array import array

runs, tolerance, weight_tolerance = sys.argv[1], 1e-5, 1e-4
H, I, L = 64, 256, 2  # byte_mlp.toml

def metrics(name):
    with open(os.path.join(runs, name, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]

def weights(name):
    with open(os.path.join(runs, name, "model.safetensors"), "rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        data = f.read()
    header.pop("__metadata__", None)
    tensors = {}
    for key, t in header.items():
        assert t["dtype"] == "F32", (key, t["dtype"])
        tensors[key] = (t["shape"], array("f", data[t["data_offsets"][0]:t["data_offsets"][1]]))
    return tensors

expected = {"embed.weight": [256, H], "embed_prev.weight": [256, H],
            "head.weight": [256, H], "head.bias": [256]}
for l in range(L):
    expected.update({f"blocks.{l}.fc1.weight": [I, H], f"blocks.{l}.fc1.bias": [I],
                     f"blocks.{l}.fc2.weight": [H, I], f"blocks.{l}.fc2.bias": [H]})
one, reference = metrics("one_rank"), weights("one_rank")
losses = [m["loss"] for m in one]
assert len(losses) == 6 and losses[-1] < losses[0], f"the loss does not fall: {losses}"
assert {k: s for k, (s, _) in reference.items()} == expected, sorted(reference)
largest = max(abs(v) for _, values in reference.values() for v in values)
for name in ("ddp", "fsdp2", "pipeline"):
    other = metrics(name)
    for key in ("loss", "val_loss"):
        a = [m[key] for m in one if key in m]
        b = [m[key] for m in other if key in m]
        assert len(a) == len(b) > 0, (name, key, a, b)
        worst = max(abs(x - y) / abs(x) for x, y in zip(a, b))
        assert worst <= tolerance, f"{name}: {key} {b} differs from 1 rank {a} by {worst:.1e}"
        print(f"{name}: {key} within {worst:.1e} (relative) of 1 rank")
    exported = weights(name)
    assert exported.keys() == reference.keys(), (name, sorted(exported))
    worst = max(abs(x - y) for key, (_, values) in reference.items()
                for x, y in zip(values, exported[key][1]))
    assert worst <= weight_tolerance * largest, f"{name}: exported weights differ by {worst:.1e}"
    print(f"{name}: weights within {worst:.1e} of 1 rank (largest {largest:.2f})")
with open(os.path.join(runs, "one_rank", "config.json")) as f:
    hf = json.load(f)
assert (hf["model_type"], hf["architectures"]) == ("byte_mlp", ["ByteMLPForCausalLM"]), hf
assert (hf["hidden_size"], hf["intermediate_size"], hf["num_layers"]) == (H, I, L), hf
print("losses of 1 rank:", " ".join(f"{x:.4f}" for x in losses))
'
/usr/bin/python3 -c "$compare" "$runs" || fail "the runs above disagree (see the assertion)"

# Bad input: refused before any rank starts, exit status 2, one line that
# names the key, and no output folder.
refused() {
  local what="$1" needle="$2" status=0 out err
  shift 2
  echo "== refused: $what"
  out="$tmp/refused.out" err="$tmp/refused.err"
  "$meshrun" train "$config" --nproc-per-node 2 --output "$runs/refused" "$@" >"$out" 2>"$err" ||
    status=$?
  [[ $status == 2 ]] || fail "$what: exit status $status, not 2; stderr:"$'\n'"$(cat "$err")"
  [[ ! -s "$out" && ! -e "$runs/refused" ]] || fail "$what: something ran before the refusal"
  [[ "$(wc -l <"$err")" == 1 && "$(cat "$err")" == "meshrun: error: "*"$needle"* ]] ||
    fail "$what: stderr should be one line naming '$needle'; it is:"$'\n'"$(cat "$err")"
}
refused "an unknown [model] key" \
  "model.hidden_sise: unknown key for model_type 'byte_mlp'" model.hidden_sise=32
refused "a bad value, in the plugin's words" \
  "model.num_layers: expected an integer in [1, 1000], got 0" model.num_layers=0
refused "autocast (the description has no autocast_dtypes)" \
  "distributed.autocast_dtype: model plugin" distributed.autocast_dtype=bfloat16
refused "context parallelism (the description has no context_parallel)" \
  "distributed.cp_size: 2 > 1, but model plugin" "${fsdp2[@]}" distributed.cp_size=2
refused "a zero-bubble schedule (no split backward)" \
  "distributed.pipeline.pp_schedule: schedule zbv_zero_bubble splits the backward into I and W" \
  "${fsdp2[@]}" model.num_layers=4 distributed.pp_size=2 \
  distributed.pipeline.pp_schedule=zbv_zero_bubble \
  distributed.pipeline.pp_batch_size=16 distributed.pipeline.pp_microbatch_size=4

echo "out-of-tree C model: all checks passed"
