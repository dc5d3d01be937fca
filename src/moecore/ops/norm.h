// RMSNorm and LayerNorm over the last dimension D of [R, D] (D = weight.numel(); R = inp.numel() / D). Megatron/TE
// semantics (see kernels/cpu/norm.h). Backward accumulates into dinp, dweight and dbias.
// The forward ops return how many rows had statistics that are not finite (RMSNorm: the mean of squares; LayerNorm:
// the mean or variance): with a finite input that is an overflow, and the row's output is zeros (plus the bias).
#pragma once

#include <cstdint>

#include "moecore/tensor/tensor.h"

namespace moecore::ops {

int64_t rmsnorm_forward(Tensor& out_RD, Tensor& rstd_R, const Tensor& inp_RD, const Tensor& weight_D, double eps);
void rmsnorm_backward(Tensor& dinp_RD, Tensor& dweight_D, const Tensor& dout_RD, const Tensor& inp_RD,
                      const Tensor& weight_D, const Tensor& rstd_R);
int64_t layernorm_forward(Tensor& out_RD, Tensor& mean_R, Tensor& rstd_R, const Tensor& inp_RD, const Tensor& weight_D,
                          const Tensor* bias_D, double eps);
void layernorm_backward(Tensor& dinp_RD, Tensor& dweight_D, Tensor* dbias_D, const Tensor& dout_RD,
                        const Tensor& inp_RD, const Tensor& weight_D, const Tensor& mean_R, const Tensor& rstd_R);

}  // namespace moecore::ops
