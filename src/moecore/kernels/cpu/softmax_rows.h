// Row-wise softmax pieces shared by the fast cross-entropy kernels (loss.cpp) and the vocabulary-parallel ones
// (vocab_parallel.cpp): max-subtracted exponentials vectorised for float (AVX-512 or AVX2 + FMA chosen at run time,
// so a portable build uses them too; both give the same bits). Internal to kernels/cpu.
#pragma once

#if defined(__x86_64__)
// GCC 12's AVX-512 intrinsics start from _mm512_undefined_*(), which its flow analysis reports as
// (maybe-)uninitialized once inlined (GCC bug 105593, fixed in GCC 13).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#define MOECORE_HAVE_AVX2_PATH 1
#define MOECORE_AVX2_FMA __attribute__((target("avx2,fma")))
#define MOECORE_AVX512_FMA __attribute__((target("avx512f,avx2,fma")))
#endif

#include <bit>
#include <cmath>
#include <cstdint>

#include "moecore/kernels/cpu/vector_isa.h"

namespace moecore::kernels::cpu::softmax_rows {
// Internal linkage, as where these lived before: each including file gets its own (run-time dispatched) copies.
namespace {

// exp(x) for float with Cody-Waite range reduction and Cephes' degree-6 polynomial (about 1 ulp), written with
// plain arithmetic so the loops below vectorise (glibc's expf is a scalar call). Inputs are <= 0 here
// (max-subtracted); below -87 the result flushes to 0.
inline float exp_nonpositive(float x) {
  const bool underflow = x < -87.0f;
  x = underflow ? -87.0f : x;
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  const float scale = std::bit_cast<float>((static_cast<int32_t>(n) + 127) << 23);
  return underflow ? 0.0f : y * scale;
}

#if defined(MOECORE_HAVE_AVX2_PATH)
// True when this CPU runs the AVX2 + FMA functions below (tested once).
inline bool cpu_has_avx2_fma() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
}

// Eight lanes of exp_nonpositive.
MOECORE_AVX2_FMA inline __m256 exp_nonpositive8(__m256 x) {
  const __m256 underflow = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  const __m256 y = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(underflow, _mm256_mul_ps(y, _mm256_castsi256_ps(exponent)));
}

// sum_exp's 8-lane sums from element v on (acc holding those of the elements before), over the 8-aligned prefix,
// added to sum lane by lane; returns how many elements it consumed.
MOECORE_AVX2_FMA inline int64_t sum_exp_avx2_from(double& sum, const float* row, const int64_t V, const float shift,
                                                  int64_t v, __m256 acc) {
  const __m256 shift8 = _mm256_set1_ps(shift);
  for (; v + 8 <= V; v += 8)
    acc = _mm256_add_ps(acc, exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(row + v), shift8)));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  for (const float lane : lanes) sum += lane;
  return v;
}

// The 8-aligned prefix of sum_exp; returns how many elements it consumed.
MOECORE_AVX2_FMA inline int64_t sum_exp_avx2(double& sum, const float* row, const int64_t V, const float shift) {
  return sum_exp_avx2_from(sum, row, V, shift, 0, _mm256_setzero_ps());
}

// The 8-aligned prefix of scaled_softmax from element v on; returns how many elements it wrote.
MOECORE_AVX2_FMA inline int64_t scaled_softmax_avx2(float* out, const float* row, const int64_t V, const float lse,
                                                    const float scale, int64_t v = 0) {
  const __m256 lse8 = _mm256_set1_ps(lse), scale8 = _mm256_set1_ps(scale);
  for (; v + 8 <= V; v += 8) {
    const __m256 e = exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(row + v), lse8));
    _mm256_storeu_ps(out + v, _mm256_mul_ps(scale8, e));
  }
  return v;
}

// True when this CPU runs the AVX-512 functions below (tested once).
inline bool cpu_has_avx512f() {
  static const bool has = cpu_has_avx2_fma() && __builtin_cpu_supports("avx512f");
  return has;
}

// Sixteen lanes of exp_nonpositive, each the bits of exp_nonpositive8's.
MOECORE_AVX512_FMA inline __m512 exp_nonpositive16(__m512 x) {
  const __mmask16 underflow = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 y = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512i exponent = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(static_cast<__mmask16>(~underflow), y, _mm512_castsi512_ps(exponent));
}

// sum_exp_avx2 with sixteen exponentials a step: each half added to the 8-lane sums in the order the AVX2 loop adds
// them, so the sum has the same bits.
MOECORE_AVX512_FMA inline int64_t sum_exp_avx512(double& sum, const float* row, const int64_t V, const float shift) {
  int64_t v = 0;
  __m256 acc = _mm256_setzero_ps();
  const __m512 shift16 = _mm512_set1_ps(shift);
  for (; v + 16 <= V; v += 16) {
    const __m512 e = exp_nonpositive16(_mm512_sub_ps(_mm512_loadu_ps(row + v), shift16));
    acc = _mm256_add_ps(acc, _mm512_castps512_ps256(e));
    acc = _mm256_add_ps(acc, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1)));
  }
  return sum_exp_avx2_from(sum, row, V, shift, v, acc);
}

