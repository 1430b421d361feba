"""Trains a Llama written in PyTorch (torch_llama.py) on the bytes of the GPL
under meshrun's ddp or fsdp2 strategy (meshrun.torch), or under PyTorch's own
DistributedDataParallel over gloo, for comparison.

    meshrun launch --nproc-per-node 2 -- python3 examples/python/train_torch.py \\
        --strategy fsdp2 --param-dtype float32 --steps 20 --output runs/torch-fsdp2

CONFIG (default examples/llama-tiny.toml) is a meshrun TOML file: [model],
[data] and [train] configure the model, the data and the optimizer as for
`meshrun train`; the whole file, with the key=value overrides, configures the
meshrun runtime ([distributed], [comm]). --strategy sets
distributed.strategy; --param-dtype sets fsdp2's
distributed.mp_policy.param_dtype (llama-tiny.toml leaves bfloat16, the
default: float32 computes exactly what ddp does).

Strategies: ddp and fsdp2 (meshrun's, through meshrun.torch); torch_ddp
(torch.nn.parallel.DistributedDataParallel over gloo); torch_nosync (the
same with every micro-batch under no_sync: no gradient all-reduce, replicas
drift apart; a timing baseline only, with a barrier after backward so that
its ranks still wait for the slower one, as those of the others do). For
torch's, the ranks are meshrun's (the launcher's environment:
OMPI_COMM_WORLD_RANK and _SIZE under `meshrun launch`); rank 0 picks a free
TCP port on 127.0.0.1 and broadcasts it to the others through meshrun's
world communicator; gloo meets there.

Several strategies, comma-separated, train one model each in the same ranks,
their steps interleaved (strategy a's step s, b's step s, a's step s + 1,
...), each writing DIR/<strategy>/metrics.jsonl: on a shared machine whose
speed changes from second to second, interleaved steps see the same
conditions, where runs one after the other do not
(tests/bench/python_ddp_vs_torch.py).

The global batch is the same whatever the number of ranks: step s draws
train.global_batch_size windows of seq_len + 1 bytes from a generator seeded
by (seed, s); data-parallel rank r takes its contiguous slice, in
micro-batches of train.micro_batch_size with gradient accumulation. Every
rank's loss is the mean over its slice, the strategies average over ranks,
so 1, 2 or 4 ranks compute the same losses up to float32 rounding.
AdamW with linear warmup and cosine decay, global-norm clipping, weight decay
on matrices only (not 1-D norm weights), as `meshrun train` does.

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

STRATEGIES = ("ddp", "fsdp2", "torch_ddp", "torch_nosync")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", nargs="?",
                        default=os.path.join(HERE, "..", "llama-tiny.toml"),
                        help="meshrun TOML config (default examples/llama-tiny.toml)")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="config overrides, as for meshrun train")
    parser.add_argument("--strategy", required=True,
                        help=f"one of {', '.join(STRATEGIES)}, or several, comma-separated")
    parser.add_argument("--param-dtype", choices=("float32", "bfloat16"),
                        help="fsdp2's distributed.mp_policy.param_dtype")
    parser.add_argument("--steps", type=int, help="override train.steps")
    parser.add_argument("--output", required=True, help="folder for metrics.jsonl")
    args = parser.parse_intermixed_args()
    args.strategies = args.strategy.split(",")
    for strategy in args.strategies:
        if strategy not in STRATEGIES or args.strategies.count(strategy) > 1:
            parser.error(f"--strategy: '{strategy}' is not one of {', '.join(STRATEGIES)} "
                         "(each at most once)")
    if args.config and "=" in args.config:  # only overrides were given
        args.overrides.insert(0, args.config)
        args.config = parser.get_default("config")
    return args


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_gloo(job):
    """PyTorch's process group over gloo on the job's ranks, meeting on a
    port rank 0 chose and broadcast through meshrun."""
    port = torch.tensor([free_port() if job.rank == 0 else 0], dtype=torch.int64)
    job.comm("world").broadcast(port, root=0)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{int(port)}", rank=job.rank,
                            world_size=job.world_size)


def torch_adamw(model, train):
    """torch.optim.AdamW decaying the matrices only, as meshrun.torch's."""
    matrices = [p for p in model.parameters() if p.dim() > 1]
    vectors = [p for p in model.parameters() if p.dim() <= 1]
    return torch.optim.AdamW([{"params": matrices}, {"params": vectors, "weight_decay": 0.0}],
                             lr=train["lr"], betas=tuple(train["betas"]), eps=train["eps"],
                             weight_decay=train["weight_decay"])


