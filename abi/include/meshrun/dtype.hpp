/*
 * meshrun/dtype.hpp — the element types meshrun moves, for C++ plugin
 * authors and the runtime alike (header-only; nothing to link).
 *
 * DLPack names an element type; this header converts one: float32 to and
 * from bfloat16 and float16 with IEEE round-to-nearest-even, and any
 * element of a compact buffer of float32, float64, bfloat16, float16, int32
 * or int64 read or written as double (the reference side of tests and
 * benchmarks, and what a backend needs to reduce a dtype it has no loop
 * for). Every function is pure: no allocation, no errors, no state.
 */
#ifndef MESHRUN_DTYPE_HPP_
#define MESHRUN_DTYPE_HPP_

#include <dlpack/dlpack.h>

#include <cstdint>
#include <cstring>

namespace meshrun {

/* The bits of a float32 rounded to bfloat16 and widened back: round to
 * nearest even, a NaN stays a (quiet) NaN. Branch-free, so loops over it
 * vectorize. */
inline uint32_t bfloat16_rounded_bits(uint32_t bits) {
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
  const uint32_t quiet_nan = (bits | 0x00400000u) & 0xffff0000u;
  return (bits & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded;
}

/* float32 -> bfloat16 bits, round to nearest even (NaN stays NaN). */
inline uint16_t float_to_bfloat16(float value) {
  uint32_t bits = 0;
  std::memcpy(&bits, &value, sizeof bits);
  return static_cast<uint16_t>(bfloat16_rounded_bits(bits) >> 16);
}

/* bfloat16 bits -> float32 (exact). */
inline float bfloat16_to_float(uint16_t value) {
  const uint32_t bits = static_cast<uint32_t>(value) << 16;
  float result = 0;
  std::memcpy(&result, &bits, sizeof result);
  return result;
}

/* `value` rounded to the nearest bfloat16, as float32 (exact). */
inline float rounded_to_bfloat16(float value) {
  uint32_t bits = 0;
  std::memcpy(&bits, &value, sizeof bits);
  bits = bfloat16_rounded_bits(bits);
  float result = 0;
  std::memcpy(&result, &bits, sizeof result);
  return result;
}

namespace dtype_portable {

/* IEEE binary16 conversions on the bits, for compilers without _Float16
 * (clang before 15 on x86-64); elsewhere the tests hold them equal to the
 * compiler's. */
inline float float16_to_float(uint16_t value) {
  const uint32_t sign = static_cast<uint32_t>(value & 0x8000u) << 16;
  const uint32_t exponent = (value >> 10) & 0x1fu;
  uint32_t mantissa = value & 0x3ffu;
  uint32_t bits = sign;
  if (exponent == 0x1fu) {
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112u) << 23) | (mantissa << 13);
  } else if (mantissa != 0) {
    uint32_t shift = 0; /* a subnormal: normalize it */
    while ((mantissa & 0x400u) == 0) {
      mantissa <<= 1;
      ++shift;
    }
    bits = sign | ((113u - shift) << 23) | ((mantissa & 0x3ffu) << 13);
  }
  float result = 0;
  std::memcpy(&result, &bits, sizeof result);
  return result;
}

inline uint16_t float_to_float16(float value) {
  uint32_t bits = 0;
  std::memcpy(&bits, &value, sizeof bits);
  const auto sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);
  if (magnitude >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);
  if (magnitude < 0x38800000u) {
    /* A float16 subnormal or zero: the value in units of 2^-24, rounded. */
    const uint32_t exponent = magnitude >> 23;
    if (exponent < 102u) return sign;
    const uint32_t mantissa = (magnitude & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126u - exponent;
    const uint32_t half_unit = 1u << (shift - 1);
    const uint32_t rest = mantissa & ((1u << shift) - 1);
    uint32_t result = mantissa >> shift;
    if (rest > half_unit || (rest == half_unit && (result & 1u) != 0)) ++result;
    return static_cast<uint16_t>(sign | result);
  }
  const uint32_t rebiased = magnitude - 0x38000000u;
  const uint32_t rounded = rebiased + 0xfffu + ((rebiased >> 13) & 1u);
  return static_cast<uint16_t>(sign | (rounded >> 13));
}

}  // namespace dtype_portable

#if defined(__FLT16_MAX__)
/* float16 bits -> float32 (exact). */
inline float float16_to_float(uint16_t value) {
  _Float16 half;
  std::memcpy(&half, &value, sizeof half);
  return static_cast<float>(half);
}

/* float32 (or float64) -> float16 bits, round to nearest even; overflow
 * goes to infinity, a NaN stays a NaN. */
template <class Real>
inline uint16_t to_float16(Real value) {
  const auto half = static_cast<_Float16>(value);
  uint16_t bits = 0;
  std::memcpy(&bits, &half, sizeof bits);
  return bits;
}
#else
inline float float16_to_float(uint16_t value) { return dtype_portable::float16_to_float(value); }

/* A double is narrowed to float32 first: the one place this differs from
 * _Float16 is a double within 2^-29 of a float16 rounding midpoint. */
template <class Real>
inline uint16_t to_float16(Real value) {
  return dtype_portable::float_to_float16(static_cast<float>(value));
}
#endif

/* float32 -> float16 bits, round to nearest even. */
inline uint16_t float_to_float16(float value) { return to_float16(value); }

/* Element `index` of a compact buffer of `dtype`, as double. Integer types
 * other than int64 read as int32. */
inline double load_element(const void* data, DLDataType dtype, int64_t index) {
  const auto* bytes = static_cast<const unsigned char*>(data);
  if (dtype.code == kDLBfloat || (dtype.code == kDLFloat && dtype.bits == 16)) {
    uint16_t bits = 0;
    std::memcpy(&bits, bytes + index * 2, 2);
    return dtype.code == kDLBfloat ? bfloat16_to_float(bits) : float16_to_float(bits);
  }
  if (dtype.code == kDLFloat) {
    if (dtype.bits == 64) return reinterpret_cast<const double*>(data)[index];
    return reinterpret_cast<const float*>(data)[index];
  }
  if (dtype.bits == 64) return static_cast<double>(reinterpret_cast<const int64_t*>(data)[index]);
  return reinterpret_cast<const int32_t*>(data)[index];
}

/* Stores `value`, rounded to the dtype, as element `index`. */
inline void store_element(void* data, DLDataType dtype, int64_t index, double value) {
  auto* bytes = static_cast<unsigned char*>(data);
  if (dtype.code == kDLBfloat || (dtype.code == kDLFloat && dtype.bits == 16)) {
    const uint16_t bits =
        dtype.code == kDLBfloat ? float_to_bfloat16(static_cast<float>(value)) : to_float16(value);
    std::memcpy(bytes + index * 2, &bits, 2);
  } else if (dtype.code == kDLFloat) {
    if (dtype.bits == 64) {
      reinterpret_cast<double*>(data)[index] = value;
    } else {
      reinterpret_cast<float*>(data)[index] = static_cast<float>(value);
    }
  } else if (dtype.bits == 64) {
    reinterpret_cast<int64_t*>(data)[index] = static_cast<int64_t>(value);
  } else {
    reinterpret_cast<int32_t*>(data)[index] = static_cast<int32_t>(value);
  }
}

}  // namespace meshrun

#endif /* MESHRUN_DTYPE_HPP_ */
