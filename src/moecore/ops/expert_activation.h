// The routed experts' SwiGLU with the router probability on tensors (semantics: kernels/cpu/expert_activation.h):
// Megatron's weighted_swiglu, as its grouped experts apply it between fc1 and fc2. inp_T2F is the fc1 output
// ([gate | up] halves), probs_T one probability per token, h_TF fc2's input.
#pragma once

#include "moecore/tensor/tensor.h"

namespace moecore::ops {

// h_TF = swiglu(inp_T2F) * probs_T (overwrites).
void weighted_swiglu_forward(Tensor& h_TF, const Tensor& inp_T2F, const Tensor& probs_T);
// dinp_T2F = d/d inp, dprobs_T = sum_f swiglu(inp) dh_TF (both OVERWRITTEN), swiglu recomputed from inp_T2F.
void weighted_swiglu_backward(Tensor& dinp_T2F, Tensor& dprobs_T, const Tensor& dh_TF, const Tensor& inp_T2F,
                              const Tensor& probs_T);

}  // namespace moecore::ops
