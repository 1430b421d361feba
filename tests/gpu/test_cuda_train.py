"""gpu: `meshrun train` on GPUs against the same run on the CPU.

Each case trains the same config twice, on the CPU (dist_env.backend =
"mpi") and on GPUs ("nccl": one GPU per rank, the strategies and the
model's collectives over NCCL), and compares metrics.jsonl step by step:
the loss and the validation loss within 1e-2 relative, the gradient norm
within 5e-2 relative. Why these bounds: the runs compute their matmuls in
bfloat16 (operands rounded, float32 sums) on both sides, in another order
of summation, so each step's gradients differ by the kit stage test's
bfloat16 bound (2e-3 + 3e-2 |cpu| per element) and the parameters drift
apart a little more each step; the loss, a mean over the step's tokens,
varies far less than single gradients. Measured on the CPU (llama-tiny,
one rank, five steps): computing in float32 instead of bfloat16 moves the
loss by at most 6e-4 relative, so the bound leaves room for the GPU's
other order of summation; a learning rate 10% off (as a gradient
direction slightly wrong) exceeds it from step 4, and a gradient scaled
wrongly shows in the norm. The GPU run must also report
mem.device_used_peak and mem.device_allocated_peak, and the CPU run must
not.

Runs 1-rank cases on one GPU (in the process meshrun starts) and 2-rank
cases where there are two GPUs and mpirun. Skips (exit 77) saying why
without a GPU, without a build of the CUDA trainer, or without the MPI comm
plugin.

usage: test_cuda_train.py MESHRUN REPO_ROOT
"""

import ctypes
import os
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from meshrun_testing import environment, metrics  # noqa: E402

SKIP = 77
STEPS = 5
LOSS_BOUND = 1e-2
NORM_BOUND = 5e-2


def cuda_devices():
    """The number of CUDA devices the driver sees, and why none."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError as error:
        return 0, f"no NVIDIA driver ({error})"
    if driver.cuInit(0) != 0:
        return 0, "cuInit failed"
    count = ctypes.c_int(0)
    if driver.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0, "cuDeviceGetCount failed"
    return count.value, "the driver sees no device"


# The Mixtral example without expert parallelism (its [distributed.moe]
# table needs ep_size > 1), for one rank.
MIXTRAL_ALONE = [("ep_size = 2", "ep_size = 1"),
                 ("[distributed.moe]\nreshard_after_forward = false\n", "")]

# (name, example, edits of its text, ranks, overrides)
CASES = [
    ("llama fsdp2 bfloat16", "llama-tiny.toml", [], 1, []),
    ("llama ddp", "llama-tiny.toml", [], 1, ["distributed.strategy=ddp"]),
    ("gpt2 fsdp2", "gpt2-tiny.toml", [], 1, []),
    ("mixtral fsdp2", "moe-ep.toml", MIXTRAL_ALONE, 1, []),
    ("llama megatron_fsdp", "megatron-fsdp.toml", [], 1, []),
    ("llama fsdp2, full activation checkpointing", "llama-tiny.toml", [], 1,
     ['distributed.activation_checkpointing="full"']),
    ("gpt2 fsdp2, selective activation checkpointing", "gpt2-tiny.toml", [], 1,
     ['distributed.activation_checkpointing="selective"']),
    ("llama fsdp2, 2 ranks", "llama-tiny.toml", [], 2, []),
    ("llama ddp, 2 ranks", "llama-tiny.toml", [], 2, ["distributed.strategy=ddp"]),
    ("llama megatron_fsdp, 2 ranks", "megatron-fsdp.toml", [], 2, []),
    ("mixtral, ep 2", "moe-ep.toml", [], 2, []),
    ("llama, tp 2", "tensor-parallel.toml", [], 2, []),
    ("llama, cp 2 (ring)", "llama-tiny.toml", [], 2, ["distributed.cp_size=2"]),
    ("gpt2, cp 2 (Ulysses)", "gpt2-tiny.toml", [], 2,
     ["distributed.cp_size=2", "distributed.cp_ulysses_degree=2"]),
    ("llama, pp 2 (1f1b)", "pipeline-1f1b.toml", [], 2, []),
    ("llama, pp 2 (zero-bubble V)", "pipeline-1f1b.toml", [], 2,
     ["distributed.pipeline.pp_schedule=zbv_zero_bubble"]),
]


def case_config(root, example, edits, folder):
    """The example's path, or a copy of it in `folder` with `edits` made."""
    path = os.path.join(root, "examples", example)
    if not edits:
        return path
    with open(path) as f:
        text = f.read()
    for old, new in edits:
        if old not in text:
            raise AssertionError(f"{example} has no {old!r}")
        text = text.replace(old, new)
    edited = os.path.join(folder, example)
    with open(edited, "w") as f:
        f.write(text)
    return edited


