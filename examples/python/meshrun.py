"""meshrun host API from Python through ctypes (abi/include/meshrun/host.h).

    import meshrun
    rt = meshrun.Runtime.from_file("examples/llama-tiny.toml")
    rt.build_mesh(world_size=8, rank=0)
    rt.axis_size("dp"), rt.coordinate(5, "tp"), rt.group_ranks("tp", 5)

The library is found from $MESHRUN_LIBRARY, else as "libmeshrun.so.1" on the
loader's path. Every failing call raises MeshrunError with the ABI's code and
message; the error object is released through its own destroy function.
"""

import ctypes
import json
import os

INVALID_ARGUMENT = 1
NOT_FOUND = 2
FAILED_PRECONDITION = 3
OUT_OF_RANGE = 4
UNIMPLEMENTED = 5


class _Error(ctypes.Structure):
    pass


_DestroyFn = ctypes.CFUNCTYPE(None, ctypes.POINTER(_Error))
_Error._fields_ = [
    ("struct_size", ctypes.c_size_t),
    ("code", ctypes.c_int32),
    ("message", ctypes.c_char_p),
    ("destroy", _DestroyFn),
]
_ErrorPtr = ctypes.POINTER(_Error)


class MeshrunError(Exception):
    """A meshrun_error: `code` is one of the MESHRUN_* codes."""

    def __init__(self, code, message):
        super().__init__(message)
        self.code = code
        self.message = message


def _load_library(path=None):
    lib = ctypes.CDLL(path or os.environ.get("MESHRUN_LIBRARY", "libmeshrun.so.1"))
    i64, p_i64, char_p = ctypes.c_int64, ctypes.POINTER(ctypes.c_int64), ctypes.c_char_p
    runtime_pp = ctypes.POINTER(ctypes.c_void_p)
    signatures = {
        "meshrun_abi_version_major": (ctypes.c_int32, []),
        "meshrun_abi_version_minor": (ctypes.c_int32, []),
        "meshrun_library_version": (char_p, []),
        "meshrun_runtime_create_from_text": (_ErrorPtr, [char_p, char_p, runtime_pp]),
        "meshrun_runtime_create_from_file": (_ErrorPtr, [char_p, runtime_pp]),
        "meshrun_runtime_destroy": (None, [ctypes.c_void_p]),
        "meshrun_runtime_override": (_ErrorPtr, [ctypes.c_void_p, char_p]),
        "meshrun_runtime_build_mesh": (_ErrorPtr, [ctypes.c_void_p, i64, i64]),
        "meshrun_mesh_axis_size": (_ErrorPtr, [ctypes.c_void_p, char_p, p_i64]),
        "meshrun_mesh_coordinate": (_ErrorPtr, [ctypes.c_void_p, i64, char_p, p_i64]),
        "meshrun_mesh_group_count": (_ErrorPtr, [ctypes.c_void_p, char_p, p_i64]),
        "meshrun_mesh_group_ranks": (_ErrorPtr, [ctypes.c_void_p, char_p, i64, p_i64, i64, p_i64]),
        "meshrun_mesh_group_ranks_by_index": (
            _ErrorPtr, [ctypes.c_void_p, char_p, i64, p_i64, i64, p_i64]),
        "meshrun_runtime_plan_json": (
            _ErrorPtr, [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)]),
        "meshrun_string_destroy": (None, [ctypes.c_void_p]),
    }
    for name, (restype, argtypes) in signatures.items():
        function = getattr(lib, name)
        function.restype, function.argtypes = restype, argtypes
    return lib


_lib = None


def library():
    """The loaded libmeshrun (loaded on first use)."""
    global _lib
    if _lib is None:
        _lib = _load_library()
    return _lib


def _check(error):
    if not error:
        return
    code, message = error.contents.code, error.contents.message.decode("utf-8", "replace")
    error.contents.destroy(error)
    raise MeshrunError(code, message)


def abi_version():
    return library().meshrun_abi_version_major(), library().meshrun_abi_version_minor()


def library_version():
    return library().meshrun_library_version().decode()


class Runtime:
    """A meshrun_runtime: config -> mesh. Destroyed with close() or `with`."""

    def __init__(self, handle):
        self._handle = handle

    @classmethod
    def from_text(cls, toml_text, source_name="<string>"):
        handle = ctypes.c_void_p()
        _check(library().meshrun_runtime_create_from_text(
            toml_text.encode(), source_name.encode(), ctypes.byref(handle)))
        return cls(handle)

    @classmethod
    def from_file(cls, path):
        handle = ctypes.c_void_p()
        _check(library().meshrun_runtime_create_from_file(str(path).encode(), ctypes.byref(handle)))
        return cls(handle)

    def close(self):
        if self._handle:
            library().meshrun_runtime_destroy(self._handle)
            self._handle = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        self.close()

    def override(self, assignment):
        _check(library().meshrun_runtime_override(self._handle, assignment.encode()))

    def build_mesh(self, world_size, rank=0):
        _check(library().meshrun_runtime_build_mesh(self._handle, world_size, rank))

    def _int_query(self, function, *args):
        out = ctypes.c_int64()
        _check(function(self._handle, *args, ctypes.byref(out)))
        return out.value

    def axis_size(self, axis):
        return self._int_query(library().meshrun_mesh_axis_size, axis.encode())

    def coordinate(self, rank, axis):
        return self._int_query(library().meshrun_mesh_coordinate, rank, axis.encode())

    def group_count(self, axis):
        return self._int_query(library().meshrun_mesh_group_count, axis.encode())

    def _ranks(self, function, axis, which):
        size = self.axis_size(axis)
        ranks, count = (ctypes.c_int64 * size)(), ctypes.c_int64()
        _check(function(self._handle, axis.encode(), which, ranks, size, ctypes.byref(count)))
        return list(ranks[: count.value])

    def group_ranks(self, axis, rank):
        """Ranks of the `axis` group that contains `rank`, in axis order."""
        return self._ranks(library().meshrun_mesh_group_ranks, axis, rank)

    def group_ranks_by_index(self, axis, group):
        return self._ranks(library().meshrun_mesh_group_ranks_by_index, axis, group)

    def groups(self, axis):
        """Every group of `axis`, numbered by lowest rank."""
        return [self.group_ranks_by_index(axis, g) for g in range(self.group_count(axis))]

    def plan(self):
        out = ctypes.c_void_p()
        _check(library().meshrun_runtime_plan_json(self._handle, ctypes.byref(out)))
        try:
            return json.loads(ctypes.string_at(out.value).decode())
        finally:
            library().meshrun_string_destroy(out)
