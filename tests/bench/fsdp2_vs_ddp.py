"""Benchmark: `meshrun train` with FSDP2 against DDP, measured in one run.

For 2 and 4 ranks, runs CONFIG (default examples/llama-tiny.toml) with
  - strategy ddp,
  - strategy fsdp2 in float32 (mp_policy.param_dtype = float32: the same
    arithmetic as DDP, so the ratio is the cost of sharding alone),
  - strategy fsdp2 with its default policy (bfloat16 parameters),
alternating the strategies over --rounds rounds (the machine is shared and
noisy) and keeping each one's best round. Then, on 2 ranks, fsdp2 with
prefetch on and off.

Prints:
  - tokens/s of each and fsdp2 / ddp (goal >= 0.9);
  - per-rank persistent memory (params + grads + optimizer state, from
    metrics.jsonl's "mem") of fsdp2 / ddp on 4 ranks (goal <= 0.30);
  - the peak of persistent + strategy buffers ("buffers_peak") against a
    prediction made here from the model's unit sizes and the prefetch
    depths (goal: within 10%);
  - comm_wait_s (time inside the strategy's calls: the all-gather and
    reduce-scatter time compute did not hide) with prefetch on and off, and
    the share of the prefetch-off wait that prefetch hides.

Definitions: tokens/s = global_batch_size * seq_len / mean step_time_s over
the steps after the first --warmup. Prints figures; the exit status says
only whether every run worked.

    /usr/bin/python3 tests/bench/fsdp2_vs_ddp.py build/bin/meshrun [CONFIG]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import tomllib

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from fsdp2_memory import predicted_peak_buffers, unit_sizes  # noqa: E402
from train_vs_torch import one_thread_env  # noqa: E402

FP32 = ("distributed.mp_policy.param_dtype=float32",)


def train(meshrun, config, nproc, output, steps, *overrides):
    command = [meshrun, "train", config, "--nproc-per-node", str(nproc), "--output", output,
               f"train.steps={steps}", "train.val_every=0", "train.log_every=1000",
               "checkpoint.export=false", *overrides]
    subprocess.run(command, check=True, capture_output=True, env=one_thread_env())
    with open(os.path.join(output, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def tokens_per_s(lines, tokens_per_step, warmup):
    return tokens_per_step / statistics.mean(m["step_time_s"] for m in lines[warmup:])


def persistent(mem):
    return mem["params"] + mem["grads"] + mem["optimizer"]


def plan_json(meshrun, config, ranks):
    return json.loads(subprocess.run([meshrun, "plan", config, "--world-size", str(ranks),
                                      "--json", "distributed.strategy=fsdp2"],
                                     check=True, capture_output=True, text=True).stdout)


def bench_arguments():
    """The arguments of a training benchmark, its config, and tokens per step."""
    parser = argparse.ArgumentParser()
    parser.add_argument("meshrun")
    parser.add_argument("config", nargs="?", default=os.path.join(HERE, "..", "..", "examples",
                                                                  "llama-tiny.toml"))
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    with open(args.config, "rb") as f:
        toml = tomllib.load(f)
    return args, toml, toml["train"]["global_batch_size"] * toml["data"]["seq_len"]


def main():
    args, toml, tokens_per_step = bench_arguments()

    variants = {"ddp": ("distributed.strategy=ddp",),
                "fsdp2 fp32": ("distributed.strategy=fsdp2",) + FP32,
                "fsdp2 bf16": ("distributed.strategy=fsdp2",)}
    with tempfile.TemporaryDirectory(prefix="meshrun-fsdp2-bench-") as root:
        best, last = {}, {}
        for nproc in (2, 4):
            for round_ in range(args.rounds):
                for name, overrides in variants.items():
                    out = os.path.join(root, f"{name.replace(' ', '_')}_{nproc}_{round_}")
                    lines = train(args.meshrun, args.config, nproc, out, args.steps, *overrides)
                    tps = tokens_per_s(lines, tokens_per_step, args.warmup)
                    best[name, nproc] = max(best.get((name, nproc), 0), tps)
                    last[name, nproc] = lines[-1]
        print("tokens/s (best of %d rounds)" % args.rounds)
        print(f"{'ranks':>5} {'ddp':>9} {'fsdp2 fp32':>11} {'fsdp2 bf16':>11} "
              f"{'fp32/ddp':>9} {'bf16/ddp':>9}  (goal >= 0.9)")
        for nproc in (2, 4):
            ddp = best["ddp", nproc]
            fp32, bf16 = best["fsdp2 fp32", nproc], best["fsdp2 bf16", nproc]
            print(f"{nproc:>5} {ddp:>9.0f} {fp32:>11.0f} {bf16:>11.0f} {fp32 / ddp:>9.2f} "
                  f"{bf16 / ddp:>9.2f}")

        print("\nper-rank memory on 4 ranks (bytes)")
        ddp_mem = last["ddp", 4]["mem"]
        sizes = unit_sizes(plan_json(args.meshrun, args.config, 4), 4)
        for name, param_bytes in (("fsdp2 fp32", 4), ("fsdp2 bf16", 2)):
            mem = last[name, 4]["mem"]
            ratio = persistent(mem) / persistent(ddp_mem)
            low, predicted = (persistent(mem) + predicted_peak_buffers(
                sizes, 4, param_bytes, 4, 1, 2, progress) for progress in ("asap", "serial"))
            peak = persistent(mem) + mem["buffers_peak"]
            print(f"{name}: persistent {persistent(mem)} vs ddp {persistent(ddp_mem)} = "
                  f"{ratio:.3f} (goal <= 0.30)\n  peak (persistent + buffers_peak) {peak} vs "
                  f"predicted {predicted} = {peak / predicted:.3f} (goal 0.90 .. 1.00; "
                  f"lower bound {low}); buffers_reserved {mem['buffers_reserved']}; peak_rss "
                  f"{mem['peak_rss']} vs ddp {ddp_mem['peak_rss']}")

        print("\nprefetch on 2 ranks (fsdp2 fp32): comm_wait_s per step, median")
        waits = {}
        for label, overrides in (("on", ()), ("off", ("distributed.enable_fsdp2_prefetch=false",))):
            out = os.path.join(root, f"prefetch_{label}")
            lines = train(args.meshrun, args.config, 2, out, args.steps,
                          "distributed.strategy=fsdp2", *FP32, *overrides)
            waits[label] = statistics.median(m["comm_wait_s"] for m in lines[args.warmup:])
            step = statistics.median(m["step_time_s"] for m in lines[args.warmup:])
            print(f"prefetch {label}: comm_wait_s {waits[label] * 1e3:.1f} ms of a "
                  f"{step * 1e3:.1f} ms step")
        print(f"share of the prefetch-off wait hidden by prefetch: "
              f"{1 - waits['on'] / waits['off']:.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
