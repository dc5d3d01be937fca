// Naive reference GEMM (triple loop, double accumulation) and linear layer, used by the tests.
#include <algorithm>
#include <stdexcept>
#include <string>

#include "moecore/kernels/cpu/gemm.h"

namespace moecore::kernels::ref {

template <typename T>
void gemm(const bool trans_a, const bool trans_b, const int64_t M, const int64_t N, const int64_t K, const T alpha,
          const T* A, const int64_t lda, const T* B, const int64_t ldb, const T beta, T* C, const int64_t ldc) {
  if (M < 0 || N < 0 || K < 0 || lda < std::max<int64_t>(1, trans_a ? M : K) ||
      ldb < std::max<int64_t>(1, trans_b ? K : N) || ldc < std::max<int64_t>(1, N)) {
    throw std::invalid_argument("ref::gemm: bad sizes or leading dimensions");
  }
  for (int64_t i = 0; i < M; ++i) {
    for (int64_t j = 0; j < N; ++j) {
      double acc = 0.0;
      for (int64_t k = 0; k < K; ++k) {
        const T a = trans_a ? A[k * lda + i] : A[i * lda + k];
        const T b = trans_b ? B[j * ldb + k] : B[k * ldb + j];
        acc += static_cast<double>(a) * static_cast<double>(b);
      }
      T& c = C[i * ldc + j];
      // As in BLAS, beta == 0 means C is not read (it may hold garbage or NaN).
      c = static_cast<T>(alpha * acc + (beta == T(0) ? 0.0 : static_cast<double>(beta) * c));
    }
  }
}

template <typename T>
void linear_forward(T* out_TO, const T* inp_TI, const T* weight_OI, const T* bias_O, const int64_t n_tokens,
                    const int64_t in_features, const int64_t out_features) {
  gemm<T>(false, true, n_tokens, out_features, in_features, T(1), inp_TI, in_features, weight_OI, in_features, T(0),
          out_TO, out_features);
  if (bias_O == nullptr) return;
  for (int64_t t = 0; t < n_tokens; ++t) {
    for (int64_t o = 0; o < out_features; ++o) out_TO[t * out_features + o] += bias_O[o];
  }
}

template <typename T>
void linear_backward(T* dinp_TI, T* dweight_OI, T* dbias_O, const T* dout_TO, const T* inp_TI, const T* weight_OI,
                     const int64_t n_tokens, const int64_t in_features, const int64_t out_features) {
  if (dinp_TI != nullptr) {
    gemm<T>(false, false, n_tokens, in_features, out_features, T(1), dout_TO, out_features, weight_OI, in_features,
            T(1), dinp_TI, in_features);
  }
  if (dweight_OI != nullptr) {
    gemm<T>(true, false, out_features, in_features, n_tokens, T(1), dout_TO, out_features, inp_TI, in_features, T(1),
            dweight_OI, in_features);
  }
  if (dbias_O != nullptr) {
    for (int64_t t = 0; t < n_tokens; ++t) {
      for (int64_t o = 0; o < out_features; ++o) dbias_O[o] += dout_TO[t * out_features + o];
    }
  }
}

#define MOECORE_INSTANTIATE(T)                                                                                 \
  template void gemm<T>(bool, bool, int64_t, int64_t, int64_t, T, const T*, int64_t, const T*, int64_t, T, T*, \
                        int64_t);                                                                              \
  template void linear_forward<T>(T*, const T*, const T*, const T*, int64_t, int64_t, int64_t);                \
  template void linear_backward<T>(T*, T*, T*, const T*, const T*, const T*, int64_t, int64_t, int64_t);
MOECORE_INSTANTIATE(float)
MOECORE_INSTANTIATE(double)
#undef MOECORE_INSTANTIATE

}  // namespace moecore::kernels::ref
