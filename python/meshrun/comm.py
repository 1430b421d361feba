"""Collectives and point-to-point transfers on numpy arrays and torch tensors
(anything with __dlpack__), on the communicator of one mesh axis.

Semantics are meshrun/comm.h's: every rank of the communicator issues its
collectives in the same order; all_gather concatenates every rank's send in
rank order (numel(recv) = size * numel(send)); reduce_scatter leaves chunk
`rank` of the reduction (numel(send) = size * numel(recv)); "avg" divides
the sum by the size (integer division for int32/int64). Tensors must be
contiguous, on the backend's device (CPU for comm.backend = "mpi"), of dtype
float32, bfloat16, float16, int32 or int64; the Python side checks each
tensor before the call and raises MeshrunError INVALID_ARGUMENT naming it.

Blocking calls return None once the operation is done. With async_op=True a
call returns an Op at once; the tensors' memory must not be touched until
Op.wait() returns (the Op keeps the arrays alive until then).
"""

import ctypes

from . import dlpack
from ._capi import check, library
from .errors import FAILED_PRECONDITION, INVALID_ARGUMENT, MeshrunError

REDUCE_OPS = {"sum": 0, "avg": 1, "max": 2}


def _reduce_op(op):
    if op not in REDUCE_OPS:
        raise MeshrunError(INVALID_ARGUMENT,
                           f"op {op!r} is not one of {', '.join(map(repr, REDUCE_OPS))}")
    return REDUCE_OPS[op]


class Op:
    """An operation in flight (meshrun_op). wait() completes it; test()
    polls. Holds the tensors it works on until it is done and released."""

    def __init__(self, runtime, handle, what, tensors):
        self._handle = handle
        self._what = what
        self._tensors = tensors  # Borrowed: the arrays and their DLPack capsules
        runtime.adopt(self)

    def wait(self, timeout=None):
        """Blocks until done; timeout in seconds (None: the config's
        comm.timeout_minutes). On expiry raises DEADLINE_EXCEEDED and the
        operation stays in flight (wait again, or close())."""
        if self._handle is None:
            return
        check(library().meshrun_op_wait(self._handle, -1.0 if timeout is None else timeout))
        self.close()

    def test(self):
        """True when the operation is done (then wait() returns at once)."""
        if self._handle is None:
            return True
        done = ctypes.c_int32()
        check(library().meshrun_op_test(self._handle, ctypes.byref(done)))
        return bool(done.value)

    def close(self):
        """Releases the operation, first waiting for it (up to the comm
        timeout) if it is still in flight; then lets go of its tensors."""
        if self._handle is not None:
            library().meshrun_op_destroy(self._handle)
            self._handle = None
            self._tensors = None

    def __del__(self):
        self.close()

    def __repr__(self):
        return f"<meshrun.Op {self._what} {'in flight' if self._handle else 'done'}>"


