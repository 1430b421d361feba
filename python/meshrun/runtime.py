"""A meshrun_runtime: a config, its device mesh and, once joined, this
process's rank of a running job with one communicator per mesh axis.

What is made from a joined runtime (strategies, operations in flight) is
recorded with it; close() destroys those first, then the runtime, which
finalizes the comm backend (MPI_Finalize) once nothing else holds it.
join() registers close() with atexit, so a program that just returns still
finalizes MPI (mpirun otherwise reports "exited without calling
MPI_Finalize").
"""

import atexit
import ctypes
import json
import os
import weakref

from . import _capi
from ._capi import check, library
from .comm import Comm
from .errors import FAILED_PRECONDITION, MeshrunError

# The mesh axes, outermost first (meshrun/host.h).
AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


class Runtime:
    """A meshrun_runtime. Made by from_text / from_file (or meshrun.init);
    destroyed with close() or `with`."""

    def __init__(self, handle):
        self._handle = handle
        self._comms = {}
        self._children = weakref.WeakSet()  # strategies and operations made from it
        self._rank = None

    @classmethod
    def from_text(cls, toml_text, source_name="<string>"):
        handle = ctypes.c_void_p()
        check(library().meshrun_runtime_create_from_text(
            toml_text.encode(), source_name.encode(), ctypes.byref(handle)))
        return cls(handle)

    @classmethod
    def from_file(cls, path):
        handle = ctypes.c_void_p()
        check(library().meshrun_runtime_create_from_file(os.fsencode(path), ctypes.byref(handle)))
        return cls(handle)

    def close(self):
        """Destroys what was made from this runtime (waiting for operations
        in flight), then the runtime. Idempotent."""
        if not self._handle:
            return
        for child in list(self._children):
            child.close()
        for comm in self._comms.values():
            comm._invalidate()
        self._comms.clear()
        library().meshrun_runtime_destroy(self._handle)
        self._handle = None
        atexit.unregister(self.close)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        self.close()

    @property
    def handle(self):
        """The meshrun_runtime*; FAILED_PRECONDITION once closed."""
        if not self._handle:
            raise MeshrunError(FAILED_PRECONDITION, "the runtime is closed")
        return self._handle

    def adopt(self, child):
        """Records `child` (anything with close()) to be closed before the
        runtime is."""
        self._children.add(child)

    # ---- configuration and the mesh ----

    def override(self, assignment):
        """Applies one "key.path=value" override (before the mesh is built)."""
        check(library().meshrun_runtime_override(self.handle, assignment.encode()))

    def build_mesh(self, world_size, rank=0):
        """Resolves the mesh for `world_size` ranks, for planning."""
        check(library().meshrun_runtime_build_mesh(self.handle, world_size, rank))

    def _int_query(self, function, *args):
        out = ctypes.c_int64()
        check(function(self.handle, *args, ctypes.byref(out)))
        return out.value

    def axis_size(self, axis):
        return self._int_query(library().meshrun_mesh_axis_size, axis.encode())

    def axis_sizes(self):
        """{axis: size} for the mesh axes pp, dp_replicate, dp_shard, cp, tp."""
        return {axis: self.axis_size(axis) for axis in AXES}

    def coordinate(self, rank, axis):
        return self._int_query(library().meshrun_mesh_coordinate, rank, axis.encode())

    def group_count(self, axis):
        return self._int_query(library().meshrun_mesh_group_count, axis.encode())

    def _ranks(self, function, axis, which):
        size = self.axis_size(axis)
        ranks, count = (ctypes.c_int64 * size)(), ctypes.c_int64()
        check(function(self.handle, axis.encode(), which, ranks, size, ctypes.byref(count)))
        return list(ranks[: count.value])

    def group_ranks(self, axis, rank):
        """Ranks of the `axis` group that contains `rank`, in axis order."""
        return self._ranks(library().meshrun_mesh_group_ranks, axis, rank)

    def group_ranks_by_index(self, axis, group):
        return self._ranks(library().meshrun_mesh_group_ranks_by_index, axis, group)

    def groups(self, axis):
        """Every group of `axis`, numbered by lowest rank."""
        return [self.group_ranks_by_index(axis, g) for g in range(self.group_count(axis))]

    def _json(self, function, *args):
        out = ctypes.c_void_p()
        check(function(self.handle, *args, ctypes.byref(out)))
        try:
            return json.loads(ctypes.string_at(out.value).decode())
        finally:
            library().meshrun_string_destroy(out)

    def plan(self):
        """The plan as `meshrun plan --json` prints it."""
        return self._json(library().meshrun_runtime_plan_json)

    def estimate(self, hardware="cpu-this-machine", ranks_per_node=0):
        """The estimate `meshrun plan --estimate --json` prints under
        "estimate": per-rank memory and step time of the plan on `hardware`
        ("h100-sxm", "h200", "cpu-this-machine" or a profile .toml path),
        `ranks_per_node` ranks to a node (0: the profile's; every rank for
        cpu-this-machine)."""
        return self._json(library().meshrun_runtime_estimate_json, os.fsencode(hardware),
                          ranks_per_node)

    # ---- a rank of a running job (ABI 1.5) ----

    def join(self):
        """Joins the job this process runs in (collective over the job) and
        registers close() to run at exit."""
        check(library().meshrun_runtime_join(self.handle))
        atexit.register(self.close)
        rank, world, local = ctypes.c_int64(), ctypes.c_int64(), ctypes.c_int64()
        check(library().meshrun_runtime_rank(self.handle, ctypes.byref(rank), ctypes.byref(world),
                                              ctypes.byref(local)))
        self._rank = (rank.value, world.value, local.value)

    def _joined(self):
        if self._rank is None:
            # The library's own error: FAILED_PRECONDITION naming the cause.
            check(library().meshrun_runtime_rank(self.handle, None, None, None))
        return self._rank

    @property
    def rank(self):
        """This process's rank in the job."""
        return self._joined()[0]

    @property
    def world_size(self):
        return self._joined()[1]

    @property
    def local_rank(self):
        """The rank among this node's ranks (0 when the launcher does not say)."""
        return self._joined()[2]

    def train(self, output_dir=None, on_step=None):
        """Trains as `meshrun train` does, this process being one rank of
        the joined job (collective: every rank calls it), with this
        runtime's config: the model, strategy and schedule it names, its
        data, validation, checkpoints and the export at the end; rank 0
        writes metrics.jsonl, run.json and the export into `output_dir`
        (None: runs/<start time>).

        on_step(metrics) is called on every rank after each step with the
        step's metrics.jsonl object as a dict ("mem" is this rank's own);
        returning False stops the run after that step on every rank. An
        exception it raises stops the run too and is raised again here.
        Errors (bad config keys, a step whose loss is not finite, a failed
        peer) raise MeshrunError; the process never exits."""
        raised = []

        def step(_context, metrics_json):
            if raised:
                return 1
            try:
                return 0 if on_step(json.loads(metrics_json.decode())) is not False else 1
            except BaseException as error:  # re-raised once the run has ended
                raised.append(error)
                return 1

        callback = _capi.STEP_CALLBACK(step) if on_step is not None else _capi.STEP_CALLBACK()
        directory = None if output_dir is None else os.fsencode(output_dir)
        check(library().meshrun_run_train(self.handle, directory, callback, None))
        if raised:
            raise raised[0]

    def comm(self, axis="world"):
        """The communicator of `axis` ("world" or a mesh axis name)."""
        if axis not in self._comms:
            handle = ctypes.c_void_p()
            check(library().meshrun_runtime_comm(self.handle, axis.encode(),
                                                 ctypes.byref(handle)))
            self._comms[axis] = Comm(self, handle, axis)
        return self._comms[axis]


