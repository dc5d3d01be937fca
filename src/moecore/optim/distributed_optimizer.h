// AdamW over the buffers of a DistributedDataParallel. Without the distributed optimizer every rank updates every
// parameter (exactly AdamWOptimizer). With it (Megatron's DistributedOptimizer) each rank keeps fp32 Adam states
// only for its shard of every bucket, updates that shard (weight decay per element from the owning param) and
// all-gathers the updated parameters over the bucket's group.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "moecore/model/param.h"
#include "moecore/optim/adamw_optimizer.h"
#include "moecore/optim/ddp.h"

namespace moecore {

class DistributedAdamW {
 public:
  // `params` must be the vector `ddp` was built over.
  DistributedAdamW(DistributedDataParallel& ddp, std::vector<Param>& params, const AdamWOptions& options);

  // Global L2 norm over the unique gradient elements of the whole world (each replicated element counted once);
  // a collective over the world group, equal on every rank. Call after finish_grad_sync.
  double grad_norm() const;
  // Scales the gradients this rank uses by max_norm / (norm + 1e-6) when norm > max_norm (torch's clip_grad_norm_);
  // max_norm <= 0 disables. Returns the norm before clipping.
  double clip_grad_norm(double max_norm);
  // Loss scaling (Megatron's _unscale_main_grads_and_check_for_nan): multiplies the gradients this rank updates by
  // inv_scale and returns whether any of them, on any rank, is Inf or NaN (a collective over the world, equal on
  // every rank). inv_scale 1 only checks. Call after finish_grad_sync.
  bool unscale_grads_and_check_for_nan(float inv_scale);
  // Fault injection for the overflow tests: writes +Inf into the first gradient element this rank updates.
  void inject_nonfinite_grad();
  // One AdamW update at learning rate lr, then (distributed optimizer) the parameter all-gather.
  void step(double lr);
  int64_t steps_taken() const { return replicated_ ? replicated_->steps_taken() : step_; }
  void set_steps_taken(int64_t steps) {  // a checkpoint's count (Adam's bias correction)
    if (replicated_) {
      replicated_->set_steps_taken(steps);
    } else {
      step_ = steps;
    }
  }
  const AdamWOptions& options() const { return options_; }
  // True with --use-distributed-optimizer (each DP rank holds the moments of its shard only).
  bool distributed() const { return !replicated_.has_value(); }
  // This rank's Adam moments by parameter element range (see AdamWMomentSlice): without the distributed optimizer
  // every parameter whole; with it one slice per piece of a parameter inside this rank's bucket shards, in
  // registration order (a parameter wholly in other ranks' shards has none).
  std::vector<AdamWMomentSlice> moment_slices() const;
  // 16-bit or quantized weights (see AdamWOptimizer): main parameters from the model's values (then the values
  // rounded, the quantized weights replaced by their quantization), or the model's values of this rank's shard from
  // the main parameters (the quantized weights then quantized and gathered: a collective). No-ops with fp32 weights
  // and no quantized parameter all-gather.
  void main_params_from_model();
  void model_from_main_params();

 private:
  // A param's elements inside this rank's shard of its bucket: buffer offset and count.
  struct Piece {
    int param = 0;
    int bucket = 0;
    int64_t offset = 0;
    int64_t numel = 0;
  };
  bool counted_in_norm(const Param& p) const;
  // The piece's elements of its group's flat gradient buffer (a view).
  Tensor grad_piece(const Piece& piece) const;
  Tensor param_piece(const Piece& piece) const;  // the model's values (the DDP's parameter buffer)
  Tensor main_piece(const Piece& piece) const;   // the fp32 main parameters (16-bit weights only)

  DistributedDataParallel& ddp_;
  std::vector<Param>& params_;
  AdamWOptions options_;
  std::optional<AdamWOptimizer> replicated_;  // without the distributed optimizer
  std::vector<Piece> pieces_;                 // registration order
  std::vector<Tensor> exp_avg_;               // [bucket] -> [shard_size], kOptimizer
  std::vector<Tensor> exp_avg_sq_;
  // [bucket] -> [shard_size] fp32 main parameters (16-bit or quantized weights only), kOptimizer
  std::vector<Tensor> main_;
  int64_t step_ = 0;
};

}  // namespace moecore
