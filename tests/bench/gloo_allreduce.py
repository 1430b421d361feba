"""The peer for `meshrun bench comm`: PyTorch 1.13's gloo all_reduce.

Runs with Debian's /usr/bin/python3 and python3-torch. Prints one JSON object
per size in the same fields as `meshrun bench comm --json` (busbw with the
nccl-tests factor 2(n-1)/n). Ranks meet over TCP on 127.0.0.1 only.

    /usr/bin/python3 tests/bench/gloo_allreduce.py --nproc 2 --sizes 1M,16M,64M,256M
"""

import argparse
import json
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text):
    digits = text.rstrip("KMG")
    return int(digits) * UNITS[text[len(digits):]]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank, nproc, port, sizes, seconds, queue):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=nproc)
    for size in sizes:
        tensor = torch.ones(size // 4, dtype=torch.float32)
        for _ in range(2):
            dist.all_reduce(tensor)
        start = time.perf_counter()
        dist.all_reduce(tensor)
        once = time.perf_counter() - start
        iterations = torch.tensor([max(3, min(2000, int(seconds / max(once, 1e-9))))])
        dist.all_reduce(iterations, op=dist.ReduceOp.MAX)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(int(iterations)):
            dist.all_reduce(tensor)
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if rank == 0:
            time_s = float(elapsed) / int(iterations)
            algbw = size / time_s / 1e9
            queue.put({"op": "all_reduce", "dtype": "float32", "nproc": nproc, "bytes": size,
                       "time_us": time_s * 1e6, "algbw_gbps": algbw,
                       "busbw_gbps": algbw * 2 * (nproc - 1) / nproc, "peer": "gloo"})
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--sizes", default="1M,16M,64M,256M")
    parser.add_argument("--seconds", type=float, default=0.3)
    args = parser.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    context = mp.get_context("spawn")
    queue = context.SimpleQueue()
    mp.start_processes(worker, args=(args.nproc, free_port(), sizes, args.seconds, queue),
                       nprocs=args.nproc, start_method="spawn")
    while not queue.empty():
        print(json.dumps(queue.get()))


if __name__ == "__main__":
    main()
