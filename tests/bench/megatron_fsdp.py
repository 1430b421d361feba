"""Benchmark: megatron_fsdp's ZeRO levels against fsdp2 and DDP on 4 ranks, measured in one run.

Runs CONFIG (default examples/llama-tiny.toml) on 4 ranks in float32 with
  - strategy ddp,
  - strategy fsdp2 (mp_policy.param_dtype = float32),
  - strategy megatron_fsdp at zero_dp_strategy 0, 1, 2 and 3, and 3 with
    fsdp_double_buffer, with disable_bucketing (one bucket) and with
    init_fsdp_with_meta_device (each rank starts only its shard),
at one micro-batch per rank and step as the config says, alternating them
over --rounds rounds (the machine is shared and noisy) and keeping each
one's best round.

Prints, for each:
  - tokens/s, and against fsdp2 (the issue's goal: ZeRO-3 >= 1.0x);
  - comm_wait_s per step (time inside the strategy's calls: the collectives
    compute did not hide), and for megatron_fsdp the share of it that
    overlap_grad_reduce and overlap_param_gather hide (a run with both off
    is the reference);
  - per-rank memory from metrics.jsonl's "mem": params + grads + optimizer
    (the float32 master shard, its gradients and AdamW's two moments:
    16 bytes per element of the rank's padded shard, all of the model's
    for ddp and ZeRO-0; the ratio to that prediction is printed) and
    buffers_peak (what a step holds beyond them), against the range
    tests/bench/fsdp2_memory.py predicts for the strategy's rules: each
    collective complete by the next hook ("asap") up to complete no sooner
    than start order makes certain ("serial"); the ratio is to the latter;
  - rank 0's peak RSS when the first step began, ZeRO-3 started from the
    whole model and by shard, beside the model's float32 bytes.

tokens/s = global_batch_size * seq_len / mean step_time_s over the steps
after the first --warmup. Prints figures; the exit status says only whether
every run worked.

    /usr/bin/python3 tests/bench/megatron_fsdp.py build/bin/meshrun [CONFIG]
"""

import math
import os
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from fsdp2_memory import predicted_peak_buffers, unit_sizes  # noqa: E402
from fsdp2_vs_ddp import bench_arguments, persistent, plan_json, tokens_per_s, train  # noqa: E402

RANKS = 4
VARIANTS = {
    "ddp": ("distributed.strategy=ddp",),
    "fsdp2": ("distributed.strategy=fsdp2", "distributed.mp_policy.param_dtype=float32"),
    **{f"zero{level}": ("distributed.strategy=megatron_fsdp",
                        f"distributed.zero_dp_strategy={level}") for level in (0, 1, 2, 3)},
    "zero3db": ("distributed.strategy=megatron_fsdp", "distributed.zero_dp_strategy=3",
                "distributed.fsdp_double_buffer=true"),
    "zero3one": ("distributed.strategy=megatron_fsdp", "distributed.zero_dp_strategy=3",
                 "distributed.disable_bucketing=true"),
    "zero3meta": ("distributed.strategy=megatron_fsdp", "distributed.zero_dp_strategy=3",
                  "distributed.init_fsdp_with_meta_device=true"),
}


def level_of(name):
    return int(name[4])


def shard_ranks(name):
    """The ranks parameters are sharded over: 1 for ddp and ZeRO-0."""
    return 1 if name == "ddp" or name == "zero0" else RANKS


def predicted_persistent(args, name):
    sizes = unit_sizes(plan_json(args.meshrun, args.config, RANKS), shard_ranks(name))
    return 16 * sum(block for _, _, block in sizes)
NO_OVERLAP = ("distributed.overlap_grad_reduce=false", "distributed.overlap_param_gather=false")


