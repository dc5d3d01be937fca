#include "moecore/kernels/cpu/rank_update.h"

namespace moecore::kernels::ref {

void rank_update(float* c_OI, const float* a_nO, const float* b_nI, const int64_t n, const int64_t O, const int64_t I) {
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t o = 0; o < O; ++o) {
      for (int64_t i = 0; i < I; ++i) c_OI[o * I + i] += a_nO[r * O + o] * b_nI[r * I + i];
    }
  }
}

}  // namespace moecore::kernels::ref
