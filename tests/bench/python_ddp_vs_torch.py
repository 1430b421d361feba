"""Benchmark: a PyTorch model under meshrun's ddp and fsdp2 (the Python package,
meshrun.torch) against PyTorch's own DDP over gloo, measured in one run on 2 ranks.

Every configuration is examples/python/train_torch.py on the same model,
data and optimizer (default examples/llama-tiny.toml at seq_len 128: hidden
256, 4 layers, global batch 8 in micro-batches of 2, one compute thread per
rank), started with `meshrun launch --nproc-per-node 2`:
  ddp        meshrun's ddp strategy (gradient all-reduce overlapped with backward)
  fsdp2      meshrun's fsdp2 strategy, param_dtype float32 (the same math as ddp)
  torch_ddp  torch.nn.parallel.DistributedDataParallel over gloo
  torch_nosync  torch_ddp with no gradient all-reduce at all (train_torch.py
             --no-sync; replicas drift apart): the all-reduce's cost for torch
The configurations run one after the other in each of --rounds rounds, so
that a slow phase of a shared machine hits all of them.

Figures. tokens/s = global batch * seq_len / step time, the median over the
steps after the first --warmup of a run, then the median over rounds; the
ratios are medians of the per-round ratios (goals: ddp >= 1.05 x torch_ddp,
fsdp2 >= 0.9 x ddp). The all-reduce's share of a step: for meshrun, the time
a rank spends inside the strategy's calls (train_torch.py's strategy_s:
waiting for gradient buckets in finish_gradients, gathers and reductions in
fsdp2's hooks) over the step time; for torch_ddp, 1 - t(torch_nosync) /
t(torch_ddp), the step time the all-reduce adds, overlap included. Each run
also reports how many cores other processes of the machine kept busy
meanwhile (from /proc/stat, less the run's own CPU time): on a shared
machine, figures from runs with other load are not comparable.

Prints a table and one JSON summary line; the exit status says only whether
every run worked. --smoke runs a tiny model for 3 steps (a ctest).

    /usr/bin/python3 tests/bench/python_ddp_vs_torch.py build/bin/meshrun --rounds 3
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..")
TRAIN_TORCH = os.path.join(ROOT, "examples", "python", "train_torch.py")
CONFIGURATIONS = {
    "ddp": ("--strategy", "ddp"),
    "fsdp2": ("--strategy", "fsdp2", "distributed.mp_policy.param_dtype=float32"),
    "torch_ddp": ("--strategy", "torch_ddp"),
    "torch_nosync": ("--strategy", "torch_ddp", "--no-sync"),
}
BASE = ("data.seq_len=128",)
SMOKE = ("model.hidden_size=32", "model.intermediate_size=64", "model.num_hidden_layers=2",
         "model.num_attention_heads=4", "model.num_key_value_heads=2", "data.seq_len=32")


def busy_cpu_seconds():
    """CPU time the whole machine has spent busy, from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def children_cpu_seconds():
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run(meshrun, folder, name, args, steps, warmup, overrides):
    """One configuration: tokens/s from the median step time over the
    measured steps (robust to a step another process delayed), the means of
    step_time_s and strategy_s, and other_load: how many cores processes
    outside the run kept busy meanwhile, on average."""
    output = os.path.join(folder, name)
    start, busy, ours = time.monotonic(), busy_cpu_seconds(), children_cpu_seconds()
    result = subprocess.run(
        [meshrun, "launch", "--nproc-per-node", "2", "--", sys.executable, TRAIN_TORCH,
         args.config, *CONFIGURATIONS[name], "--steps", str(steps), "--output", output,
         *overrides], capture_output=True, text=True, errors="replace", timeout=1200)
    if result.returncode != 0:
        raise SystemExit(f"{name} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    other_load = ((busy_cpu_seconds() - busy) - (children_cpu_seconds() - ours)) / (
        time.monotonic() - start)
    with open(os.path.join(output, "metrics.jsonl")) as f:
        measured = [json.loads(line) for line in f][warmup:]
    tokens = measured[0]["tokens_per_s"] * measured[0]["step_time_s"]
    return {"tokens_per_s": tokens / statistics.median(m["step_time_s"] for m in measured),
            "step_time_s": statistics.mean(m["step_time_s"] for m in measured),
            "strategy_s": statistics.mean(m.get("strategy_s", 0.0) for m in measured),
            "other_load": max(0.0, other_load)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("meshrun", help="the meshrun executable (build/bin/meshrun)")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="config overrides for every run")
    parser.add_argument("--config", default=os.path.join(ROOT, "examples", "llama-tiny.toml"))
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the means")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="tiny model, 3 steps, 1 round")
    args = parser.parse_args()
    overrides = list(SMOKE if args.smoke else BASE) + args.overrides
    steps, warmup, rounds = (3, 1, 1) if args.smoke else (args.steps, args.warmup, args.rounds)

    results = {name: [] for name in CONFIGURATIONS}
    with tempfile.TemporaryDirectory(prefix="meshrun-python-bench-") as folder:
        for r in range(rounds):
            for name in CONFIGURATIONS:
                results[name].append(run(args.meshrun, os.path.join(folder, str(r)), name, args,
                                         steps, warmup, overrides))
                last = results[name][-1]
                print(f"round {r + 1} {name:13s} {last['tokens_per_s']:9.0f} tokens/s, "
                      f"other processes busy on {last['other_load']:.2f} cores", flush=True)

    def median(name, key):
        return statistics.median(x[key] for x in results[name])

    def ratio(a, b):
        return statistics.median(x["tokens_per_s"] / y["tokens_per_s"]
                                 for x, y in zip(results[a], results[b]))

    summary = {"ranks": 2, "rounds": rounds, "steps": steps, "warmup_steps_skipped": warmup,
               "overrides": overrides}
    for name in CONFIGURATIONS:
        summary[name] = {"tokens_per_s": median(name, "tokens_per_s"),
                         "step_time_s": median(name, "step_time_s"),
                         "other_load": median(name, "other_load")}
    for name in ("ddp", "fsdp2"):
        summary[name]["strategy_share"] = statistics.median(
            x["strategy_s"] / x["step_time_s"] for x in results[name])
    summary["torch_ddp"]["allreduce_share"] = statistics.median(
        1 - n["step_time_s"] / d["step_time_s"]
        for n, d in zip(results["torch_nosync"], results["torch_ddp"]))
    summary["ddp_over_torch_ddp"] = ratio("ddp", "torch_ddp")
    summary["fsdp2_over_ddp"] = ratio("fsdp2", "ddp")

    print(f"\n{'':13s} {'tokens/s':>9s} {'step s':>7s} {'comm share':>10s}")
    for name in CONFIGURATIONS:
        share = summary[name].get("strategy_share", summary[name].get("allreduce_share"))
        print(f"{name:13s} {summary[name]['tokens_per_s']:9.0f} "
              f"{summary[name]['step_time_s']:7.3f} "
              f"{'' if share is None else f'{share:10.1%}'}")
    print(f"meshrun ddp / torch_ddp: {summary['ddp_over_torch_ddp']:.3f} (goal >= 1.05); "
          f"fsdp2 / ddp: {summary['fsdp2_over_ddp']:.3f} (goal >= 0.9)")
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
