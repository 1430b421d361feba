"""Benchmark: a kit-composed model against the hand-written one it replaced.

Trains the family's example (examples/<family>-tiny.toml, and for mixtral
examples/moe-ep.toml with its experts over ep 2; bfloat16 matmuls under
fsdp2) as the shipped model_type ("llama", "gpt2" or "mixtral", composed
from meshrun/kit.h) and as its oracle ("hand_llama", "hand_gpt2",
"hand_mixtral": tests/kit, the hand-written families), alternating them
over --rounds rounds (the machine
is shared and noisy), and prints each one's median tokens/s (the first step,
which allocates, left out; each model's best round) and kit / hand-written
(goal: >= 0.97).

    MESHRUN_PLUGIN_PATH=$PWD/build/test-plugins /usr/bin/python3 tests/bench/kit_vs_hand.py \\
        build/bin/meshrun [--family llama|gpt2|mixtral] [--nproc 2] [--steps 12] [--rounds 3] \\
        [overrides ...]

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
EXAMPLES = os.path.join(HERE, "..", "..", "examples")
CONFIGS = {"llama": "llama-tiny.toml", "gpt2": "gpt2-tiny.toml", "mixtral": "moe-ep.toml"}


def tokens_per_s(args, output, model_type):
    config = os.path.join(EXAMPLES, CONFIGS[args.family])
    subprocess.run([args.meshrun, "train", config, "--nproc-per-node", str(args.nproc),
                    "--output", output, f"model.model_type={model_type}",
                    f"train.steps={args.steps}", "train.val_every=0", "checkpoint.export=false",
                    *args.overrides], check=True, capture_output=True, text=True)
    with open(os.path.join(output, "metrics.jsonl")) as f:
        lines = [json.loads(line) for line in f]
    return statistics.median(m["tokens_per_s"] for m in lines[1:])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("meshrun")
    parser.add_argument("--family", choices=tuple(CONFIGS), default="llama")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_intermixed_args()
    kit, hand = args.family, f"hand_{args.family}"
    runs = {model: [] for model in (hand, kit)}
    with tempfile.TemporaryDirectory(prefix="meshrun-bench-kit-") as root:
        for round_ in range(args.rounds):
            for model in runs:
                runs[model].append(tokens_per_s(args, os.path.join(root, f"{model}{round_}"),
                                                model))
    best = {model: max(results) for model, results in runs.items()}
    for model in runs:
        print(f"{model}: tokens/s per round " + ", ".join(f"{t:.0f}" for t in runs[model]) +
              f"; best {best[model]:.0f}")
    print(f"{kit} (kit) / {hand}: {best[kit] / best[hand]:.3f} (goal >= 0.97)")


if __name__ == "__main__":
    sys.exit(main())
