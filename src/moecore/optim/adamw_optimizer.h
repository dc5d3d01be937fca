// AdamW over a model's parameters with fp32 states, Megatron's parameter groups (no weight decay on
// biases and norm weights) and global-norm gradient clipping.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "moecore/model/param.h"
#include "moecore/ops/optim.h"
#include "moecore/ops/weight_casts.h"

namespace moecore {

struct AdamWOptions {
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.01;
  // The model weights' dtype (ModelConfig::params_dtype). 16-bit: the optimizer keeps fp32 main parameters, updates
  // them and writes them back rounded (Megatron's Float16OptimizerWithFloat16Params / the distributed optimizer's
  // fp32 shards).
  DType params_dtype = DType::kF32;
  // The precision-aware optimizer (Megatron's --use-precision-aware-optimizer, with the distributed optimizer only;
  // optim/scaled_state.h): the formats the moments and, with 16-bit weights, the main parameters are stored in.
  // AdamWOptimizer takes fp32 only.
  quant::StateFormat exp_avg_format = quant::StateFormat::kF32;
  quant::StateFormat exp_avg_sq_format = quant::StateFormat::kF32;
  quant::StateFormat main_params_format = quant::StateFormat::kF32;  // fp32 or fp16
  // Megatron's OptimizerConfig.store_param_remainders where TE's FusedAdam holds the master weights (the trainer sets
  // it as Megatron does, config/optimizer_master.h): with bf16 weights and fp32 main parameters these are kept as the
  // weights plus 16-bit remainders, half the bytes, exactly; the weights then round half away from zero. Ignored for
  // other weights / main formats and for quantized weights.
  bool store_param_remainders = false;
  // The precision-aware optimizer (TE FusedAdam) reads the DDP's 16-bit gradient buffer as it is (Megatron's
  // decoupled_grad), so unscaling and clipping multiply 16-bit values in place and round to 16 bits; otherwise the
  // optimizer works on fp32 copies of the gradients (Megatron's main_param.grad = main_grad.float()).
  bool decoupled_grads = false;
};

// Megatron's clip_grad_by_total_norm_fp32: the gradients are scaled by max_norm / (norm + 1e-6) when that is below 1
// (also for a norm just under max_norm); none when max_norm <= 0 (clipping off) or the coefficient is not below 1.
std::optional<float> clip_coefficient(double max_norm, double norm);

// A run of one parameter's Adam moments held by this rank: flat elements [begin, end) of params[param]'s local
// tensor (its tensor-parallel shard, row-major): views of the optimizer's fp32 states (writing them writes the
// state), or, for states stored in a reduced format, fp32 copies of their unscaled values (written back by
// DistributedAdamW::load_moment_slices). The replicated optimizer holds every parameter whole; the distributed
// optimizer the part of each parameter inside this rank's shard of its bucket (Megatron's DistributedOptimizer param
// ranges).
struct AdamWMomentSlice {
  int param = 0;
  int64_t begin = 0, end = 0;
  Tensor exp_avg;     // [end - begin]
  Tensor exp_avg_sq;  // [end - begin]
  Tensor main_param;  // [end - begin] fp32 main parameters with 16-bit model weights; undefined otherwise
};

// Writes the fp32 `main` values into the model weights `value`, rounded to `params_dtype`.
void copy_main_to_model(Tensor& value, const Tensor& main, DType params_dtype);

// The kernel's hyper-parameters for update number `step` at learning rate lr (no decay on no_weight_decay params).
ops::AdamWHyper adamw_hyper(const AdamWOptions& options, double lr, int64_t step, bool no_weight_decay);

class AdamWOptimizer {
 public:
  AdamWOptimizer(ParamStore& params, const AdamWOptions& options);

  // L2 norm of all gradients together (computed in double).
  double grad_norm() const;
  // Scales every gradient by clip_coefficient(max_norm, norm) when there is one. Returns the norm before clipping.
  double clip_grad_norm(double max_norm);
  // One AdamW update of every parameter at learning rate lr, from the gradients scaled by grad_scale (the clipping
  // coefficient, applied as the update reads them: clip_grad_norm then step(lr) is step(lr, coefficient) with
  // grad_norm, bit for bit, in one pass less). 16-bit weights are written from the main parameters in the same pass.
  // consume_grads: the same pass leaves every gradient zero (the next accumulation needs no zeroing of its own).
  // With `casts` (bf16 weights) the pass also rewrites each bf16 weight cast the carry holds for the next step.
  void step(double lr, float grad_scale = 1.0f, bool consume_grads = false, ops::WeightCastCarry* casts = nullptr);
  int64_t steps_taken() const { return step_; }
  void set_steps_taken(int64_t steps) { step_ = steps; }  // a checkpoint's count (Adam's bias correction)
  const AdamWOptions& options() const { return options_; }
  // The scheduler's weight decay for the next step (Megatron's param_group['weight_decay']).
  void set_weight_decay(double weight_decay) { options_.weight_decay = weight_decay; }
  // Every parameter's moments, whole, in parameter order (see AdamWMomentSlice).
  std::vector<AdamWMomentSlice> moment_slices() const;
  // 16-bit weights: main parameters := the model's current values (after loading weights without main parameters),
  // then the model's values := the main parameters rounded; main parameters := after writing them (a checkpoint's
  // fp32 parameters), the model's values rounded from them. No-ops with fp32 weights.
  void main_params_from_model();
  void model_from_main_params();

 private:
  ParamStore& params_;
  AdamWOptions options_;
  std::vector<Tensor> exp_avg_;
  std::vector<Tensor> exp_avg_sq_;
  std::vector<Tensor> main_;  // fp32 main parameters (16-bit weights only)
  int64_t step_ = 0;
};

}  // namespace moecore
