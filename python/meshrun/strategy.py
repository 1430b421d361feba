"""The configured strategy (distributed.strategy: "ddp" or "fsdp2") over a
model's parameters held in two flat float32 CPU buffers, as host.h's
meshrun_strategy_* functions drive it.

The caller computes the model; the strategy decides where parameters live
and when gradients are communicated (meshrun/strategy.h). Per step, per
micro-batch: begin_micro_batch(sync) (sync=True on the step's last), the
forward and backward — a replicated strategy (ddp) wants gradient_ready(p)
as each parameter's gradient becomes final; a sharded one (fsdp2) wants
pre_forward(u)/post_forward(u) and pre_backward(u)/post_backward(u) around
each unit, the root unit's first and last, and the caller reads and writes
the unit's gathered parameters and gradients through unit_views(u) — then,
after the last backward, finish_gradients(). The optimizer then updates
local_shard(): the caller's whole buffers under ddp, this rank's shard
under fsdp2, whose gradients hold the step's data-parallel average.

Views the strategy hands out (unit_views, local_shard) are numpy arrays over
the strategy's memory, not copies; they are valid as host.h says (a unit's
until its next post_forward or post_backward, the local shard's until the
strategy is closed).
"""

import collections
import ctypes
import math
import os

import numpy

from . import dlpack
from ._capi import StrategyParameters, StrategySegment, check, library
from .errors import FAILED_PRECONDITION, MeshrunError

Segment = collections.namedtuple("Segment", "parameter global_begin local_begin count")
Segment.__doc__ = """Elements [global_begin, global_begin + count) of the flat layout (parameter
`parameter`) are elements [local_begin, local_begin + count) of the local shard."""


def _float32_view(tensor, owner):
    """A numpy float32 array over a strategy-owned 1-D DLTensor (None when
    its data is NULL); it keeps `owner` (the Strategy) referenced."""
    if not tensor.data:
        return None
    buffer = (ctypes.c_float * tensor.shape[0]).from_address(tensor.data + tensor.byte_offset)
    buffer.owner = owner
    return numpy.frombuffer(buffer, dtype=numpy.float32)


