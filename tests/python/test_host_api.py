"""The host C API through the Python package (python/meshrun), in one process
that never joins a job: planning queries, and the lifecycle errors of the
calls that need a joined runtime.

Coordinates and groups are checked against an independent enumeration of the
row-major (pp, dp_replicate, dp_shard, cp, tp) rank grid; meshrun.plan() and
its estimate against `meshrun plan --json`.
Run by ctest with /usr/bin/python3: test_host_api.py MESHRUN_EXE;
MESHRUN_LIBRARY names libmeshrun.so.
"""

import ctypes
import itertools
import json
import os
import subprocess
import sys
import unittest

import numpy

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "python"))
import meshrun  # noqa: E402

AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
FLATTENED = {"dp": ("dp_replicate", "dp_shard"), "dp_shard_cp": ("dp_shard", "cp"),
             "dp_cp": ("dp_replicate", "dp_shard", "cp")}

HSDP_CONFIG = """
[distributed]
strategy = "fsdp2"
pp_size = 2
dp_replicate_size = 2
tp_size = 2
ep_size = 4

[distributed.pipeline]

[distributed.moe]
"""


def enumerate_grid(shape):
    """rank -> {axis: index} by nested loops, tp fastest."""
    coords = {}
    for rank, index in enumerate(itertools.product(*(range(shape[a]) for a in AXES))):
        coord = dict(zip(AXES, index))
        for name, parts in FLATTENED.items():
            flat = 0
            for part in parts:
                flat = flat * shape[part] + coord[part]
            coord[name] = flat
        coords[rank] = coord
    return coords


def oracle_group(coords, axis, rank):
    """Ranks that differ from `rank` only along `axis`, in axis order."""
    parts = FLATTENED.get(axis, (axis,))
    fixed = [a for a in AXES if a not in parts]
    members = [r for r, c in coords.items() if all(c[a] == coords[rank][a] for a in fixed)]
    return sorted(members, key=lambda r: coords[r][axis])


