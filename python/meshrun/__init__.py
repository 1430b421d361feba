"""meshrun from Python: the C host API (abi/include/meshrun/host.h) through
ctypes, with no compiled extension.

Planning, on any world size:

    rt = meshrun.Runtime.from_file("examples/llama-tiny.toml")
    rt.build_mesh(world_size=8, rank=0)
    rt.axis_size("dp"), rt.coordinate(5, "tp"), rt.group_ranks("tp", 5), rt.plan()

As one rank of a job (`meshrun launch --nproc-per-node 2 -- python3 prog.py`,
or mpirun, srun; alone it is a job of one rank):

    job = meshrun.init(strategy="ddp")          # joins; MPI finalized at exit
    job.rank, job.world_size, job.local_rank, job.axis_sizes()
    dp = job.comm("dp")
    dp.all_reduce(array, op="avg")              # numpy arrays, torch tensors
    op = dp.all_gather(x, out, async_op=True); ...; op.wait()
    strategy = meshrun.Strategy(job, params, grads, names, shapes, units)

meshrun.torch (imported on its own) wraps a torch.nn.Module with the
configured ddp or fsdp2 strategy.

The library is $MESHRUN_LIBRARY, else libmeshrun.so.1 of this package's
installation or build tree, else the loader's (meshrun._capi). Every failing
call raises MeshrunError with the ABI's code and message.
"""

from ._capi import library
from .comm import REDUCE_OPS, Comm, Op
from .errors import (DEADLINE_EXCEEDED, FAILED_PRECONDITION, INTERNAL, INVALID_ARGUMENT,
                     NOT_FOUND, OUT_OF_RANGE, UNAVAILABLE, UNIMPLEMENTED, VERSION_MISMATCH,
                     MeshrunError)
from .runtime import AXES, Runtime, init, plan
from .strategy import Segment, Strategy

__all__ = [
    "AXES", "Comm", "DEADLINE_EXCEEDED", "FAILED_PRECONDITION", "INTERNAL", "INVALID_ARGUMENT",
    "MeshrunError", "NOT_FOUND", "OUT_OF_RANGE", "Op", "REDUCE_OPS", "Runtime", "Segment",
    "Strategy", "UNAVAILABLE", "UNIMPLEMENTED", "VERSION_MISMATCH", "abi_version", "init",
    "library", "library_version", "plan",
]


def abi_version():
    """(major, minor) of the loaded libmeshrun's ABI."""
    return library().meshrun_abi_version_major(), library().meshrun_abi_version_minor()


def library_version():
    """The loaded libmeshrun's release, e.g. "0.1.0"."""
    return library().meshrun_library_version().decode()
