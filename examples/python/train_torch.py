"""Trains a Llama written in PyTorch (torch_llama.py) on the bytes of the GPL
under meshrun's ddp or fsdp2 strategy (meshrun.torch), or under PyTorch's own
DistributedDataParallel over gloo, for comparison.

    meshrun launch --nproc-per-node 2 -- python3 examples/python/train_torch.py \\
        --strategy fsdp2 --steps 20 --output runs/torch-fsdp2 \\
        distributed.mp_policy.param_dtype=float32

CONFIG (default examples/llama-tiny.toml) is a meshrun TOML file: [model],
[data] and [train] configure the model, the data and the optimizer as for
`meshrun train`; the whole file, with the key=value overrides, configures the
meshrun runtime ([distributed], [comm]). --strategy sets
distributed.strategy.

The global batch is the same whatever the number of ranks: step s draws
train.global_batch_size windows of seq_len + 1 bytes from a generator seeded
by (seed, s); data-parallel rank r takes its contiguous slice, in
micro-batches of train.micro_batch_size with gradient accumulation. Every
rank's loss is the mean over its slice, the strategies average over ranks,
so 1, 2 or 4 ranks compute the same losses up to float32 rounding.
AdamW with linear warmup and cosine decay, global-norm clipping, weight decay
on matrices only (not 1-D norm weights), as `meshrun train` does.

torch_ddp: ranks are meshrun's (the launcher's environment: OMPI_COMM_WORLD_RANK
and _SIZE under `meshrun launch`); rank 0 picks a free TCP port on 127.0.0.1
and broadcasts it to the others through meshrun's world communicator; gloo
meets there. --no-sync runs every torch_ddp micro-batch under no_sync (no
gradient all-reduce; replicas drift apart): a timing baseline only.

Rank 0 writes DIR/metrics.jsonl, one JSON object per step: step, loss (mean
over the global batch), grad_norm, lr, tokens_per_s, step_time_s, and for
meshrun's strategies strategy_s, the time spent inside the strategy's calls
(waiting for communication, and the strategy's own copies). One compute
thread per rank.
"""

import os

# One compute thread per rank, set before torch loads (torch.set_num_threads
# alone does not reach OpenBLAS's own thread pool).
os.environ["OMP_NUM_THREADS"] = "1"
os.environ["OPENBLAS_NUM_THREADS"] = "1"

import argparse
import contextlib
import json
import socket
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))
import meshrun  # noqa: E402
import meshrun.torch  # noqa: E402
from torch_llama import (LlamaForCausalLM, global_batch, load_config, lr_factor,  # noqa: E402
                         training_bytes)

STRATEGIES = ("ddp", "fsdp2", "torch_ddp")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", nargs="?",
                        default=os.path.join(HERE, "..", "llama-tiny.toml"),
                        help="meshrun TOML config (default examples/llama-tiny.toml)")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="config overrides, as for meshrun train")
    parser.add_argument("--strategy", choices=STRATEGIES, required=True)
    parser.add_argument("--steps", type=int, help="override train.steps")
    parser.add_argument("--output", required=True, help="folder for metrics.jsonl")
    parser.add_argument("--no-sync", action="store_true",
                        help="torch_ddp only: never all-reduce gradients (timing baseline)")
    args = parser.parse_intermixed_args()
    if args.no_sync and args.strategy != "torch_ddp":
        parser.error("--no-sync applies to --strategy torch_ddp only")
    if args.config and "=" in args.config:  # only overrides were given
        args.overrides.insert(0, args.config)
        args.config = parser.get_default("config")
    return args


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torch_ddp(model, job):
    """PyTorch's DDP over gloo on the job's ranks, meeting on a port rank 0
    chose and broadcast through meshrun."""
    port = torch.tensor([free_port() if job.rank == 0 else 0], dtype=torch.int64)
    job.comm("world").broadcast(port, root=0)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{int(port)}", rank=job.rank,
                            world_size=job.world_size)
    return DistributedDataParallel(model)


