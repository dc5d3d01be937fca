// Reference token permutation kernels: the formulas of permute.h, one element at a time.
#include <cstdint>

#include "moecore/kernels/cpu/permute.h"

namespace moecore::kernels::ref {

template <typename T>
void moe_unpermute(T* out_NW, const T* in_RW, const int64_t* index_R, const T* probs_R, const int64_t R,
                   const int64_t /*N*/, const int64_t W) {
  for (int64_t r = 0; r < R; ++r) {
    if (index_R[r] < 0) continue;
    for (int64_t w = 0; w < W; ++w) {
      out_NW[index_R[r] * W + w] += probs_R == nullptr ? in_RW[r * W + w] : probs_R[r] * in_RW[r * W + w];
    }
  }
}

template <typename T>
void moe_unpermute_backward(T* din_RW, T* dprobs_R, const T* dout_NW, const T* in_RW, const int64_t* index_R,
                            const T* probs_R, const int64_t R, const int64_t W) {
  for (int64_t r = 0; r < R; ++r) {
    const int64_t n = index_R[r];
    double dot = 0.0;
    for (int64_t w = 0; w < W; ++w) {
      const T dout = n < 0 ? T(0) : dout_NW[n * W + w];
      if (din_RW != nullptr) din_RW[r * W + w] = probs_R == nullptr ? dout : probs_R[r] * dout;
      if (dprobs_R != nullptr) dot += static_cast<double>(dout) * static_cast<double>(in_RW[r * W + w]);
    }
    if (dprobs_R != nullptr) dprobs_R[r] = static_cast<T>(dot);
  }
}

template <typename T>
void sort_chunks(T* out_RW, const T* in_NW, const int64_t* first_C, const int64_t* rows_C, const int64_t C,
                 const int64_t W) {
  int64_t out_row = 0;
  for (int64_t c = 0; c < C; ++c) {
    for (int64_t i = 0; i < rows_C[c]; ++i, ++out_row) {
      for (int64_t w = 0; w < W; ++w) out_RW[out_row * W + w] = in_NW[(first_C[c] + i) * W + w];
    }
  }
}

template <typename T>
void unsort_chunks(T* out_NW, const T* in_RW, const int64_t* first_C, const int64_t* rows_C, const int64_t C,
                   const int64_t N, const int64_t W) {
  for (int64_t i = 0; i < N * W; ++i) out_NW[i] = T(0);
  int64_t in_row = 0;
  for (int64_t c = 0; c < C; ++c) {
    for (int64_t i = 0; i < rows_C[c]; ++i, ++in_row) {
      for (int64_t w = 0; w < W; ++w) out_NW[(first_C[c] + i) * W + w] = in_RW[in_row * W + w];
    }
  }
}

#define MOECORE_INSTANTIATE(T)                                                                                     \
  template void moe_unpermute<T>(T*, const T*, const int64_t*, const T*, int64_t, int64_t, int64_t);               \
  template void moe_unpermute_backward<T>(T*, T*, const T*, const T*, const int64_t*, const T*, int64_t, int64_t); \
  template void sort_chunks<T>(T*, const T*, const int64_t*, const int64_t*, int64_t, int64_t);                    \
  template void unsort_chunks<T>(T*, const T*, const int64_t*, const int64_t*, int64_t, int64_t, int64_t);
MOECORE_INSTANTIATE(float)
MOECORE_INSTANTIATE(double)
#undef MOECORE_INSTANTIATE

}  // namespace moecore::kernels::ref
