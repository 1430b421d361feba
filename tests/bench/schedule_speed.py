"""How long `meshrun schedule` takes for the largest documented case.

Times `meshrun schedule interleaved_1f1b --pp 64 --microbatches 1024
--stages-per-rank 2 --json` end to end (plugin load, generation, lowering,
validation, simulation, JSON output; about 260k compute actions) and prints
the best of a few runs in seconds. The goal is under a second; with
--limit SECONDS it exits 1 when the best run is slower, which ctest uses
with a generous limit so that a regression to quadratic work shows.

Usage: schedule_speed.py MESHRUN_EXE [--runs N] [--limit SECONDS]
"""

import argparse
import json
import os
import subprocess
import sys
import time

COMMAND = ["schedule", "interleaved_1f1b", "--pp", "64", "--microbatches", "1024",
           "--stages-per-rank", "2", "--json"]


def timed_run(meshrun):
    env = dict(os.environ, MESHRUN_PLUGIN_PATH="")
    start = time.perf_counter()
    result = subprocess.run([meshrun, *COMMAND], capture_output=True, text=True, env=env,
                            check=True)
    seconds = time.perf_counter() - start
    data = json.loads(result.stdout)
    compute = sum(1 for rank in data["actions"] for a in rank
                  if a.lstrip("0123456789")[:1] in "FBIW")
    return seconds, compute, data["bubble_fraction"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("meshrun")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--limit", type=float, help="fail when the best run takes longer")
    args = parser.parse_args()
    runs = [timed_run(args.meshrun) for _ in range(args.runs)]
    best, compute, bubble = min(runs)
    print(f"meshrun {' '.join(COMMAND)}")
    print(f"compute actions {compute}, bubble {bubble:.6f}")
    print(f"seconds (best of {args.runs}): {best:.3f}  goal < 1")
    if args.limit is not None and best > args.limit:
        print(f"slower than the limit of {args.limit} s", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
