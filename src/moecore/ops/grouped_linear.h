// The linear layers of a rank's local experts over their rows of one buffer, in one op (TransformerEngine's
// GroupedLinear; semantics and scheduling: kernels/cpu/grouped_linear.h). Expert e's rows are [offsets_E1[e],
// offsets_E1[e + 1]) of x_RI / out_RO (offsets_E1: E + 1 non-decreasing entries from 0); its weight weights_E[e]
// [O, I], its bias biases_E[e] [O] (biases_E empty or entries null: none). fp32 or fp64 tensors of one dtype; under
// --bf16 / --fp16 the outputs and input gradients are rounded as ops::linear rounds them.
//
// Paths the grouped kernels do not cover run each expert's rows through ops::linear_forward / _backward in turn
// (same numerics as ops::linear): FP8 / FP4 quantization (ops/quantization.h; without a delayed-scaling state, so
// callers under the delayed recipe call ops::linear per expert with theirs) and the native 16-bit GEMM path.
#pragma once

#include <cstdint>
#include <span>

#include "moecore/tensor/tensor.h"

namespace moecore::ops {

// out_RO = x_RI @ weights_E[e]^T (+ biases_E[e]) on each expert's rows (overwrites).
void grouped_linear_forward(Tensor& out_RO, const Tensor& x_RI, std::span<const Tensor* const> weights_E,
                            std::span<const Tensor* const> biases_E, std::span<const int64_t> offsets_E1);
// On each expert's rows: dx_RI += dout @ W_e; dweights_E[e] += dout^T @ x (needs x_RI); dbiases_E[e] += column sums
// of dout. dx_RI and the spans' entries may be null, the spans empty.
void grouped_linear_backward(Tensor* dx_RI, std::span<Tensor* const> dweights_E, std::span<Tensor* const> dbiases_E,
                             const Tensor& dout_RO, const Tensor* x_RI, std::span<const Tensor* const> weights_E,
                             std::span<const int64_t> offsets_E1);

}  // namespace moecore::ops
