// Element and scale number formats of low-precision training, bit-exact with TransformerEngine's conversions:
//   E4M3 (OCP "e4m3fn"): bias 7, 3 mantissa bits, max 448, no infinities, NaN = S.1111.111 (0x7F / 0xFF)
//   E5M2: bias 15, 2 mantissa bits, max 57344, infinities 0x7C / 0xFC, NaN = S.11111.{01,10,11}
//   E2M1 (FP4): bias 1, 1 mantissa bit, values 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives, no NaN or Inf
//   E8M0 (MXFP8's block scale): an unsigned biased exponent, 2^(code - 127); 0xFF = NaN
// Encoding rounds to nearest, ties to even, with subnormals. TE's casts use PTX `cvt.rn.satfinite`
// (transformer_engine/common/util/ptx.cuh, mul_cvt_*): a finite overflow and +-Inf become +-max finite.
// NaN becomes the canonical NaN code 0x7F (E4M3, E5M2) and +6 (E2M1, which has no NaN; ptx.cuh
// stochastic_round_fp4_e2m1: "NaN becomes positive MAX_NORM"). The non-saturating mode (IEEE-style, used to
// round-trip Inf) sends an E4M3 overflow to NaN and an E5M2 overflow to Inf, as CUDA's __NV_NOSAT.
#pragma once

#include <cstdint>
#include <string>

namespace moecore::quant {

enum class ElementFormat { kE4M3, kE5M2, kE2M1 };
enum class Saturation { kSatFinite, kNoSat };

std::string format_name(ElementFormat format);
// Largest finite magnitude: 448, 57344, 6 (TE's Quantized_Limits<T>::max_norm).
float format_max(ElementFormat format);

// fp32 -> code (one byte; E2M1 codes are 0..15: sign bit 3) and back.
uint8_t encode(ElementFormat format, float x, Saturation saturation = Saturation::kSatFinite);
float decode(ElementFormat format, uint8_t code);

uint8_t encode_e4m3(float x, Saturation saturation = Saturation::kSatFinite);
uint8_t encode_e5m2(float x, Saturation saturation = Saturation::kSatFinite);
uint8_t encode_e2m1(float x);  // always satfinite (the format has no Inf or NaN)
float decode_e4m3(uint8_t code);
float decode_e5m2(uint8_t code);
float decode_e2m1(uint8_t code);

// Stochastic rounding onto the E2M1 grid with 8 random bits, TE's ptx.cuh stochastic_round_fp4_e2m1 (the
// software form of `cvt.rs.satfinite.e2m1x4.f32`): t = fma(rbits / 256, step(|x|), |x|), then t is floored to
// the grid step at t and clamped to 6; the sign of x is kept (NaN -> +6). The result rounds up with probability
// (|x| - lo) / (hi - lo) up to the 1/256 resolution of the random bits.
uint8_t encode_e2m1_stochastic(float x, uint8_t rbits);

// E8M0 from a positive fp32 value, rounded up to a power of two as TE's float_to_e8m0
// (transformer_engine/common/util/ptx_arch_spec.cuh; `cvt.rp.satfinite.ue8m0x2.f32` on Blackwell):
// NaN -> 0xFF, Inf -> 0xFE, 0 -> 0x00, values <= 2^-127 -> 0x00, otherwise the exponent rounded up, saturated
// at 0xFE.
uint8_t e8m0_round_up(float value);
// 2^(code - 127) (code 0 is the subnormal 2^-127); 0xFF -> NaN (ptx.cuh exp2f).
float decode_e8m0(uint8_t code);
// 2^(127 - code), the reciprocal MXFP8 multiplies by before the cast (ptx.cuh exp2f_rcp<float>).
float e8m0_reciprocal(uint8_t code);

}  // namespace moecore::quant
