"""libmeshrun through ctypes: finding and loading it, the C signatures of
abi/include/meshrun/host.h, and turning its error objects into MeshrunError.

Where the library is looked for, first match wins:
  1. $MESHRUN_LIBRARY, a path (nothing else is tried when it is set);
  2. under $MESHRUN_PREFIX, an install prefix or a build folder: its lib/ or
     lib/<multiarch>/ (a package pip installed elsewhere finds it so);
  3. next to this package as it is installed (<libdir>/meshrun/python/meshrun
     -> <libdir>/libmeshrun.so.1) or as it sits in a source checkout built
     into build/ (python/meshrun -> build/lib/libmeshrun.so.1);
  4. "libmeshrun.so.1" on the dynamic loader's path (LD_LIBRARY_PATH, ldconfig).
"""

import ctypes
import os
import sys

from . import dlpack
from .errors import MeshrunError

LIBRARY_NAME = "libmeshrun.so.1"


class _Error(ctypes.Structure):
    pass


_ErrorPtr = ctypes.POINTER(_Error)
_Error._fields_ = [
    ("struct_size", ctypes.c_size_t),
    ("code", ctypes.c_int32),
    ("message", ctypes.c_char_p),
    ("destroy", ctypes.CFUNCTYPE(None, _ErrorPtr)),
]


class StrategyParameters(ctypes.Structure):
    """meshrun_strategy_parameters."""

    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("num_parameters", ctypes.c_int64),
        ("names", ctypes.POINTER(ctypes.c_char_p)),
        ("numels", ctypes.POINTER(ctypes.c_int64)),
        ("rows", ctypes.POINTER(ctypes.c_int64)),
        ("units", ctypes.POINTER(ctypes.c_int32)),
        ("num_units", ctypes.c_int32),
        ("root_unit", ctypes.c_int32),
        ("parameters", dlpack.DLTensor),
        ("gradients", dlpack.DLTensor),
        ("extensions", ctypes.c_void_p),
    ]


class StrategySegment(ctypes.Structure):
    """meshrun_strategy_segment."""

    _fields_ = [("parameter", ctypes.c_int64), ("global_begin", ctypes.c_int64),
                ("local_begin", ctypes.c_int64), ("count", ctypes.c_int64)]


# meshrun_step_callback: int32_t (*)(void* context, const char* metrics_json).
STEP_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_void_p, ctypes.c_char_p)


