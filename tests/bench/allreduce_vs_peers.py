"""Benchmark: meshrun's all_reduce against its peers, measured in one run.

Runs, one after the other on the same machine:
  - `meshrun bench comm --nproc N --ops all_reduce` (float32),
  - PyTorch 1.13 gloo all_reduce (tests/bench/gloo_allreduce.py, /usr/bin/python3),
  - single-core memcpy (`meshrun bench memcpy`),
and prints busbw per size with the ratios the communication issue asks for:
meshrun / gloo (goal >= 5), meshrun / memcpy (goal >= 0.4 from 16 MiB on),
and each size against the best size (goal >= 0.5). Prints figures; the
exit status says only whether every run worked and every result was correct.

    /usr/bin/python3 tests/bench/allreduce_vs_peers.py build/bin/meshrun [--nproc 2]
"""

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def json_lines(command):
    output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return [json.loads(line) for line in output.splitlines() if line.startswith("{")]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("meshrun")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--sizes", default="1M,16M,64M,256M")
    args = parser.parse_args()

    ours = json_lines([args.meshrun, "bench", "comm", "--nproc", str(args.nproc), "--ops",
                       "all_reduce", "--sizes", args.sizes, "--json"])
    gloo = json_lines(["/usr/bin/python3", os.path.join(HERE, "gloo_allreduce.py"), "--nproc",
                       str(args.nproc), "--sizes", args.sizes])
    memcpy = json_lines([args.meshrun, "bench", "memcpy", "--sizes", args.sizes, "--json"])

    gloo_by_size = {r["bytes"]: r["busbw_gbps"] for r in gloo}
    memcpy_by_size = {r["bytes"]: r["gbps"] for r in memcpy}
    best = max(r["busbw_gbps"] for r in ours)
    print(f"all_reduce float32, {args.nproc} ranks (busbw GB/s; memcpy GB/s single core)")
    print(f"{'bytes':>11} {'meshrun':>8} {'gloo':>7} {'memcpy':>7} {'x gloo':>7} "
          f"{'/memcpy':>8} {'/best':>6} {'correct':>7}")
    for r in ours:
        size = r["bytes"]
        ratio_gloo = r["busbw_gbps"] / gloo_by_size[size]
        ratio_memcpy = r["busbw_gbps"] / memcpy_by_size[size]
        print(f"{size:>11} {r['busbw_gbps']:>8.2f} {gloo_by_size[size]:>7.2f} "
              f"{memcpy_by_size[size]:>7.2f} {ratio_gloo:>7.1f} {ratio_memcpy:>8.2f} "
              f"{r['busbw_gbps'] / best:>6.2f} {str(r['correct']):>7}")
    return 0 if all(r["correct"] for r in ours) else 1


if __name__ == "__main__":
    sys.exit(main())
