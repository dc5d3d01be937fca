// The routed experts' SwiGLU with the router probability, fused as Megatron's weighted_swiglu /
// weighted_swiglu_back (megatron/core/fusions/fused_bias_swiglu.py), the activation its grouped experts apply
// between fc1 and fc2: h = swiglu(inp) * p with swiglu([gate | up]) = silu(gate) * up, one probability p per token.
// Backward recomputes swiglu from inp, as Megatron's: dinp = swiglu'(inp)^T (dh * p), dp = sum_f swiglu(inp) dh.
#pragma once

#include <cstdint>

namespace moecore::kernels {

#define MOECORE_EXPERT_ACTIVATION_DECL                                                                             \
  /* h_TF = swiglu(inp_T2F) * probs_T (overwrites). */                                                             \
  template <typename T>                                                                                            \
  void weighted_swiglu_forward(T* h_TF, const T* inp_T2F, const T* probs_T, int64_t n_tokens, int64_t F);          \
  /* dinp_T2F (overwritten) = d/d inp of <h, dh>; dprobs_T (overwritten) = sum_f swiglu(inp) dh, summed in double. \
   */                                                                                                              \
  template <typename T>                                                                                            \
  void weighted_swiglu_backward(T* dinp_T2F, T* dprobs_T, const T* dh_TF, const T* inp_T2F, const T* probs_T,      \
                                int64_t n_tokens, int64_t F);

namespace cpu {
MOECORE_EXPERT_ACTIVATION_DECL
}
namespace ref {
MOECORE_EXPERT_ACTIVATION_DECL
}
#undef MOECORE_EXPERT_ACTIVATION_DECL

}  // namespace moecore::kernels
