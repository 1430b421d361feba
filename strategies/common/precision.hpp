// The dtypes of FSDP2's MixedPrecisionPolicy and the casts between them and
// the float32 master shard: parameters are all-gathered in param_dtype and
// gradients reduce-scattered in reduce_dtype.
#pragma once

#include <dlpack/dlpack.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace meshrun::strategies {

enum class Dtype { float32, bfloat16, float16 };

// "float32", "bfloat16", "float16": the names mp_policy accepts.
const std::vector<std::string>& dtype_names();
Dtype dtype_from_name(const std::string& name);
const char* dtype_name(Dtype dtype);
DLDataType dlpack_dtype(Dtype dtype);
size_t dtype_bytes(Dtype dtype);

// A one-dimensional view of `numel` elements of `dtype` at `data` on
// `device`; its shape is `numel` itself, which must outlive the view.
DLTensor flat_tensor(void* data, DLDevice device, Dtype dtype, int64_t& numel);

// out[i] = in[i] * scale (in float32) rounded to `dtype` (round to nearest
// even), for `count` elements; `out` holds elements of `dtype`.
void narrow(Dtype dtype, const float* in, void* out, int64_t count, float scale = 1.0f);
// out[i] = in[i] as float32; `in` holds elements of `dtype`.
void widen(Dtype dtype, const void* in, float* out, int64_t count);
// out[i] += in[i] as float32.
void widen_add(Dtype dtype, const void* in, float* out, int64_t count);

}  // namespace meshrun::strategies
