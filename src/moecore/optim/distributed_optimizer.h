// AdamW over the buffers of a DistributedDataParallel. Without the distributed optimizer every rank updates every
// parameter (exactly AdamWOptimizer). With it (Megatron's DistributedOptimizer) each rank keeps fp32 Adam states
// only for its shard of every bucket, updates that shard (weight decay per element from the owning param) and
// all-gathers the updated parameters over the bucket's group. With the precision-aware optimizer the shard's moments
// and main parameters are stored in reduced formats, one scale per parameter piece (optim/scaled_state.h).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

#include "moecore/model/param.h"
#include "moecore/optim/adamw_optimizer.h"
#include "moecore/optim/ddp.h"
#include "moecore/optim/scaled_state.h"

namespace moecore {

class DistributedAdamW {
 public:
  // `params` must be the vector `ddp` was built over.
  DistributedAdamW(DistributedDataParallel& ddp, ParamStore& params, const AdamWOptions& options);

  // Global L2 norm over the unique gradient elements of the whole world (each replicated element counted once);
  // a collective over the world group, equal on every rank. Call after finish_grad_sync.
  double grad_norm() const;
  // Megatron's --log-params-norm: the L2 norm of the fp32 main parameters (the model's values where there are none),
  // each replicated element counted once; a collective over the world.
  double params_norm() const;
  // Megatron's --log-num-zeros-in-grad: the gradient elements equal to zero, each replicated element counted once; a
  // collective over the world. Call after finish_grad_sync and before step (the update consumes the gradients).
  int64_t count_zero_grads() const;
  // Scales the gradients this rank uses by clip_coefficient(max_norm, norm) when there is one (Megatron's
  // clip_grad_by_total_norm_fp32). Returns the norm before clipping.
  double clip_grad_norm(double max_norm);
  // Loss scaling (Megatron's _unscale_main_grads_and_check_for_nan): multiplies the gradients this rank updates by
  // inv_scale and returns whether any of them, on any rank, is Inf or NaN (a collective over the world, equal on
  // every rank). inv_scale 1 only checks. Call after finish_grad_sync.
  bool unscale_grads_and_check_for_nan(float inv_scale);
  // The same with Megatron's two optimizers' scalers: the routed experts' gradients (Param::is_expert) unscaled by
  // expert_inv_scale, the others by dense_inv_scale; whether each group holds an Inf or NaN, on any rank.
  struct NonFiniteGrads {
    bool dense = false;
    bool expert = false;
  };
  NonFiniteGrads unscale_grads_and_check_for_nan(float dense_inv_scale, float expert_inv_scale);
  // Fault injection for the overflow tests: writes +Inf into the first gradient element this rank updates.
  void inject_nonfinite_grad();
  // One AdamW update at learning rate lr, then (distributed optimizer) the parameter all-gather. grad_scale: the
  // clipping coefficient, as AdamWOptimizer::step takes it (grad_norm then step(lr, clip_coefficient) is
  // clip_grad_norm then step(lr), bit for bit). consume_grads (replicated AdamW; the training step): the update
  // leaves the gradients zero and tells the DDP, whose next zero_grad then skips its pass over them. casts: the
  // replicated AdamW refreshes the carried bf16 weight casts (AdamWOptimizer::step); the distributed optimizer
  // refreshes none (the all-gather writes the weights), so drop_stale() frees them.
  void step(double lr, float grad_scale = 1.0f, bool consume_grads = false, ops::WeightCastCarry* casts = nullptr);
  int64_t steps_taken() const { return replicated_ ? replicated_->steps_taken() : step_; }
  void set_steps_taken(int64_t steps) {  // a checkpoint's count (Adam's bias correction)
    if (replicated_) {
      replicated_->set_steps_taken(steps);
    } else {
      step_ = steps;
    }
  }
  const AdamWOptions& options() const { return options_; }
  const DistributedDataParallel& ddp() const { return ddp_; }
  // The scheduler's weight decay for the next step (Megatron's param_group['weight_decay']).
  void set_weight_decay(double weight_decay) {
    options_.weight_decay = weight_decay;
    if (replicated_) replicated_->set_weight_decay(weight_decay);
  }
  // True with --use-distributed-optimizer (each DP rank holds the moments of its shard only).
  bool distributed() const { return !replicated_.has_value(); }
  // This rank's Adam moments by parameter element range (see AdamWMomentSlice): without the distributed optimizer
  // every parameter whole; with it one slice per piece of a parameter inside this rank's bucket shards, in
  // registration order (a parameter wholly in other ranks' shards has none). States stored in a reduced format come
  // as fp32 copies of their unscaled values (TE's get_unscaled_state), fp32 states as views.
  std::vector<AdamWMomentSlice> moment_slices() const;
  // After writing into moment_slices()' tensors (a checkpoint load): stores the copies of reduced-format states back,
  // each with the scale of its new absmax (TE's set_scaled_state); the main parameters only with `main_params`
  // (remainders: the weights and remainders from the fp32 values). `slices` must come from moment_slices().
  void load_moment_slices(const std::vector<AdamWMomentSlice>& slices, bool main_params = true);
  // True when the fp32 main parameters are the bf16 weights plus 16-bit remainders (not a full fp32 copy).
  bool stores_param_remainders() const { return remainders_; }
  // Bytes of every optimizer state this rank stores (moments and main parameters, padding included).
  int64_t state_bytes() const;
  // 16-bit or quantized weights (see AdamWOptimizer): main parameters from the model's values (then the values
  // rounded, the quantized weights replaced by their quantization), or the model's values of this rank's shard from
  // the main parameters (the quantized weights then quantized and gathered: a collective; fp16 main parameters: the
  // model's values are kept, rounded, as Megatron keeps a checkpoint's weights when TransformerEngine owns the master
  // weights). No-ops with fp32 weights and no quantized parameter all-gather.
  void main_params_from_model();
  void model_from_main_params();

