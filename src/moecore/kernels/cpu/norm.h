// RMSNorm and LayerNorm over the last dimension D of [n_rows, D] (Megatron/TE semantics:
// rmsnorm y = x * rsqrt(mean(x^2) + eps) * w; layernorm y = (x - mean) * rsqrt(var + eps) * w + b,
// biased variance). Statistics computed in the kernel's type T.
// The forward kernels return how many rows had a statistic that is not finite (RMSNorm: the mean of squares;
// LayerNorm: the mean or the variance): a finite row whose sum of squares overflows T gets rstd 0 and an output of
// zeros (or the bias), which nothing downstream would notice (ops/norm.h, NormModule report it).
#pragma once

#include <cstdint>

namespace moecore::kernels {

#define MOECORE_NORM_DECL                                                                                             \
  template <typename T>                                                                                               \
  int64_t rmsnorm_forward(T* out_RD, T* rstd_R, const T* inp_RD, const T* weight_D, int64_t n_rows, int64_t D,        \
                          double eps);                                                                                \
  template <typename T>                                                                                               \
  void rmsnorm_backward(T* dinp_RD, T* dweight_D, const T* dout_RD, const T* inp_RD, const T* weight_D,               \
                        const T* rstd_R, int64_t n_rows, int64_t D);                                                  \
  /* bias_D may be null (no bias); dbias_D may be null. */                                                            \
  template <typename T>                                                                                               \
  int64_t layernorm_forward(T* out_RD, T* mean_R, T* rstd_R, const T* inp_RD, const T* weight_D, const T* bias_D,     \
                            int64_t n_rows, int64_t D, double eps);                                                   \
  template <typename T>                                                                                               \
  void layernorm_backward(T* dinp_RD, T* dweight_D, T* dbias_D, const T* dout_RD, const T* inp_RD, const T* weight_D, \
                          const T* mean_R, const T* rstd_R, int64_t n_rows, int64_t D);

namespace cpu {
MOECORE_NORM_DECL
}
namespace ref {
MOECORE_NORM_DECL
}
#undef MOECORE_NORM_DECL

}  // namespace moecore::kernels
