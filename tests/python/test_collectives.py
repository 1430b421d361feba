"""The Python package's collectives, run inside every rank of a job:

    meshrun launch --nproc-per-node N -- /usr/bin/python3 tests/python/test_collectives.py

Every rank builds every rank's input from (rank, size) and checks its result
against numpy's reduction of them: every op, on numpy arrays and torch
tensors, float32, bfloat16 (torch), int32 and int64, blocking and
asynchronous. Inputs are small integers, exact in every dtype (bfloat16
holds integers up to 256 exactly; sums over 4 ranks stay below that), so
results must match exactly. Then bad tensors (refused before any
communication, with INVALID_ARGUMENT naming the problem) and the lifecycle
errors of a joined runtime. All ranks run the same tests in the same order,
so their collectives match; a short comm timeout turns a hang into an error.
"""

import ctypes
import gc
import os
import sys
import unittest
import weakref

import numpy
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
import meshrun  # noqa: E402

JOB = None


def setUpModule():
    global JOB
    JOB = meshrun.init(overrides=["comm.timeout_minutes=0.5"], strategy="ddp")


NUMPY_DTYPES = {"float32": numpy.float32, "int32": numpy.int32, "int64": numpy.int64}
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int32": torch.int32,
                "int64": torch.int64}


def rank_input(rank, numel):
    """Rank `rank`'s input: small positive integers, as float64."""
    return (numpy.arange(numel) % 7 + 3 * rank + 1).astype(numpy.float64)


class Arrays:
    """Makes arrays of one library and dtype, and reads them back as float64."""

    def __init__(self, library, dtype):
        self.library, self.dtype = library, dtype

    def make(self, values):
        if self.library == "numpy":
            return numpy.array(values, dtype=NUMPY_DTYPES[self.dtype])
        return torch.tensor(values, dtype=TORCH_DTYPES[self.dtype])

    def empty(self, numel):
        return self.make(numpy.zeros(numel))

    @staticmethod
    def values(array):
        if isinstance(array, torch.Tensor):
            return array.to(torch.float64).numpy()
        return array.astype(numpy.float64)


def cases():
    for dtype in NUMPY_DTYPES:
        yield Arrays("numpy", dtype)
    for dtype in TORCH_DTYPES:
        yield Arrays("torch", dtype)