class HostApiTest(unittest.TestCase):
    def test_versions(self):
        self.assertEqual(meshrun.abi_version(), (1, 14))
        self.assertRegex(meshrun.library_version(), r"^\d+\.\d+\.\d+$")

    def test_hsdp_pipeline_moe_mesh_matches_enumeration(self):
        with meshrun.Runtime.from_text(HSDP_CONFIG, "hsdp.toml") as rt:
            rt.build_mesh(world_size=32, rank=3)
            shape = {axis: rt.axis_size(axis) for axis in AXES}
            self.assertEqual(shape, {"pp": 2, "dp_replicate": 2, "dp_shard": 4, "cp": 1, "tp": 2})
            self.assertEqual(rt.axis_size("dp"), 8)
            self.assertEqual(rt.axis_size("dp_cp"), 8)
            self.assertEqual((rt.axis_size("ep_shard"), rt.axis_size("ep")), (4, 4))
            coords = enumerate_grid(shape)
            for rank in range(32):
                for axis in AXES + tuple(FLATTENED):
                    self.assertEqual(rt.coordinate(rank, axis), coords[rank][axis], (rank, axis))
                    self.assertEqual(rt.group_ranks(axis, rank), oracle_group(coords, axis, rank))
                local = rank % 16
                self.assertEqual(rt.coordinate(rank, "ep"), local % 4)
                self.assertEqual(rt.coordinate(rank, "ep_shard"), local // 4)

    def test_every_group_of_every_axis_partitions_the_world(self):
        with meshrun.Runtime.from_text(HSDP_CONFIG) as rt:
            rt.build_mesh(32, 0)
            for axis in AXES + tuple(FLATTENED) + ("ep_shard", "ep"):
                groups = rt.groups(axis)
                self.assertEqual(len(groups), 32 // rt.axis_size(axis))
                self.assertEqual(sorted(r for g in groups for r in g), list(range(32)), axis)
                self.assertEqual([g[0] for g in groups], sorted(min(g) for g in groups))

    def test_plan_json(self):
        with meshrun.Runtime.from_text(HSDP_CONFIG) as rt:
            rt.build_mesh(32, 0)
            plan = rt.plan()
        self.assertEqual(plan["world_size"], 32)
        self.assertEqual(plan["axes"]["dp_shard"], 4)
        self.assertEqual(plan["moe"], {"ep_shard": 4, "ep": 4})
        self.assertEqual(len(plan["ranks"]), 32)
        self.assertEqual(plan["ranks"][5]["coords"]["tp"], 1)

    def test_query_before_mesh_is_failed_precondition(self):
        with meshrun.Runtime.from_text("") as rt:
            with self.assertRaises(meshrun.MeshrunError) as caught:
                rt.axis_size("dp")
            self.assertEqual(caught.exception.code, meshrun.FAILED_PRECONDITION)
            rt.build_mesh(4, 0)
            with self.assertRaises(meshrun.MeshrunError) as caught:
                rt.build_mesh(4, 0)
            self.assertEqual(caught.exception.code, meshrun.FAILED_PRECONDITION)
            with self.assertRaises(meshrun.MeshrunError) as caught:
                rt.override("distributed.tp_size=2")
            self.assertEqual(caught.exception.code, meshrun.FAILED_PRECONDITION)

    def test_bad_config_names_key_and_position(self):
        with self.assertRaises(meshrun.MeshrunError) as caught:
            meshrun.Runtime.from_text("[distributed]\ntp_sise = 2\n", "bad.toml")
        self.assertEqual(caught.exception.code, meshrun.INVALID_ARGUMENT)
        self.assertIn("bad.toml:2:", caught.exception.message)
        self.assertIn("tp_size", caught.exception.message)

    def test_world_not_divisible_is_invalid_argument(self):
        with meshrun.Runtime.from_text("[distributed]\ntp_size = 3\n", "tp3.toml") as rt:
            with self.assertRaises(meshrun.MeshrunError) as caught:
                rt.build_mesh(8, 0)
            self.assertEqual(caught.exception.code, meshrun.INVALID_ARGUMENT)
            self.assertIn("must be divisible by", caught.exception.message)
            self.assertIn("tp3.toml:2:", caught.exception.message)

    def test_override_then_mesh(self):
        with meshrun.Runtime.from_text("") as rt:
            rt.override("distributed.tp_size=2")
            with self.assertRaises(meshrun.MeshrunError) as caught:
                rt.override("distributed.tp_size=-1")
            self.assertEqual(caught.exception.code, meshrun.INVALID_ARGUMENT)
            rt.build_mesh(8, 7)
            self.assertEqual(rt.axis_size("tp"), 2)
            self.assertEqual(rt.group_ranks("tp", 7), [6, 7])

    def test_unknown_axis_and_out_of_range(self):
        with meshrun.Runtime.from_text("") as rt:
            rt.build_mesh(4, 0)
            with self.assertRaises(meshrun.MeshrunError) as caught:
                rt.axis_size("dq")
            self.assertEqual(caught.exception.code, meshrun.NOT_FOUND)
            with self.assertRaises(meshrun.MeshrunError) as caught:
                rt.axis_size("ep")
            self.assertEqual(caught.exception.code, meshrun.NOT_FOUND)
            with self.assertRaises(meshrun.MeshrunError) as caught:
                rt.coordinate(4, "dp")
            self.assertEqual(caught.exception.code, meshrun.OUT_OF_RANGE)
            with self.assertRaises(meshrun.MeshrunError) as caught:
                rt.group_ranks_by_index("dp", 1)
            self.assertEqual(caught.exception.code, meshrun.OUT_OF_RANGE)

    def test_job_calls_before_join_are_failed_precondition(self):
        params, grads = numpy.zeros(4, numpy.float32), numpy.zeros(4, numpy.float32)
        with meshrun.Runtime.from_text("") as rt:
            for call in (lambda: rt.rank, lambda: rt.comm("world"), lambda: rt.comm("dp"),
                         lambda: meshrun.Strategy(rt, params, grads, ["w"], [(4,)]),
                         lambda: rt.train(on_step=lambda metrics: None)):
                with self.assertRaises(meshrun.MeshrunError) as caught:
                    call()
                self.assertEqual(caught.exception.code, meshrun.FAILED_PRECONDITION)
                self.assertIn("meshrun_runtime_join", caught.exception.message)

    def test_run_train_names_a_null_runtime(self):
        error = meshrun.library().meshrun_run_train(None, None, meshrun._capi.STEP_CALLBACK(),
                                                    None)
        self.assertTrue(error)
        self.assertEqual(error.contents.code, meshrun.INVALID_ARGUMENT)
        self.assertEqual(error.contents.message,
                         b"meshrun_run_train: argument 'runtime' is NULL")
        error.contents.destroy(error)

    def refusal(self, error):
        """(code, message) of an error object the raw C call returned."""
        with self.assertRaises(meshrun.MeshrunError) as caught:
            meshrun._capi.check(error)
        return caught.exception.code, caught.exception.message

    def test_a_destroyed_foreign_or_wrong_typed_handle_is_refused_not_read(self):
        lib = meshrun.library()
        handle = ctypes.c_void_p()
        meshrun._capi.check(lib.meshrun_runtime_create_from_text(b"", b"<test>",
                                                                 ctypes.byref(handle)))
        lib.meshrun_runtime_destroy(handle)
        lib.meshrun_runtime_destroy(handle)  # twice: the second does nothing
        size = ctypes.c_int64()
        code, message = self.refusal(lib.meshrun_mesh_axis_size(handle, b"dp",
                                                                ctypes.byref(size)))
        self.assertEqual(code, meshrun.INVALID_ARGUMENT)
        self.assertEqual(message, "meshrun_mesh_axis_size: argument 'runtime' is not a live "
                         "meshrun_runtime: it was destroyed, or never returned by this library")
        never_made = ctypes.create_string_buffer(64)  # memory the library never handed out
        code, message = self.refusal(lib.meshrun_runtime_join(never_made))
        self.assertEqual(code, meshrun.INVALID_ARGUMENT)
        self.assertIn("meshrun_runtime_join: argument 'runtime' is not a live", message)
        with meshrun.Runtime.from_text("") as rt:
            sharded = ctypes.c_int32()
            code, message = self.refusal(lib.meshrun_strategy_sharded(rt.handle,
                                                                      ctypes.byref(sharded)))
            self.assertEqual(message, "meshrun_strategy_sharded: argument 'strategy' is a "
                             "meshrun_runtime, not a meshrun_strategy")
            rt.build_mesh(2, 0)
            self.assertEqual(rt.axis_size("dp"), 2)  # the live runtime is untouched

    def test_a_wrong_struct_size_or_null_buffer_is_named_before_the_join(self):
        lib = meshrun.library()
        names = (ctypes.c_char_p * 1)(b"w")
        numels, rows = (ctypes.c_int64 * 1)(4), (ctypes.c_int64 * 1)(1)
        units = (ctypes.c_int32 * 1)(0)
        values, grads = numpy.zeros(4, numpy.float32), numpy.zeros(4, numpy.float32)
        borrowed = [meshrun.dlpack.borrow(a, n, ("float32",), (meshrun.dlpack.CPU,))
                    for a, n in ((values, "parameters"), (grads, "gradients"))]

        def params(**change):
            fields = dict(struct_size=ctypes.sizeof(meshrun._capi.StrategyParameters),
                          num_parameters=1, names=names, numels=numels, rows=rows, units=units,
                          num_units=1, root_unit=0, parameters=borrowed[0].tensor,
                          gradients=borrowed[1].tensor)
            fields.update(change)
            return meshrun._capi.StrategyParameters(**fields)

        null_data = meshrun.dlpack.DLTensor.from_buffer_copy(borrowed[0].tensor)
        null_data.data = None
        with meshrun.Runtime.from_text("") as rt:
            out = ctypes.c_void_p()
            for change, expected in (
                    ({"struct_size": 8}, "meshrun_strategy_create: meshrun_strategy_parameters: "
                                         "struct_size 8 is smaller than its ABI 1.5 layout"),
                    ({"parameters": null_data},
                     "meshrun_strategy_create: params->parameters: data is NULL"),
                    ({"numels": None},
                     "meshrun_strategy_create: argument 'params->numels' is NULL")):
                code, message = self.refusal(lib.meshrun_strategy_create(
                    rt.handle, ctypes.byref(params(**change)), ctypes.byref(out)))
                self.assertEqual(code, meshrun.INVALID_ARGUMENT)
                self.assertTrue(message.startswith(expected), message)
                self.assertFalse(out)  # out-parameters are written only on success
            code, message = self.refusal(lib.meshrun_strategy_create(
                rt.handle, None, ctypes.byref(out)))
            self.assertEqual(message, "meshrun_strategy_create: argument 'params' is NULL")
            code, message = self.refusal(lib.meshrun_strategy_create(
                rt.handle, ctypes.byref(params()), ctypes.byref(out)))
            self.assertEqual(code, meshrun.FAILED_PRECONDITION)  # well formed, not joined
            self.assertIn("meshrun_runtime_join", message)

    def test_gemm_peak_is_stated_or_measured_and_refuses_other_dtypes(self):
        import meshrun.metrics
        stated = os.environ.get("MESHRUN_GEMM_PEAK_FLOPS", "")
        if "float32=" in stated:
            expected = float(stated.split("float32=")[1].split(",")[0])
            self.assertEqual(meshrun.metrics.gemm_peak_flops("float32"), expected)
        else:
            self.assertGreater(meshrun.metrics.gemm_peak_flops("float32", 0.02), 1e8)
        with self.assertRaises(meshrun.MeshrunError) as caught:
            meshrun.metrics.gemm_peak_flops("float64")
        self.assertEqual(caught.exception.code, meshrun.INVALID_ARGUMENT)
        self.assertIn("float64", caught.exception.message)

    def test_join_after_build_mesh_is_failed_precondition(self):
        with meshrun.Runtime.from_text("") as rt:
            rt.build_mesh(2, 0)
            with self.assertRaises(meshrun.MeshrunError) as caught:
                rt.join()
            self.assertEqual(caught.exception.code, meshrun.FAILED_PRECONDITION)
            with self.assertRaises(meshrun.MeshrunError) as caught:
                rt.comm("dp")
            self.assertEqual(caught.exception.code, meshrun.FAILED_PRECONDITION)

    def test_closed_runtime_is_failed_precondition(self):
        rt = meshrun.Runtime.from_text("")
        rt.close()
        rt.close()
        with self.assertRaises(meshrun.MeshrunError) as caught:
            rt.axis_size("dp")
        self.assertEqual(caught.exception.code, meshrun.FAILED_PRECONDITION)

    def test_init_maps_keys_to_distributed_overrides(self):
        self.assertEqual(meshrun.runtime._key_overrides(
            {"strategy": "ddp", "mp_policy": {"param_dtype": "float32"}, "static_graph": True}),
            ["distributed.strategy=ddp", "distributed.mp_policy.param_dtype=float32",
             "distributed.static_graph=true"])

    def test_missing_file_is_not_found(self):
        with self.assertRaises(meshrun.MeshrunError) as caught:
            meshrun.Runtime.from_file("/nonexistent/meshrun.toml")
        self.assertEqual(caught.exception.code, meshrun.NOT_FOUND)
        self.assertIn("/nonexistent/meshrun.toml", caught.exception.message)


class PlanAndEstimate(unittest.TestCase):
    """meshrun.plan() and Runtime.estimate() against `meshrun plan --json`
    of the same config: equal dicts (h100-sxm, a stated profile, so the
    estimate does not depend on this machine)."""

    CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "llama-tiny.toml")
    KEYS = ["data.seq_len=512", "distributed.activation_checkpointing=\"selective\""]

    def cli(self, *args):
        result = subprocess.run([MESHRUN, "plan", self.CONFIG, "--world-size", "8", "--json",
                                 *args, *self.KEYS], capture_output=True, text=True, timeout=120)
        self.assertEqual(result.returncode, 0, result.stderr)
        return json.loads(result.stdout)

    def test_plan_is_the_clis(self):
        self.assertEqual(meshrun.plan(self.CONFIG, world_size=8, overrides=self.KEYS),
                         self.cli())

    def test_estimate_is_the_clis(self):
        got = meshrun.plan(self.CONFIG, world_size=8, overrides=self.KEYS, estimate="h100-sxm")
        self.assertEqual(got["estimate"], self.cli("--estimate", "--hardware", "h100-sxm")[
            "estimate"])
        self.assertGreater(got["estimate"]["memory"]["total"], 0)

    def test_bad_profile_and_unbuilt_mesh(self):
        with self.assertRaises(meshrun.MeshrunError) as caught:
            meshrun.plan(self.CONFIG, estimate="h100-typo")
        self.assertEqual(caught.exception.code, meshrun.INVALID_ARGUMENT)
        self.assertIn("h100-typo", caught.exception.message)
        with meshrun.Runtime.from_file(self.CONFIG) as runtime:
            with self.assertRaises(meshrun.MeshrunError) as caught:
                runtime.estimate("h100-sxm")
            self.assertEqual(caught.exception.code, meshrun.FAILED_PRECONDITION)


if __name__ == "__main__":
    MESHRUN = sys.argv.pop(1)
    unittest.main(verbosity=2)
