// The MLPs of a rank's local experts over their rows of one buffer, fused in one op (Megatron's GroupedMLP;
// semantics and scheduling: kernels/cpu/grouped_mlp.h). Expert e's rows are [offsets_E1[e], offsets_E1[e + 1]) of
// the [R, ...] tensors (offsets_E1: E + 1 non-decreasing entries from 0); per expert y = W2 (act(W1 x + b1) p) + p b2,
// or with the probability on the input y = W2 act(W1 (x p) + b1) + b2. fp32 or fp64 tensors of one dtype; under
// --bf16 / --fp16 every activation and activation gradient is rounded where the per-op sequence (ops::linear_forward,
// activation_forward, scale_rows, add_outer, weighted_swiglu_forward and their backwards) rounds it, so the result
// is that sequence's bit for bit. Where the linear layers run on the native 16-bit GEMMs (gemm_lowp.h), so do the
// experts' GEMMs here, on the 16-bit bits of the same values, with fp32 sums (a different summation order from the
// per-op sequence's GEMMs, so not bit for bit with it there).
//
// Saved activations (forward writes them, backward reads them): fc1_RF1 [R, F1] always; h_RF [R, F] (fc2's input
// swiglu(fc1) p) for SwiGLU with the probability after it (the fused weighted SwiGLU), else act_RF [R, F] (the
// activation output); xs_RH [R, H] (x p, fc1's input) with the probability on the input. The others may be null.
//
// Not fused (grouped_mlp_fused() false, and the ops refuse): FP8 / FP4 quantization (ops/quantization.h); callers
// run each expert's rows through ops::linear and the activation ops instead.
#pragma once

#include <cstdint>
#include <span>

#include "moecore/kernels/cpu/grouped_mlp.h"
#include "moecore/ops/activation.h"
#include "moecore/tensor/tensor.h"

namespace moecore::ops {

using kernels::GroupedMlpBackwardPart;

struct GroupedMlpSpec {
  Activation activation = Activation::kGelu;
  bool probs_on_input = false;  // --moe-apply-probs-on-input
};

// E entries each: fc1 weights [F1, H], fc2 weights [H, F]; the biases ([F1], [H]) an empty span or null entries for
// none.
struct GroupedMlpParams {
  std::span<const Tensor*const> fc1_weight_E, fc1_bias_E, fc2_weight_E, fc2_bias_E;
};
// The parameters' gradients (accumulated); empty spans or null entries are skipped. weights_zero_E (optional, one per
// expert): 1 where both weight gradients hold only zeros, which the kernels may write instead of add to.
struct GroupedMlpGrads {
  std::span<Tensor*const> fc1_weight_E, fc1_bias_E, fc2_weight_E, fc2_bias_E;
  std::span<const uint8_t> weights_zero_E = {};
};

// Whether the fused kernels cover fp32 tensors of `device` now (not under FP8 / FP4 quantization).
bool grouped_mlp_fused(Device device = Device::kCPU);

// y_RH [R, H] and the saved activations (see above) from x_RH [R, H] and probs_R [R] (all overwritten).
void grouped_mlp_forward(Tensor& y_RH, Tensor& fc1_RF1, Tensor* act_RF, Tensor* h_RF, Tensor* xs_RH, const Tensor& x_RH,
                         const Tensor& probs_R, const GroupedMlpParams& params, std::span<const int64_t> offsets_E1,
                         const GroupedMlpSpec& spec);
// One backward in two calls (Megatron's --delay-wgrad-compute: the experts' weight gradients run later, while the
// dispatch's backward all-to-all is in flight): a kData call, then a kWeights call with the same arguments and the
// same workspace, give bit for bit what one call without a split gives (the parts: kernels/cpu/grouped_mlp.h). Both
// calls run under the same precision and quantization scopes.
struct GroupedMlpBackwardSplit {
  GroupedMlpBackwardPart part = GroupedMlpBackwardPart::kAll;
  // grouped_mlp_backward_workspace's tensor (caller-owned): kData writes every row's d(fc1 output), kWeights reads
  // it. Needed by kData and kWeights; with kAll null (the op's own) or used as the op's own.
  Tensor* dfc1_workspace_RF1 = nullptr;
};

// The workspace a split backward needs: d(fc1 output) [R, F1], zeroed, fp32 for 16-bit dy_RH else dy_RH's dtype, on
// dy_RH's device (what the op allocates for itself without one). R and F1 from offsets_E1 and the parameters.
Tensor grouped_mlp_backward_workspace(const Tensor& dy_RH, const GroupedMlpParams& params,
                                      std::span<const int64_t> offsets_E1, const GroupedMlpSpec& spec);

// From dy_RH [R, H]: dx_RH += d/dx, dprobs_R = d/dp (overwritten), the parameters' gradients accumulate (an expert
// without rows keeps its own). The saved activations as forward wrote them. With a split, only its part: kData
// leaves the gradients untouched (grads may be empty), kWeights leaves dx_RH and dprobs_R untouched (they may be
// undefined tensors).
void grouped_mlp_backward(Tensor& dx_RH, Tensor& dprobs_R, const GroupedMlpGrads& grads, const Tensor& dy_RH,
                          const Tensor& x_RH, const Tensor* xs_RH, const Tensor& fc1_RF1, const Tensor* act_RF,
                          const Tensor* h_RF, const Tensor& probs_R, const GroupedMlpParams& params,
                          std::span<const int64_t> offsets_E1, const GroupedMlpSpec& spec,
                          const GroupedMlpBackwardSplit* split = nullptr);

}  // namespace moecore::ops
