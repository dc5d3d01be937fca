// Array conversions between fp32 / fp64 and bf16 / fp16 bit patterns (uint16_t), bit for bit as the scalar functions
// of tensor/dtype.h: round to nearest even, NaN stays a (quiet) NaN, overflow goes to Inf. `encode_*` narrows,
// `decode_*` widens (exact). The fast versions pick a vector path at run time (ConvertIsa) and run OpenMP-parallel
// on large arrays; fp64 goes through fp32 with round-to-odd, so it too is rounded once.
#pragma once

#include <cstdint>
#include <string_view>

namespace moecore::kernels {

// The 16-bit format a kernel rounds the activations it writes to, as the ops round them under --bf16 / --fp16
// (kNone: fp32 / fp64, no rounding).
enum class ActivationRounding : uint8_t { kNone, kBF16, kF16 };

#define MOECORE_CONVERT_DECL                                                       \
  void encode_bf16(uint16_t* out, const float* in, int64_t n);                     \
  void encode_bf16(uint16_t* out, const double* in, int64_t n);                    \
  void decode_bf16(float* out, const uint16_t* in, int64_t n);                     \
  void decode_bf16(double* out, const uint16_t* in, int64_t n);                    \
  void encode_fp16(uint16_t* out, const float* in, int64_t n);                     \
  void encode_fp16(uint16_t* out, const double* in, int64_t n);                    \
  void decode_fp16(float* out, const uint16_t* in, int64_t n);                     \
  void decode_fp16(double* out, const uint16_t* in, int64_t n);                    \
  /* `value` rounded once to bf16 / fp16 bits (RNE; NaN and overflow as above). */ \
  uint16_t round_to_bf16(double value);                                            \
  uint16_t round_to_fp16(double value);                                            \
  /* Each of n fp32 values replaced by its nearest bf16 / fp16 value, in place. */ \
  void round_bf16(float* data, int64_t n);                                         \
  void round_fp16(float* data, int64_t n);

namespace cpu {
MOECORE_CONVERT_DECL

// The vector paths of the fp32 conversions. kAvx2: AVX2 + F16C (vcvtps2ph / vcvtph2ps); kAvx512: AVX-512F;
// kAvx512Bf16: kAvx512 with vcvtne2ps2bf16 for fp32 -> bf16 (that instruction flushes denormal inputs to zero, so
// lanes holding fp32 denormals are redone with the integer rounding; F16C keeps NaN payloads and quiets signalling
// NaNs where dtype.h does not, so NaN lanes are redone too).
enum class ConvertIsa : uint8_t { kScalar, kAvx2, kAvx512, kAvx512Bf16 };
bool convert_isa_supported(ConvertIsa isa);
ConvertIsa best_convert_isa();  // the one the functions above use
std::string_view convert_isa_name(ConvertIsa isa);

// One thread, one given path (tests; the GEMM's tile conversions). Throws std::invalid_argument for a path this
// CPU lacks.
void encode_bf16(uint16_t* out, const float* in, int64_t n, ConvertIsa isa);
void decode_bf16(float* out, const uint16_t* in, int64_t n, ConvertIsa isa);
void encode_fp16(uint16_t* out, const float* in, int64_t n, ConvertIsa isa);
void decode_fp16(float* out, const uint16_t* in, int64_t n, ConvertIsa isa);
}  // namespace cpu

namespace ref {
MOECORE_CONVERT_DECL
}
#undef MOECORE_CONVERT_DECL

}  // namespace moecore::kernels
