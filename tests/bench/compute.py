"""Benchmark: training at the machine's limit, against PyTorch 1.13 in the same run.

On CONFIG (default examples/llama-tiny.toml) at data.seq_len = --seq-len
(default 128; the issue's base model: hidden 256, 4 layers, global batch 8),
2 ranks, one compute thread per rank:
  - meshrun ddp (float32), fsdp2 with its default mp_policy (bfloat16
    parameters: bfloat16 matmuls), fsdp2 in float32, alternating over
    --rounds rounds (the machine is shared and noisy), each one's best;
  - tests/bench/torch_llama_ddp.py (torch DDP over gloo) in float32 and
    under torch.autocast("cpu", torch.bfloat16), once each.
Then on 1 rank a wider model (hidden_size --wide, 4 layers) in bfloat16
(fsdp2's default) and float32, for MFU at a size where GEMMs dominate.

Prints tokens/s and mean mfu (metrics.jsonl: the model's FLOPs over the
GEMM peak measured at the start of the run, run.json) of each, and the
ratios the goals are stated in: fsdp2-bfloat16 / torch autocast,
fsdp2-bfloat16 / meshrun float32 (ddp), fsdp2 / ddp in float32, and the
activations fsdp2 holds in bfloat16 / in float32 (mem.activations_peak). Prints
figures; the exit status says only whether every run worked.

    /usr/bin/python3 tests/bench/compute.py build/bin/meshrun [CONFIG]
"""

import argparse
import os
import re
import statistics
import sys
import tempfile
import tomllib

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from fsdp2_vs_ddp import tokens_per_s, train  # noqa: E402
from train_vs_torch import torch_peer  # noqa: E402

RUNS = {
    "ddp float32": ("distributed.strategy=ddp",),
    "fsdp2 bfloat16": ("distributed.strategy=fsdp2",),
    "fsdp2 float32": ("distributed.strategy=fsdp2", "distributed.mp_policy.param_dtype=float32"),
}


def with_seq_len(config, seq_len, root):
    """A copy of CONFIG with data.seq_len = seq_len, for both sides."""
    with open(config) as f:
        text = f.read()
    text = re.sub(r"(?m)^seq_len\s*=.*$", f"seq_len = {seq_len}", text)
    path = os.path.join(root, "config.toml")
    with open(path, "w") as f:
        f.write(text)
    return path


def mean_mfu(lines, warmup):
    return statistics.mean(m["mfu"] for m in lines[warmup:])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("meshrun")
    parser.add_argument("config", nargs="?", default=os.path.join(HERE, "..", "..", "examples",
                                                                  "llama-tiny.toml"))
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--wide", type=int, default=512, help="hidden_size of the 1-rank MFU runs")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="meshrun-compute-bench-") as root:
        args.config = with_seq_len(args.config, args.seq_len, root)
        with open(args.config, "rb") as f:
            toml = tomllib.load(f)
        tokens_per_step = toml["train"]["global_batch_size"] * args.seq_len
        best, mfu, activations = {}, {}, {}
        for round_ in range(args.rounds):
            for name, overrides in RUNS.items():
                lines = train(args.meshrun, args.config, 2, os.path.join(root, f"{round_}{name}"),
                              args.steps, *overrides)
                activations[name] = lines[-1]["mem"]["activations_peak"]
                speed = tokens_per_s(lines, tokens_per_step, args.warmup)
                if speed > best.get(name, 0):
                    best[name], mfu[name] = speed, mean_mfu(lines, args.warmup)
        peer = {}
        for name, extra in (("torch float32", []), ("torch autocast", ["--autocast"])):
            times, _ = torch_peer(args, ["--nproc", "2", *extra])
            peer[name] = tokens_per_step / statistics.mean(times)
        wide = (f"model.hidden_size={args.wide}", f"model.intermediate_size={3 * args.wide}",
                "train.global_batch_size=4", "train.micro_batch_size=4",
                "distributed.strategy=fsdp2")
        wide_mfu = {}
        for name, extra in (("bfloat16", ()), ("float32", RUNS["fsdp2 float32"][1:])):
            lines = train(args.meshrun, args.config, 1, os.path.join(root, f"wide {name}"),
                          args.steps, *wide, *extra)
            wide_mfu[name] = mean_mfu(lines, args.warmup)

    print(f"2 ranks, seq_len {args.seq_len}, {args.steps} steps, first {args.warmup} skipped")
    for name, speed in best.items():
        print(f"  meshrun {name:<16} {speed:>9.0f} tokens/s  mfu {mfu[name]:.3f}")
    for name, speed in peer.items():
        print(f"  {name:<24} {speed:>9.0f} tokens/s")
    bf16 = best["fsdp2 bfloat16"]
    print(f"fsdp2 bfloat16 / torch autocast: {bf16 / peer['torch autocast']:.2f}x (goal >= 1.8)")
    print(f"fsdp2 bfloat16 / meshrun float32 (ddp): {bf16 / best['ddp float32']:.2f}x (goal >= 2)")
    print(f"fsdp2 / ddp in float32: {best['fsdp2 float32'] / best['ddp float32']:.2f}x "
          f"(goal >= 0.95)")
    held = activations["fsdp2 bfloat16"] / activations["fsdp2 float32"]
    print(f"mem.activations_peak fsdp2 bfloat16 / float32: {held:.3f} (goal <= 0.55)")
    print(f"1 rank, hidden_size {args.wide}: mfu bfloat16 {wide_mfu['bfloat16']:.3f} "
          f"(goal >= 0.40), float32 {wide_mfu['float32']:.3f} (goal >= 0.60)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
