"""Benchmark: `meshrun plan --estimate` against runs on this machine.

For each layout (ddp, fsdp2 in float32 and in bfloat16, fsdp2 with full
checkpointing, a 1F1B pipeline, tp = 2) of the reference model on 4 ranks:
the estimate on the cpu-this-machine profile, then `meshrun train` for a
few steps. Prints per layout the estimated and measured step time (the
median of the steps after the first two) and per-rank memory (parameters,
gradients, optimizer, buffers at their peak, activations at their peak),
with their ratios (goals: memory within 10%, step time within 25%).
Figures only; the exit status says whether every run worked.

    /usr/bin/python3 tests/bench/estimate_vs_runs.py build/bin/meshrun [--smoke]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIG = os.path.join(HERE, "..", "..", "examples", "llama-tiny.toml")
LAYOUTS = {
    "ddp": ["distributed.strategy=ddp"],
    "fsdp2 float32": ["distributed.mp_policy.param_dtype=float32"],
    "fsdp2 bfloat16": [],
    "fsdp2 full ckpt": ["distributed.mp_policy.param_dtype=float32",
                        "distributed.activation_checkpointing=\"full\""],
    "pp 2 x dp 2 1f1b": ["distributed.pp_size=2", "distributed.mp_policy.param_dtype=float32",
                         "distributed.pipeline.pp_microbatch_size=1",
                         "distributed.pipeline.pp_batch_size=4"],
    "tp 2 x dp 2": ["distributed.tp_size=2", "distributed.mp_policy.param_dtype=float32"],
}
LAUNCHER_VARIABLES = ("OMPI_", "PMI_", "PMIX_", "SLURM_")


def environment():
    return {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_VARIABLES)}


def estimate(meshrun, overrides):
    output = subprocess.run([meshrun, "plan", CONFIG, "--world-size", "4", "--estimate", "--json",
                             *overrides], check=True, capture_output=True, text=True,
                            env=environment()).stdout
    return json.loads(output)["estimate"]


def measure(meshrun, overrides, steps, folder):
    subprocess.run([meshrun, "train", CONFIG, "--nproc-per-node", "4", "--output", folder,
                    f"train.steps={steps}", "train.val_every=0", "checkpoint.export=false",
                    *overrides], check=True, capture_output=True, text=True, env=environment())
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        lines = [json.loads(line) for line in f]
    mem = lines[-1]["mem"]
    held = (mem["params"] + mem["grads"] + mem["optimizer"] + mem["buffers_peak"] +
            mem["activations_peak"])
    return statistics.median(m["step_time_s"] for m in lines[2:]), held, mem


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("meshrun")
    parser.add_argument("--smoke", action="store_true", help="2 layouts, 4 steps")
    args = parser.parse_args()
    layouts = dict(list(LAYOUTS.items())[:2]) if args.smoke else LAYOUTS
    steps = 4 if args.smoke else 12
    print("llama-tiny, 4 ranks on cpu-this-machine: estimate / measured")
    print(f"{'layout':>18} {'step est':>9} {'step run':>9} {'ratio':>6} {'mem est':>9} "
          f"{'mem run':>9} {'ratio':>6}")
    with tempfile.TemporaryDirectory() as root:
        for name, overrides in layouts.items():
            guess = estimate(args.meshrun, overrides)
            step, held, _ = measure(args.meshrun, overrides, steps,
                                    os.path.join(root, name.replace(" ", "-")))
            est_step, est_mem = guess["time"]["step"], guess["memory"]["total"]
            print(f"{name:>18} {est_step * 1e3:>7.1f}ms {step * 1e3:>7.1f}ms "
                  f"{est_step / step:>6.2f} {est_mem / 2**20:>7.1f}Mi {held / 2**20:>7.1f}Mi "
                  f"{est_mem / held:>6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
