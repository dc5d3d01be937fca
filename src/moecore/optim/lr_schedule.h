// Megatron's OptimizerParamScheduler (megatron/core/optimizer_param_scheduler.py): the learning rate (get_lr: linear
// warmup from --lr-warmup-init to --lr, then one of the decay styles down to --min-lr) and the weight decay (get_wd:
// from --start-weight-decay to --end-weight-decay by --weight-decay-incr-style), both functions of num_steps, the
// samples of the successful iterations so far.
//
// Units. Megatron's scheduler counts samples: when training by iterations it is built with
//   lr_decay_steps  = lr_decay_iters * global_batch_size
//   lr_warmup_steps = lr_warmup_fraction * lr_decay_steps   (a float)   or   lr_warmup_iters * global_batch_size
//   wsd_decay_steps = lr_wsd_decay_iters * global_batch_size
//   wd_incr_steps   = train_iters * global_batch_size
// and advanced by the global batch size of each successful (not skipped) iteration: num_steps is a sample count, so a
// run resumed with another global batch size goes on from the samples it has seen, as Megatron's.
//
// Which value is used when. Megatron sets the lr for the first update at construction (step(0)); the update of an
// iteration uses lr() before step(); the iteration log line prints lr() after the scheduler stepped. Skipped
// iterations do not step.
//
// Checkpoints hold Megatron's state_dict fields (SchedulerState). load() applies Megatron's _check_and_set to each:
// the flags' value must equal the checkpoint's, unless --override-opt_param-scheduler (the flags' values win) or
// --use-checkpoint-opt_param-scheduler (the checkpoint's win); num_steps always comes from the checkpoint.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace moecore {

enum class LRDecayStyle { kConstant, kLinear, kCosine, kInverseSquareRoot, kWSD };  // --lr-decay-style
enum class WSDDecayStyle { kExponential, kLinear, kCosine, kMinusSqrt };            // --lr-wsd-decay-style
enum class WDIncrStyle { kConstant, kLinear, kCosine };                             // --weight-decay-incr-style

// Megatron's spellings: "constant", "linear", "cosine", "inverse-square-root", "WSD".
std::string to_string(LRDecayStyle style);
// "exponential", "linear", "cosine", "minus_sqrt".
std::string to_string(WSDDecayStyle style);
// Parse Megatron's spelling; std::nullopt when it is not one of the choices.
std::optional<LRDecayStyle> parse_lr_decay_style(std::string_view text);
std::optional<WSDDecayStyle> parse_wsd_decay_style(std::string_view text);
std::string to_string(WDIncrStyle style);  // "constant", "linear", "cosine"
std::optional<WDIncrStyle> parse_wd_incr_style(std::string_view text);

struct LRScheduleConfig {
  double max_lr = 0.0;                    // --lr
  double min_lr = 0.0;                    // --min-lr
  double init_lr = 0.0;                   // --lr-warmup-init
  int64_t global_batch_size = 1;          // samples per iteration (the scheduler's step increment)
  int64_t warmup_iters = 0;               // --lr-warmup-iters
  std::optional<double> warmup_fraction;  // --lr-warmup-fraction (of the decay length); excludes warmup_iters
  int64_t decay_iters = 0;                // --lr-decay-iters (defaults to --train-iters in the argument parser)
  LRDecayStyle decay_style = LRDecayStyle::kLinear;
  std::optional<int64_t> wsd_decay_iters;  // --lr-wsd-decay-iters, required with WSD
  WSDDecayStyle wsd_decay_style = WSDDecayStyle::kExponential;
  double start_wd = 0.0;      // --start-weight-decay (--weight-decay with the constant style)
  double end_wd = 0.0;        // --end-weight-decay
  int64_t wd_incr_iters = 1;  // --train-iters
  WDIncrStyle wd_incr_style = WDIncrStyle::kConstant;
};

// Megatron's OptimizerParamScheduler.state_dict, in sample units.
struct SchedulerState {
  double max_lr = 0.0;
  double lr_warmup_steps = 0.0;
  double num_steps = 0.0;
  LRDecayStyle lr_decay_style = LRDecayStyle::kLinear;
  double lr_decay_steps = 0.0;
  double min_lr = 0.0;
  double start_wd = 0.0;
  double end_wd = 0.0;
  double wd_incr_steps = 0.0;
  WDIncrStyle wd_incr_style = WDIncrStyle::kConstant;
};

// How load() treats a field whose checkpoint value differs from the flags'.
enum class SchedulerLoadMode {
  kCheck,          // an error naming the flag (Megatron's assertion)
  kOverride,       // --override-opt_param-scheduler: the flags' value
  kUseCheckpoint,  // --use-checkpoint-opt_param-scheduler: the checkpoint's value
};

class LRSchedule {
 public:
  // Throws ConfigError (one line) for settings Megatron's scheduler asserts against.
  explicit LRSchedule(const LRScheduleConfig& config);

  // Learning rate and weight decay at num_steps samples (Megatron's get_lr / get_wd).
  double lr_at_steps(double num_steps) const;
  double wd_at_steps(double num_steps) const;
  // Learning rate after `completed_iterations` successful iterations of the configured global batch size.
  double lr_at(int64_t completed_iterations) const;

  // The scheduler's position: samples of the successful iterations so far, and the values there.
  double num_steps() const { return state_.num_steps; }
  double lr() const { return lr_at_steps(state_.num_steps); }
  double weight_decay() const { return wd_at_steps(state_.num_steps); }
  // After a successful iteration of `increment` samples (Megatron's step(increment)).
  void step(int64_t increment) { state_.num_steps += static_cast<double>(increment); }
  // --override-opt_param-scheduler on a load: num_steps set to the consumed samples (Megatron's load_checkpoint).
  void set_num_steps(double num_steps) { state_.num_steps = num_steps; }

  const LRScheduleConfig& config() const { return config_; }
  const SchedulerState& state() const { return state_; }
  // The schedule lengths in Megatron's sample units.
  double warmup_steps() const { return state_.lr_warmup_steps; }
  double decay_steps() const { return state_.lr_decay_steps; }

  // A checkpoint's state (Megatron's load_state_dict): each field through `mode`, num_steps from the checkpoint.
  // ConfigError naming the flag when a field differs under kCheck, or when the result is not a valid schedule.
  void load(const SchedulerState& stored, SchedulerLoadMode mode);

 private:
  void validate() const;
  LRScheduleConfig config_;
  SchedulerState state_;
  double wsd_decay_steps_ = 0.0;
};

}  // namespace moecore
