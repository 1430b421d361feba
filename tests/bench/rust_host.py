"""Benchmark: the Rust host (bindings/rust, examples/train_llama through
meshrun_run_train) against `meshrun train`, the same config on 2 ranks.

Alternates the two over --rounds rounds (the machine is shared and noisy)
and prints each run's median tokens/s over the steps after --warmup, the
medians of each side and their ratio (goal: the Rust host within 2%).
Prints figures; the exit status says only whether every run worked.

    /usr/bin/python3 tests/bench/rust_host.py build/bin/meshrun \\
        build/rust-target/release/examples/train_llama [CONFIG]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from train_vs_torch import one_thread_env  # noqa: E402


def median_tokens_per_s(output, warmup):
    with open(os.path.join(output, "metrics.jsonl")) as f:
        lines = [json.loads(line) for line in f]
    return statistics.median(m["tokens_per_s"] for m in lines[warmup:])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("meshrun")
    parser.add_argument("train_llama")
    parser.add_argument("config", nargs="?",
                        default=os.path.join(HERE, "..", "..", "examples", "llama-tiny.toml"))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    keys = [f"train.steps={args.steps}", "train.val_every=0", "checkpoint.export=false"]
    commands = {
        "meshrun train": lambda out: [args.meshrun, "train", args.config, "--nproc-per-node", "2",
                                      "--output", out, *keys],
        "rust host": lambda out: [args.meshrun, "launch", "--nproc-per-node", "2", "--",
                                  args.train_llama, args.config, out, *keys],
    }
    results = {name: [] for name in commands}
    with tempfile.TemporaryDirectory(prefix="meshrun-rust-host-bench-") as root:
        for round_ in range(args.rounds):
            for name, command in commands.items():
                out = os.path.join(root, f"{name.replace(' ', '_')}_{round_}")
                subprocess.run(command(out), check=True, capture_output=True,
                               env=one_thread_env())
                results[name].append(median_tokens_per_s(out, args.warmup))
                print(f"round {round_ + 1} {name:>13}: {results[name][-1]:8.0f} tokens/s",
                      flush=True)
    medians = {name: statistics.median(values) for name, values in results.items()}
    print(f"median tokens/s: meshrun train {medians['meshrun train']:.0f}, rust host "
          f"{medians['rust host']:.0f}; rust host / meshrun train "
          f"{medians['rust host'] / medians['meshrun train']:.3f} (goal within 0.98 .. 1.02)")


if __name__ == "__main__":
    main()