class Collectives(unittest.TestCase):
    def setUp(self):
        self.comm = JOB.comm("world")
        self.rank, self.size = self.comm.rank, self.comm.size

    def finish(self, result, async_op):
        """Waits for an asynchronous call's Op (a blocking call returns None)."""
        if async_op:
            self.assertIsInstance(result, meshrun.Op)
            result.wait()
            self.assertTrue(result.test())
        else:
            self.assertIsNone(result)

    def each(self):
        """(case, async_op) pairs, each labelled as a subTest."""
        for arrays in cases():
            for async_op in (False, True):
                with self.subTest(library=arrays.library, dtype=arrays.dtype, async_op=async_op):
                    yield arrays, async_op

    def test_all_reduce(self):
        inputs = numpy.stack([rank_input(r, 10) for r in range(self.size)])
        expected = {"sum": inputs.sum(0), "max": inputs.max(0),
                    "avg": None}  # avg: float mean, integer division for integers
        for arrays, async_op in self.each():
            for op in ("sum", "avg", "max"):
                want = expected[op]
                if op == "avg":
                    want = (inputs.sum(0) // self.size if arrays.dtype.startswith("int")
                            else inputs.sum(0) / self.size)
                if arrays.dtype == "bfloat16" and op == "avg":
                    want = torch.tensor(want).to(torch.bfloat16).to(torch.float64).numpy()
                in_place = arrays.make(rank_input(self.rank, 10))
                self.finish(self.comm.all_reduce(in_place, op=op, async_op=async_op), async_op)
                numpy.testing.assert_array_equal(Arrays.values(in_place), want, op)
                send, recv = arrays.make(rank_input(self.rank, 10)), arrays.empty(10)
                self.finish(self.comm.all_reduce(send, op=op, recv=recv, async_op=async_op),
                            async_op)
                numpy.testing.assert_array_equal(Arrays.values(recv), want, op)
                numpy.testing.assert_array_equal(Arrays.values(send), rank_input(self.rank, 10))

    def test_all_gather(self):
        expected = numpy.concatenate([rank_input(r, 6) for r in range(self.size)])
        for arrays, async_op in self.each():
            recv = arrays.empty(6 * self.size)
            self.finish(self.comm.all_gather(arrays.make(rank_input(self.rank, 6)), recv,
                                             async_op=async_op), async_op)
            numpy.testing.assert_array_equal(Arrays.values(recv), expected)

    def test_reduce_scatter(self):
        numel, mine = 4 * self.size, slice(4 * self.rank, 4 * (self.rank + 1))
        expected = {"sum": sum(rank_input(r, numel) for r in range(self.size))[mine],
                    "max": rank_input(self.size - 1, numel)[mine]}  # inputs grow with the rank
        for arrays, async_op in self.each():
            for op, want in expected.items():
                recv = arrays.empty(4)
                self.finish(self.comm.reduce_scatter(arrays.make(rank_input(self.rank, numel)),
                                                     recv, op=op, async_op=async_op), async_op)
                numpy.testing.assert_array_equal(Arrays.values(recv), want, op)

    def test_all_to_all_with_uneven_counts(self):
        # Rank r sends s + r + 1 elements to rank s: every pair a different
        # count; a block's values say who sent it and its position.
        def count(sender, receiver):
            return receiver + sender + 1

        def block(sender, receiver):
            start = 100 * sender + 10 * receiver
            return numpy.arange(start, start + count(sender, receiver), dtype=numpy.float64)

        send_counts = [count(self.rank, r) for r in range(self.size)]
        recv_counts = [count(r, self.rank) for r in range(self.size)]
        outgoing = numpy.concatenate([block(self.rank, r) for r in range(self.size)])
        expected = numpy.concatenate([block(r, self.rank) for r in range(self.size)])
        for arrays, async_op in self.each():
            recv = arrays.empty(sum(recv_counts))
            self.finish(self.comm.all_to_all(arrays.make(outgoing), send_counts, recv,
                                             recv_counts, async_op=async_op), async_op)
            numpy.testing.assert_array_equal(Arrays.values(recv), expected)

    def test_all_to_all_refuses_counts_of_the_wrong_length(self):
        with self.assertRaises(meshrun.MeshrunError) as caught:
            self.comm.all_to_all(numpy.zeros(2, numpy.float32), [1], numpy.zeros(2, numpy.float32),
                                 [1])
        self.assertEqual(caught.exception.code, meshrun.INVALID_ARGUMENT)
        self.assertIn("send_counts", caught.exception.message)

    def test_broadcast_from_the_last_rank(self):
        root = self.size - 1
        for arrays, async_op in self.each():
            tensor = arrays.make(rank_input(self.rank, 5))
            self.finish(self.comm.broadcast(tensor, root=root, async_op=async_op), async_op)
            numpy.testing.assert_array_equal(Arrays.values(tensor), rank_input(root, 5))

    def test_send_recv_around_a_ring(self):
        after, before = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        for arrays, async_op in self.each():
            outgoing, incoming = arrays.make(rank_input(self.rank, 3)), arrays.empty(3)
            if async_op:
                ops = [self.comm.recv(incoming, before, tag=5, async_op=True),
                       self.comm.send(outgoing, after, tag=5, async_op=True)]
                for op in ops:
                    self.finish(op, True)
            elif self.rank % 2 == 0:
                self.assertIsNone(self.comm.send(outgoing, after, tag=5))
                self.assertIsNone(self.comm.recv(incoming, before, tag=5))
            else:
                self.assertIsNone(self.comm.recv(incoming, before, tag=5))
                self.assertIsNone(self.comm.send(outgoing, after, tag=5))
            numpy.testing.assert_array_equal(Arrays.values(incoming), rank_input(before, 3))

    def test_barrier(self):
        self.assertIsNone(self.comm.barrier())
        self.finish(self.comm.barrier(async_op=True), True)

    def test_multidimensional_tensors_and_axis_communicators(self):
        dp = JOB.comm("dp")
        self.assertEqual((dp.rank, dp.size), (self.rank, self.size))
        self.assertEqual(JOB.comm("tp").size, 1)
        matrix = torch.arange(12, dtype=torch.float32).reshape(3, 4) + self.rank
        dp.all_reduce(matrix)
        want = (numpy.arange(12).reshape(3, 4) * self.size + sum(range(self.size)))
        numpy.testing.assert_array_equal(matrix.numpy(), want)

    def test_async_op_keeps_its_arrays_alive_until_waited(self):
        array = numpy.ones(1000, numpy.float32)
        alive = weakref.ref(array)
        op = self.comm.all_reduce(array, async_op=True)
        del array
        gc.collect()
        self.assertIsNotNone(alive())
        numpy.testing.assert_array_equal(alive(), numpy.full(1000, self.size, numpy.float32))
        op.wait()
        gc.collect()
        self.assertIsNone(alive())

    def test_float32_random_values(self):
        generator = numpy.random.default_rng(self.rank)
        mine = generator.standard_normal(1000).astype(numpy.float32)
        everyone = numpy.zeros((self.size, 1000), numpy.float32)
        self.comm.all_gather(mine, everyone)
        numpy.testing.assert_array_equal(everyone[self.rank], mine)
        total = torch.from_numpy(mine.copy())
        self.comm.all_reduce(total, op="avg")
        numpy.testing.assert_allclose(total.numpy(), everyone.mean(0), rtol=1e-5, atol=1e-6)


