// Optimizer and gradient-norm ops on tensors.
#pragma once

#include "moecore/kernels/cpu/adamw.h"
#include "moecore/tensor/tensor.h"

namespace moecore::ops {

using kernels::AdamWHyper;

// One torch.optim.AdamW update of param from grad with the moments exp_avg / exp_avg_sq (semantics:
// kernels/cpu/adamw.h). All four tensors have the same number of elements.
void adamw_step(Tensor& param, const Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq, const AdamWHyper& hyper);

}  // namespace moecore::ops
