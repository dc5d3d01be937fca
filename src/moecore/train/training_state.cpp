#include "moecore/train/training_state.h"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace moecore {

int64_t lr_decay_style_code(const LRDecayStyle style) { return static_cast<int64_t>(style); }

LRDecayStyle lr_decay_style_from_code(const int64_t code) {
  if (code < 0 || code > static_cast<int64_t>(LRDecayStyle::kWSD)) {
    throw CheckpointError("lr_scheduler.lr_decay_style " + std::to_string(code) + " is not a decay style");
  }
  return static_cast<LRDecayStyle>(code);
}

void add_optimizer_state(StateDict& state, const ParamStore& params, const std::vector<AdamWMomentSlice>& slices,
                         const int64_t step) {
  std::vector<const AdamWMomentSlice*> slice_of(params.size(), nullptr);
  for (const AdamWMomentSlice& s : slices) {
    if (s.param < 0 || static_cast<size_t>(s.param) >= params.size()) {
      throw std::logic_error("optimizer moment slice of parameter " + std::to_string(s.param) + " out of range");
    }
    const auto i = static_cast<size_t>(s.param);
    if (slice_of[i] != nullptr) throw std::logic_error("two optimizer moment slices of " + params[i].name);
    slice_of[i] = &s;
  }
  // With 16-bit weights the fp32 main parameters are saved too (Megatron's optimizer state holds them), so a resume
  // continues from the exact values rather than from the rounded weights.
  const bool main_params = !slices.empty() && slices.front().main_param.defined();
  enum class Kind { kExpAvg, kExpAvgSq, kMainParam };
  std::vector<Kind> kinds = {Kind::kExpAvg, Kind::kExpAvgSq};
  if (main_params) kinds.push_back(Kind::kMainParam);
  for (const Kind kind : kinds) {
    const std::string prefix = kind == Kind::kExpAvg     ? "optimizer.state.exp_avg."
                               : kind == Kind::kExpAvgSq ? "optimizer.state.exp_avg_sq."
                                                         : std::string(kMainParamPrefix);
    const auto tensor_of = [kind](const AdamWMomentSlice& s) {
      return kind == Kind::kExpAvg ? s.exp_avg : kind == Kind::kExpAvgSq ? s.exp_avg_sq : s.main_param;
    };
    for (size_t i = 0; i < params.size(); ++i) {
      const Param& p = params[i];
      const AdamWMomentSlice* s = slice_of[i];
      StatePlacement placement{p.shard};
      // The local tensor's size from its placement: a Megatron-FSDP param may hold no whole value.
      if (s != nullptr && s->begin == 0 && s->end == local_numel(placement)) {  // the whole local tensor
        state.add_tensor(prefix + p.name, tensor_of(*s).view(shard_shape(p.shard)), placement);
      } else if (s != nullptr) {  // a distributed-optimizer piece: a flat range of the local tensor
        placement.flat_begin = s->begin;
        placement.flat_end = s->end;
        state.add_tensor(prefix + p.name, tensor_of(*s), placement);
      } else {  // wholly in other DP ranks' shards: an empty range, so every rank lists the same keys
        placement.flat_end = 0;
        state.add_tensor(prefix + p.name, Tensor(std::vector<int64_t>{0}, DType::kF32, MemCategory::kOptimizer),
                         placement);
      }
    }
  }
  state.add_i64("optimizer.step", step);
}

void add_lr_scheduler_state(StateDict& state, const LRSchedule& schedule) {
  const SchedulerState& s = schedule.state();
  state.add_f64("lr_scheduler.max_lr", s.max_lr);
  state.add_f64("lr_scheduler.lr_warmup_steps", s.lr_warmup_steps);
  state.add_i64("lr_scheduler.num_steps", static_cast<int64_t>(s.num_steps));
  state.add_i64("lr_scheduler.lr_decay_style", lr_decay_style_code(s.lr_decay_style));
  state.add_f64("lr_scheduler.lr_decay_steps", s.lr_decay_steps);
  state.add_f64("lr_scheduler.min_lr", s.min_lr);
  state.add_f64("lr_scheduler.start_wd", s.start_wd);
  state.add_f64("lr_scheduler.end_wd", s.end_wd);
  state.add_f64("lr_scheduler.wd_incr_steps", s.wd_incr_steps);
  state.add_i64("lr_scheduler.wd_incr_style", static_cast<int64_t>(s.wd_incr_style));
}

