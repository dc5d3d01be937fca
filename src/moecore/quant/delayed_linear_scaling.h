// The delayed-scaling state of one linear layer (Megatron's --fp8-recipe delayed): TE's fp8_meta of a Linear
// (transformer_engine/pytorch/module/base.py, get_extra_state), scaling_fwd for the input x and the weight W,
// scaling_bwd for the output gradient dy, in TE's layout:
//   scale_fwd [2]    amax_history_fwd [L, 2]    column 0 the input, column 1 the weight
//   scale_bwd [1]    amax_history_bwd [L, 1]    the output gradient
// Row 0 of a history collects the amaxes of the quantizations since the last update, rows 1..L-1 the older amaxes,
// oldest first (delayed_scaling.h). TE also keeps slots for an FP8 output and input gradient, which it fills only
// when a module emits FP8 tensors; moecore never does, so they are left out.
//
// One micro-batch of a layer:
//   forward:  x quantized with input() and W with weight_for_forward(), both amaxes recorded into row 0; the two
//             scales are kept for the backward (DelayedForwardScales), since TE quantizes x and W once in forward
//             for both of their usages (dgrad's W, wgrad's x)
//   backward: dy quantized with grad_output() (recorded), x and W at the forward's scales, not recorded
//   update_forward() / update_backward(): after the model has MAX-reduced row 0 over the amax group
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "moecore/quant/delayed_scaling.h"
#include "moecore/quant/recipe.h"

namespace moecore::quant {

// Megatron's --fp8-amax-history-len, --fp8-amax-compute-algo and --fp8-margin (defaults 1, most_recent, 0;
// megatron/core/transformer/transformer_config.py).
struct DelayedScalingOptions {
  int64_t amax_history_len = 1;
  AmaxComputeAlgo amax_compute_algo = AmaxComputeAlgo::kMostRecent;
  int margin = 0;
};

// The scales one forward quantized x and W with.
struct DelayedForwardScales {
  float input = 1.0f;
  float weight = 1.0f;
};

class DelayedLinearScaling {
 public:
  static constexpr int64_t kForwardSlots = 2;   // input, weight
  static constexpr int64_t kBackwardSlots = 1;  // output gradient
  // Scales 1 and zero histories, TE's initial fp8_meta. format: the forward tensors are E4M3, the gradient E4M3 or
  // (hybrid) E5M2. std::invalid_argument for a history shorter than 1.
  DelayedLinearScaling(const DelayedScalingOptions& options, Fp8Format format);

  // The input of this forward: the current scale, amax recorded.
  DelayedOperand input() { return {scale_fwd_[0], &amax_history_fwd_[0]}; }
  // The weight of this forward, as TE's weight workspace cache gives it (transformer_engine/pytorch/module/linear.py:
  // update_workspace = is_first_microbatch is None or is_first_microbatch): the first forward after
  // set_first_microbatch() quantizes W with the current scale and records its amax; later forwards reuse that FP8
  // weight (the same scale, nothing recorded) until the next set_first_microbatch().
  DelayedOperand weight_for_forward();
  // The output gradient of this backward: the current scale, amax recorded.
  DelayedOperand grad_output() { return {scale_bwd_[0], &amax_history_bwd_[0]}; }
  // Megatron's set_is_first_microbatch (megatron/core/pipeline_parallel/schedules.py, at the first micro-batch of
  // every forward_backward call): the next forward quantizes the weight afresh.
  void set_first_microbatch() { first_microbatch_ = true; }

  // Row 0 of each history (the amaxes of the quantizations since the last update): the values the amax reduction
  // MAX-reduces in place before the update.
  std::span<float> pending_forward_amaxes() { return {amax_history_fwd_.data(), kForwardSlots}; }
  std::span<float> pending_backward_amaxes() { return {amax_history_bwd_.data(), kBackwardSlots}; }
  // TE's amax_and_scale_update on every forward (backward) slot: roll each history and recompute its scale.
  void update_forward();
  void update_backward();

  // The state tensors (checkpoints read and write them in place), shapes as in the header comment.
  std::span<float> scale_fwd() { return scale_fwd_; }
  std::span<float> amax_history_fwd() { return amax_history_fwd_; }
  std::span<float> scale_bwd() { return scale_bwd_; }
  std::span<float> amax_history_bwd() { return amax_history_bwd_; }
  std::span<const float> scale_fwd() const { return scale_fwd_; }
  std::span<const float> amax_history_fwd() const { return amax_history_fwd_; }
  std::span<const float> scale_bwd() const { return scale_bwd_; }
  std::span<const float> amax_history_bwd() const { return amax_history_bwd_; }
  const DelayedScalingOptions& options() const { return options_; }

 private:
  DelayedScalingOptions options_;
  ElementFormat forward_format_, grad_format_;
  std::vector<float> scale_fwd_, amax_history_fwd_, scale_bwd_, amax_history_bwd_;
  bool first_microbatch_ = true;
  float cached_weight_scale_ = 1.0f;  // the scale the cached FP8 weight was quantized with
};

}  // namespace moecore::quant
