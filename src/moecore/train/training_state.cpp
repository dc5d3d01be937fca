#include "moecore/train/training_state.h"

#include <stdexcept>
#include <string>
#include <vector>

namespace moecore {

int64_t lr_decay_style_code(const LRDecayStyle style) { return static_cast<int64_t>(style); }

void add_optimizer_state(StateDict& state, const std::vector<Param>& params,
                         const std::vector<AdamWMomentSlice>& slices, const int64_t step) {
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
      if (s != nullptr && s->begin == 0 && s->end == p.value.numel()) {  // the whole local tensor
        state.add_tensor(prefix + p.name, tensor_of(*s).view(p.value.shape()), placement);
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

void add_lr_scheduler_state(StateDict& state, const LRSchedule& schedule, const int64_t completed_iterations,
                            const double weight_decay) {
  const LRScheduleConfig& c = schedule.config();
  state.add_f64("lr_scheduler.max_lr", c.max_lr);
  state.add_f64("lr_scheduler.lr_warmup_steps", schedule.warmup_steps());
  state.add_i64("lr_scheduler.num_steps", completed_iterations * c.global_batch_size);
  state.add_i64("lr_scheduler.lr_decay_style", lr_decay_style_code(c.decay_style));
  state.add_f64("lr_scheduler.lr_decay_steps", schedule.decay_steps());
  state.add_f64("lr_scheduler.min_lr", c.min_lr);
  state.add_f64("lr_scheduler.start_wd", weight_decay);
  state.add_f64("lr_scheduler.end_wd", weight_decay);
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

namespace {

StateDict assemble(const GPTModel& model, const std::vector<AdamWMomentSlice>& slices, const int64_t step,
                   const double weight_decay, const LRSchedule& schedule, const TrainingProgress& progress,
                   const int64_t seed) {
  StateDict state;
  add_model_state(state, model);
  add_delayed_scaling_state(state, model.delayed_scaling());
  add_optimizer_state(state, model.params(), slices, step);
  add_lr_scheduler_state(state, schedule, progress.successful_iterations(), weight_decay);
  add_progress_state(state, progress, seed);
  return state;
}

}  // namespace

StateDict training_state(const GPTModel& model, const DistributedAdamW& optimizer, const LRSchedule& schedule,
                         const TrainingProgress& progress, const int64_t seed) {
  return assemble(model, optimizer.moment_slices(), optimizer.steps_taken(), optimizer.options().weight_decay, schedule,
                  progress, seed);
}

StateDict training_state(const GPTModel& model, const DistributedAdamW& optimizer,
                         const std::vector<AdamWMomentSlice>& slices, const LRSchedule& schedule,
                         const TrainingProgress& progress, const int64_t seed) {
  return assemble(model, slices, optimizer.steps_taken(), optimizer.options().weight_decay, schedule, progress, seed);
}

StateDict training_state(const GPTModel& model, const AdamWOptimizer& optimizer, const LRSchedule& schedule,
                         const TrainingProgress& progress, const int64_t seed) {
  return assemble(model, optimizer.moment_slices(), optimizer.steps_taken(), optimizer.options().weight_decay, schedule,
                  progress, seed);
}

}  // namespace moecore