def torch_adamw(model, train):
    """torch.optim.AdamW decaying the matrices only, as meshrun.torch's."""
    matrices = [p for p in model.parameters() if p.dim() > 1]
    vectors = [p for p in model.parameters() if p.dim() <= 1]
    return torch.optim.AdamW([{"params": matrices}, {"params": vectors, "weight_decay": 0.0}],
                             lr=train["lr"], betas=tuple(train["betas"]), eps=train["eps"],
                             weight_decay=train["weight_decay"])


def main():
    args = parse_args()
    torch.set_num_threads(1)
    overrides = list(args.overrides)
    if args.strategy != "torch_ddp":
        overrides.append(f"distributed.strategy={args.strategy}")
    if args.steps is not None:
        overrides.append(f"train.steps={args.steps}")
    model_cfg, data_cfg, train = load_config(args.config, overrides)
    try:
        job = meshrun.init(args.config, overrides)
    except meshrun.MeshrunError as error:  # a bad config or override
        raise SystemExit(f"train_torch.py: error: {error}") from None
    dp = job.comm("dp")
    seq_len, micro, batch = data_cfg["seq_len"], train["micro_batch_size"], train[
        "global_batch_size"]
    per_rank, rest = divmod(batch, dp.size)
    if rest or per_rank % micro:
        raise SystemExit(f"train.global_batch_size {batch} is not divisible by "
                         f"micro_batch_size {micro} x {dp.size} data-parallel ranks")
    accumulation = per_rank // micro
    tokens = training_bytes(data_cfg)

    torch.manual_seed(train["seed"])
    model = LlamaForCausalLM(model_cfg)
    if args.strategy == "torch_ddp":
        wrapped = torch_ddp(model, job)
        optimizer = torch_adamw(model, train)
    else:
        wrapped = meshrun.torch.DistributedModule(model, job, units=model.model.layers)
        optimizer = wrapped.adamw(lr=train["lr"], betas=tuple(train["betas"]), eps=train["eps"],
                                  weight_decay=train["weight_decay"])
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, train))
    if job.rank == 0:
        os.makedirs(args.output, exist_ok=True)
        metrics = open(os.path.join(args.output, "metrics.jsonl"), "w")

    for step in range(train["steps"]):
        strategy_before = getattr(wrapped, "strategy_seconds", 0.0)
        start = time.perf_counter()
        inputs, targets = global_batch(tokens, seq_len, batch, train["seed"], step)
        rows = slice(dp.rank * per_rank, (dp.rank + 1) * per_rank)
        inputs, targets = inputs[rows], targets[rows]
        if args.strategy == "torch_ddp":
            optimizer.zero_grad(set_to_none=False)
        else:
            wrapped.zero_grad()
        step_loss = 0.0
        for m in range(accumulation):
            part = slice(m * micro, (m + 1) * micro)
            last = m == accumulation - 1 and not args.no_sync
            with contextlib.nullcontext() if last else wrapped.no_sync():
                loss = wrapped(inputs[part], targets[part]) / accumulation
                loss.backward()
            step_loss += loss.item()
        if args.strategy == "torch_ddp":
            grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(),
                                                             train["max_grad_norm"]))
        else:
            grad_norm = wrapped.clip_grad_norm_(train["max_grad_norm"])
        lr = optimizer.param_groups[0]["lr"]
        optimizer.step()
        schedule.step()
        step_time = time.perf_counter() - start

        # Outside the timed region: the mean loss over the global batch.
        loss_sum = torch.tensor([step_loss], dtype=torch.float32)
        dp.all_reduce(loss_sum, op="avg")
        record = {"step": step + 1, "loss": float(loss_sum), "grad_norm": grad_norm, "lr": lr,
                  "tokens_per_s": batch * seq_len / step_time, "step_time_s": step_time}
        if args.strategy != "torch_ddp":
            record["strategy_s"] = wrapped.strategy_seconds - strategy_before
        if job.rank == 0:
            metrics.write(json.dumps(record) + "\n")
            metrics.flush()
    if job.rank == 0:
        metrics.close()
    if args.strategy == "torch_ddp":
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