 private:
  // A param's elements inside this rank's shard of its bucket: buffer offset and count, and its states (views of the
  // bucket's state buffers).
  struct Piece {
    int param = 0;
    int bucket = 0;
    int64_t offset = 0;
    int64_t numel = 0;
    ScaledState exp_avg, exp_avg_sq;
    ScaledState main;  // 16-bit weights only
    Tensor remainder;  // bf16 weights with store_param_remainders: the int16 remainders (a 16-bit tensor)
  };
  bool fp32_states() const;
  // The dtype unscaling and clipping round the gradients to: the buffer's with decoupled_grads, else fp32.
  DType decoupled_grad_dtype() const;
  bool counted_in_norm(const Param& p) const;
  // Visits, in order, what this rank counts in the norms: the replicated optimizer's parameters whole (piece null),
  // else the pieces of its shards.
  void for_each_counted(const std::function<void(size_t param, const Param& p, const Piece* piece)>& visit) const;
  double sum_over_world(double sum) const;  // a collective over the world
  // The sum over the world of term(index, param, piece) over what this rank counts in the norms.
  double sum_over_counted(const std::function<double(size_t param, const Param& p, const Piece* piece)>& term) const;
  // The piece's elements of its group's flat gradient buffer (a view).
  Tensor grad_piece(const Piece& piece) const;
  Tensor param_piece(const Piece& piece) const;  // the model's values (the DDP's parameter buffer)
  // The piece's fp32 main parameters (16-bit or quantized weights): a view of fp32 states, else a copy.
  Tensor main_param_fp32(const Piece& piece) const;

  DistributedDataParallel& ddp_;
  ParamStore& params_;
  AdamWOptions options_;
  std::optional<AdamWOptimizer> replicated_;  // without the distributed optimizer
  std::vector<Piece> pieces_;                 // registration order
  std::vector<Tensor> exp_avg_;               // [bucket] -> [shard_size] in exp_avg_format, kOptimizer
  std::vector<Tensor> exp_avg_sq_;
  // [bucket] -> [shard_size] main parameters (16-bit or quantized weights only; with remainders their low halves),
  // kOptimizer
  std::vector<Tensor> main_;
  int64_t step_ = 0;
  bool remainders_ = false;  // main parameters as bf16 weights + 16-bit remainders
};

}  // namespace moecore
