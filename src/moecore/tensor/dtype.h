// Element types and their conversions. Arithmetic runs in fp32/fp64; bf16 and fp16 are storage types,
// converted with IEEE round-to-nearest-even (NaN stays NaN, overflow goes to Inf).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <type_traits>

namespace moecore {

enum class DType : uint8_t { kF32, kF64, kBF16, kF16, kI32, kI64, kU8 };

size_t dtype_size(DType dtype);

// The DType of a C++ element type (float, double, int32_t, int64_t, uint8_t).
template <typename T>
constexpr DType dtype_of() {
  if constexpr (std::is_same_v<T, float>) return DType::kF32;
  if constexpr (std::is_same_v<T, double>) return DType::kF64;
  if constexpr (std::is_same_v<T, int32_t>) return DType::kI32;
  if constexpr (std::is_same_v<T, int64_t>) return DType::kI64;
  if constexpr (std::is_same_v<T, uint8_t>) return DType::kU8;
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double> || std::is_same_v<T, int32_t> ||
                    std::is_same_v<T, int64_t> || std::is_same_v<T, uint8_t>,
                "no DType for this element type");
  return DType::kU8;
}
std::string_view dtype_name(DType dtype);  // "float32", "bfloat16", ...

uint16_t fp32_to_bf16(float value);
float bf16_to_fp32(uint16_t bits);
uint16_t fp32_to_fp16(float value);
float fp16_to_fp32(uint16_t bits);

}  // namespace moecore
