// Reference low-precision GEMM and linear layer: inputs decoded to double, naive triple loop, each output rounded
// once (to fp32, or to the inputs' format with the reference's own nearest-pattern search).
#include <algorithm>
#include <stdexcept>
#include <type_traits>

#include "moecore/kernels/cpu/convert.h"
#include "moecore/kernels/cpu/gemm_lowp.h"
#include "moecore/tensor/dtype.h"

namespace moecore::kernels::ref {
namespace {

double value(const LowpType type, const uint16_t bits) {
  return type == LowpType::kBF16 ? moecore::bf16_to_fp32(bits) : moecore::fp16_to_fp32(bits);
}
double value(LowpType, const float x) { return x; }

template <typename T>
T rounded(const LowpType type, const double x) {
  if constexpr (std::is_same_v<T, float>) {
    return static_cast<float>(x);
  } else {
    return type == LowpType::kBF16 ? round_to_bf16(x) : round_to_fp16(x);
  }
}

}  // namespace

template <typename CT>
void gemm_lowp(const LowpType type, const bool trans_a, const bool trans_b, const int64_t M, const int64_t N,
               const int64_t K, const float alpha, const uint16_t* A, const int64_t lda, const uint16_t* B,
               const int64_t ldb, const float beta, CT* C, const int64_t ldc) {
  if (M < 0 || N < 0 || K < 0 || lda < std::max<int64_t>(1, trans_a ? M : K) ||
      ldb < std::max<int64_t>(1, trans_b ? K : N) || ldc < std::max<int64_t>(1, N)) {
    throw std::invalid_argument("ref::gemm_lowp: bad sizes or leading dimensions");
  }
  for (int64_t i = 0; i < M; ++i) {
    for (int64_t j = 0; j < N; ++j) {
      double acc = 0.0;
      for (int64_t k = 0; k < K; ++k) {
        const uint16_t a = trans_a ? A[k * lda + i] : A[i * lda + k];
        const uint16_t b = trans_b ? B[j * ldb + k] : B[k * ldb + j];
        acc += value(type, a) * value(type, b);
      }
      CT& c = C[i * ldc + j];
      // As in BLAS, beta == 0 means C is not read.
      const double old = beta == 0.0f ? 0.0 : static_cast<double>(beta) * value(type, c);
      c = rounded<CT>(type, static_cast<double>(alpha) * acc + old);
    }
  }
}

template <typename Out, typename Bias>
void linear_forward_lowp(const LowpType type, Out* out_TO, const uint16_t* inp_TI, const uint16_t* weight_OI,
                         const Bias* bias_O, const int64_t n_tokens, const int64_t in_features,
                         const int64_t out_features) {
  for (int64_t t = 0; t < n_tokens; ++t) {
    for (int64_t o = 0; o < out_features; ++o) {
      double acc = bias_O != nullptr ? value(type, bias_O[o]) : 0.0;
      for (int64_t i = 0; i < in_features; ++i) {
        acc += value(type, inp_TI[t * in_features + i]) * value(type, weight_OI[o * in_features + i]);
      }
      out_TO[t * out_features + o] = rounded<Out>(type, acc);
    }
  }
}

template <typename DInp, typename DWeight, typename DBias>
void linear_backward_lowp(const LowpType type, DInp* dinp_TI, DWeight* dweight_OI, DBias* dbias_O,
                          const uint16_t* dout_TO, const uint16_t* inp_TI, const uint16_t* weight_OI,
                          const int64_t n_tokens, const int64_t in_features, const int64_t out_features) {
  if (dinp_TI != nullptr) {
    gemm_lowp(type, false, false, n_tokens, in_features, out_features, 1.0f, dout_TO, out_features, weight_OI,
              in_features, 1.0f, dinp_TI, in_features);
  }
  if (dweight_OI != nullptr) {
    gemm_lowp(type, true, false, out_features, in_features, n_tokens, 1.0f, dout_TO, out_features, inp_TI, in_features,
              1.0f, dweight_OI, in_features);
  }
  if (dbias_O != nullptr) {
    for (int64_t o = 0; o < out_features; ++o) {
      double acc = value(type, dbias_O[o]);
      for (int64_t t = 0; t < n_tokens; ++t) acc += value(type, dout_TO[t * out_features + o]);
      dbias_O[o] = rounded<DBias>(type, acc);
    }
  }
}

#define MOECORE_INSTANTIATE_GEMM(CT)                                                                            \
  template void gemm_lowp<CT>(LowpType, bool, bool, int64_t, int64_t, int64_t, float, const uint16_t*, int64_t, \
                              const uint16_t*, int64_t, float, CT*, int64_t);
#define MOECORE_INSTANTIATE_FORWARD(Out, Bias)                                                                         \
  template void linear_forward_lowp<Out, Bias>(LowpType, Out*, const uint16_t*, const uint16_t*, const Bias*, int64_t, \
                                               int64_t, int64_t);
#define MOECORE_INSTANTIATE_BACKWARD(DInp, DWeight, DBias)                                                     \
  template void linear_backward_lowp<DInp, DWeight, DBias>(LowpType, DInp*, DWeight*, DBias*, const uint16_t*, \
                                                           const uint16_t*, const uint16_t*, int64_t, int64_t, \
                                                           int64_t);
#include "moecore/kernels/cpu/gemm_lowp_instances.h"

}  // namespace moecore::kernels::ref
