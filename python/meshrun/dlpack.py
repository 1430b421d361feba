"""DLPack (0.6 and later: Debian's libdlpack-dev, numpy >= 1.22, torch 1.13)
through ctypes: the C structs, and borrowing the DLTensor of a numpy array or
torch tensor for one call of the C API.

An object is exported with `obj.__dlpack__()` (torch tensors with
torch.utils.dlpack.to_dlpack(tensor.detach()), which accepts tensors that
require grad). The export is a PyCapsule named "dltensor" that owns a
DLManagedTensor; its pointer is read with PyCapsule_GetPointer and
&managed->dl_tensor is what the C API gets. The capsule is not renamed
("used_dltensor") or consumed: when it dies, its destructor calls the
deleter, which releases the exporter's reference to the memory. So whoever
holds the Borrowed object holds the memory and the DLTensor struct alive —
for an asynchronous operation until it has been waited.
"""

import ctypes
import sys

from .errors import INVALID_ARGUMENT, MeshrunError

# DLDeviceType and DLDataTypeCode values used here.
CPU = 1
CUDA = 2
INT = 0
FLOAT = 2
BFLOAT = 4

# The dtypes meshrun's communicators move (meshrun/comm.h).
DTYPE_NAMES = {(FLOAT, 32): "float32", (BFLOAT, 16): "bfloat16", (FLOAT, 16): "float16",
               (INT, 32): "int32", (INT, 64): "int64"}
DEVICE_NAMES = {CPU: "cpu", CUDA: "cuda"}


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class DLManagedTensor(ctypes.Structure):
    pass


DLManagedTensor._fields_ = [
    ("dl_tensor", DLTensor),
    ("manager_ctx", ctypes.c_void_p),
    ("deleter", ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensor))),
]

_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_get_pointer.restype = ctypes.c_void_p
_get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


def dtype_name(dtype):
    """"float32", ..., or a description of a dtype meshrun does not move."""
    if dtype.lanes == 1 and (dtype.code, dtype.bits) in DTYPE_NAMES:
        return DTYPE_NAMES[(dtype.code, dtype.bits)]
    return f"(code {dtype.code}, bits {dtype.bits}, lanes {dtype.lanes})"


class Borrowed:
    """The DLTensor of `obj` for the C API, alive while this object is.

    `pointer` is a ctypes POINTER(DLTensor) to the struct inside the
    exporter's DLManagedTensor; `obj` and the capsule are kept."""

    __slots__ = ("obj", "capsule", "pointer")

    def __init__(self, obj, name):
        self.obj = obj
        self.capsule = _export(obj, name)
        address = _get_pointer(self.capsule, b"dltensor")
        # dl_tensor is the first member of DLManagedTensor.
        self.pointer = ctypes.cast(address, ctypes.POINTER(DLTensor))

    @property
    def tensor(self):
        return self.pointer.contents

    def shape(self):
        t = self.tensor
        return tuple(t.shape[d] for d in range(t.ndim))

    def numel(self):
        count = 1
        for size in self.shape():
            count *= size
        return count

    def contiguous(self):
        """Compact row-major: strides NULL, or each the product of the sizes
        after it (dimensions of size 1 may have any stride)."""
        t = self.tensor
        if not t.strides:
            return True
        expected = 1
        for d in reversed(range(t.ndim)):
            if t.shape[d] != 1 and t.strides[d] != expected:
                return False
            expected *= t.shape[d]
        return True

    def device_name(self):
        d = self.tensor.device
        return f"{DEVICE_NAMES.get(d.device_type, f'device type {d.device_type}')}:{d.device_id}"


def _export(obj, name):
    torch = sys.modules.get("torch")
    try:
        if torch is not None and isinstance(obj, torch.Tensor):
            return torch.utils.dlpack.to_dlpack(obj.detach())
        if not hasattr(obj, "__dlpack__"):
            raise TypeError(f"a {type(obj).__name__} has no __dlpack__ (numpy arrays and torch "
                            "tensors have)")
        return obj.__dlpack__()
    except (TypeError, BufferError, RuntimeError, ValueError) as error:
        raise MeshrunError(INVALID_ARGUMENT,
                           f"{name}: cannot be exported through DLPack: {error}") from None


def borrow(obj, name, dtypes=None, device_types=(CPU, CUDA)):
    """`obj`'s DLTensor, checked: contiguous, a dtype meshrun moves (or one
    of `dtypes`, names such as "float32"), a device in `device_types`.
    Raises MeshrunError INVALID_ARGUMENT naming `name` and the problem."""
    borrowed = Borrowed(obj, name)
    t = borrowed.tensor
    dtype = dtype_name(t.dtype)
    allowed = dtypes or tuple(DTYPE_NAMES.values())
    if dtype not in allowed:
        raise MeshrunError(INVALID_ARGUMENT,
                           f"{name}: dtype {dtype} is not one of {', '.join(allowed)}")
    if t.device.device_type not in device_types:
        names = ", ".join(DEVICE_NAMES[d] for d in device_types)
        raise MeshrunError(INVALID_ARGUMENT,
                           f"{name}: the tensor is on {borrowed.device_name()}, not on {names}")
    if not borrowed.contiguous():
        strides = tuple(t.strides[d] for d in range(t.ndim))
        raise MeshrunError(INVALID_ARGUMENT,
                           f"{name}: the tensor is not contiguous (shape {borrowed.shape()}, "
                           f"strides {strides} in elements); pass a compact copy")
    return borrowed
