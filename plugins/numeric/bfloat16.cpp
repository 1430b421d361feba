#include "numeric/bfloat16.hpp"

#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

#include "meshrun/dtype.hpp"

namespace meshrun::kernels {

void to_bfloat16(const float* in, uint16_t* out, int64_t count) {
  int64_t i = 0;
#ifdef __AVX512BF16__
  for (; i + 32 <= count; i += 32) {
    const __m512bh pair =
        _mm512_cvtne2ps_pbh(_mm512_loadu_ps(in + i + 16), _mm512_loadu_ps(in + i));
    _mm512_storeu_si512(out + i, reinterpret_cast<__m512i>(pair));
  }
#endif
  for (; i < count; ++i) out[i] = float_to_bfloat16(in[i]);
}

void round_to_bfloat16(const float* in, float* out, int64_t count) {
  for (int64_t i = 0; i < count; ++i) out[i] = rounded_to_bfloat16(in[i]);
}

void from_bfloat16(const uint16_t* in, float* out, int64_t count) {
  for (int64_t i = 0; i < count; ++i) out[i] = bfloat16_to_float(in[i]);
}

}  // namespace meshrun::kernels
