"""Benchmark: what full activation checkpointing saves and costs.

Trains the reference model (examples/llama-tiny.toml) with and without
distributed.activation_checkpointing = "full", alternating the two over
--rounds rounds (the machine is shared and noisy), and prints rank 0's
mem.activations_peak of each and their ratio (goal <= 0.35), then the
median step time of each (the first step, which allocates, left out) and
their ratio from the best round of each (goal <= 1.4).

    /usr/bin/python3 tests/bench/activation_checkpointing.py build/bin/meshrun \\
        [--nproc 4] [--steps 8] [--rounds 2] [overrides ...]

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


def train(args, output, *overrides):
    subprocess.run([args.meshrun, "train", CONFIG, "--nproc-per-node", str(args.nproc),
                    "--output", output, f"train.steps={args.steps}", "train.val_every=0",
                    "checkpoint.export=false", *args.overrides, *overrides],
                   check=True, capture_output=True, text=True)
    with open(os.path.join(output, "metrics.jsonl")) as f:
        lines = [json.loads(line) for line in f]
    return (lines[-1]["mem"]["activations_peak"],
            statistics.median(m["step_time_s"] for m in lines[1:]))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("meshrun")
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_intermixed_args()
    runs = {"kept": [], "full": []}
    with tempfile.TemporaryDirectory(prefix="meshrun-bench-ac-") as root:
        for round_ in range(args.rounds):
            for mode in runs:
                ac = "full" if mode == "full" else "false"
                output = os.path.join(root, f"{mode}{round_}")
                runs[mode].append(train(args, output,
                                        f"distributed.activation_checkpointing={ac}"))
    memory = {mode: results[0][0] for mode, results in runs.items()}
    time = {mode: min(t for _, t in results) for mode, results in runs.items()}
    print(f"mem.activations_peak: kept {memory['kept']} B, full {memory['full']} B, "
          f"ratio {memory['full'] / memory['kept']:.3f} (goal <= 0.35)")
    print(f"median step time: kept {time['kept']:.3f} s, full {time['full']:.3f} s, "
          f"ratio {time['full'] / time['kept']:.3f} (goal <= 1.4)")


if __name__ == "__main__":
    sys.exit(main())
