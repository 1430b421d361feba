#include "arguments.hpp"

#include <optional>

#include "collectives.hpp"
#include "meshrun/plugin.hpp"

namespace meshrun::mpi {
namespace {

std::optional<Dtype> dtype_of(DLDataType type) {
  if (type.lanes != 1) return std::nullopt;
  if (type.code == kDLFloat && type.bits == 32) return Dtype::float32;
  if (type.code == kDLBfloat && type.bits == 16) return Dtype::bfloat16;
  if (type.code == kDLFloat && type.bits == 16) return Dtype::float16;
  if (type.code == kDLInt && type.bits == 32) return Dtype::int32;
  if (type.code == kDLInt && type.bits == 64) return Dtype::int64;
  return std::nullopt;
}

// The number of elements of a tensor whose shape has been checked to exist;
// nullopt for a negative extent or a count that overflows.
std::optional<size_t> numel_of(const DLTensor& tensor) {
  uint64_t numel = 1;
  for (int32_t d = 0; d < tensor.ndim; ++d) {
    if (tensor.shape[d] < 0) return std::nullopt;
    if (__builtin_mul_overflow(numel, static_cast<uint64_t>(tensor.shape[d]), &numel)) {
      return std::nullopt;
    }
  }
  return static_cast<size_t>(numel);
}

// Row-major contiguous: the stride of every dimension longer than one is the
// product of the extents after it (the stride of a unit dimension does not
// matter, as in PyTorch).
// Called for non-empty tensors only, whose extents multiply without
// overflow.
bool compact(const DLTensor& tensor) {
  if (tensor.strides == nullptr) return true;
  int64_t expected = 1;
  for (int32_t d = tensor.ndim - 1; d >= 0; --d) {
    if (tensor.shape[d] != 1 && tensor.strides[d] != expected) return false;
    expected *= tensor.shape[d];
  }
  return true;
}

std::string shape_text(const DLTensor& tensor, const int64_t* values) {
  std::string text = "[";
  for (int32_t d = 0; d < tensor.ndim; ++d) {
    text += (d > 0 ? ", " : "") + std::to_string(values[d]);
  }
  return text + "]";
}

void check_shape_and_device(const DLTensor& tensor, const std::string& what,
                            const std::string& role) {
  if (tensor.ndim < 0 || (tensor.ndim > 0 && tensor.shape == nullptr)) {
    invalid(what, role + " has ndim " + std::to_string(tensor.ndim) + " and shape " +
                      (tensor.shape == nullptr ? "NULL" : "set"));
  }
  if (tensor.device.device_type != kDLCPU) {
    invalid(what, role + " is on device type " + std::to_string(tensor.device.device_type) +
                      "; the mpi backend moves CPU tensors (kDLCPU = 1)");
  }
}

}  // namespace

void invalid(const std::string& what, const std::string& problem) {
  throw meshrun::plugin::Error(MESHRUN_INVALID_ARGUMENT, what + ": " + problem);
}

View view_of(const DLTensor* tensor, const std::string& what, const char* role) {
  const std::string name = role;
  if (tensor == nullptr) invalid(what, name + " tensor is NULL");
  check_shape_and_device(*tensor, what, name);
  const std::optional<Dtype> dtype = dtype_of(tensor->dtype);
  if (!dtype) {
    invalid(what, name + " dtype (code " + std::to_string(tensor->dtype.code) + ", bits " +
                      std::to_string(tensor->dtype.bits) + ", lanes " +
                      std::to_string(tensor->dtype.lanes) +
                      ") is not one of float32, bfloat16, float16, int32, int64");
  }
  const std::optional<size_t> numel = numel_of(*tensor);
  if (!numel) invalid(what, name + " has a negative or overflowing shape");
  if (*numel > 0 && !compact(*tensor)) {
    invalid(what, name + " is not compact: shape " + shape_text(*tensor, tensor->shape) +
                      ", strides " + shape_text(*tensor, tensor->strides));
  }
  if (tensor->data == nullptr && *numel > 0) invalid(what, name + " data is NULL");
  auto* data = static_cast<std::byte*>(tensor->data);
  return View{data == nullptr ? nullptr : data + tensor->byte_offset, *numel, *dtype};
}

ReduceOp reduce_op_of(int32_t op, const std::string& what) {
  if (op < MESHRUN_REDUCE_SUM || op > MESHRUN_REDUCE_MAX) {
    invalid(what, "reduce op " + std::to_string(op) +
                      " is not MESHRUN_REDUCE_SUM (0), MESHRUN_REDUCE_AVG (1) or "
                      "MESHRUN_REDUCE_MAX (2)");
  }
  return static_cast<ReduceOp>(op);
}

int rank_of(int64_t value, int size, const std::string& what, const char* role) {
  if (value < 0 || value >= size) {
    invalid(what, std::string(role) + " " + std::to_string(value) + " is not a rank of it (0.." +
                      std::to_string(size - 1) + ")");
  }
  return static_cast<int>(value);
}

int bounded_int(int64_t value, int upper, const std::string& what, const char* role) {
  if (value < 0 || value > upper) {
    invalid(what, std::string(role) + " " + std::to_string(value) + " is outside 0.." +
                      std::to_string(upper));
  }
  return static_cast<int>(value);
}

void require_same_dtype(const View& send, const View& recv, const std::string& what) {
  if (send.dtype != recv.dtype) {
    invalid(what, std::string("send is ") + dtype_name(send.dtype) + " but recv is " +
                      dtype_name(recv.dtype) + "; they must be the same");
  }
}

void require_numel(const View& tensor, const char* role, size_t expected, const char* rule,
                   const std::string& what) {
  if (tensor.numel != expected) {
    invalid(what, std::string(role) + " has " + std::to_string(tensor.numel) + " elements, but " +
                      rule + " asks for " + std::to_string(expected));
  }
}

void require_same_or_disjoint(const View& send, const View& recv, const std::string& what) {
  if (send.data != recv.data && overlaps(send.data, send.bytes(), recv.data, recv.bytes())) {
    invalid(what, "send and recv overlap without being the same memory (in place)");
  }
}

}  // namespace meshrun::mpi