class Strategy:
    """meshrun_strategy over the caller's flat float32 CPU buffers.

    runtime: a joined Runtime. parameters, gradients: 1-D float32 arrays of
    every parameter (numpy or torch), parameter i at [offsets[i],
    offsets[i+1]) with offsets cumulative over `shapes`; the initial values
    are data-parallel rank 0's. A replicated strategy works in both buffers
    until closed (this object keeps them referenced); a sharded one copies
    its shard out during creation. names: one per parameter (checkpoints use
    them). units: the unit of each parameter (default: one unit, the root);
    root_unit: the unit enclosing the others, which are layers numbered in
    forward order. Collective over the data-parallel ranks.
    """

    def __init__(self, runtime, parameters, gradients, names, shapes, units=None, root_unit=0,
                 num_units=None):
        count = len(names)
        if len(shapes) != count or (units is not None and len(units) != count):
            raise ValueError("names, shapes and units must have one entry per parameter")
        units = [0] * count if units is None else list(units)
        numels = [math.prod(shape) for shape in shapes]
        self.names = list(names)
        self.shapes = [tuple(shape) for shape in shapes]
        self.offsets = [0]
        for numel in numels:
            self.offsets.append(self.offsets[-1] + numel)
        self._runtime = runtime
        self._handle = None
        flat = (dlpack.borrow(parameters, "parameters", ("float32",), (dlpack.CPU,)),
                dlpack.borrow(gradients, "gradients", ("float32",), (dlpack.CPU,)))

        encoded = [name.encode() for name in names]
        c_names = (ctypes.c_char_p * count)(*encoded)
        c_numels = (ctypes.c_int64 * count)(*numels)
        c_rows = (ctypes.c_int64 * count)(*[shape[0] if shape else 1 for shape in shapes])
        c_units = (ctypes.c_int32 * count)(*units)
        params = StrategyParameters(
            struct_size=ctypes.sizeof(StrategyParameters), num_parameters=count, names=c_names,
            numels=c_numels, rows=c_rows, units=c_units,
            num_units=max(units) + 1 if num_units is None else num_units, root_unit=root_unit,
            parameters=flat[0].tensor, gradients=flat[1].tensor)
        handle = ctypes.c_void_p()
        check(library().meshrun_strategy_create(runtime.handle, ctypes.byref(params),
                                                ctypes.byref(handle)))
        self._handle = handle
        runtime.adopt(self)
        sharded = ctypes.c_int32()
        check(library().meshrun_strategy_sharded(self._handle, ctypes.byref(sharded)))
        self.sharded = bool(sharded.value)
        # A replicated strategy keeps working in the caller's buffers.
        self._buffers = None if self.sharded else flat
        self._local = None

    @property
    def handle(self):
        if not self._handle:
            raise MeshrunError(FAILED_PRECONDITION, "the strategy is closed")
        return self._handle

    @property
    def numel(self):
        """Elements of every parameter (the flat layout's length)."""
        return self.offsets[-1]

    def close(self):
        """Destroys the strategy; its views become invalid. Idempotent."""
        if self._handle:
            library().meshrun_strategy_destroy(self._handle)
            self._handle = None
            self._buffers = None
            self._local = None

    def __del__(self):
        self.close()

    def _call(self, name, *args):
        check(getattr(library(), name)(self.handle, *args))

    # ---- the hooks ----

    def broadcast_parameters(self):
        """Makes every replica equal to data-parallel rank 0's parameters."""
        self._call("meshrun_strategy_broadcast_parameters")

    def begin_micro_batch(self, sync=True):
        self._call("meshrun_strategy_begin_micro_batch", 1 if sync else 0)

    def gradient_ready(self, parameter):
        """Parameter `parameter`'s gradient is final for this backward."""
        self._call("meshrun_strategy_gradient_ready", parameter)

    def finish_gradients(self):
        self._call("meshrun_strategy_finish_gradients")

    def pre_forward(self, unit):
        self._call("meshrun_strategy_pre_forward", unit)

    def post_forward(self, unit):
        self._call("meshrun_strategy_post_forward", unit)

    def pre_backward(self, unit):
        self._call("meshrun_strategy_pre_backward", unit)

    def post_backward(self, unit):
        self._call("meshrun_strategy_post_backward", unit)

    def unit_views(self, unit):
        """(parameters, gradients) of a gathered unit: its parameters in
        index order, contiguous; gradients None outside its backward."""
        parameters, gradients = dlpack.DLTensor(), dlpack.DLTensor()
        self._call("meshrun_strategy_unit_views", unit, ctypes.byref(parameters),
                   ctypes.byref(gradients))
        return _float32_view(parameters, self), _float32_view(gradients, self)

    # ---- the optimizer's side ----

    def local_shard(self):
        """(parameters, gradients): what this rank's optimizer updates."""
        if self._local is None:
            parameters, gradients = dlpack.DLTensor(), dlpack.DLTensor()
            self._call("meshrun_strategy_local_shard", ctypes.byref(parameters),
                       ctypes.byref(gradients))
            self._local = (_float32_view(parameters, self), _float32_view(gradients, self))
        return self._local

    def shard_segments(self):
        """The Segments of the local shard, in local order."""
        count = ctypes.c_int64()
        self._call("meshrun_strategy_shard_segments", None, 0, ctypes.byref(count))
        segments = (StrategySegment * count.value)()
        self._call("meshrun_strategy_shard_segments", segments, count.value, ctypes.byref(count))
        return [Segment(s.parameter, s.global_begin, s.local_begin, s.count) for s in segments]

    def gradient_norm_squared(self):
        """The squared L2 norm of the whole gradient (collective)."""
        out = ctypes.c_double()
        self._call("meshrun_strategy_gradient_norm_squared", ctypes.byref(out))
        return out.value

    def memory_use(self):
        """(buffers, buffers_peak, buffers_reserved): the bytes the strategy
        holds now, the most since it was made, and those plus its cache."""
        values = [ctypes.c_int64() for _ in range(3)]
        self._call("meshrun_strategy_memory_use", *(ctypes.byref(v) for v in values))
        return tuple(v.value for v in values)

    def gather_parameters(self, out=None):
        """Every parameter, in the flat layout, into `out` (a float32 array
        of numel elements, allocated when None); collective, outside a step."""
        if out is None:
            out = numpy.empty(self.numel, dtype=numpy.float32)
        full = dlpack.borrow(out, "out", ("float32",), (dlpack.CPU,))
        self._call("meshrun_strategy_gather_parameters", full.pointer)
        return out

    # ---- checkpoints ----

    @staticmethod
    def _named(buffers):
        """(count, names, DLTensor array, Borrowed list to keep alive during the call)."""
        buffers = dict(buffers or {})
        names = (ctypes.c_char_p * len(buffers))(*[n.encode() for n in buffers])
        borrowed = [dlpack.borrow(b, f"buffer '{n}'", ("float32",), (dlpack.CPU,))
                    for n, b in buffers.items()]
        tensors = (dlpack.DLTensor * len(borrowed))(*[b.tensor for b in borrowed])
        return len(buffers), names, tensors, borrowed

    def save_checkpoint(self, directory, step, buffers=None):
        """Writes a sharded checkpoint (meshrun train's format) of the local
        shard's parameters and `buffers` ({name: float32 array of the local
        shard's length}, e.g. optimizer moments) into `directory`.
        Collective over the job."""
        count, names, tensors, _alive = self._named(buffers)
        self._call("meshrun_strategy_save_checkpoint", os.fsencode(directory), step, count, names,
                   tensors)

    def load_checkpoint(self, directory, buffers=None):
        """Loads a checkpoint of any world size and strategy over the same
        parameters into the local shard and `buffers`; returns its step."""
        count, names, tensors, _alive = self._named(buffers)
        step = ctypes.c_int64()
        self._call("meshrun_strategy_load_checkpoint", os.fsencode(directory), count, names,
                   tensors, ctypes.byref(step))
        return step.value