def train(meshrun, config, ranks, backend, overrides, output):
    command = [meshrun, "train", config, "--nproc-per-node", str(ranks), "--output", output,
               f"dist_env.backend={backend}", f"train.steps={STEPS}", "train.val_every=5",
               "train.log_every=1"] + overrides
    # A job of its own, with Open MPI's settings kept (scripts/gpu-deps.sh
    # sets its transports where it brings Open MPI along).
    settings = {k: v for k, v in os.environ.items() if k.startswith("OMPI_MCA_")}
    result = subprocess.run(command, capture_output=True, text=True,
                            env=environment(**settings), timeout=600)
    if result.returncode != 0:
        raise AssertionError(f"{' '.join(command)} exited {result.returncode}:\n"
                             f"{result.stdout[-2000:]}\n{result.stderr[-4000:]}")
    return metrics(output)


def relative(gpu, cpu):
    return abs(gpu - cpu) / max(abs(cpu), 1e-12)


def compare(name, cpu, gpu):
    failures = []
    if len(cpu) != len(gpu):
        return [f"{name}: {len(cpu)} CPU steps, {len(gpu)} GPU steps"]
    for c, g in zip(cpu, gpu):
        for key, bound in (("loss", LOSS_BOUND), ("val_loss", LOSS_BOUND),
                           ("grad_norm", NORM_BOUND)):
            if (key in c) != (key in g):
                failures.append(f"{name} step {c['step']}: {key} on one side only")
            elif key in c and relative(g[key], c[key]) > bound:
                failures.append(f"{name} step {c['step']}: {key} {g[key]:.6g} on the GPU, "
                                f"{c[key]:.6g} on the CPU (bound {bound} relative)")
        for key in ("device_used_peak", "device_allocated_peak"):
            if g["mem"].get(key, 0) <= 0:
                failures.append(f"{name} step {g['step']}: no mem.{key}")
            if key in c["mem"]:
                failures.append(f"{name} step {c['step']}: mem.{key} on the CPU")
    print(f"{name}: losses " + ", ".join(f"{c['loss']:.5f}/{g['loss']:.5f}"
                                          for c, g in zip(cpu, gpu)) + " (cpu/gpu)")
    return failures


def main():
    meshrun, root = sys.argv[1], sys.argv[2]
    count, why = cuda_devices()
    if count == 0:
        print(f"SKIP: no usable CUDA device ({why})")
        return SKIP
    lib = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(meshrun))), "lib")
    needed = [(os.path.join(lib, "libmeshrun_trainer_cuda.so"), "a build without the CUDA toolkit"),
              (os.path.join(lib, "meshrun", "plugins", "meshrun_comm_mpi.so"),
               "a build without MPI, whose world a GPU run's trainer joins")]
    for path, why in needed:
        if not os.path.exists(path):
            print(f"SKIP: {path} is missing ({why})")
            return SKIP
    launches = shutil.which("mpirun") is not None
    failures = []
    with tempfile.TemporaryDirectory() as folder:
        for k, (name, example, edits, ranks, overrides) in enumerate(CASES):
            if ranks > count:
                print(f"SKIP {name}: needs {ranks} GPUs, this machine has {count}")
                continue
            if ranks > 1 and not launches:
                print(f"SKIP {name}: mpirun is not on PATH (it starts the ranks)")
                continue
            try:
                config = case_config(root, example, edits, folder)
                cpu = train(meshrun, config, ranks, "mpi", overrides,
                            os.path.join(folder, f"cpu{k}"))
                gpu = train(meshrun, config, ranks, "nccl", overrides,
                            os.path.join(folder, f"gpu{k}"))
                failures += compare(name, cpu, gpu)
            except (AssertionError, subprocess.TimeoutExpired) as error:
                failures.append(f"{name}: {error}")
    for failure in failures:
        print("FAIL: " + failure)
    print("PASS" if not failures else f"{len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