def _signatures():
    i32, i64, f64, char_p, ptr = (ctypes.c_int32, ctypes.c_int64, ctypes.c_double,
                                  ctypes.c_char_p, ctypes.c_void_p)
    p_i32, p_i64, p_ptr = (ctypes.POINTER(i32), ctypes.POINTER(i64), ctypes.POINTER(ptr))
    tensor = ctypes.POINTER(dlpack.DLTensor)
    e = _ErrorPtr
    return {
        "meshrun_abi_version_major": (i32, []),
        "meshrun_abi_version_minor": (i32, []),
        "meshrun_library_version": (char_p, []),
        "meshrun_runtime_create_from_text": (e, [char_p, char_p, p_ptr]),
        "meshrun_runtime_create_from_file": (e, [char_p, p_ptr]),
        "meshrun_runtime_destroy": (None, [ptr]),
        "meshrun_runtime_override": (e, [ptr, char_p]),
        "meshrun_runtime_build_mesh": (e, [ptr, i64, i64]),
        "meshrun_mesh_axis_size": (e, [ptr, char_p, p_i64]),
        "meshrun_mesh_coordinate": (e, [ptr, i64, char_p, p_i64]),
        "meshrun_mesh_group_count": (e, [ptr, char_p, p_i64]),
        "meshrun_mesh_group_ranks": (e, [ptr, char_p, i64, p_i64, i64, p_i64]),
        "meshrun_mesh_group_ranks_by_index": (e, [ptr, char_p, i64, p_i64, i64, p_i64]),
        "meshrun_runtime_plan_json": (e, [ptr, p_ptr]),
        "meshrun_string_destroy": (None, [ptr]),
        # ABI 1.5: a rank of a running job.
        "meshrun_runtime_join": (e, [ptr]),
        "meshrun_runtime_rank": (e, [ptr, p_i64, p_i64, p_i64]),
        "meshrun_runtime_comm": (e, [ptr, char_p, p_ptr]),
        "meshrun_comm_rank": (e, [ptr, p_i64]),
        "meshrun_comm_size": (e, [ptr, p_i64]),
        "meshrun_all_reduce": (e, [ptr, tensor, tensor, i32, p_ptr]),
        "meshrun_all_gather": (e, [ptr, tensor, tensor, p_ptr]),
        "meshrun_reduce_scatter": (e, [ptr, tensor, tensor, i32, p_ptr]),
        "meshrun_broadcast": (e, [ptr, tensor, i64, p_ptr]),
        "meshrun_send": (e, [ptr, tensor, i64, i64, p_ptr]),
        "meshrun_recv": (e, [ptr, tensor, i64, i64, p_ptr]),
        "meshrun_barrier": (e, [ptr, p_ptr]),
        "meshrun_op_wait": (e, [ptr, f64]),
        "meshrun_op_test": (e, [ptr, p_i32]),
        "meshrun_op_destroy": (None, [ptr]),
        # ABI 1.5: the configured strategy over the caller's parameters.
        "meshrun_strategy_create": (e, [ptr, ctypes.POINTER(StrategyParameters), p_ptr]),
        "meshrun_strategy_destroy": (None, [ptr]),
        "meshrun_strategy_sharded": (e, [ptr, p_i32]),
        "meshrun_strategy_broadcast_parameters": (e, [ptr]),
        "meshrun_strategy_begin_micro_batch": (e, [ptr, i32]),
        "meshrun_strategy_gradient_ready": (e, [ptr, i64]),
        "meshrun_strategy_finish_gradients": (e, [ptr]),
        "meshrun_strategy_pre_forward": (e, [ptr, i32]),
        "meshrun_strategy_post_forward": (e, [ptr, i32]),
        "meshrun_strategy_pre_backward": (e, [ptr, i32]),
        "meshrun_strategy_post_backward": (e, [ptr, i32]),
        "meshrun_strategy_unit_views": (e, [ptr, i32, tensor, tensor]),
        "meshrun_strategy_local_shard": (e, [ptr, tensor, tensor]),
        "meshrun_strategy_shard_segments": (
            e, [ptr, ctypes.POINTER(StrategySegment), i64, p_i64]),
        "meshrun_strategy_gradient_norm_squared": (e, [ptr, ctypes.POINTER(f64)]),
        "meshrun_strategy_gather_parameters": (e, [ptr, tensor]),
        "meshrun_strategy_save_checkpoint": (
            e, [ptr, char_p, i64, i64, ctypes.POINTER(char_p), tensor]),
        "meshrun_strategy_load_checkpoint": (
            e, [ptr, char_p, i64, ctypes.POINTER(char_p), tensor, p_i64]),
        # ABI 1.12: all-to-all, a strategy's memory, the GEMM peak, and the
        # whole of `meshrun train` in this process.
        "meshrun_all_to_all": (e, [ptr, tensor, p_i64, tensor, p_i64, p_ptr]),
        "meshrun_strategy_memory_use": (e, [ptr, p_i64, p_i64, p_i64]),
        "meshrun_gemm_peak_flops": (e, [char_p, f64, ctypes.POINTER(f64)]),
        "meshrun_trace_start": (e, [ptr]),
        "meshrun_trace_now": (f64, []),
        "meshrun_trace_span": (e, [char_p, char_p, f64, f64]),
        "meshrun_trace_write": (e, [ptr, char_p]),
        "meshrun_write_safetensors": (e, [char_p, i64, ctypes.POINTER(char_p), p_i32, p_i64,
                                          tensor, i32]),
        "meshrun_run_train": (e, [ptr, char_p, STEP_CALLBACK, ptr]),
        "meshrun_runtime_estimate_json": (e, [ptr, char_p, i64, p_ptr]),
    }


def library_candidates():
    """The paths tried in order when $MESHRUN_LIBRARY is not set (see the
    module docstring)."""
    package = os.path.dirname(os.path.abspath(__file__))
    paths = []
    prefix = os.environ.get("MESHRUN_PREFIX")
    if prefix:
        multiarch = getattr(sys.implementation, "_multiarch", "")
        paths += [os.path.join(prefix, "lib", LIBRARY_NAME),
                  os.path.join(prefix, "lib", multiarch, LIBRARY_NAME)]
    paths += [os.path.join(package, "..", "..", "..", LIBRARY_NAME),
              os.path.join(package, "..", "..", "build", "lib", LIBRARY_NAME)]
    return [os.path.normpath(p) for p in paths if os.path.exists(p)] + [LIBRARY_NAME]


def _load():
    path = os.environ.get("MESHRUN_LIBRARY") or library_candidates()[0]
    lib = ctypes.CDLL(path)
    for name, (restype, argtypes) in _signatures().items():
        function = getattr(lib, name)
        function.restype, function.argtypes = restype, argtypes
    return lib


_lib = None


def library():
    """The loaded libmeshrun (loaded on first use)."""
    global _lib
    if _lib is None:
        _lib = _load()
    return _lib


def check(error):
    """Raises MeshrunError for a non-NULL meshrun_error*, releasing it
    through its own destroy function."""
    if not error:
        return
    code = error.contents.code
    message = (error.contents.message or b"").decode("utf-8", "replace")
    error.contents.destroy(error)
    raise MeshrunError(code, message)
