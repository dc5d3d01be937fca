// One fp32 value rounded to its nearest bf16 value, kept as fp32: bit for bit as fp32_to_bf16 of tensor/dtype.h
// (round to nearest even, overflow to Inf, NaN stays a quiet NaN). Integer operations only, so it vectorises inside
// `omp simd` loops on every ISA.
#pragma once

#include <bit>
#include <cstdint>

namespace moecore::kernels::cpu {

[[gnu::always_inline]] inline float bf16_value(const float x) {
  const uint32_t bits = std::bit_cast<uint32_t>(x);
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
  const uint32_t quiet_nan = (bits & 0xffff0000u) | 0x00400000u;
  return std::bit_cast<float>((bits & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

}  // namespace moecore::kernels::cpu
