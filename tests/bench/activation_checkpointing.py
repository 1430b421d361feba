"""Benchmark: what activation checkpointing saves and costs.

Trains the reference model (examples/llama-tiny.toml) without
distributed.activation_checkpointing, with "full" and with "selective",
alternating them over --rounds rounds (the machine is shared and noisy),
and prints for each checkpointing mode rank 0's mem.activations_peak
against none (goal for full: <= 0.35) and the median step time against
none (the first step, which allocates, left out; each mode's best round;
goal for full: <= 1.4).

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
    runs = {"false": [], "full": [], "selective": []}
    with tempfile.TemporaryDirectory(prefix="meshrun-bench-ac-") as root:
        for round_ in range(args.rounds):
            for mode in runs:
                output = os.path.join(root, f"{mode}{round_}")
                runs[mode].append(train(args, output,
                                        f"distributed.activation_checkpointing={mode}"))
    memory = {mode: results[0][0] for mode, results in runs.items()}
    time = {mode: min(t for _, t in results) for mode, results in runs.items()}
    print(f"none: mem.activations_peak {memory['false']} B, median step {time['false']:.3f} s")
    for mode, goals in (("full", " (goals <= 0.35, <= 1.4)"), ("selective", "")):
        print(f"{mode}: mem.activations_peak {memory[mode]} B, ratio "
              f"{memory[mode] / memory['false']:.3f}; median step {time[mode]:.3f} s, ratio "
              f"{time[mode] / time['false']:.3f}{goals}")


if __name__ == "__main__":
    sys.exit(main())
