// Fast embedding lookup and its gradient.
#include "moecore/kernels/cpu/embedding.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace moecore::kernels::cpu {
namespace {

// Validates every id before any thread starts (an exception must not escape an OpenMP region).
void check_ids(const int32_t* ids_T, const int64_t n_tokens, const int64_t V) {
  for (int64_t t = 0; t < n_tokens; ++t) {
    if (ids_T[t] < 0 || ids_T[t] >= V) {
      throw std::out_of_range("embedding: token id " + std::to_string(ids_T[t]) + " at position " + std::to_string(t) +
                              " is outside the vocabulary [0, V=" + std::to_string(V) + ")");
    }
  }
}

}  // namespace

template <typename T>
void embedding_forward(T* out_TD, const int32_t* ids_T, const T* weight_VD, const int64_t n_tokens, const int64_t V,
                       const int64_t D) {
  check_ids(ids_T, n_tokens, V);
#pragma omp parallel for schedule(static) if (n_tokens * D > 32768)
  for (int64_t t = 0; t < n_tokens; ++t) std::copy_n(weight_VD + ids_T[t] * D, D, out_TD + t * D);
}

template <typename T>
void embedding_backward(T* dweight_VD, const T* dout_TD, const int32_t* ids_T, const int64_t n_tokens, const int64_t V,
                        const int64_t D) {
  check_ids(ids_T, n_tokens, V);
  // Repeated ids would race if tokens were split across threads; instead each thread owns a block of columns
  // and walks all tokens in order, which is race-free and sums in the same order as the reference.
  constexpr int64_t kBlock = 128;
  const int64_t n_blocks = (D + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static) if (n_tokens * D > 32768)
  for (int64_t block = 0; block < n_blocks; ++block) {
    const int64_t d_begin = block * kBlock;
    const int64_t d_end = std::min(D, d_begin + kBlock);
    for (int64_t t = 0; t < n_tokens; ++t) {
      T* dst = dweight_VD + ids_T[t] * D;
      const T* src = dout_TD + t * D;
#pragma omp simd
      for (int64_t d = d_begin; d < d_end; ++d) dst[d] += src[d];
    }
  }
}

template void embedding_forward<float>(float*, const int32_t*, const float*, int64_t, int64_t, int64_t);
template void embedding_forward<double>(double*, const int32_t*, const double*, int64_t, int64_t, int64_t);
template void embedding_backward<float>(float*, const float*, const int32_t*, int64_t, int64_t, int64_t);
template void embedding_backward<double>(double*, const double*, const int32_t*, int64_t, int64_t, int64_t);

}  // namespace moecore::kernels::cpu
