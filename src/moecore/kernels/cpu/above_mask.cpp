#include "moecore/kernels/cpu/above_mask.h"

#include <stdexcept>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MOECORE_ABOVE_MASK_X86 1
#include <immintrin.h>
#endif

namespace moecore::kernels::cpu {

uint32_t above_mask16_portable(const double* values, const double bound) {
  uint32_t mask = 0;
  for (uint32_t j = 0; j < 16; ++j) mask |= static_cast<uint32_t>(values[j] > bound) << j;
  return mask;
}

#if defined(MOECORE_ABOVE_MASK_X86)
bool above_mask16_avx_usable() {
  static const bool usable = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx") != 0;
  }();
  return usable;
}
bool above_mask16_avx512_usable() {
  static const bool usable = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") != 0;
  }();
  return usable;
}

__attribute__((target("avx"))) uint32_t above_mask16_avx(const double* values, const double bound) {
  const __m256d b = _mm256_set1_pd(bound);
  uint32_t mask = 0;
  for (int q = 0; q < 4; ++q) {
    const __m256d above = _mm256_cmp_pd(_mm256_loadu_pd(values + 4 * q), b, _CMP_GT_OQ);
    mask |= static_cast<uint32_t>(_mm256_movemask_pd(above)) << (4 * q);
  }
  return mask;
}

__attribute__((target("avx512f"))) uint32_t above_mask16_avx512(const double* values, const double bound) {
  const __m512d b = _mm512_set1_pd(bound);
  const __mmask8 low = _mm512_cmp_pd_mask(_mm512_loadu_pd(values), b, _CMP_GT_OQ);
  const __mmask8 high = _mm512_cmp_pd_mask(_mm512_loadu_pd(values + 8), b, _CMP_GT_OQ);
  return static_cast<uint32_t>(low) | static_cast<uint32_t>(high) << 8;
}
#else
bool above_mask16_avx_usable() { return false; }
bool above_mask16_avx512_usable() { return false; }
uint32_t above_mask16_avx(const double* /*values*/, double /*bound*/) {
  throw std::logic_error("above_mask16_avx: not an x86-64 build");
}
uint32_t above_mask16_avx512(const double* /*values*/, double /*bound*/) {
  throw std::logic_error("above_mask16_avx512: not an x86-64 build");
}
#endif

AboveMask16 best_above_mask16() {
  static const AboveMask16 best = above_mask16_avx512_usable() ? &above_mask16_avx512
                                  : above_mask16_avx_usable()  ? &above_mask16_avx
                                                               : &above_mask16_portable;
  return best;
}

}  // namespace moecore::kernels::cpu
