"""Benchmark: a PyTorch model under meshrun's ddp and fsdp2 (the Python package,
meshrun.torch) against PyTorch's own DDP over gloo, measured in one run on 2 ranks.

One job, `meshrun launch --nproc-per-node 2 -- examples/python/train_torch.py
--strategy ddp,fsdp2,torch_ddp,torch_nosync`, trains one model per strategy
on the same data (default examples/llama-tiny.toml at seq_len 128: hidden
256, 4 layers, 3.3 M parameters, global batch 8 in micro-batches of 2, one
compute thread per rank), the strategies' steps interleaved:
  ddp           meshrun's ddp (gradient all-reduce overlapped with backward)
  fsdp2         meshrun's fsdp2, param_dtype float32 (the same math as ddp)
  torch_ddp     torch.nn.parallel.DistributedDataParallel over gloo
  torch_nosync  the same, never all-reducing (replicas drift apart), with a
                barrier after backward: the all-reduce's cost for torch
PyTorch's FullyShardedDataParallel is not among the peers: in PyTorch
1.13 it runs only on CUDA (its compute device is always a CUDA device and
it asserts torch.cuda.is_available() when it makes its streams), and
Debian's build of it does not even import on Python 3.11 (a dataclass
field with a mutable default in torch.distributed._shard). fsdp2 is
therefore measured against torch DDP, the nearest PyTorch peer that runs
on this machine: fsdp2_over_torch_ddp.
Interleaving matters on a shared machine: its speed changes from second to
second (a fixed matmul loop varies 2x in half-second windows on this
2-core machine), so runs one after the other compare different machines;
neighbouring steps of one run do not. --rounds repeats the job.

Figures, over the steps after the first --warmup of each round:
tokens/s = global batch * seq_len / the median step time; a ratio a/b is
the median over steps of t_b(step) / t_a(step), each pair of steps taken
seconds apart, with the quartiles of those per-step ratios in the JSON line
(goals: ddp >= 1.05 x torch_ddp, fsdp2 >= 0.9 x ddp). The
all-reduce's share of a step: for meshrun, the time a rank spends inside
the strategy's calls (strategy_s: waiting for gradient buckets in
finish_gradients; gathers, reductions and their copies in fsdp2's hooks)
over the step time; for torch_ddp, 1 - t(torch_nosync) / t(torch_ddp), the
step time the all-reduce adds, overlap included.

Prints a table and one JSON summary line; the exit status says only whether
every run worked. --smoke runs a tiny model for 3 steps (a ctest).

    /usr/bin/python3 tests/bench/python_ddp_vs_torch.py build/bin/meshrun --rounds 3
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..")
TRAIN_TORCH = os.path.join(ROOT, "examples", "python", "train_torch.py")
STRATEGIES = ("ddp", "fsdp2", "torch_ddp", "torch_nosync")
BASE = ("data.seq_len=128",)
SMOKE = ("model.hidden_size=32", "model.intermediate_size=64", "model.num_hidden_layers=2",
         "model.num_attention_heads=4", "model.num_key_value_heads=2", "data.seq_len=32")


def run(meshrun, output, config, steps, overrides):
    """One job of every strategy; {strategy: [metrics record per step]}."""
    result = subprocess.run(
        [meshrun, "launch", "--nproc-per-node", "2", "--", sys.executable, TRAIN_TORCH, config,
         "--strategy", ",".join(STRATEGIES), "--param-dtype", "float32", "--steps", str(steps),
         "--output", output, *overrides],
        capture_output=True, text=True, errors="replace", timeout=3600)
    if result.returncode != 0:
        raise SystemExit(f"train_torch.py failed ({result.returncode}):\n{result.stdout}\n"
                         f"{result.stderr}")
    records = {}
    for strategy in STRATEGIES:
        with open(os.path.join(output, strategy, "metrics.jsonl")) as f:
            records[strategy] = [json.loads(line) for line in f]
    return records


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("meshrun", help="the meshrun executable (build/bin/meshrun)")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="config overrides for every strategy")
    parser.add_argument("--config", default=os.path.join(ROOT, "examples", "llama-tiny.toml"))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of the figures")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--smoke", action="store_true", help="tiny model, 3 steps, 1 round")
    args = parser.parse_args()
    overrides = list(SMOKE if args.smoke else BASE) + args.overrides
    steps, warmup, rounds = (3, 1, 1) if args.smoke else (args.steps, args.warmup, args.rounds)

    measured = {strategy: [] for strategy in STRATEGIES}  # records after warm-up, every round
    with tempfile.TemporaryDirectory(prefix="meshrun-python-bench-") as folder:
        for r in range(rounds):
            records = run(args.meshrun, os.path.join(folder, str(r)), args.config, steps,
                          overrides)
            for strategy in STRATEGIES:
                measured[strategy] += records[strategy][warmup:]

    tokens = measured["ddp"][0]["tokens_per_s"] * measured["ddp"][0]["step_time_s"]

    def times(strategy):
        return [m["step_time_s"] for m in measured[strategy]]

    def ratios(a, b):
        """Throughput of a over b per step: t_b / t_a."""
        return [tb / ta for ta, tb in zip(times(a), times(b))]

    def ratio(a, b):
        return statistics.median(ratios(a, b))

    summary = {"ranks": 2, "rounds": rounds, "steps": steps, "warmup_steps_skipped": warmup,
               "overrides": overrides}
    for strategy in STRATEGIES:
        summary[strategy] = {"tokens_per_s": tokens / statistics.median(times(strategy)),
                             "step_time_s": statistics.median(times(strategy))}
    for strategy in ("ddp", "fsdp2"):
        summary[strategy]["comm_share"] = statistics.median(
            m["strategy_s"] / m["step_time_s"] for m in measured[strategy])
    summary["torch_ddp"]["comm_share"] = 1 - 1 / ratio("torch_nosync", "torch_ddp")
    summary["ddp_over_torch_ddp"] = ratio("ddp", "torch_ddp")
    summary["fsdp2_over_ddp"] = ratio("fsdp2", "ddp")
    summary["fsdp2_over_torch_ddp"] = ratio("fsdp2", "torch_ddp")
    summary["torch_nosync_over_ddp"] = ratio("torch_nosync", "ddp")
    if len(times("ddp")) > 1:  # how much the per-step ratios spread: quartiles
        for a, b in (("ddp", "torch_ddp"), ("fsdp2", "ddp"), ("fsdp2", "torch_ddp")):
            quartiles = statistics.quantiles(ratios(a, b), n=4)
            summary[f"{a}_over_{b}_quartiles"] = [quartiles[0], quartiles[2]]

    print(f"{'':13s} {'tokens/s':>9s} {'step s':>7s} {'comm share':>10s}")
    for strategy in STRATEGIES:
        share = summary[strategy].get("comm_share")
        print(f"{strategy:13s} {summary[strategy]['tokens_per_s']:9.0f} "
              f"{summary[strategy]['step_time_s']:7.3f} "
              f"{'' if share is None else f'{share:10.1%}'}")
    print(f"meshrun ddp / torch_ddp: {summary['ddp_over_torch_ddp']:.3f} (goal >= 1.05); "
          f"fsdp2 / ddp: {summary['fsdp2_over_ddp']:.3f} (goal >= 0.9); "
          f"fsdp2 / torch_ddp: {summary['fsdp2_over_torch_ddp']:.3f}; "
          f"torch_nosync / ddp: {summary['torch_nosync_over_ddp']:.3f}")
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
