"""Benchmark: distributed.autocast_dtype = "bfloat16" against float32, and
against PyTorch 1.13's torch.autocast("cpu", torch.bfloat16), measured in
one run.

Runs CONFIG (default examples/llama-tiny.toml) on 2 ranks with DDP, one
compute thread per rank:
  - meshrun in float32 and with autocast, alternating over --rounds rounds
    (the machine is shared and noisy), each one's best round;
  - tests/bench/torch_llama_ddp.py (torch DDP over gloo) in float32 and with
    --autocast, once each.

Prints tokens/s of each, autocast / float32 for both, and meshrun / torch
with autocast. meshrun's autocast rounds the matmul operands and multiplies
them with the float32 GEMM (docs/decisions.md, "Autocast rounds the
matmuls' operands"), so its ratio to float32 is the cost of the rounding;
torch's is what a bfloat16 GEMM (oneDNN) gains. The final losses of the
four runs are printed too: the same data and steps, so they agree to about
1e-3 (torch initializes its model from its own seed).

tokens/s = global_batch_size * seq_len / mean step_time_s over the steps
after the first --warmup. Prints figures; the exit status says only whether
every run worked.

    /usr/bin/python3 tests/bench/autocast.py build/bin/meshrun [CONFIG]
"""

import os
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from fsdp2_vs_ddp import bench_arguments, tokens_per_s, train  # noqa: E402
from train_vs_torch import torch_peer  # noqa: E402

DDP = ("distributed.strategy=ddp",)
AUTOCAST = ("distributed.autocast_dtype=bfloat16",)


def main():
    args, toml, tokens_per_step = bench_arguments()
    best, final_loss = {}, {}
    with tempfile.TemporaryDirectory(prefix="meshrun-autocast-bench-") as root:
        for round_ in range(args.rounds):
            for name, overrides in (("float32", DDP), ("autocast", DDP + AUTOCAST)):
                lines = train(args.meshrun, args.config, 2, os.path.join(root, f"{name}_{round_}"),
                              args.steps, *overrides)
                best[name] = max(best.get(name, 0), tokens_per_s(lines, tokens_per_step,
                                                                 args.warmup))
                final_loss[name] = lines[-1]["loss"]
    peer = {}
    for name, extra in (("float32", []), ("autocast", ["--autocast"])):
        times, summary = torch_peer(args, ["--nproc", "2", *extra])
        peer[name] = tokens_per_step / statistics.mean(times)
        final_loss["torch " + name] = summary["final_loss"]

    print(f"{args.config}: 2 ranks, ddp, {args.steps} steps, first {args.warmup} skipped")
    print(f"{'tokens/s':<10} {'float32':>9} {'autocast':>9} {'autocast/float32':>17}")
    for name, figures in (("meshrun", best), ("torch", peer)):
        print(f"{name:<10} {figures['float32']:>9.0f} {figures['autocast']:>9.0f} "
              f"{figures['autocast'] / figures['float32']:>17.2f}")
    print(f"meshrun / torch with autocast: {best['autocast'] / peer['autocast']:.2f}x; "
          f"in float32: {best['float32'] / peer['float32']:.2f}x")
    print("final losses: " + ", ".join(f"{k} {v:.4f}" for k, v in final_loss.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
