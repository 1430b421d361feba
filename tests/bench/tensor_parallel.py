"""Benchmark: tensor parallelism on the 4-layer reference model, measured in one run.

Runs CONFIG (default examples/llama-tiny.toml) with strategy fsdp2 in
float32 as
  - tp = 1 on 1 rank (the memory reference),
  - tp = 2 on 2 ranks (dp 1),
  - dp = 2 on 2 ranks (tp 1, FSDP2 sharding over both),
alternating tp = 2 and dp = 2 over --rounds rounds (the machine is shared
and noisy) and keeping each one's best round.

Prints:
  - per-rank parameter + optimizer memory (metrics.jsonl "mem": params +
    optimizer) at tp = 2 against tp = 1 (goal <= 0.55: everything but the
    replicated norms is halved);
  - tokens/s of tp = 2 (with and without sequence parallelism) against
    dp = 2 on the same 2 ranks, and rank 0's mem.activations_peak with
    sequence parallelism against without;
  - the bytes tensor parallelism sends per step and rank (metrics "tp_bytes",
    counted by the host at the model's communicator) against the analytic
    count: per micro-batch of N = micro_batch_size * seq_len rows, without
    sequence parallelism, an all-reduce of N x H floats after the
    vocabulary-parallel embedding, after each layer's o_proj and down_proj
    (forward) and of each layer's two column-parallel input gradients and
    lm_head's (backward), plus the cross-entropy's 3N floats (the row max,
    the exp-sums and the target logits): 4 bytes x (N H (2 + 4 L) + 3 N).
    With sequence parallelism each all-reduce becomes an all-gather and a
    reduce-scatter, the same bus bytes, and the norm weights' gradients are
    summed over tp: + 4 bytes x H (2 L + 1).

tokens/s = global_batch_size * seq_len / mean step_time_s over the steps
after the first --warmup. Prints figures; the exit status says only whether
every run worked and the byte count matched.

    /usr/bin/python3 tests/bench/tensor_parallel.py build/bin/meshrun [CONFIG]
"""

import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from fsdp2_vs_ddp import bench_arguments, tokens_per_s, train  # noqa: E402

FP32 = ("distributed.strategy=fsdp2", "distributed.mp_policy.param_dtype=float32")


def analytic_tp_bytes(toml, dp, sequence_parallel):
    model, train_ = toml["model"], toml["train"]
    rows = train_["micro_batch_size"] * toml["data"]["seq_len"]
    hidden, layers = model["hidden_size"], model["num_hidden_layers"]
    micro_batches = train_["global_batch_size"] // dp // train_["micro_batch_size"]
    norms = hidden * (2 * layers + 1) if sequence_parallel else 0
    return micro_batches * 4 * (rows * hidden * (2 + 4 * layers) + 3 * rows + norms)


def main():
    args, toml, tokens_per_step = bench_arguments()

    with tempfile.TemporaryDirectory(prefix="meshrun-tp-bench-") as root:
        one = train(args.meshrun, args.config, 1, os.path.join(root, "tp1"), args.steps, *FP32)
        best, last = {}, {}
        for round_ in range(args.rounds):
            for name, overrides in (("tp2", ("distributed.tp_size=2",)),
                                    ("tp2 sp", ("distributed.tp_size=2",
                                                "distributed.sequence_parallel=true")),
                                    ("dp2", ())):
                output = os.path.join(root, f"{name.replace(' ', '_')}_{round_}")
                lines = train(args.meshrun, args.config, 2, output, args.steps, *FP32, *overrides)
                best[name] = max(best.get(name, 0), tokens_per_s(lines, tokens_per_step,
                                                                 args.warmup))
                last[name] = lines[-1]

        held = {name: m["mem"]["params"] + m["mem"]["optimizer"]
                for name, m in (("tp1", one[-1]), ("tp2", last["tp2"]))}
        print("per-rank params + optimizer (bytes)")
        print(f"  tp=1 {held['tp1']}  tp=2 {held['tp2']}  ratio {held['tp2'] / held['tp1']:.3f} "
              "(goal <= 0.55)")
        print(f"tokens/s on 2 ranks (best of {args.rounds} rounds)")
        print(f"  tp=2 {best['tp2']:.0f}  tp=2 sp {best['tp2 sp']:.0f}  dp=2 {best['dp2']:.0f}  "
              f"tp/dp {best['tp2'] / best['dp2']:.2f}  tp sp/dp {best['tp2 sp'] / best['dp2']:.2f}")
        peak = {name: last[name]["mem"]["activations_peak"] for name in ("tp2", "tp2 sp")}
        print(f"mem.activations_peak: tp=2 {peak['tp2']}  tp=2 sp {peak['tp2 sp']}  sp/no sp "
              f"{peak['tp2 sp'] / peak['tp2']:.3f}")
        print("tensor-parallel bytes sent per step and rank (bus bytes)")
        exact = True
        for name, sequence_parallel in (("tp2", False), ("tp2 sp", True)):
            measured = last[name]["tp_bytes"]
            expected = analytic_tp_bytes(toml, 1, sequence_parallel)
            exact = exact and measured == expected
            print(f"  {name}: measured {measured}  analytic {expected}  ratio "
                  f"{measured / expected:.4f}")
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