class BadTensors(unittest.TestCase):
    """Refused on the Python side, before anything is sent."""

    def setUp(self):
        self.comm = JOB.comm("world")

    def assert_invalid(self, call, *needles):
        with self.assertRaises(meshrun.MeshrunError) as caught:
            call()
        self.assertEqual(caught.exception.code, meshrun.INVALID_ARGUMENT)
        for needle in needles:
            self.assertIn(needle, caught.exception.message)

    def test_non_contiguous(self):
        self.assert_invalid(lambda: self.comm.all_reduce(numpy.zeros(8, numpy.float32)[::2]),
                            "all_reduce: send", "not contiguous")
        self.assert_invalid(lambda: self.comm.broadcast(torch.zeros(3, 4).t()),
                            "broadcast: tensor", "not contiguous")

    def test_wrong_dtype(self):
        self.assert_invalid(lambda: self.comm.all_reduce(numpy.zeros(4)),
                            "all_reduce: send", "dtype", "float32, bfloat16")
        self.assert_invalid(lambda: self.comm.send(torch.zeros(4, dtype=torch.uint8), 0),
                            "send: tensor", "dtype")
        self.assert_invalid(lambda: self.comm.all_reduce(
            numpy.zeros(4, numpy.float32), recv=numpy.zeros(4, numpy.int32)),
            "all_reduce", "recv's dtype differs")

    def test_not_exportable(self):
        self.assert_invalid(lambda: self.comm.all_reduce([1.0, 2.0]), "send", "__dlpack__")
        readonly = numpy.zeros(4, numpy.float32)
        readonly.setflags(write=False)
        self.assert_invalid(lambda: self.comm.all_reduce(readonly), "send", "readonly")

    def test_wrong_op(self):
        self.assert_invalid(lambda: self.comm.all_reduce(numpy.zeros(4, numpy.float32), op="min"),
                            "'min'")

    def test_wrong_shape_is_the_backends_invalid_argument(self):
        self.assert_invalid(lambda: self.comm.all_gather(numpy.zeros(4, numpy.float32),
                                                         numpy.zeros(3, numpy.float32)))


