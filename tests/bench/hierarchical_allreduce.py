"""Benchmark: the hierarchical all_reduce across nodes against the flat MPI
all_reduce, measured in one run.

Two nodes of two ranks are simulated on this machine
(MESHRUN_RANKS_PER_NODE=2) with Open MPI restricted to TCP (pml ob1, btl
tcp,self), as between real nodes. Each round runs, one after the other:
  - `meshrun bench comm --nproc 4 --ops all_reduce`: the hierarchical path
    (shared memory inside a node, MPI over TCP across, on half the data);
  - the same with MESHRUN_MPI_HIERARCHICAL=0: meshrun's flat MPI path;
  - raw MPI_Allreduce of the whole message (meshrun-mpi-allreduce-bench).
Prints each one's median busbw per size over the rounds and the ratios of
the medians (goal: hierarchical >= 1.5x the flat MPI all_reduce at 64 MiB).
Figures only; the exit status says whether every run worked and every
result was correct.

    /usr/bin/python3 tests/bench/hierarchical_allreduce.py build/bin/meshrun \
        build/bin/meshrun-mpi-allreduce-bench [--rounds 5] [--sizes 1M,64M] [--smoke]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

SIMULATED_NODES = {"MESHRUN_RANKS_PER_NODE": "2", "OMPI_MCA_pml": "ob1",
                   "OMPI_MCA_btl": "tcp,self", "OMPI_ALLOW_RUN_AS_ROOT": "1",
                   "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
LAUNCHER_VARIABLES = ("OMPI_", "PMI_", "PMIX_", "SLURM_")


def json_lines(command, **extra_env):
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_VARIABLES)}
    env.update(SIMULATED_NODES, **extra_env)
    output = subprocess.run(command, check=True, capture_output=True, text=True, env=env).stdout
    return [json.loads(line) for line in output.splitlines() if line.startswith("{")]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("meshrun")
    parser.add_argument("mpi_bench")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sizes", default="1M,64M")
    parser.add_argument("--smoke", action="store_true", help="one quick round at small sizes")
    args = parser.parse_args()
    sizes, seconds, rounds = (args.sizes, "0.5", args.rounds)
    if args.smoke:
        sizes, seconds, rounds = ("64K,1M", "0.02", 1)

    ours = [args.meshrun, "bench", "comm", "--nproc", "4", "--ops", "all_reduce", "--sizes",
            sizes, "--seconds", seconds, "--json"]
    raw = ["mpirun", "--oversubscribe", "-np", "4", args.mpi_bench, "--sizes", sizes,
           "--seconds", seconds]
    runs = {"hierarchical": [], "meshrun flat": [], "raw MPI": []}
    for _ in range(rounds):
        runs["hierarchical"].append(json_lines(ours))
        runs["meshrun flat"].append(json_lines(ours, MESHRUN_MPI_HIERARCHICAL="0"))
        runs["raw MPI"].append(json_lines(raw))

    correct = all(r["correct"] for results in runs.values() for run in results for r in run)
    median = {name: {} for name in runs}
    for name, results in runs.items():
        for size in {r["bytes"] for run in results for r in run}:
            median[name][size] = statistics.median(
                r["busbw_gbps"] for run in results for r in run if r["bytes"] == size)
    print(f"all_reduce float32, 2 simulated nodes x 2 ranks, MPI over TCP; "
          f"median busbw GB/s of {rounds} rounds")
    print(f"{'bytes':>10} {'hier':>7} {'flat':>7} {'raw MPI':>8} {'hier/flat':>10} "
          f"{'hier/raw':>9}")
    for size in sorted(median["hierarchical"]):
        hier, flat, mpi = (median[name][size] for name in runs)
        print(f"{size:>10} {hier:>7.3f} {flat:>7.3f} {mpi:>8.3f} {hier / flat:>10.2f} "
              f"{hier / mpi:>9.2f}")
    print("results correct" if correct else "WRONG RESULTS")
    return 0 if correct else 1


if __name__ == "__main__":
    sys.exit(main())