std::optional<SchedulerState> stored_scheduler_state(const ShardedCheckpoint& ckpt, const SchedulerState& mine) {
  if (!ckpt.info("lr_scheduler.max_lr")) return std::nullopt;
  SchedulerState s = mine;
  s.max_lr = ckpt.f64("lr_scheduler.max_lr");
  s.lr_warmup_steps = ckpt.f64("lr_scheduler.lr_warmup_steps");
  s.num_steps = static_cast<double>(ckpt.i64("lr_scheduler.num_steps"));
  s.lr_decay_style = lr_decay_style_from_code(ckpt.i64("lr_scheduler.lr_decay_style"));
  s.lr_decay_steps = ckpt.f64("lr_scheduler.lr_decay_steps");
  s.min_lr = ckpt.f64("lr_scheduler.min_lr");
  s.start_wd = ckpt.f64("lr_scheduler.start_wd");
  s.end_wd = ckpt.f64("lr_scheduler.end_wd");
  // Checkpoints of moecore versions that kept a constant decay have no increment fields: nothing to check there.
  if (ckpt.info("lr_scheduler.wd_incr_steps")) {
    s.wd_incr_steps = ckpt.f64("lr_scheduler.wd_incr_steps");
    const int64_t style = ckpt.i64("lr_scheduler.wd_incr_style");
    if (style < 0 || style > static_cast<int64_t>(WDIncrStyle::kCosine)) {
      throw CheckpointError("checkpoint " + ckpt.dir() + ": lr_scheduler.wd_incr_style " + std::to_string(style) +
                            " is not a weight-decay increment style");
    }
    s.wd_incr_style = static_cast<WDIncrStyle>(style);
  }
  return s;
}

std::string grad_scaler_prefix(const LossScalers& scalers, const bool expert) {
  if (!scalers.expert) return "optimizer.grad_scaler.";
  return expert ? "optimizer.1.grad_scaler." : "optimizer.0.grad_scaler.";
}

void add_grad_scaler_state(StateDict& state, const LossScalers& scalers) {
  for (const bool expert : {false, true}) {
    const std::optional<GradScaler>& scaler = expert ? scalers.expert : scalers.dense;
    if (!scaler || !scaler->is_dynamic()) continue;  // Megatron's ConstantGradScaler has an empty state
    const GradScaler::State s = scaler->state();
    const std::string prefix = grad_scaler_prefix(scalers, expert);
    state.add_f64(prefix + "scale", static_cast<double>(s.scale));
    state.add_i64(prefix + "growth_tracker", s.growth_tracker);
    state.add_i64(prefix + "hysteresis_tracker", s.hysteresis_tracker);
  }
}

void add_progress_state(StateDict& state, const TrainingProgress& progress, const int64_t seed) {
  state.add_i64("iteration", progress.iteration);
  state.add_i64("consumed_train_samples", progress.consumed_train_samples);
  state.add_i64("consumed_valid_samples", progress.consumed_valid_samples);
  state.add_f64("num_floating_point_operations_so_far", progress.floating_point_operations_so_far);
  state.add_i64("rng.seed", seed);
}

bool is_delayed_scaling_key(const std::string& key) { return key.find(kDelayedScalingInfix) != std::string::npos; }

