"""Benchmark: `meshrun train` with DDP against PyTorch 1.13 DDP over gloo, measured in one run.

Runs, one after the other on the same machine, with the same config and one
compute thread per rank (OMP_NUM_THREADS = OPENBLAS_NUM_THREADS = 1 for both):
  1. `meshrun train CONFIG --nproc-per-node 2` (DDP on 2 ranks),
  2. `meshrun train CONFIG --nproc-per-node 1` at half the global batch,
  3. tests/bench/torch_llama_ddp.py --nproc 2 (torch DDP over gloo on 2 ranks),
  4. tests/bench/torch_llama_ddp.py --no-ddp at half the global batch,
and prints tokens/s of each, the ratio meshrun / torch on 2 ranks (goal >= 1.5),
DDP's overhead for both (goal <= 10%), and the share of torch's all-reduce
hidden behind backward.

Definitions. tokens/s = global_batch_size * seq_len / mean step time, over the
steps after the first --warmup ones, computed the same way for both sides from
their per-step step_time_s. The 1-rank baselines run half the global batch, so
that each rank does the same work as a rank of the 2-rank run, and
communicate nothing (meshrun's DDP strategy on one rank; torch without a
process group). Perfect scaling would give tps_2 = 2 * tps_1, so

    DDP overhead = 1 - tps_2 / (2 * tps_1)  (= 1 - t_1 / t_2 in step times),

the share of the ideal 2-rank throughput lost. On a machine with as many
cores as ranks it also includes what two busy processes cost each other
(memory bandwidth, caches, gloo's or meshrun's helper threads), not only the
exposed communication.

Prints figures; the exit status says only whether every run worked.

    /usr/bin/python3 tests/bench/train_vs_torch.py build/bin/meshrun examples/llama-tiny.toml
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
PEER = os.path.join(HERE, "torch_llama_ddp.py")


def blas_kernels():
    """The OpenBLAS kernels `meshrun train` gives its ranks (core/launch), so
    that the peer runs on the same ones: the user's OPENBLAS_CORETYPE, else
    SkylakeX with AVX-512, Haswell with AVX2, else OpenBLAS's own choice."""
    if "OPENBLAS_CORETYPE" in os.environ:
        return os.environ["OPENBLAS_CORETYPE"]
    flags = open("/proc/cpuinfo", encoding="utf-8").read().split()
    if "avx512f" in flags:
        return "SkylakeX"
    return "Haswell" if "avx2" in flags else None


def one_thread_env():
    """The environment for every run: one OpenMP and one OpenBLAS thread per
    rank, and the same OpenBLAS kernels for meshrun and the peer."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    if blas_kernels():
        env["OPENBLAS_CORETYPE"] = blas_kernels()
    return env


def batch_shape(config_path):
    """(train.global_batch_size, data.seq_len) of the config, with meshrun's defaults."""
    with open(config_path, "rb") as f:
        raw = tomllib.load(f)
    return raw.get("train", {}).get("global_batch_size", 16), raw.get("data", {}).get("seq_len", 256)


def run(command, what):
    """Runs a command, echoing it; on failure prints its output and exits with a clear message."""
    print(f"$ {' '.join(command)}", file=sys.stderr, flush=True)
    result = subprocess.run(command, capture_output=True, text=True, env=one_thread_env())
    if result.returncode != 0:
        sys.stderr.write(result.stdout[-4000:] + result.stderr[-4000:])
        sys.exit(f"train_vs_torch: {what} failed (exit status {result.returncode}): "
                 f"{' '.join(command)}")
    return result.stdout


def step_times(records, warmup):
    """The step_time_s of each step record after the first `warmup` steps."""
    steps = [r for r in records if "step_time_s" in r]
    if len(steps) <= warmup:
        sys.exit(f"train_vs_torch: {len(steps)} steps recorded, need more than --warmup {warmup}")
    return [r["step_time_s"] for r in steps[warmup:]]


def meshrun_train(args, nproc, global_batch, output):
    """(step times, step records) of one `meshrun train` run, from OUTPUT/metrics.jsonl
    (rank 0's), both without the first --warmup steps."""
    run([args.meshrun, "train", args.config, "--nproc-per-node", str(nproc), "--output", output,
         f"train.steps={args.steps}", "train.val_every=0", "checkpoint.export=false",
         f"train.global_batch_size={global_batch}", "distributed.strategy=ddp"],
        f"meshrun train on {nproc} rank(s)")
    metrics = os.path.join(output, "metrics.jsonl")
    if not os.path.exists(metrics):
        sys.exit(f"train_vs_torch: meshrun train wrote no {metrics}")
    with open(metrics) as f:
        records = [json.loads(line) for line in f if line.startswith("{")]
    records = [r for r in records if r.get("rank", 0) == 0]
    return step_times(records, args.warmup), records[args.warmup:]


