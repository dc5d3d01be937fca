// Counter-RNG dropout on tensors (semantics: kernels/cpu/dropout.h): the mask is regenerated in backward.
#pragma once

#include "moecore/kernels/cpu/dropout.h"
#include "moecore/tensor/tensor.h"

namespace moecore::ops {

using kernels::DropoutSpec;

// out = dropout(inp) (overwrites; may alias inp).
void dropout_forward(Tensor& out, const Tensor& inp, const DropoutSpec& spec);
// dinp += mask * dout / (1 - p).
void dropout_backward(Tensor& dinp, const Tensor& dout, const DropoutSpec& spec);

}  // namespace moecore::ops