def predicted_buffers(args, toml, name, progress):
    """The predicted buffers_peak of a sharded variant, 0 for ddp."""
    if name == "ddp":
        return 0
    train_ = toml["train"]
    micro_batches = train_["global_batch_size"] // (RANKS * train_["micro_batch_size"])
    ranks = shard_ranks(name)
    sizes = unit_sizes(plan_json(args.meshrun, args.config, RANKS), ranks)
    if name == "fsdp2":
        return predicted_peak_buffers(sizes, RANKS, 4, 4, 1, 2, progress,
                                      micro_batches=micro_batches)
    level = level_of(name)
    if name == "zero3one":  # one bucket: the walk of a model of one unit
        sizes = [("root", sum(f for _, f, _ in sizes), sum(b for _, _, b in sizes))]
    return predicted_peak_buffers(sizes, ranks, 4, 4, 1, 1, progress, keep_gathered=level < 3,
                                  micro_batches=micro_batches, defer=level <= 1,
                                  replicas=RANKS // ranks, double_buffer=name == "zero3db")


def median_wait(lines, warmup):
    return statistics.median(m["comm_wait_s"] for m in lines[warmup:])


def main():
    args, toml, tokens_per_step = bench_arguments()
    best, last, wait = {}, {}, {}
    with tempfile.TemporaryDirectory(prefix="meshrun-megatron-bench-") as root:
        for round_ in range(args.rounds):
            for name, overrides in VARIANTS.items():
                lines = train(args.meshrun, args.config, RANKS,
                              os.path.join(root, f"{name}_{round_}"), args.steps, *overrides)
                speed = tokens_per_s(lines, tokens_per_step, args.warmup)
                if speed > best.get(name, 0):
                    best[name], last[name] = speed, lines[-1]
                    wait[name] = median_wait(lines, args.warmup)
        exposed = {}
        for level in (1, 3):
            lines = train(args.meshrun, args.config, RANKS, os.path.join(root, f"serial{level}"),
                          args.steps, *VARIANTS[f"zero{level}"], *NO_OVERLAP)
            exposed[level] = median_wait(lines, args.warmup)

    print(f"{args.config}: {RANKS} ranks, float32, best of {args.rounds} rounds of {args.steps} "
          f"steps (first {args.warmup} skipped)")
    print(f"{'':<8} {'tokens/s':>9} {'/fsdp2':>7} {'comm wait ms':>13} "
          f"{'params+grads+opt':>17} {'/pred':>6} {'buffers_peak':>13} {'predicted':>19} "
          f"{'ratio':>6}")
    for name in VARIANTS:
        memory = last[name]["mem"]
        low, high = (predicted_buffers(args, toml, name, p) for p in ("asap", "serial"))
        ratio = f"{memory['buffers_peak'] / high:>6.3f}" if high else ""
        held = persistent(memory)
        print(f"{name:<8} {best[name]:>9.0f} {best[name] / best['fsdp2']:>7.2f} "
              f"{wait[name] * 1e3:>13.1f} {held:>17} "
              f"{held / predicted_persistent(args, name):>6.3f} {memory['buffers_peak']:>13} "
              f"{low:>9}..{high:<9} {ratio}")
    model_bytes = 4 * sum(math.prod(p["shape"]) for p in
                          plan_json(args.meshrun, args.config, RANKS)["model"]["parameters"])
    starts = {name: last[name]["mem"]["peak_rss_at_start"] / 2**20
              for name in ("zero3", "zero3meta")}
    print(f"start (peak RSS of rank 0 at the first step): whole model {starts['zero3']:.1f} MiB, "
          f"by shard (init_fsdp_with_meta_device) {starts['zero3meta']:.1f} MiB; "
          f"the model is {model_bytes / 2**20:.1f} MiB")
    for level in (1, 3):
        hidden = 1 - wait[f"zero{level}"] / exposed[level]
        print(f"zero{level}: comm wait {exposed[level] * 1e3:.1f} ms per step with both overlaps "
              f"off, {wait[f'zero{level}'] * 1e3:.1f} ms on: {hidden:.0%} hidden")
    return 0


if __name__ == "__main__":
    sys.exit(main())