void add_delayed_scaling_state(StateDict& state, const DelayedScalingStates& states) {
  using quant::DelayedLinearScaling;
  for (const DelayedScalingEntry& e : states.entries()) {
    DelayedLinearScaling& s = *e.state;
    const int64_t L = s.options().amax_history_len;
    const auto add = [&](const char* field, const std::span<float> data, const std::vector<int64_t>& shape) {
      StatePlacement replicated;
      replicated.shard.full_shape = shape;
      state.add_tensor(e.name + kDelayedScalingInfix + field, Tensor::from_blob(data.data(), shape), replicated);
    };
    add("scale_fwd", s.scale_fwd(), {DelayedLinearScaling::kForwardSlots});
    add("amax_history_fwd", s.amax_history_fwd(), {L, DelayedLinearScaling::kForwardSlots});
    add("scale_bwd", s.scale_bwd(), {DelayedLinearScaling::kBackwardSlots});
    add("amax_history_bwd", s.amax_history_bwd(), {L, DelayedLinearScaling::kBackwardSlots});
  }
}

void add_model_state(StateDict& state, const GPTModel& model, const DistributedDataParallel& ddp) {
  const ParamStore& params = model.params();
  if (params.size() != ddp.slots().size()) throw std::logic_error("add_model_state: another model's DDP");
  for (size_t i = 0; i < params.size(); ++i) {
    const Param& p = params[i];
    if (p.value.defined()) {
      state.add_tensor(p.name, p.value, StatePlacement{p.shard});
      continue;
    }
    // Megatron-FSDP's parameter shard: a flat range of the local tensor, as the distributed optimizer's moments.
    const DistributedDataParallel::Slot& slot = ddp.slots()[i];
    const DistributedDataParallel::Bucket& b = ddp.buckets()[static_cast<size_t>(slot.bucket)];
    const int64_t lo = std::max(slot.offset, b.shard_begin);
    const int64_t hi = std::min(slot.offset + slot.numel, b.shard_begin + b.shard_size);
    StatePlacement placement{p.shard};
    if (lo < hi) {
      placement.flat_begin = lo - slot.offset;
      placement.flat_end = hi - slot.offset;
      state.add_tensor(p.name, ddp.param_view(slot.bucket, lo, hi), placement);
    } else {  // wholly in other ranks' shards: an empty range, so every rank lists the same keys
      placement.flat_end = 0;
      state.add_tensor(p.name, Tensor(std::vector<int64_t>{0}, DType::kF32, MemCategory::kParams), placement);
    }
  }
  for (const Buffer& buffer : model.named_buffers()) {
    state.add_tensor(buffer.name, buffer.value, StatePlacement{buffer.shard});
  }
}

namespace {

StateDict assemble(const GPTModel& model, const DistributedDataParallel* ddp,
                   const std::vector<AdamWMomentSlice>& slices, const int64_t step, const LRSchedule& schedule,
                   const TrainingProgress& progress, const int64_t seed) {
  StateDict state;
  if (ddp != nullptr) {
    add_model_state(state, model, *ddp);
  } else {
    add_model_state(state, model);
  }
  add_delayed_scaling_state(state, model.delayed_scaling());
  add_optimizer_state(state, model.params(), slices, step);
  add_lr_scheduler_state(state, schedule);
  add_progress_state(state, progress, seed);
  return state;
}

}  // namespace

StateDict training_state(const GPTModel& model, const DistributedAdamW& optimizer, const LRSchedule& schedule,
                         const TrainingProgress& progress, const int64_t seed) {
  return assemble(model, &optimizer.ddp(), optimizer.moment_slices(), optimizer.steps_taken(), schedule, progress,
                  seed);
}

StateDict training_state(const GPTModel& model, const DistributedAdamW& optimizer,
                         const std::vector<AdamWMomentSlice>& slices, const LRSchedule& schedule,
                         const TrainingProgress& progress, const int64_t seed) {
  return assemble(model, &optimizer.ddp(), slices, optimizer.steps_taken(), schedule, progress, seed);
}

StateDict training_state(const GPTModel& model, const AdamWOptimizer& optimizer, const LRSchedule& schedule,
                         const TrainingProgress& progress, const int64_t seed) {
  return assemble(model, nullptr, optimizer.moment_slices(), optimizer.steps_taken(), schedule, progress, seed);
}

}  // namespace moecore
