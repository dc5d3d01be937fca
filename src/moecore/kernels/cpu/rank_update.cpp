#include "moecore/kernels/cpu/rank_update.h"

#include <algorithm>
#include <cstdint>

#include "moecore/kernels/cpu/vector_isa.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MOECORE_RANK_UPDATE_STREAMING 1
#include <immintrin.h>
#endif

namespace moecore::kernels::cpu {

MOECORE_VECTOR_CLONES void rank_update_portable(float* c_OI, const float* a_nO, const float* b_nI, const int64_t n,
                                                const int64_t O, const int64_t I) {
  // 64 columns: four AVX-512 (eight AVX2) registers of sums, so the n adds of one column chain through registers.
  constexpr int64_t kCols = 64;
  for (int64_t o = 0; o < O; ++o) {
    float* c = c_OI + o * I;
    int64_t i0 = 0;
    for (; i0 + kCols <= I; i0 += kCols) {
      float sums[kCols];
      for (int64_t j = 0; j < kCols; ++j) sums[j] = c[i0 + j];
      for (int64_t r = 0; r < n; ++r) {
        const float scale = a_nO[r * O + o];
        const float* b = b_nI + r * I + i0;
        for (int64_t j = 0; j < kCols; ++j) sums[j] += scale * b[j];
      }
      for (int64_t j = 0; j < kCols; ++j) c[i0 + j] = sums[j];
    }
    for (int64_t r = 0; r < n && i0 < I; ++r) {
      const float scale = a_nO[r * O + o];
      const float* b = b_nI + r * I;
      for (int64_t i = i0; i < I; ++i) c[i] += scale * b[i];
    }
  }
}

namespace {

#if defined(MOECORE_RANK_UPDATE_STREAMING)
// GCC 12's AVX-512 intrinsics start from an undefined vector, which -Wmaybe-uninitialized reports once inlined.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
bool avx512_usable() {
  static const bool usable = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") != 0;
  }();
  return usable;
}

// Whole vectors load and store unmasked (with a full mask the masked forms measured slower on AMD Zen 5).
__attribute__((target("avx512f"))) inline __m512 load_avx512(const __mmask16 k, const float* from) {
  return k == 0xffff ? _mm512_loadu_ps(from) : _mm512_maskz_loadu_ps(k, from);
}

// 64 columns of a row in four registers, from c's values (from 0.0f when overwriting, so 0 + a_0 b_0 + ...:
// rank_update's sums on a zeroed row), the products added in row order, mul then add: each element's sum is
// rank_update_portable's. Overwriting, whole 64-byte aligned vectors stream out, so c is written without being read
// into the cache first.
template <bool kOverwrite>
__attribute__((target("avx512f"))) void rank_update_avx512(float* c_OI, const float* a_nO, const float* b_nI,
                                                           const int64_t n, const int64_t O, const int64_t I) {
  for (int64_t o = 0; o < O; ++o) {
    float* c = c_OI + o * I;
    for (int64_t i0 = 0; i0 < I; i0 += 64) {
      __mmask16 k[4];
      for (int v = 0; v < 4; ++v) {
        const int64_t left = I - i0 - 16 * v;
        k[v] =
            left <= 0 ? 0 : (left >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << left) - 1u));
      }
      __m512 sums[4];
      for (int v = 0; v < 4; ++v) sums[v] = kOverwrite ? _mm512_setzero_ps() : load_avx512(k[v], c + i0 + 16 * v);
      for (int64_t r = 0; r < n; ++r) {
        const __m512 scale = _mm512_set1_ps(a_nO[r * O + o]);
        const float* b = b_nI + r * I + i0;
        for (int v = 0; v < 4; ++v) {
          sums[v] = _mm512_add_ps(sums[v], _mm512_mul_ps(scale, load_avx512(k[v], b + 16 * v)));
        }
      }
      for (int v = 0; v < 4; ++v) {
        float* out = c + i0 + 16 * v;
        if (kOverwrite && k[v] == 0xffff && (reinterpret_cast<uintptr_t>(out) & 63) == 0) {
          _mm512_stream_ps(out, sums[v]);
        } else if (k[v] == 0xffff) {
          _mm512_storeu_ps(out, sums[v]);
        } else {
          _mm512_mask_storeu_ps(out, k[v], sums[v]);
        }
      }
    }
  }
  if (kOverwrite) _mm_sfence();
}
#pragma GCC diagnostic pop
#endif

}  // namespace

void rank_update_overwrite(float* c_OI, const float* a_nO, const float* b_nI, const int64_t n, const int64_t O,
                           const int64_t I) {
#if defined(MOECORE_RANK_UPDATE_STREAMING)
  if (avx512_usable()) {
    rank_update_avx512<true>(c_OI, a_nO, b_nI, n, O, I);
    return;
  }
#endif
  std::fill_n(c_OI, O * I, 0.0f);
  rank_update_portable(c_OI, a_nO, b_nI, n, O, I);
}

void rank_update(float* c_OI, const float* a_nO, const float* b_nI, const int64_t n, const int64_t O, const int64_t I) {
#if defined(MOECORE_RANK_UPDATE_STREAMING)
  if (avx512_usable()) {
    rank_update_avx512<false>(c_OI, a_nO, b_nI, n, O, I);
    return;
  }
#endif
  rank_update_portable(c_OI, a_nO, b_nI, n, O, I);
}

}  // namespace moecore::kernels::cpu