def hidden_share(args, records):
    """Share of the gradient all-reduce hidden behind backward: 1 - (what the
    step waited for in finish_gradients) / (a blocking all_reduce of the whole
    gradient buffer on the same ranks, from `meshrun bench comm`)."""
    grad_bytes = records[-1]["mem"]["grads"]
    output = run([args.meshrun, "bench", "comm", "--nproc", "2", "--ops", "all_reduce",
                  "--sizes", str(grad_bytes), "--json"], "meshrun bench comm")
    blocking_s = json.loads(output.splitlines()[-1])["time_us"] / 1e6
    waited_s = statistics.mean(r["grad_sync_wait_s"] for r in records)
    return blocking_s, waited_s, max(0.0, 1 - waited_s / blocking_s)


def torch_peer(args, extra):
    """(step times, summary) of one run of the torch peer."""
    output = run(["/usr/bin/python3", PEER, args.config, "--steps", str(args.steps),
                  "--warmup", str(args.warmup), *extra], f"the torch peer ({' '.join(extra)})")
    records = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
    return step_times(records, args.warmup), records[-1]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("meshrun", help="the meshrun binary, e.g. build/bin/meshrun")
    parser.add_argument("config", help="training config, e.g. examples/llama-tiny.toml")
    parser.add_argument("--steps", type=int, default=12, help="steps per run (default 12)")
    parser.add_argument("--warmup", type=int, default=2,
                        help="first steps left out of every mean (default 2)")
    args = parser.parse_args()
    global_batch, seq_len = batch_shape(args.config)
    if global_batch % 2:
        sys.exit(f"train_vs_torch: train.global_batch_size {global_batch} must be even: the "
                 "1-rank baselines run half of it")

    with tempfile.TemporaryDirectory(prefix="train_vs_torch.") as tmp:
        meshrun_2, records_2 = meshrun_train(args, 2, global_batch, os.path.join(tmp, "ddp2"))
        meshrun_1, _ = meshrun_train(args, 1, global_batch // 2, os.path.join(tmp, "single"))
    blocking_s, waited_s, hidden = hidden_share(args, records_2)
    torch_2, torch_summary = torch_peer(args, ["--nproc", "2"])
    torch_1, _ = torch_peer(args, ["--no-ddp", "--global-batch-size", str(global_batch // 2)])

    def tokens_per_s(times, batch):
        return batch * seq_len / statistics.mean(times)

    ours_2, ours_1 = tokens_per_s(meshrun_2, global_batch), tokens_per_s(meshrun_1, global_batch // 2)
    peer_2, peer_1 = tokens_per_s(torch_2, global_batch), tokens_per_s(torch_1, global_batch // 2)
    print(f"{args.config}: global batch {global_batch} x seq_len {seq_len}, {args.steps} steps, "
          f"first {args.warmup} skipped; 1-rank baselines at batch {global_batch // 2}")
    print(f"BLAS loaded by torch: {', '.join(torch_summary['blas']) or 'none found'}")
    print(f"{'':<8} {'tok/s 2 ranks':>14} {'tok/s 1 rank':>13} {'DDP overhead':>13}")
    for name, two, one in (("meshrun", ours_2, ours_1), ("torch", peer_2, peer_1)):
        print(f"{name:<8} {two:>14.0f} {one:>13.0f} {1 - two / (2 * one):>12.1%}")
    print(f"meshrun / torch on 2 ranks: {ours_2 / peer_2:.2f}x (goal >= 1.5x); "
          "DDP overhead goal <= 10%")
    print(f"torch: all-reduce span {torch_summary['allreduce_span_s_mean'] * 1e3:.0f} ms per "
          f"step, {torch_summary['allreduce_hidden_fraction']:.0%} of it hidden behind backward")
    print(f"meshrun: blocking all-reduce of the gradients {blocking_s * 1e3:.1f} ms, the step "
          f"waited {waited_s * 1e3:.1f} ms for it: {hidden:.0%} hidden behind backward")
    return 0


if __name__ == "__main__":
    sys.exit(main())
