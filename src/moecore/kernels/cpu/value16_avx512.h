// Sixteen fp32 lanes rounded to their nearest bf16 or fp16 values and kept as fp32: the AVX-512 forms of bf16_value
// (bf16_value.h) and of round_fp16 (convert.h), bit for bit. Internal to kernels/cpu; callers hold the AVX-512 target.
#pragma once

// GCC 12's AVX-512 intrinsics start from _mm512_undefined_*(), which its flow analysis reports as
// (maybe-)uninitialized once inlined (GCC bug 105593, fixed in GCC 13).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop

#include <cstdint>

namespace moecore::kernels::cpu {
// Internal linkage: each including file gets its own copies, inlined into its AVX-512 functions.
namespace {

// Round to nearest even on the upper 16 bits, NaNs kept quiet (a rare branch: a NaN's rounding carry would reach the
// sign).
__attribute__((target("avx512f,avx2,fma"))) inline __m512 bf16_value16(const __m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i upper = _mm512_set1_epi32(static_cast<int32_t>(0xffff0000u));
  const __m512i rounded =
      _mm512_and_si512(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), lsb), upper);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  if (nan == 0) return _mm512_castsi512_ps(rounded);
  const __m512i quiet_nan = _mm512_or_si512(_mm512_and_si512(bits, upper), _mm512_set1_epi32(0x00400000));
  return _mm512_castsi512_ps(_mm512_mask_blend_epi32(nan, rounded, quiet_nan));
}

// vcvtps2ph to nearest even and back, NaNs made dtype.h's sign | quiet NaN (vcvtps2ph keeps their payloads; a rare
// branch).
__attribute__((target("avx512f,avx2,fma"))) inline __m512 fp16_value16(const __m512 x) {
  const __m512 rounded = _mm512_cvtph_ps(_mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  if (nan == 0) return rounded;
  const __m512i sign = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(static_cast<int32_t>(0x80000000u)));
  const __m512i quiet_nan = _mm512_or_si512(sign, _mm512_set1_epi32(0x7fc00000));
  return _mm512_mask_blend_ps(nan, rounded, _mm512_castsi512_ps(quiet_nan));
}

}  // namespace
}  // namespace moecore::kernels::cpu