class Comm:
    """The communicator of one axis of a joined Runtime (runtime.comm(axis));
    valid until the runtime is closed."""

    def __init__(self, runtime, handle, axis):
        self._runtime = runtime
        self._handle = handle
        self.axis = axis
        self.rank = self._query(library().meshrun_comm_rank)
        self.size = self._query(library().meshrun_comm_size)

    def _invalidate(self):
        self._handle = None

    @property
    def handle(self):
        if not self._handle:
            raise MeshrunError(FAILED_PRECONDITION,
                               f"communicator '{self.axis}': its runtime is closed")
        return self._handle

    def _query(self, function):
        out = ctypes.c_int64()
        check(function(self.handle, ctypes.byref(out)))
        return out.value

    def _run(self, what, async_op, tensors, call):
        """Runs `call(out_op)`; returns an Op holding `tensors` when async_op."""
        if not async_op:
            check(call(None))
            return None
        handle = ctypes.c_void_p()
        check(call(ctypes.byref(handle)))
        return Op(self._runtime, handle, f"{what} on '{self.axis}'", tensors)

    def _send_recv(self, send, recv, what):
        """Borrowed send and recv (the same struct when recv is None or the
        same object: in place), checked to agree in dtype and device."""
        sent = dlpack.borrow(send, f"{what}: send")
        if recv is None or recv is send:
            return sent, sent
        received = dlpack.borrow(recv, f"{what}: recv")
        for name, of in (("dtype", lambda t: dlpack.dtype_name(t.dtype)), ("device", _device)):
            if of(sent.tensor) != of(received.tensor):
                raise MeshrunError(INVALID_ARGUMENT, f"{what}: recv's {name} differs from send's")
        return sent, received

    def all_reduce(self, tensor, op="sum", recv=None, async_op=False):
        """recv = op over the ranks of `tensor`; in place when recv is None."""
        code = _reduce_op(op)
        sent, received = self._send_recv(tensor, recv, "all_reduce")
        return self._run("all_reduce", async_op, (sent, received), lambda out: library(
        ).meshrun_all_reduce(self.handle, sent.pointer, received.pointer, code, out))

    def all_gather(self, send, recv, async_op=False):
        """recv = every rank's send, concatenated in rank order."""
        sent, received = self._send_recv(send, recv, "all_gather")
        return self._run("all_gather", async_op, (sent, received), lambda out: library(
        ).meshrun_all_gather(self.handle, sent.pointer, received.pointer, out))

    def reduce_scatter(self, send, recv, op="sum", async_op=False):
        """recv = chunk `rank` of op over the ranks of send."""
        code = _reduce_op(op)
        sent, received = self._send_recv(send, recv, "reduce_scatter")
        return self._run("reduce_scatter", async_op, (sent, received), lambda out: library(
        ).meshrun_reduce_scatter(self.handle, sent.pointer, received.pointer, code, out))

    def all_to_all(self, send, send_counts, recv, recv_counts, async_op=False):
        """Rank r gets send_counts[r] elements of `send` (the blocks packed in
        rank order) and this rank receives recv_counts[r] elements from rank
        r into `recv`, likewise; recv_counts[r] must be rank r's
        send_counts[this rank] (exchange the counts first, e.g. with an
        all_to_all of one count per rank). For expert and context
        parallelism in Python."""
        size = self.size
        counts = []
        for name, values in (("send_counts", send_counts), ("recv_counts", recv_counts)):
            values = [int(v) for v in values]
            if len(values) != size:
                raise MeshrunError(INVALID_ARGUMENT, f"all_to_all: {name} has {len(values)} "
                                   f"entries, the communicator {size} ranks")
            counts.append((ctypes.c_int64 * size)(*values))
        sent, received = self._send_recv(send, recv, "all_to_all")
        if received is sent:
            raise MeshrunError(INVALID_ARGUMENT, "all_to_all: send and recv must differ")
        return self._run("all_to_all", async_op, (sent, received, *counts), lambda out: library(
        ).meshrun_all_to_all(self.handle, sent.pointer, counts[0], received.pointer, counts[1],
                             out))

    def broadcast(self, tensor, root=0, async_op=False):
        """`tensor` on every rank = `tensor` on rank `root` of this communicator."""
        t = dlpack.borrow(tensor, "broadcast: tensor")
        return self._run("broadcast", async_op, (t,), lambda out: library().meshrun_broadcast(
            self.handle, t.pointer, root, out))

    def send(self, tensor, peer, tag=0, async_op=False):
        """Sends `tensor` to rank `peer`; matches peer's recv of the same tag."""
        t = dlpack.borrow(tensor, "send: tensor")
        return self._run("send", async_op, (t,), lambda out: library().meshrun_send(
            self.handle, t.pointer, peer, tag, out))

    def recv(self, tensor, peer, tag=0, async_op=False):
        """Receives into `tensor` from rank `peer`."""
        t = dlpack.borrow(tensor, "recv: tensor")
        return self._run("recv", async_op, (t,), lambda out: library().meshrun_recv(
            self.handle, t.pointer, peer, tag, out))

    def barrier(self, async_op=False):
        """Done when every rank of the communicator has entered it."""
        return self._run("barrier", async_op, (), lambda out: library().meshrun_barrier(
            self.handle, out))

    def __repr__(self):
        return f"<meshrun.Comm '{self.axis}' rank {self.rank} of {self.size}>"


def _device(tensor):
    return (tensor.device.device_type, tensor.device.device_id)
