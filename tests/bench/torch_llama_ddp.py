"""The peer for the `meshrun train` benchmark: PyTorch 1.13 eager Llama under DDP over gloo.

Hugging Face's LlamaForCausalLM as examples/python/torch_llama.py has it,
trained the way `meshrun train` trains, so that the two can be compared on
the same machine with the same config: the TOML file meshrun reads ([model],
[data], [train]), byte-level
tokens, micro-batches with gradient accumulation up to train.global_batch_size
across ranks (DDP's no_sync on all but the last micro-batch), AdamW with
linear warmup and cosine decay to min_lr, and global-norm gradient clipping.
One thread per rank, so both sides run on one core per rank through the BLAS
torch is linked to (Debian's libblas.so.3, which is OpenBLAS when the
alternative points there; the summary names the library actually loaded).

Runs with Debian's /usr/bin/python3 and python3-torch. Rank 0 prints one JSON
line per step and a final summary line; ranks meet over TCP on 127.0.0.1 only.

    /usr/bin/python3 tests/bench/torch_llama_ddp.py examples/llama-tiny.toml --nproc 2
    /usr/bin/python3 tests/bench/torch_llama_ddp.py examples/llama-tiny.toml --no-ddp \
        --global-batch-size 8      # the 1-rank baseline without communication
    /usr/bin/python3 tests/bench/torch_llama_ddp.py examples/llama-tiny.toml --autocast
                                   # forward under torch.autocast("cpu", torch.bfloat16)
"""

import os

# One compute thread per rank. Set before torch loads so that OpenMP and the
# pthread build of OpenBLAS both see it (torch.set_num_threads alone does not
# reach OpenBLAS's own thread pool).
os.environ["OMP_NUM_THREADS"] = "1"
os.environ["OPENBLAS_NUM_THREADS"] = "1"

import argparse
import contextlib
import json
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "examples", "python"))
from torch_llama import (LlamaForCausalLM, global_batch, load_config,  # noqa: E402
                         lr_factor, training_bytes)

def loaded_blas():
    """The BLAS shared objects mapped into this process, resolved (e.g. openblas-pthread)."""
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "blas" in line.lower() and "/" in line}
    return sorted({os.path.realpath(p) for p in paths})


def previous_step_overlap(ddp_model):
    """(all-reduce span, part of it hidden behind backward compute) in s, or None.

    DDP's host-side runtime stats for its last synced backward: the span runs from the
    first bucket's launch to the reducer's finalize; the part before backward compute ends
    is hidden. DDP files them at the next synced forward, so after step k's last forward
    they describe step k - 1 (none yet at the first step).
    """
    data = ddp_model._get_ddp_logging_data()
    if "backward_comm_time" not in data:
        return None
    return data["backward_comm_time"] / 1e9, data["backward_compute_comm_overlap_time"] / 1e9


def worker(rank, nproc, port, args):
    """One rank: builds the model, trains args.steps steps, and reports from rank 0."""
    torch.set_num_threads(1)
    model_cfg, data_cfg, train = load_config(args.config)
    if args.steps is not None:
        train["steps"] = args.steps
    if args.global_batch_size is not None:
        train["global_batch_size"] = args.global_batch_size
    seq_len, micro = data_cfg["seq_len"], train["micro_batch_size"]
    per_rank, rest = divmod(train["global_batch_size"], nproc)
    if rest or per_rank % micro:
        raise SystemExit(f"train.global_batch_size {train['global_batch_size']} is not divisible "
                         f"by micro_batch_size {micro} x {nproc} ranks")
    accumulation = per_rank // micro
    tokens = training_bytes(data_cfg)

    torch.manual_seed(train["seed"])
    model = LlamaForCausalLM(model_cfg)
    if args.no_ddp:
        wrapped = model
    else:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=nproc)
        wrapped = DistributedDataParallel(model)
        wrapped._set_ddp_runtime_logging_sample_rate(1)
    betas = tuple(train["betas"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=train["lr"], betas=betas,
                                  eps=train["eps"], weight_decay=train["weight_decay"])
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, train))

    records, overlaps = [], []
    for step in range(train["steps"]):
        start = time.perf_counter()
        inputs, targets = global_batch(tokens, seq_len, train["global_batch_size"],
                                       train["seed"], step)
        inputs = inputs[rank * per_rank:(rank + 1) * per_rank]
        targets = targets[rank * per_rank:(rank + 1) * per_rank]
        step_loss = 0.0
        for m in range(accumulation):
            rows = slice(m * micro, (m + 1) * micro)
            last = m == accumulation - 1
            sync = contextlib.nullcontext() if last or args.no_ddp else wrapped.no_sync()
            with sync:
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.autocast):
                    loss = wrapped(inputs[rows], targets[rows]) / accumulation
                loss.backward()
            step_loss += loss.item()
        if train["max_grad_norm"] > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), train["max_grad_norm"])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        schedule.step()
        step_time = time.perf_counter() - start

        record = {"step": step + 1, "loss": step_loss, "lr": optimizer.param_groups[0]["lr"],
                  "tokens_per_s": train["global_batch_size"] * seq_len / step_time,
                  "step_time_s": step_time}
        if not args.no_ddp:
            # Outside the timed region: the loss averaged over ranks, and DDP's overlap stats.
            loss_sum = torch.tensor([step_loss])
            dist.all_reduce(loss_sum)
            record["loss"] = loss_sum.item() / nproc
            if step > args.warmup:
                overlaps.append(previous_step_overlap(wrapped))
        if rank == 0:
            print(json.dumps(record), flush=True)
            records.append(record)

    if rank == 0:
        measured = records[args.warmup:] or records
        summary = {
            "peer": "torch-ddp-gloo", "ddp": not args.no_ddp, "nproc": nproc,
            "torch": torch.__version__, "blas": loaded_blas(), "threads_per_rank": 1,
            "autocast": "bfloat16" if args.autocast else None,
            "global_batch_size": train["global_batch_size"], "micro_batch_size": micro,
            "seq_len": seq_len, "steps": train["steps"], "warmup_steps_skipped": args.warmup,
            "first_loss": records[0]["loss"], "final_loss": records[-1]["loss"],
            "tokens_per_s_mean": statistics.mean(r["tokens_per_s"] for r in measured),
            "step_time_s_mean": statistics.mean(r["step_time_s"] for r in measured),
        }
        if overlaps:
            span = sum(o[0] for o in overlaps)
            summary["allreduce_span_s_mean"] = span / len(overlaps)
            summary["allreduce_hidden_fraction"] = sum(o[1] for o in overlaps) / span
        print(json.dumps(summary), flush=True)
    if not args.no_ddp:
        dist.destroy_process_group()


def free_port():
    """A TCP port on 127.0.0.1 that is free now, for the gloo rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="meshrun TOML config ([model], [data], [train])")
    parser.add_argument("--nproc", type=int, default=2, help="ranks (processes), default 2")
    parser.add_argument("--steps", type=int, help="override train.steps")
    parser.add_argument("--global-batch-size", type=int, help="override train.global_batch_size")
    parser.add_argument("--no-ddp", action="store_true",
                        help="one rank, plain model, no process group: the overhead baseline")
    parser.add_argument("--warmup", type=int, default=2,
                        help="steps left out of the summary's means (default 2)")
    parser.add_argument("--autocast", action="store_true",
                        help='forward and loss under torch.autocast("cpu", torch.bfloat16)')
    args = parser.parse_args()
    if args.no_ddp:
        args.nproc = 1
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.start_processes(worker, args=(args.nproc, free_port(), args), nprocs=args.nproc,
                       start_method="spawn")


if __name__ == "__main__":
    main()
