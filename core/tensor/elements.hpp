// Reading and writing single tensor elements of the dtypes meshrun moves
// (float32, bfloat16, float16, int32, int64) as double: the reference side of
// tests and benchmarks. Header-only so plugins can use it without linking
// the core. bfloat16 rounds to nearest even; float16 uses the compiler's
// _Float16 (IEEE binary16).
#pragma once

#include <dlpack/dlpack.h>

#include <cstdint>
#include <cstring>

namespace meshrun {

// The bits of a float32 rounded to bfloat16 and widened back: round to
// nearest even, a NaN stays a (quiet) NaN. Branch-free, so loops over it
// vectorize.
inline uint32_t bfloat16_rounded_bits(uint32_t bits) {
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
  const uint32_t quiet_nan = (bits | 0x00400000u) & 0xffff0000u;
  return (bits & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded;
}

// float32 -> bfloat16 bits, round to nearest even (NaN stays NaN).
inline uint16_t float_to_bfloat16(float value) {
  uint32_t bits = 0;
  std::memcpy(&bits, &value, sizeof bits);
  return static_cast<uint16_t>(bfloat16_rounded_bits(bits) >> 16);
}

inline float bfloat16_to_float(uint16_t value) {
  const uint32_t bits = static_cast<uint32_t>(value) << 16;
  float result = 0;
  std::memcpy(&result, &bits, sizeof result);
  return result;
}

// `value` rounded to the nearest bfloat16, as float32 (exact).
inline float rounded_to_bfloat16(float value) {
  uint32_t bits = 0;
  std::memcpy(&bits, &value, sizeof bits);
  bits = bfloat16_rounded_bits(bits);
  float result = 0;
  std::memcpy(&result, &bits, sizeof result);
  return result;
}

// Element `index` of a compact buffer of `dtype`, as double.
inline double load_element(const void* data, DLDataType dtype, int64_t index) {
  const auto* bytes = static_cast<const unsigned char*>(data);
  switch (dtype.code) {
    case kDLBfloat: {
      uint16_t bits = 0;
      std::memcpy(&bits, bytes + index * 2, 2);
      return bfloat16_to_float(bits);
    }
    case kDLFloat:
      if (dtype.bits == 16)
        return static_cast<double>(reinterpret_cast<const _Float16*>(data)[index]);
      if (dtype.bits == 64) return reinterpret_cast<const double*>(data)[index];
      return reinterpret_cast<const float*>(data)[index];
    default:
      if (dtype.bits == 64)
        return static_cast<double>(reinterpret_cast<const int64_t*>(data)[index]);
      return reinterpret_cast<const int32_t*>(data)[index];
  }
}

// Stores `value` (rounded to the dtype) as element `index`.
inline void store_element(void* data, DLDataType dtype, int64_t index, double value) {
  auto* bytes = static_cast<unsigned char*>(data);
  switch (dtype.code) {
    case kDLBfloat: {
      const uint16_t bits = float_to_bfloat16(static_cast<float>(value));
      std::memcpy(bytes + index * 2, &bits, 2);
      return;
    }
    case kDLFloat:
      if (dtype.bits == 16) {
        reinterpret_cast<_Float16*>(data)[index] = static_cast<_Float16>(value);
      } else if (dtype.bits == 64) {
        reinterpret_cast<double*>(data)[index] = value;
      } else {
        reinterpret_cast<float*>(data)[index] = static_cast<float>(value);
      }
      return;
    default:
      if (dtype.bits == 64) {
        reinterpret_cast<int64_t*>(data)[index] = static_cast<int64_t>(value);
      } else {
        reinterpret_cast<int32_t*>(data)[index] = static_cast<int32_t>(value);
      }
  }
}

}  // namespace meshrun
