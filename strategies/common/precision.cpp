#include "precision.hpp"

#include <cstring>

#include "common/errors.hpp"
#include "meshrun/dtype.hpp"

namespace meshrun::strategies {
namespace {

// Calls `body` with `data` as elements of `dtype` and the function that
// widens one to float32.
template <class Body>
void with_elements(Dtype dtype, const void* data, Body&& body) {
  switch (dtype) {
    case Dtype::bfloat16:
      body(static_cast<const uint16_t*>(data),
           [](uint16_t value) { return meshrun::bfloat16_to_float(value); });
      return;
    case Dtype::float16:
      body(static_cast<const uint16_t*>(data),
           [](uint16_t value) { return meshrun::float16_to_float(value); });
      return;
    case Dtype::float32:
      break;
  }
  body(static_cast<const float*>(data), [](float value) { return value; });
}

}  // namespace

const std::vector<std::string>& dtype_names() {
  static const std::vector<std::string> names = {"float32", "bfloat16", "float16"};
  return names;
}

Dtype dtype_from_name(const std::string& name) {
  if (name == "bfloat16") return Dtype::bfloat16;
  if (name == "float16") return Dtype::float16;
  if (name == "float32") return Dtype::float32;
  strategies::invalid("unknown dtype '" + name + "'");
}

const char* dtype_name(Dtype dtype) { return dtype_names()[static_cast<size_t>(dtype)].c_str(); }

DLDataType dlpack_dtype(Dtype dtype) {
  switch (dtype) {
    case Dtype::bfloat16:
      return DLDataType{kDLBfloat, 16, 1};
    case Dtype::float16:
      return DLDataType{kDLFloat, 16, 1};
    case Dtype::float32:
      break;
  }
  return DLDataType{kDLFloat, 32, 1};
}

size_t dtype_bytes(Dtype dtype) { return dtype == Dtype::float32 ? 4 : 2; }

DLTensor flat_tensor(void* data, DLDevice device, Dtype dtype, int64_t& numel) {
  return DLTensor{data, device, 1, dlpack_dtype(dtype), &numel, nullptr, 0};
}

void narrow(Dtype dtype, const float* in, void* out, int64_t count, float scale) {
  switch (dtype) {
    case Dtype::bfloat16: {
      auto* bits = static_cast<uint16_t*>(out);
      for (int64_t i = 0; i < count; ++i) bits[i] = meshrun::float_to_bfloat16(in[i] * scale);
      return;
    }
    case Dtype::float16: {
      auto* halves = static_cast<uint16_t*>(out);
      for (int64_t i = 0; i < count; ++i) halves[i] = meshrun::float_to_float16(in[i] * scale);
      return;
    }
    case Dtype::float32:
      break;
  }
  if (scale == 1.0f) {
    std::memcpy(out, in, static_cast<size_t>(count) * sizeof(float));
    return;
  }
  auto* scaled = static_cast<float*>(out);
  for (int64_t i = 0; i < count; ++i) scaled[i] = in[i] * scale;
}

void widen(Dtype dtype, const void* in, float* out, int64_t count) {
  if (dtype == Dtype::float32) {
    std::memcpy(out, in, static_cast<size_t>(count) * sizeof(float));
    return;
  }
  with_elements(dtype, in, [&](const auto* elements, auto to_float) {
    for (int64_t i = 0; i < count; ++i) out[i] = to_float(elements[i]);
  });
}

void widen_add(Dtype dtype, const void* in, float* out, int64_t count) {
  with_elements(dtype, in, [&](const auto* elements, auto to_float) {
    for (int64_t i = 0; i < count; ++i) out[i] += to_float(elements[i]);
  });
}

}  // namespace meshrun::strategies
