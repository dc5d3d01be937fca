// MLP activations. SwiGLU follows Megatron: fc1 output [.., 2F] is split in halves [gate | up] and
// out = silu(gate) * up. GeLU is the exact erf form (torch.nn.functional.gelu). Squared ReLU = relu(x)^2.
#pragma once

#include <cstdint>

namespace moecore::kernels {

#define MOECORE_ACTIVATION_DECL                                                                       \
  template <typename T>                                                                               \
  void swiglu_forward(T* out_TF, const T* inp_T2F, int64_t n_tokens, int64_t F);                      \
  template <typename T>                                                                               \
  void swiglu_backward(T* dinp_T2F, const T* dout_TF, const T* inp_T2F, int64_t n_tokens, int64_t F); \
  template <typename T>                                                                               \
  void gelu_forward(T* out, const T* inp, int64_t n);                                                 \
  template <typename T>                                                                               \
  void gelu_backward(T* dinp, const T* dout, const T* inp, int64_t n);                                \
  template <typename T>                                                                               \
  void squared_relu_forward(T* out, const T* inp, int64_t n);                                         \
  template <typename T>                                                                               \
  void squared_relu_backward(T* dinp, const T* dout, const T* inp, int64_t n);

namespace cpu {
MOECORE_ACTIVATION_DECL
}
namespace ref {
MOECORE_ACTIVATION_DECL
}
#undef MOECORE_ACTIVATION_DECL

}  // namespace moecore::kernels
