"""Benchmark: the kit-composed Llama against the hand-written one.

Trains the reference model (examples/llama-tiny.toml, bfloat16 matmuls
under fsdp2) as model_type "llama" (models/llama/plugin.cpp, composed from
meshrun/kit.h) and as "hand_llama" (tests/kit/hand_llama.cpp, the
hand-written Llama family it replaced), alternating them over
--rounds rounds (the machine is shared and noisy), and prints each one's
median tokens/s (the first step, which allocates, left out; each model's
best round) and kit / hand-written (goal: >= 0.97).

    MESHRUN_PLUGIN_PATH=build/test-plugins /usr/bin/python3 tests/bench/kit_vs_llama.py \\
        build/bin/meshrun [--nproc 2] [--steps 12] [--rounds 3] [overrides ...]

Prints figures; the exit status says only whether every run worked.
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
MODELS = ("hand_llama", "llama")


def tokens_per_s(args, output, model_type):
    subprocess.run([args.meshrun, "train", CONFIG, "--nproc-per-node", str(args.nproc),
                    "--output", output, f"model.model_type={model_type}",
                    f"train.steps={args.steps}", "train.val_every=0", "checkpoint.export=false",
                    *args.overrides], check=True, capture_output=True, text=True)
    with open(os.path.join(output, "metrics.jsonl")) as f:
        lines = [json.loads(line) for line in f]
    return statistics.median(m["tokens_per_s"] for m in lines[1:])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("meshrun")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_intermixed_args()
    runs = {model: [] for model in MODELS}
    with tempfile.TemporaryDirectory(prefix="meshrun-bench-kit-") as root:
        for round_ in range(args.rounds):
            for model in MODELS:
                runs[model].append(tokens_per_s(args, os.path.join(root, f"{model}{round_}"),
                                                model))
    best = {model: max(results) for model, results in runs.items()}
    for model in MODELS:
        print(f"{model}: tokens/s per round " + ", ".join(f"{t:.0f}" for t in runs[model]) +
              f"; best {best[model]:.0f}")
    print(f"llama (kit) / hand_llama: {best['llama'] / best['hand_llama']:.3f} (goal >= 0.97)")


if __name__ == "__main__":
    sys.exit(main())
