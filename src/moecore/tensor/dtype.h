// Element types and their conversions. Arithmetic runs in fp32/fp64; bf16 and fp16 are storage types,
// converted with IEEE round-to-nearest-even (NaN stays NaN, overflow goes to Inf).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace moecore {

enum class DType : uint8_t { kF32, kF64, kBF16, kF16, kI32, kI64, kU8 };

size_t dtype_size(DType dtype);
std::string_view dtype_name(DType dtype);  // "float32", "bfloat16", ...

uint16_t fp32_to_bf16(float value);
float bf16_to_fp32(uint16_t bits);
uint16_t fp32_to_fp16(float value);
float fp16_to_fp32(uint16_t bits);

}  // namespace moecore
