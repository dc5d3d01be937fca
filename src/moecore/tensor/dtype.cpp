#include "moecore/tensor/dtype.h"

#include <bit>
#include <stdexcept>

namespace moecore {

size_t dtype_size(const DType dtype) {
  switch (dtype) {
    case DType::kF32: return 4;
    case DType::kF64: return 8;
    case DType::kBF16: return 2;
    case DType::kF16: return 2;
    case DType::kI32: return 4;
    case DType::kI64: return 8;
    case DType::kU8: return 1;
  }
  throw std::invalid_argument("unknown dtype");
}

std::string_view dtype_name(const DType dtype) {
  switch (dtype) {
    case DType::kF32: return "float32";
    case DType::kF64: return "float64";
    case DType::kBF16: return "bfloat16";
    case DType::kF16: return "float16";
    case DType::kI32: return "int32";
    case DType::kI64: return "int64";
    case DType::kU8: return "uint8";
  }
  throw std::invalid_argument("unknown dtype");
}

uint16_t fp32_to_bf16(const float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);  // quiet NaN
  const uint32_t rounding_bias = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding_bias) >> 16);
}

float bf16_to_fp32(const uint16_t bits) { return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16); }

uint16_t fp32_to_fp16(const float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t abs_bits = bits & 0x7fffffffu;
  if (abs_bits > 0x7f800000u) return sign | 0x7e00u;   // NaN
  if (abs_bits >= 0x477ff000u) return sign | 0x7c00u;  // rounds to >= 65520: Inf
  if (abs_bits < 0x38800000u) {                        // below fp16's smallest normal: subnormal or zero
    if (abs_bits < 0x33000000u) return sign;           // below half the smallest subnormal
    const uint32_t exponent = abs_bits >> 23;
    const uint32_t mantissa = (abs_bits & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126u - exponent;  // 14..24 extra bits to drop
    uint32_t half = mantissa >> shift;
    const uint32_t remainder = mantissa & ((1u << shift) - 1u);
    const uint32_t halfway = 1u << (shift - 1u);
    if (remainder > halfway || (remainder == halfway && (half & 1u))) ++half;
    return static_cast<uint16_t>(sign | half);
  }
  uint32_t half = ((abs_bits - 0x38000000u) >> 13);  // rebias exponent 127 -> 15
  const uint32_t remainder = abs_bits & 0x1fffu;
  if (remainder > 0x1000u || (remainder == 0x1000u && (half & 1u))) ++half;
  return static_cast<uint16_t>(sign | half);
}

float fp16_to_fp32(const uint16_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
  const uint32_t exponent = (bits >> 10) & 0x1fu;
  uint32_t mantissa = bits & 0x3ffu;
  if (exponent == 0x1fu) return std::bit_cast<float>(sign | 0x7f800000u | (mantissa << 13));
  if (exponent == 0) {
    if (mantissa == 0) return std::bit_cast<float>(sign);
    int e = -1;
    do {
      ++e;
      mantissa <<= 1;
    } while ((mantissa & 0x400u) == 0);
    return std::bit_cast<float>(sign | ((112u - static_cast<uint32_t>(e)) << 23) | ((mantissa & 0x3ffu) << 13));
  }
  return std::bit_cast<float>(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

}  // namespace moecore
