// Learning-rate schedule of Megatron's OptimizerParamScheduler (megatron/core/optimizer_param_scheduler.py, get_lr):
// linear warmup from --lr-warmup-init to --lr, then one of the decay styles down to --min-lr.
//
// Units. Megatron's scheduler counts samples: when training by iterations it is built with
//   lr_decay_steps  = lr_decay_iters * global_batch_size
//   lr_warmup_steps = lr_warmup_fraction * lr_decay_steps   (a float)   or   lr_warmup_iters * global_batch_size
//   wsd_decay_steps = lr_wsd_decay_iters * global_batch_size
// and advanced by global_batch_size after every successful (not skipped) iteration. Most ratios are the same in
// iteration units, but inverse-square-root clamps warmup and step counts to at least 1 *sample*, so this class keeps
// Megatron's sample units internally and takes the number of completed iterations as input: results are identical.
//
// Which value is used when. Megatron sets the lr for the first update at construction (step(0)), i.e. lr_at(0); the
// update of iteration i (1-based) uses lr_at(i - 1); the iteration log line of iteration i prints the value after
// the scheduler stepped, lr_at(i). Skipped iterations do not advance the scheduler.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace moecore {

enum class LRDecayStyle { kConstant, kLinear, kCosine, kInverseSquareRoot, kWSD };  // --lr-decay-style
enum class WSDDecayStyle { kExponential, kLinear, kCosine, kMinusSqrt };            // --lr-wsd-decay-style

// Megatron's spellings: "constant", "linear", "cosine", "inverse-square-root", "WSD".
std::string to_string(LRDecayStyle style);
// "exponential", "linear", "cosine", "minus_sqrt".
std::string to_string(WSDDecayStyle style);
// Parse Megatron's spelling; std::nullopt when it is not one of the choices.
std::optional<LRDecayStyle> parse_lr_decay_style(std::string_view text);
std::optional<WSDDecayStyle> parse_wsd_decay_style(std::string_view text);

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
};

class LRSchedule {
 public:
  // Throws ConfigError (one line) for settings Megatron's scheduler asserts against.
  explicit LRSchedule(const LRScheduleConfig& config);

  // Learning rate after `completed_iterations` successful iterations (Megatron: num_steps = that * global batch).
  double lr_at(int64_t completed_iterations) const;

  const LRScheduleConfig& config() const { return config_; }
  // The schedule lengths in Megatron's sample units.
  double warmup_steps() const { return warmup_steps_; }
  double decay_steps() const { return decay_steps_; }

 private:
  LRScheduleConfig config_;
  double warmup_steps_ = 0.0;
  double decay_steps_ = 0.0;
  double wsd_decay_steps_ = 0.0;
};

}  // namespace moecore
