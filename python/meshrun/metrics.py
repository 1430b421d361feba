"""metrics.jsonl and run.json for a run a Python host trains itself, with the
fields `meshrun train` writes (docs/design.md, "User-facing contract"), so
that the same tools read both.

    log = meshrun.metrics.RunMetrics(job, "runs/py", tokens_per_step=2048,
                                     flops_per_token=6 * matmul_weights, matmul_dtype="float32")
    ...
    log.begin_step()  # optional: where the step's span begins in the trace
    ...
    log.write(step=1, loss=..., lr=..., grad_norm=..., step_time_s=...,
              comm_wait_s=..., grad_sync_wait_s=..., mem=module.memory_use())

Creating it is collective over the job: every rank measures its GEMM peak
at once (meshrun_gemm_peak_flops: MESHRUN_GEMM_PEAK_FLOPS where it states
one), as `meshrun train` does, and mfu divides by their sum. Rank 0 writes
the files; every rank gets each record back. With profile=True the ranks
record the trace `meshrun train` records with train.profile — each step;
each unit's forward and backward compute, named as `meshrun train` names
them ("forward model.layers.0"; under ddp the backward is one span, the
root's); and the time meshrun.torch blocks in the strategy's calls as
exposed communication ("strategy pre_forward 1", "finish_gradients") — and
close() (collective) writes OUTPUT/trace.json, which `meshrun trace summary`
reads and Perfetto shows.
"""

import ctypes
import json
import os
import resource

import numpy

from ._capi import check, library

# The GEMM peak is measured for this long on every rank, as `meshrun train`'s.
PEAK_SECONDS = 0.1

# Whether this process records a trace (RunMetrics(profile=True)).
_tracing = False


def trace_span(name, category, begin, end):
    """Records [begin, end) (meshrun_trace_now seconds) while tracing."""
    if _tracing:
        check(library().meshrun_trace_span(name.encode(), category.encode(), begin, end))


def trace_now():
    return library().meshrun_trace_now()


def peak_rss_bytes():
    """This process's peak resident set size (getrusage's ru_maxrss)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def gemm_peak_flops(dtype, seconds=PEAK_SECONDS):
    """One rank's GEMM FLOP/s in `dtype` ("float32" or "bfloat16"): stated by
    MESHRUN_GEMM_PEAK_FLOPS or measured for about `seconds`."""
    out = ctypes.c_double()
    check(library().meshrun_gemm_peak_flops(dtype.encode(), seconds, ctypes.byref(out)))
    return out.value


class RunMetrics:
    """Writes OUTPUT/run.json now and a metrics.jsonl line per write() on
    rank 0 of `runtime`'s job (a joined meshrun.Runtime)."""

    def __init__(self, runtime, output_dir, tokens_per_step, flops_per_token,
                 matmul_dtype="float32", profile=False):
        global _tracing
        self._runtime, self._output_dir, self.profile = runtime, output_dir, profile
        self._step_began = None  # trace time of begin_step(), until write()
        if profile:
            check(library().meshrun_trace_start(runtime.handle))
            _tracing = True
        world = runtime.comm("world")
        world.barrier()  # the ranks measure at once, sharing cores as they will train
        # Whole FLOP/s, summed exactly (the collectives take no float64).
        peak = numpy.array([round(gemm_peak_flops(matmul_dtype))], numpy.int64)
        world.all_reduce(peak, op="sum")
        self.tokens_per_step = tokens_per_step
        self.flops_per_step = float(flops_per_token) * tokens_per_step
        self.peak_flops_per_s = float(peak[0])
        self.writer = world.rank == 0
        self._path = os.path.join(output_dir, "metrics.jsonl")
        if self.writer:
            os.makedirs(output_dir, exist_ok=True)
            stated = f"{matmul_dtype}=" in os.environ.get("MESHRUN_GEMM_PEAK_FLOPS", "")
            run = {"ranks": world.size, "matmul_dtype": matmul_dtype,
                   "flops_per_token": float(flops_per_token),
                   "flops_per_step": self.flops_per_step,
                   "peak_flops_per_s": self.peak_flops_per_s,
                   "peak_source": "MESHRUN_GEMM_PEAK_FLOPS" if stated else "measured"}
            with open(os.path.join(output_dir, "run.json"), "w") as f:
                json.dump(run, f, indent=2)
                f.write("\n")
            open(self._path, "w").close()

    def begin_step(self):
        """Marks where the step write() reports next began, for the trace
        (optional: without it the step's span ends at write())."""
        if _tracing:
            self._step_began = trace_now()

    def write(self, step, loss, lr, grad_norm, step_time_s, mem, comm_wait_s=0.0,
              grad_sync_wait_s=0.0, val_loss=None):
        """The step's metrics object, in metrics.jsonl's order; rank 0
        appends it. `mem` as DistributedModule.memory_use() gives it. A
        Python run computes no tensor or context parallelism: tp_bytes,
        cp_bytes and cp_wait_s are 0, as `meshrun train` reports without
        them."""
        begun, self._step_began = self._step_began, None
        if begun is None:
            begun = trace_now() - step_time_s
        trace_span(f"step {step}", "step", begun, begun + step_time_s)
        flops_per_s = self.flops_per_step / step_time_s
        record = {"step": step, "loss": loss, "tokens_per_s": self.tokens_per_step / step_time_s,
                  "step_time_s": step_time_s, "flops_per_s": flops_per_s,
                  "mfu": flops_per_s / self.peak_flops_per_s,
                  "grad_sync_wait_s": grad_sync_wait_s, "comm_wait_s": comm_wait_s,
                  "tp_bytes": 0, "cp_bytes": 0, "cp_wait_s": 0.0, "lr": lr,
                  "grad_norm": grad_norm}
        if val_loss is not None:
            record["val_loss"] = val_loss
        record["mem"] = mem
        if self.writer:
            with open(self._path, "a") as f:
                f.write(json.dumps(record) + "\n")
        return record

    def close(self):
        """With profile: writes OUTPUT/trace.json on rank 0 (collective) and
        stops recording."""
        global _tracing
        if self.profile and _tracing:
            _tracing = False
            check(library().meshrun_trace_write(self._runtime.handle,
                                                os.fsencode(self._output_dir)))