// scaled_softmax_avx2 with sixteen exponentials a step (the same values).
MOECORE_AVX512_FMA inline int64_t scaled_softmax_avx512(float* out, const float* row, const int64_t V, const float lse,
                                                        const float scale) {
  int64_t v = 0;
  const __m512 lse16 = _mm512_set1_ps(lse), scale16 = _mm512_set1_ps(scale);
  for (; v + 16 <= V; v += 16) {
    const __m512 e = exp_nonpositive16(_mm512_sub_ps(_mm512_loadu_ps(row + v), lse16));
    _mm512_storeu_ps(out + v, _mm512_mul_ps(scale16, e));
  }
  return scaled_softmax_avx2(out, row, V, lse, scale, v);
}

// Sixteen lanes of bf16_value (bf16_value.h): round to nearest even on the upper 16 bits, NaNs kept quiet (a rare
// branch: a NaN's rounding carry would reach the sign).
MOECORE_AVX512_FMA inline __m512 bf16_value16(const __m512 x) {
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

// Sixteen lanes of the fp16 rounding of round_fp16 (convert.h, bit for bit as dtype.h): vcvtps2ph to nearest even
// and back, NaNs made dtype.h's sign | quiet NaN (vcvtps2ph keeps their payloads; a rare branch).
MOECORE_AVX512_FMA inline __m512 fp16_value16(const __m512 x) {
  const __m512 rounded = _mm512_cvtph_ps(_mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  if (nan == 0) return rounded;
  const __m512i sign = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(static_cast<int32_t>(0x80000000u)));
  const __m512i quiet_nan = _mm512_or_si512(sign, _mm512_set1_epi32(0x7fc00000));
  return _mm512_mask_blend_ps(nan, rounded, _mm512_castsi512_ps(quiet_nan));
}

// sum_exp_avx512 over the row's values rounded by Round (bf16_value16 or fp16_value16) in its 16-lane prefix, which it
// rounds in place as it reads it (the sums of sum_exp over the rounded row); the elements past the prefix are read as
// they are.
template <__m512 (*Round)(__m512)>
MOECORE_AVX512_FMA inline int64_t sum_exp_rounded_avx512(double& sum, float* row, const int64_t V, const float shift) {
  int64_t v = 0;
  __m256 acc = _mm256_setzero_ps();
  const __m512 shift16 = _mm512_set1_ps(shift);
  for (; v + 16 <= V; v += 16) {
    const __m512 x = Round(_mm512_loadu_ps(row + v));
    _mm512_storeu_ps(row + v, x);
    const __m512 e = exp_nonpositive16(_mm512_sub_ps(x, shift16));
    acc = _mm256_add_ps(acc, _mm512_castps512_ps256(e));
    acc = _mm256_add_ps(acc, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1)));
  }
  return sum_exp_avx2_from(sum, row, V, shift, v, acc);
}

// In place over the 16-aligned prefix of row: scaled_softmax_avx512's values, dloss taken from element `target`'s
// (scaled_softmax followed by row[target] -= dloss), each rounded by Round. Returns how many elements it wrote.
template <__m512 (*Round)(__m512)>
MOECORE_AVX512_FMA inline int64_t scaled_softmax_rounded_avx512(float* row, const int64_t V, const float lse,
                                                                const float dloss, const int64_t target) {
  int64_t v = 0;
  const __m512 lse16 = _mm512_set1_ps(lse), dloss16 = _mm512_set1_ps(dloss);
  for (; v + 16 <= V; v += 16) {
    const __m512 x = _mm512_loadu_ps(row + v);
    __m512 g = _mm512_mul_ps(dloss16, exp_nonpositive16(_mm512_sub_ps(x, lse16)));
    if (target >= v && target < v + 16) {
      g = _mm512_mask_sub_ps(g, static_cast<__mmask16>(1u << (target - v)), g, dloss16);
    }
    _mm512_storeu_ps(row + v, Round(g));
  }
  return v;
}
#endif

// Sum over v of exp(row[v] - shift), for shift >= max(row).
inline double sum_exp(const float* row, const int64_t V, const float shift) {
  int64_t v = 0;
  double sum = 0.0;
#if defined(MOECORE_HAVE_AVX2_PATH)
  if (cpu_has_avx512f()) {
    v = sum_exp_avx512(sum, row, V, shift);
  } else if (cpu_has_avx2_fma()) {
    v = sum_exp_avx2(sum, row, V, shift);
  }
#endif
  for (; v < V; ++v) sum += exp_nonpositive(row[v] - shift);
  return sum;
}
inline double sum_exp(const double* row, const int64_t V, const double shift) {
  double sum = 0.0;
  for (int64_t v = 0; v < V; ++v) sum += std::exp(row[v] - shift);
  return sum;
}

inline void scaled_softmax(float* out, const float* row, const int64_t V, const float lse, const float scale) {
  int64_t v = 0;
#if defined(MOECORE_HAVE_AVX2_PATH)
  if (cpu_has_avx512f()) {
    v = scaled_softmax_avx512(out, row, V, lse, scale);
  } else if (cpu_has_avx2_fma()) {
    v = scaled_softmax_avx2(out, row, V, lse, scale);
  }
#endif
  for (; v < V; ++v) out[v] = scale * exp_nonpositive(row[v] - lse);
}
inline void scaled_softmax(double* out, const double* row, const int64_t V, const double lse, const double scale) {
  for (int64_t v = 0; v < V; ++v) out[v] = scale * std::exp(row[v] - lse);
}

template <typename T>
MOECORE_VECTOR_CLONES T row_max(const T* row, int64_t V) {
  T best = row[0];
#pragma omp simd reduction(max : best)
  for (int64_t v = 1; v < V; ++v) best = row[v] > best ? row[v] : best;
  return best;
}

}  // namespace
}  // namespace moecore::kernels::cpu::softmax_rows
