// The training state: everything a checkpoint holds to resume a run bit for bit or to reshard it into another
// layout, as one StateDict (ckpt/state_dict.h) of global keys, in this order:
//   <param name>                          fp32, each model parameter (moecore's parameters are the fp32 master
//                                         weights: there is no separate master copy)
//   <buffer name>                         e.g. decoder.layers.{i}.mlp.router.expert_bias [E] fp32, replicated
//   <linear>._extra_state.scale_fwd [2], .amax_history_fwd [L, 2], .scale_bwd [1], .amax_history_bwd [L, 1]
//                                         fp32, replicated: with --fp8-recipe delayed, each decoder-layer linear's
//                                         scaling state (quant/delayed_linear_scaling.h; TE's fp8_meta, which Megatron
//                                         saves as the module's _extra_state), e.g.
//                                         decoder.layers.0.self_attention.linear_qkv._extra_state.scale_fwd,
//                                         decoder.layers.1.mlp.experts.local_experts.3.linear_fc1._extra_state...
//   optimizer.state.exp_avg.<param name>     fp32, Adam's moments under Megatron's fully reshardable optimizer keys;
//   optimizer.state.exp_avg_sq.<param name>  global shape = the parameter's; placed by the parameter's shard and, with
//                                            the distributed optimizer, the flat range of the parameter's local
//                                            tensor this rank's moments cover
//   optimizer.state.fp32_param.<param name>  fp32, with 16-bit weights: the main parameters, placed as the moments
//                                            (the precision-aware optimizer's reduced-format states are saved as
//                                            their unscaled fp32 values, as Megatron's get_unscaled_state, so any
//                                            --exp-avg-dtype / --main-params-dtype loads them)
//   optimizer.step                        int64, Adam updates taken (the bias-correction count)
//   optimizer.grad_scaler.{scale (float64), growth_tracker, hysteresis_tracker (int64)}
//                                         fp16's dynamic loss scaler (Megatron's optimizer state_dict 'grad_scaler';
//                                         a constant scale has none); with routed experts Megatron's two chained
//                                         optimizers' scalers, optimizer.0.grad_scaler.* (dense) and
//                                         optimizer.1.grad_scaler.* (experts)
//   lr_scheduler.{max_lr, min_lr, lr_warmup_steps, lr_decay_steps, start_wd, end_wd, wd_incr_steps}   float64
//   lr_scheduler.{num_steps, lr_decay_style, wd_incr_style}                                          int64
//                                         Megatron's OptimizerParamScheduler.state_dict (sample units: num_steps is
//                                         the samples of the successful iterations; styles as their enum codes)
//   iteration, consumed_train_samples, consumed_valid_samples                         int64
//   num_floating_point_operations_so_far                                              float64
//   rng.seed                               int64, the run seed (every random draw is a counter RNG keyed by it)
// Routed-expert entries exist only on the EP ranks that own the expert; every other key is on every rank (a
// distributed-optimizer rank whose shards miss a parameter lists its moments with an empty flat range [0, 0)). The
// union over ranks is the one-process key set.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "moecore/ckpt/sharded_checkpoint.h"
#include "moecore/ckpt/state_dict.h"
#include "moecore/model/gpt_model.h"
#include "moecore/optim/adamw_optimizer.h"
#include "moecore/optim/distributed_optimizer.h"
#include "moecore/optim/grad_scaler.h"
#include "moecore/optim/lr_schedule.h"
#include "moecore/train/training_progress.h"

namespace moecore {

// The model's parameters and buffers (ckpt/state_dict.h add_model_state), a Megatron-FSDP parameter held as this
// rank's shard (Param::value unbound between its unit's uses, optim/fsdp.h) as the flat range of its local tensor the
// shard covers (an empty range where it covers none), so FSDP shards save and load under the same global keys.
void add_model_state(StateDict& state, const GPTModel& model, const DistributedDataParallel& ddp);

// The int64 stored for a decay style: its position in LRDecayStyle (0 constant, 1 linear, 2 cosine,
// 3 inverse-square-root, 4 WSD).
int64_t lr_decay_style_code(LRDecayStyle style);

// Key prefix of the fp32 main parameters saved with 16-bit weights.
inline constexpr const char* kMainParamPrefix = "optimizer.state.fp32_param.";

// optimizer.state.exp_avg.* then optimizer.state.exp_avg_sq.* for every parameter in order (views of the optimizer's
// states; at most one slice per parameter), with 16-bit weights optimizer.state.fp32_param.* (the main parameters),
// then optimizer.step. `params` are the optimizer's parameters (slice.param
// indexes them).
void add_optimizer_state(StateDict& state, const ParamStore& params, const std::vector<AdamWMomentSlice>& slices,
                         int64_t step);
// The FP8 delayed-scaling entries (views of the live states) and their key test.
inline constexpr const char* kDelayedScalingInfix = "._extra_state.";
void add_delayed_scaling_state(StateDict& state, const DelayedScalingStates& states);
bool is_delayed_scaling_key(const std::string& key);
// lr_scheduler.*: the scheduler's state (Megatron's OptimizerParamScheduler.state_dict).
void add_lr_scheduler_state(StateDict& state, const LRSchedule& schedule);
// The scheduler state a checkpoint holds (fields it lacks taken from `mine`); nullopt without one (--no-save-optim).
std::optional<SchedulerState> stored_scheduler_state(const ShardedCheckpoint& ckpt, const SchedulerState& mine);
// The decay style of a stored code (CheckpointError for a code that is none).
LRDecayStyle lr_decay_style_from_code(int64_t code);
// optimizer[.0|.1].grad_scaler.*: the dynamic loss scalers' state (none for a constant scale or no scaling).
void add_grad_scaler_state(StateDict& state, const LossScalers& scalers);
std::string grad_scaler_prefix(const LossScalers& scalers, bool expert);
// iteration, consumed samples, FLOPs so far, rng.seed.
void add_progress_state(StateDict& state, const TrainingProgress& progress, int64_t seed);

// The whole training state of this rank (see the list above). Tensor entries are views of the live model and
// optimizer. With the distributed optimizer, call after the parameter all-gather of the last step has finished
// (DistributedDataParallel::wait_param_gather).
StateDict training_state(const GPTModel& model, const DistributedAdamW& optimizer, const LRSchedule& schedule,
                         const TrainingProgress& progress, int64_t seed);
// The same over given moment slices (optimizer.moment_slices()): a loader keeps them to hand the loaded values back
// with DistributedAdamW::load_moment_slices (reduced-format states come as fp32 copies).
StateDict training_state(const GPTModel& model, const DistributedAdamW& optimizer,
                         const std::vector<AdamWMomentSlice>& slices, const LRSchedule& schedule,
                         const TrainingProgress& progress, int64_t seed);
// The same for an AdamWOptimizer built over model.params() (one process, no DDP).
StateDict training_state(const GPTModel& model, const AdamWOptimizer& optimizer, const LRSchedule& schedule,
                         const TrainingProgress& progress, int64_t seed);

}  // namespace moecore
