// Whole buffers between float32 and bfloat16, for the operand copies of
// the bfloat16 GEMMs (numeric/gemm.hpp) and the activations a bfloat16 run
// keeps for its backward (common/kept_activations.hpp). Element-wise as
// meshrun/dtype.hpp converts one value: round to nearest even, NaN stays
// NaN; widening is exact.
#pragma once

#include <cstdint>

namespace meshrun::kernels {

// out[i] = in[i] rounded to bfloat16, for i < count. With AVX512_BF16 (a
// MESHRUN_NATIVE build on such a CPU) one instruction converts 32.
void to_bfloat16(const float* in, uint16_t* out, int64_t count);

// out[i] = in[i] as float32 (exact), for i < count.
void from_bfloat16(const uint16_t* in, float* out, int64_t count);

// out[i] = in[i] rounded to bfloat16 and widened back, for i < count; `in`
// may be `out`.
void round_to_bfloat16(const float* in, float* out, int64_t count);

}  // namespace meshrun::kernels
