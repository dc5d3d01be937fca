#include "moecore/kernels/cpu/rank_update.h"

#include "moecore/kernels/cpu/vector_isa.h"

namespace moecore::kernels::cpu {

MOECORE_VECTOR_CLONES void rank_update(float* c_OI, const float* a_nO, const float* b_nI, const int64_t n,
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

}  // namespace moecore::kernels::cpu
