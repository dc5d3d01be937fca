// RMSNorm and LayerNorm over the last dimension D of [n_rows, D] (Megatron/TE semantics:
// rmsnorm y = x * rsqrt(mean(x^2) + eps) * w; layernorm y = (x - mean) * rsqrt(var + eps) * w + b,
// biased variance). Statistics computed in the kernel's type T.
// The forward kernels return how many rows had a statistic that is not finite (RMSNorm: the mean of squares;
// LayerNorm: the mean or the variance): a finite row whose sum of squares overflows T gets rstd 0 and an output of
// zeros (or the bias), which nothing downstream would notice (ops/norm.h, NormModule report it).
#pragma once

#include <cstdint>

#include "moecore/kernels/cpu/gemm_lowp.h"

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

// The backward kernels on 16-bit activations (bits of `type`): dinp_RD (accumulated into, may be null), dout_RD and
// inp_RD are 16-bit, the rest fp32. Each row is widened into fp32, runs the fp32 kernel's row and its input gradient
// is narrowed back (round to nearest even); rows are split over the threads as in the fp32 kernel, so every output
// equals the fp32 kernel's on the widened tensors, rounded, bit for bit.
void rmsnorm_backward16(LowpType type, uint16_t* dinp_RD, float* dweight_D, const uint16_t* dout_RD,
                        const uint16_t* inp_RD, const float* weight_D, const float* rstd_R, int64_t n_rows, int64_t D);
void layernorm_backward16(LowpType type, uint16_t* dinp_RD, float* dweight_D, float* dbias_D, const uint16_t* dout_RD,
                          const uint16_t* inp_RD, const float* weight_D, const float* mean_R, const float* rstd_R,
                          int64_t n_rows, int64_t D);
}  // namespace cpu
namespace ref {
MOECORE_NORM_DECL
}
#undef MOECORE_NORM_DECL

}  // namespace moecore::kernels
