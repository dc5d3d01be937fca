// Naive reference embedding lookup and gradient, used by the tests.
#include <stdexcept>
#include <string>

#include "moecore/kernels/cpu/embedding.h"

namespace moecore::kernels::ref {
namespace {

int64_t checked_row(const int32_t id, const int64_t t, const int64_t V) {
  if (id < 0 || id >= V) {
    throw std::out_of_range("embedding: token id " + std::to_string(id) + " at position " + std::to_string(t) +
                            " is outside the vocabulary [0, V=" + std::to_string(V) + ")");
  }
  return id;
}

}  // namespace

template <typename T>
void embedding_forward(T* out_TD, const int32_t* ids_T, const T* weight_VD, const int64_t n_tokens, const int64_t V,
                       const int64_t D) {
  for (int64_t t = 0; t < n_tokens; ++t) {
    const int64_t row = checked_row(ids_T[t], t, V);
    for (int64_t d = 0; d < D; ++d) out_TD[t * D + d] = weight_VD[row * D + d];
  }
}

template <typename T>
void embedding_backward(T* dweight_VD, const T* dout_TD, const int32_t* ids_T, const int64_t n_tokens, const int64_t V,
                        const int64_t D) {
  for (int64_t t = 0; t < n_tokens; ++t) checked_row(ids_T[t], t, V);
  for (int64_t t = 0; t < n_tokens; ++t) {
    for (int64_t d = 0; d < D; ++d) dweight_VD[ids_T[t] * D + d] += dout_TD[t * D + d];
  }
}

template void embedding_forward<float>(float*, const int32_t*, const float*, int64_t, int64_t, int64_t);
template void embedding_forward<double>(double*, const int32_t*, const double*, int64_t, int64_t, int64_t);
template void embedding_backward<float>(float*, const float*, const int32_t*, int64_t, int64_t, int64_t);
template void embedding_backward<double>(double*, const double*, const int32_t*, int64_t, int64_t, int64_t);

}  // namespace moecore::kernels::ref