class Trainer:
    """One strategy's model, optimizer and schedule, stepping on its
    data-parallel slice of each global batch."""

    def __init__(self, strategy, job, model_cfg, train):
        self.strategy, self.train = strategy, train
        torch.manual_seed(train["seed"])
        self.model = LlamaForCausalLM(model_cfg)
        self.meshrun = strategy in ("ddp", "fsdp2")
        if self.meshrun:
            self.wrapped = meshrun.torch.DistributedModule(self.model, job,
                                                           units=self.model.model.layers)
            self.optimizer = self.wrapped.adamw(lr=train["lr"], betas=tuple(train["betas"]),
                                                eps=train["eps"],
                                                weight_decay=train["weight_decay"])
            self.dp = job.comm("dp")
        else:
            self.wrapped = DistributedDataParallel(self.model)
            self.optimizer = torch_adamw(self.model, train)
            self.dp = job.comm("world")
        self.schedule = torch.optim.lr_scheduler.LambdaLR(self.optimizer,
                                                          lambda s: lr_factor(s, train))
        micro, batch = train["micro_batch_size"], train["global_batch_size"]
        self.per_rank, rest = divmod(batch, self.dp.size)
        if rest or self.per_rank % micro:
            raise SystemExit(f"train.global_batch_size {batch} is not divisible by "
                             f"micro_batch_size {micro} x {self.dp.size} data-parallel ranks")

    def step(self, step, inputs, targets):
        """One optimizer step; returns its metrics record."""
        train, micro = self.train, self.train["micro_batch_size"]
        accumulation = self.per_rank // micro
        strategy_before = self.wrapped.strategy_seconds if self.meshrun else 0.0
        start = time.perf_counter()
        rows = slice(self.dp.rank * self.per_rank, (self.dp.rank + 1) * self.per_rank)
        inputs, targets = inputs[rows], targets[rows]
        if self.meshrun:
            self.wrapped.zero_grad()
        else:
            self.optimizer.zero_grad(set_to_none=False)
        step_loss = 0.0
        for m in range(accumulation):
            part = slice(m * micro, (m + 1) * micro)
            sync = m == accumulation - 1 and self.strategy != "torch_nosync"
            with contextlib.nullcontext() if sync else self.wrapped.no_sync():
                loss = self.wrapped(inputs[part], targets[part]) / accumulation
                loss.backward()
            step_loss += loss.item()
        if self.strategy == "torch_nosync":
            dist.barrier()  # where DDP's all-reduce ends: wait for the slower rank as the others do
        if self.meshrun:
            grad_norm = self.wrapped.clip_grad_norm_(train["max_grad_norm"])
        else:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(),
                                                             train["max_grad_norm"]))
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.schedule.step()
        step_time = time.perf_counter() - start

        # Outside the timed region: the mean loss over the global batch.
        loss_sum = torch.tensor([step_loss], dtype=torch.float32)
        self.dp.all_reduce(loss_sum, op="avg")
        record = {"step": step + 1, "loss": float(loss_sum), "grad_norm": grad_norm, "lr": lr,
                  "tokens_per_s": train["global_batch_size"] * inputs.shape[1] / step_time,
                  "step_time_s": step_time}
        if self.meshrun:
            record["strategy_s"] = self.wrapped.strategy_seconds - strategy_before
        return record


def main():
    args = parse_args()
    torch.set_num_threads(1)
    overrides = list(args.overrides)
    if args.steps is not None:
        overrides.append(f"train.steps={args.steps}")
    model_cfg, data_cfg, train = load_config(args.config, overrides)
    # One joined runtime per meshrun strategy (a process may join several);
    # PyTorch's strategies take their ranks from the first.
    jobs = {}
    try:
        for strategy in args.strategies:
            if strategy in ("ddp", "fsdp2"):
                extra = [f"distributed.strategy={strategy}"]
                if strategy == "fsdp2" and args.param_dtype:
                    extra.append(f"distributed.mp_policy.param_dtype={args.param_dtype}")
                jobs[strategy] = meshrun.init(args.config, overrides + extra)
        if not jobs:
            jobs["torch"] = meshrun.init(args.config, overrides)
    except meshrun.MeshrunError as error:  # a bad config or override
        raise SystemExit(f"train_torch.py: error: {error}") from None
    first = next(iter(jobs.values()))
    if any(s.startswith("torch") for s in args.strategies):
        join_gloo(first)
    trainers = [Trainer(s, jobs.get(s, first), model_cfg, train) for s in args.strategies]
    tokens = training_bytes(data_cfg)

    metrics = {}
    if first.rank == 0:
        for trainer in trainers:
            folder = args.output if len(trainers) == 1 else os.path.join(args.output,
                                                                         trainer.strategy)
            os.makedirs(folder, exist_ok=True)
            metrics[trainer] = open(os.path.join(folder, "metrics.jsonl"), "w")
    for step in range(train["steps"]):
        inputs, targets = global_batch(tokens, data_cfg["seq_len"], train["global_batch_size"],
                                       train["seed"], step)
        for trainer in trainers:  # interleaved: a slow phase of the machine hits them all
            record = trainer.step(step, inputs, targets)
            if trainer in metrics:
                metrics[trainer].write(json.dumps(record) + "\n")
                metrics[trainer].flush()
    for file in metrics.values():
        file.close()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
