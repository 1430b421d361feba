"""Benchmark: what context parallelism saves and what its attention costs.

On the reference model (examples/llama-tiny.toml: 8 heads, 4 key/value
heads), one sequence per rank per micro-batch, 4 ranks:

  memory  mem.activations_peak of rank 0 at --seq-len (default 4096) with
          cp = 4 (each rank a quarter of one sequence) against cp = 1 (dp
          = 4: each rank a whole sequence); goal <= 0.3.
  speed   tokens/s at --speed-seq-len (default 2048) of ring (cp_ring_degree
          4), Ulysses (cp_ulysses_degree 4) and the hybrid (2 x 2), each
          training one sequence per step over the 4 ranks, with dp = 4 at
          cp = 1 (4 sequences per step, no attention traffic) as the peer;
          medians over the steps after the first, each configuration's best
          of --rounds alternating rounds (the machine is shared and noisy).
  overlap the share of ring attention's transfer time hidden behind
          compute, 1 - cp_wait_s / (cp_bytes / B), where cp_wait_s is the
          time the model blocked waiting for its cp transfers
          (metrics.jsonl) and B the point-to-point bandwidth measured in
          the same run by `meshrun bench comm --ops sendrecv` at the size of
          one key/value block; on 4 ranks and on 2 (cp = 2). The wait also
          holds what a rank waits for a slower neighbour, so this is a lower
          bound, and on CPU a transfer is a copy that needs a core of its
          own to run beside compute.

    /usr/bin/python3 tests/bench/context_parallel.py build/bin/meshrun \\
        [--seq-len 4096] [--speed-seq-len 2048] [--steps 4] [--rounds 2] [--smoke]

--smoke runs every configuration at a tiny size (ctest does). Prints
figures; the exit status says only whether every run worked.
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
NPROC = 4
KV_DIM = 4 * 32  # llama-tiny's key/value heads x head_dim

LAYOUTS = {
    "dp4 (cp 1)": ("distributed.cp_size=1", f"train.global_batch_size={NPROC}"),
    "ring 4": ("distributed.cp_size=4", "distributed.cp_ring_degree=4"),
    "ulysses 4": ("distributed.cp_size=4", "distributed.cp_ulysses_degree=4"),
    "hybrid 2x2": ("distributed.cp_size=4", "distributed.cp_ring_degree=2",
                   "distributed.cp_ulysses_degree=2"),
}


def train(args, output, seq_len, *overrides, nproc=NPROC):
    subprocess.run([args.meshrun, "train", CONFIG, "--nproc-per-node", str(nproc),
                    "--output", output, f"train.steps={args.steps}", "train.val_every=0",
                    "data.val_fraction=0", "checkpoint.export=false",
                    f"data.seq_len={seq_len}", "train.global_batch_size=1",
                    "train.micro_batch_size=1", *overrides],
                   check=True, capture_output=True, text=True)
    with open(os.path.join(output, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def sendrecv_bytes_per_s(args, block_bytes, nproc):
    result = subprocess.run([args.meshrun, "bench", "comm", "--nproc", str(nproc), "--ops",
                             "sendrecv", "--sizes", str(block_bytes), "--seconds",
                             "0.05" if args.smoke else "0.5", "--json"],
                            check=True, capture_output=True, text=True)
    line = json.loads(result.stdout.strip().splitlines()[-1])
    return line["algbw_gbps"] * 1e9


def memory(args, root):
    peaks = {}
    for name in ("dp4 (cp 1)", "ring 4"):
        lines = train(args, os.path.join(root, f"memory-{len(peaks)}"), args.seq_len,
                      *LAYOUTS[name], "train.steps=1")
        peaks[name] = lines[-1]["mem"]["activations_peak"]
    one, four = peaks["dp4 (cp 1)"], peaks["ring 4"]
    print(f"memory at seq_len {args.seq_len}: mem.activations_peak cp 1 {one} B, cp 4 {four} B, "
          f"ratio {four / one:.3f} (goal <= 0.3)")


def speed(args, root):
    best = {name: None for name in LAYOUTS}
    for round_ in range(args.rounds):
        for index, (name, overrides) in enumerate(LAYOUTS.items()):
            lines = train(args, os.path.join(root, f"speed-{round_}-{index}"),
                          args.speed_seq_len, *overrides)
            later = lines[1:] or lines
            run = {"tokens_per_s": statistics.median(m["tokens_per_s"] for m in later),
                   "cp_bytes": statistics.median(m["cp_bytes"] for m in later),
                   "cp_wait_s": statistics.median(m["cp_wait_s"] for m in later)}
            if best[name] is None or run["tokens_per_s"] > best[name]["tokens_per_s"]:
                best[name] = run
    peer = best["dp4 (cp 1)"]["tokens_per_s"]
    print(f"speed at seq_len {args.speed_seq_len} on {NPROC} ranks (tokens/s, median step):")
    for name, run in best.items():
        print(f"  {name:<12} {run['tokens_per_s']:10.0f} tokens/s  {run['tokens_per_s'] / peer:5.2f}x "
              f"dp4  cp_bytes {run['cp_bytes']:.0f} B/step  cp_wait {run['cp_wait_s']:.4f} s/step")
    return best


def overlap(args, root, best):
    """Ring's transfers against its step, with 4 ranks sharing the cores and
    with cp = 2 on 2 ranks (one per core of the reference machine)."""
    ring2 = train(args, os.path.join(root, "overlap-cp2"), args.speed_seq_len,
                  "distributed.cp_size=2", nproc=2)
    later = ring2[1:] or ring2
    runs = {"ring 4, 4 ranks": (best["ring 4"], NPROC),
            "ring 2, 2 ranks": ({key: statistics.median(m[key] for m in later)
                                 for key in ("tokens_per_s", "cp_bytes", "cp_wait_s",
                                             "step_time_s")}, 2)}
    for name, (run, nproc) in runs.items():
        block = args.speed_seq_len // nproc * 2 * KV_DIM * 4
        bandwidth = sendrecv_bytes_per_s(args, block, nproc)
        transfer_s = run["cp_bytes"] / bandwidth
        step_s = args.speed_seq_len / run["tokens_per_s"]
        hidden = max(0.0, 1.0 - run["cp_wait_s"] / transfer_s) if transfer_s > 0 else 0.0
        print(f"overlap ({name}): {run['cp_bytes']:.0f} B/step at {bandwidth / 1e9:.2f} GB/s "
              f"(sendrecv of one {block} B block) = {transfer_s:.4f} s of transfer; the model "
              f"waited {run['cp_wait_s']:.4f} s ({100 * run['cp_wait_s'] / step_s:.1f}% of the "
              f"{step_s:.3f} s step): {100 * hidden:.0f}% of the transfer time hidden")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("meshrun")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--speed-seq-len", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    if args.smoke:
        args.seq_len, args.speed_seq_len, args.steps, args.rounds = 128, 64, 2, 1
    with tempfile.TemporaryDirectory(prefix="meshrun-bench-cp-") as root:
        memory(args, root)
        overlap(args, root, speed(args, root))


if __name__ == "__main__":
    sys.exit(main())
