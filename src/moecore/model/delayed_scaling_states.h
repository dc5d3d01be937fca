// FP8 delayed scaling across the linear layers of one rank (Megatron's --fp8-recipe delayed; TE's
// FP8GlobalStateManager, transformer_engine/pytorch/quantization.py). Each decoder-layer linear keeps its own state
// beside its weight (Param::delayed_scaling, quant/delayed_linear_scaling.h); this class lists them in parameter
// order and runs their reductions and updates.
//
// When TE updates (and so when moecore does), with several micro-batches per step:
//   - Megatron wraps the whole TransformerBlock forward in one fp8_autocast under delayed scaling
//     (megatron/core/transformer/transformer_block.py). At its exit, when grad is enabled, TE's autocast_exit calls
//     reduce_and_update_fp8_tensors(forward=True): the forward tensors (inputs, weights) of every delayed-scaling
//     module of the rank are reduced and updated. That is after EVERY micro-batch's forward, not once per step:
//     after_forward(), called by GPTModel::forward at the end of a training forward's decoder layers.
//   - The first FP8 module of each autocast (is_first_fp8_module) calls reduce_and_update_fp8_tensors(forward=False)
//     at the end of its backward (transformer_engine/pytorch/module/linear.py), i.e. once the micro-batch's
//     decoder backward is done: after_backward(), called by GPTModel::backward after the decoder layers.
//   - Evaluation runs without grad: the amaxes it records stay in row 0 of the histories and are folded into the
//     next training update, as in TE.
//   - The weight is cast once per forward_backward call (the first micro-batch; DelayedLinearScaling::
//     weight_for_forward), so a weight's history rolls once per step and its row 0 stays 0 in the later updates.
// Reduction: TE concatenates the amaxes (row 0 of every history) of all modules in registration order and
// MAX-reduces the buffer over the amax reduction group, Megatron's get_amax_reduction_group(with_context_parallel=
// True): TP x DP x CP of the dense grid (tp_dp_cp). Entries are matched by position, so under expert parallelism
// local expert i of every EP rank is reduced together (as TE does); every rank of the group then holds the same
// states. A history whose (reduced) row 0 is 0 does not roll and keeps its scale (delayed_scaling.h).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "moecore/model/param.h"
#include "moecore/parallel/process_group.h"
#include "moecore/quant/delayed_linear_scaling.h"

namespace moecore {

struct DelayedScalingEntry {
  std::string name;   // the linear layer's name, e.g. decoder.layers.0.self_attention.linear_qkv
  int64_t layer = 0;  // its global decoder layer
  quant::DelayedLinearScaling* state = nullptr;
};

class DelayedScalingStates {
 public:
  DelayedScalingStates() = default;
  // The states of `params` (those with a delayed_scaling), in parameter order; params must not grow afterwards.
  DelayedScalingStates(ParamStore& params, const parallel::ProcessGroup& amax_group);

  bool empty() const { return entries_.empty(); }
  const std::vector<DelayedScalingEntry>& entries() const { return entries_; }

  // Megatron's set_is_first_microbatch for the layers [first_layer, end_layer) (a model chunk).
  void set_first_microbatch(int64_t first_layer, int64_t end_layer);
  // Reduce and update the forward (input, weight) or backward (output gradient) states; collective over the amax
  // group (every rank of it calls them in the same order).
  void after_forward();
  void after_backward();
  // MAX-reduces the amaxes recorded since the last updates (row 0) without updating: the states are then the same
  // on every rank of the group (a checkpoint saves one copy). The later update gives what it would have given.
  void reduce_pending();
  // Every state's tensors (scales and histories), to put back with restore(): a forward that must leave the scaling
  // as it found it (moecore's evaluation before training, which Megatron does not run).
  std::vector<float> snapshot() const;
  void restore(const std::vector<float>& values);

 private:
  void reduce(bool forward, bool backward);

  std::vector<DelayedScalingEntry> entries_;
  parallel::ProcessGroup amax_group_ = parallel::ProcessGroup::self();
};

}  // namespace moecore
