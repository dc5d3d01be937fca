// Naive reference expert-major rows: each expert's column scanned in turn, then its padding rows.
#include "moecore/kernels/cpu/expert_rows.h"

namespace moecore::kernels::ref {

void expert_routed_counts(int64_t* routed_X, const uint8_t* map_TE, const int64_t T, const int64_t E,
                          const int64_t e_begin, const int64_t e_end) {
  for (int64_t e = e_begin; e < e_end; ++e) {
    int64_t count = 0;
    for (int64_t t = 0; t < T; ++t) count += map_TE[t * E + e] != 0;
    routed_X[e - e_begin] = count;
  }
}

template <typename T>
void expert_major_rows(int64_t* token_R, T* probs_R, const uint8_t* map_TE, const T* probs_TE, const int64_t num_tokens,
                       const int64_t E, const int64_t e_begin, const int64_t e_end, const int64_t* rows_X) {
  int64_t r = 0;
  for (int64_t e = e_begin; e < e_end; ++e) {
    const int64_t end = r + rows_X[e - e_begin];
    for (int64_t t = 0; t < num_tokens; ++t) {
      if (map_TE[t * E + e] == 0) continue;
      token_R[r] = t;
      probs_R[r] = probs_TE[t * E + e];
      ++r;
    }
    for (; r < end; ++r) {
      token_R[r] = -1;
      probs_R[r] = T(0);
    }
  }
}

template void expert_major_rows<float>(int64_t*, float*, const uint8_t*, const float*, int64_t, int64_t, int64_t,
                                       int64_t, const int64_t*);
template void expert_major_rows<double>(int64_t*, double*, const uint8_t*, const double*, int64_t, int64_t, int64_t,
                                        int64_t, const int64_t*);

}  // namespace moecore::kernels::ref