class Lifecycle(unittest.TestCase):
    def assert_code(self, code, call, *needles):
        with self.assertRaises(meshrun.MeshrunError) as caught:
            call()
        self.assertEqual(caught.exception.code, code, caught.exception.message)
        for needle in needles:
            self.assertIn(needle, caught.exception.message)

    def test_job_queries(self):
        size = JOB.world_size
        self.assertEqual(size, int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1")))
        self.assertEqual(JOB.rank, int(os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
        self.assertEqual(JOB.local_rank, JOB.rank)
        # ddp replicates over every rank (AutoModel: DDP is dp_replicate).
        self.assertEqual(JOB.axis_sizes(), {"pp": 1, "dp_replicate": size, "dp_shard": 1,
                                            "cp": 1, "tp": 1})

    def test_join_twice_override_after_join(self):
        self.assert_code(meshrun.FAILED_PRECONDITION, JOB.join, "already built")
        self.assert_code(meshrun.FAILED_PRECONDITION,
                         lambda: JOB.override("distributed.tp_size=1"), "already built")
        self.assert_code(meshrun.FAILED_PRECONDITION, lambda: JOB.build_mesh(2, 0))

    def test_unknown_axis_is_not_found(self):
        self.assert_code(meshrun.NOT_FOUND, lambda: JOB.comm("dq"), "dq")

    def test_strategy_buffers_on_a_gpu_are_named_not_read(self):
        # This runtime's comm backend (mpi) moves host memory: buffers that
        # say they are on CUDA device 0 are refused before anything reads them.
        values = numpy.zeros(4, numpy.float32)
        borrowed = [meshrun.dlpack.borrow(values, name, ("float32",), (meshrun.dlpack.CPU,))
                    for name in ("parameters", "gradients")]
        on_gpu = [meshrun.dlpack.DLTensor.from_buffer_copy(b.tensor) for b in borrowed]
        for tensor in on_gpu:
            tensor.device.device_type = 2  # kDLCUDA
        names = (ctypes.c_char_p * 1)(b"w")
        params = meshrun._capi.StrategyParameters(
            struct_size=ctypes.sizeof(meshrun._capi.StrategyParameters), num_parameters=1,
            names=names, numels=(ctypes.c_int64 * 1)(4), rows=(ctypes.c_int64 * 1)(1),
            units=(ctypes.c_int32 * 1)(0), num_units=1, root_unit=0, parameters=on_gpu[0],
            gradients=on_gpu[1])
        out = ctypes.c_void_p()
        self.assert_code(meshrun.INVALID_ARGUMENT, lambda: meshrun._capi.check(
            meshrun.library().meshrun_strategy_create(JOB.handle, ctypes.byref(params),
                                                      ctypes.byref(out))),
            "meshrun_strategy_create: params->parameters: is on device type 2 id 0, but the "
            "runtime's buffers are on the CPU (the comm backend's device)")
        self.assertFalse(out)

    def test_strategy_misuse(self):
        params, grads = numpy.zeros(6, numpy.float32), numpy.zeros(6, numpy.float32)
        self.assert_code(meshrun.INVALID_ARGUMENT, lambda: meshrun.Strategy(
            JOB, params, grads, ["a", "b"], [(2,), (2,)]), "parameters", "4 elements")
        self.assert_code(meshrun.INVALID_ARGUMENT, lambda: meshrun.Strategy(
            JOB, params.astype(numpy.float64), grads, ["a"], [(6,)]), "parameters: dtype")
        strategy = meshrun.Strategy(JOB, params, grads, ["a", "b"], [(2, 2), (2,)])
        self.assertFalse(strategy.sharded)
        self.assertEqual(strategy.shard_segments(),
                         [meshrun.Segment(0, 0, 0, 4), meshrun.Segment(1, 4, 4, 2)])
        self.assert_code(meshrun.FAILED_PRECONDITION, strategy.finish_gradients)
        self.assert_code(meshrun.FAILED_PRECONDITION, lambda: strategy.gradient_ready(0))
        self.assert_code(meshrun.UNIMPLEMENTED, lambda: strategy.unit_views(0))
        strategy.begin_micro_batch(sync=True)
        self.assert_code(meshrun.OUT_OF_RANGE, lambda: strategy.gradient_ready(2))
        strategy.gradient_ready(0)
        strategy.gradient_ready(1)
        strategy.finish_gradients()
        strategy.close()
        self.assert_code(meshrun.FAILED_PRECONDITION, strategy.finish_gradients, "closed")

    def test_z_closed_runtime(self):
        """Last (tests run in name order): closing ends the job's communicators."""
        comm = JOB.comm("world")
        op = comm.barrier(async_op=True)
        JOB.close()
        self.assertFalse(op._handle)  # closed with the runtime, after completing
        self.assert_code(meshrun.FAILED_PRECONDITION, comm.barrier, "closed")
        self.assert_code(meshrun.FAILED_PRECONDITION, lambda: JOB.comm("world"), "closed")


if __name__ == "__main__":
    unittest.main(verbosity=1)