def _config_text_or_path(config):
    """(text, None) or (None, path): an os.PathLike is a path; a str is TOML
    text when it holds a newline, "=" or "[", else a path."""
    if config is None:
        return "", None
    if isinstance(config, os.PathLike):
        return None, config
    if any(c in config for c in "\n=["):
        return config, None
    return None, config


def _key_overrides(keys, prefix="distributed."):
    """{"strategy": "ddp", "mp_policy": {"param_dtype": "float32"}} ->
    ["distributed.strategy=ddp", "distributed.mp_policy.param_dtype=float32"]."""
    assignments = []
    for key, value in keys.items():
        if isinstance(value, dict):
            assignments += _key_overrides(value, f"{prefix}{key}.")
        elif isinstance(value, bool):
            assignments.append(f"{prefix}{key}={str(value).lower()}")
        else:
            assignments.append(f"{prefix}{key}={value}")
    return assignments


def plan(config=None, world_size=1, overrides=(), estimate=None, ranks_per_node=0, **keys):
    """The plan `meshrun plan CONFIG --world-size N --json` prints, as a
    dict, for a job of `world_size` ranks; with `estimate` a hardware
    profile ("h100-sxm", "h200", "cpu-this-machine", a .toml path) it
    carries "estimate" as `--estimate --hardware PROFILE` adds it.
    config, overrides and keys as init()'s; nothing joins a job."""
    text, path = _config_text_or_path(config)
    runtime = Runtime.from_text(text, "<plan>") if path is None else Runtime.from_file(path)
    with runtime:
        for assignment in list(overrides) + _key_overrides(keys):
            runtime.override(assignment)
        runtime.build_mesh(world_size, 0)
        result = runtime.plan()
        if estimate is not None:
            result["estimate"] = runtime.estimate(estimate, ranks_per_node)
        return result


def init(config=None, overrides=(), **keys):
    """Joins the running job as one rank and returns the joined Runtime.

    config: None (meshrun's defaults), a TOML file path, or TOML text (see
        _config_text_or_path). overrides: "key.path=value" assignments, as on
        the `meshrun train` command line. keys: [distributed] keys, applied
        after `overrides`: init(strategy="ddp") is the override
        "distributed.strategy=ddp"; a dict value names a sub-table,
        init(mp_policy={"param_dtype": "float32"}).

    Every rank of the job must call it (it is collective). Under `meshrun
    launch` or mpirun the rank and world size come from the launcher's
    environment; without a launcher the job is this one process.
    """
    text, path = _config_text_or_path(config)
    runtime = Runtime.from_text(text, "<init>") if path is None else Runtime.from_file(path)
    try:
        for assignment in list(overrides) + _key_overrides(keys):
            runtime.override(assignment)
        runtime.join()
    except BaseException:
        runtime.close()
        raise
    return runtime
