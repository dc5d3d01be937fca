// MLP activations on tensors, chosen by kind (semantics: kernels/cpu/activation.h). inp_TF1 is the fc1 output:
// [T, 2F] ([gate | up] halves) for SwiGLU, [T, F] otherwise; out_TF is [T, F].
#pragma once

#include <cstdint>

#include "moecore/tensor/tensor.h"

namespace moecore::ops {

enum class Activation : uint8_t { kGelu, kSwiGLU, kSquaredReLU };

// Width of the fc1 output that feeds an activation producing F features.
constexpr int64_t activation_input_width(const Activation kind, const int64_t F) {
  return kind == Activation::kSwiGLU ? 2 * F : F;
}

// out_TF = act(inp_TF1) (overwrites).
void activation_forward(Activation kind, Tensor& out_TF, const Tensor& inp_TF1);
// dinp_TF1 += d act / d inp ^T dout_TF.
void activation_backward(Activation kind, Tensor& dinp_TF1, const Tensor& dout_TF, const Tensor& inp_TF1);

}  // namespace moecore::ops
