// Softmax cross-entropy over V classes, per token: losses_T[t] = lse(logits_TV[t]) - logits_TV[t, target].
// Targets outside [0, V) throw std::out_of_range.
#pragma once

#include <cstdint>

#include "moecore/kernels/cpu/convert.h"

namespace moecore::kernels {

#define MOECORE_LOSS_DECL                                                                                            \
  template <typename T>                                                                                              \
  void cross_entropy_forward(T* losses_T, T* lse_T, const T* logits_TV, const int32_t* targets_T, int64_t n_tokens,  \
                             int64_t V);                                                                             \
  /* OVERWRITES dlogits_TV = dlosses_T[t] * (softmax(logits_TV[t]) - onehot(target)). dlogits_TV may                 \
     alias logits_TV (in-place). */                                                                                  \
  template <typename T>                                                                                              \
  void cross_entropy_backward(T* dlogits_TV, const T* dlosses_T, const T* logits_TV, const T* lse_T,                 \
                              const int32_t* targets_T, int64_t n_tokens, int64_t V);                                \
  /* cross_entropy_forward and, with dlosses_T, cross_entropy_backward in one pass over each token's row (it stays   \
     in cache between them), as the output layer runs them on each chunk of logits. `rounding` (fp32 only) first     \
     rounds the logits in place to that format, as the ops round the linear layer's output, and rounds the           \
     gradient to it. The gradient overwrites logits_TV, or with dlogits16_TV (rounding kBF16 / kF16) goes there as   \
     that format's bits instead, logits_TV keeping the rounded logits. */                                            \
  template <typename T>                                                                                              \
  void cross_entropy_fused(T* losses_T, T* lse_T, T* logits_TV, const T* dlosses_T, uint16_t* dlogits16_TV,          \
                           const int32_t* targets_T, ActivationRounding rounding, int64_t n_tokens, int64_t V);      \
  /* cross_entropy_fused on 16-bit logits, as the native 16-bit GEMM writes them: logits16_TV holds each token's     \
     logits as bits of `format` (kBF16 / kF16); with dlosses_T their gradient, rounded to the format, replaces them. \
     The sums and the softmax in fp32: the same values as cross_entropy_fused on the widened logits. */              \
  void cross_entropy_fused16(float* losses_T, float* lse_T, uint16_t* logits16_TV, const float* dlosses_T,           \
                             const int32_t* targets_T, ActivationRounding format, int64_t n_tokens, int64_t V);

namespace cpu {
MOECORE_LOSS_DECL
}
namespace ref {
MOECORE_LOSS_DECL
}
#undef MOECORE_LOSS_DECL

}  // namespace moecore::kernels
