"""One rank of a training run through Runtime.train (meshrun_run_train), for
tests/python/test_run.py: `meshrun launch --nproc-per-node N -- python3
run_rank.py CONFIG OUTPUT STOP_AT [--twice] [key=value ...]`.

Trains CONFIG (with the overrides) into OUTPUT; on_step writes each step's
metrics object to OUTPUT.callbacks/rank<R>.jsonl and asks to stop after
step STOP_AT (0: never). With --twice the same runtime then trains again,
into OUTPUT.again. A run the library refuses prints the error's code and
message; then the rank prints that it is still alive.
"""

import json
import os
import sys

import meshrun


def main():
    config, output, stop_at = sys.argv[1], sys.argv[2], int(sys.argv[3])
    twice = "--twice" in sys.argv[4:]
    runtime = meshrun.init(config, overrides=[a for a in sys.argv[4:] if a != "--twice"])
    with open(os.path.join(output + ".callbacks", f"rank{runtime.rank}.jsonl"), "w") as seen:

        def on_step(metrics):
            seen.write(json.dumps(metrics) + "\n")
            return metrics["step"] != stop_at

        try:
            runtime.train(output_dir=output, on_step=on_step)
            if twice:
                runtime.train(output_dir=output + ".again", on_step=on_step)
        except meshrun.MeshrunError as error:
            print(f"rank {runtime.rank} refused: {error.code} {error}", flush=True)
    print(f"rank {runtime.rank} alive", flush=True)


if __name__ == "__main__":
    main()
