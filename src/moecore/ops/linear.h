// Dense layers on tensors. Legend: T rows (tokens), I in features, O out features; T = inp.numel() / I, so
// inputs may carry extra leading dimensions ([S, B, N, d] is read as [S*B, N*d]).
#pragma once

#include "moecore/tensor/tensor.h"

namespace moecore::ops {

// out_TO = inp_TI @ weight_OI^T (+ bias_O). Overwrites out.
void linear_forward(Tensor& out_TO, const Tensor& inp_TI, const Tensor& weight_OI, const Tensor* bias_O = nullptr);
// dinp_TI += dout_TO @ weight_OI; dweight_OI += dout_TO^T @ inp_TI; dbias_O += column sums of dout_TO.
// Null outputs are skipped; inp_TI may be null when dweight_OI is.
void linear_backward(Tensor* dinp_TI, Tensor* dweight_OI, Tensor* dbias_O, const Tensor& dout_TO, const Tensor* inp_TI,
                     const Tensor& weight_OI);

}  // namespace moecore::ops
