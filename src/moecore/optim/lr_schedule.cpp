#include "moecore/optim/lr_schedule.h"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <sstream>

#include "moecore/model/config.h"

namespace moecore {
namespace {

void require(const bool ok, const std::string& message) {
  if (!ok) throw ConfigError(message);
}

std::string number(const double value) {
  std::string text = std::to_string(value);
  // Trim the zeros std::to_string pads with, keeping one digit after the point.
  const size_t dot = text.find('.');
  if (dot != std::string::npos) {
    while (text.size() > dot + 2 && text.back() == '0') text.pop_back();
  }
  return text;
}

}  // namespace

std::string to_string(const LRDecayStyle style) {
  switch (style) {
    case LRDecayStyle::kConstant: return "constant";
    case LRDecayStyle::kLinear: return "linear";
    case LRDecayStyle::kCosine: return "cosine";
    case LRDecayStyle::kInverseSquareRoot: return "inverse-square-root";
    case LRDecayStyle::kWSD: return "WSD";
  }
  return "?";
}

std::string to_string(const WSDDecayStyle style) {
  switch (style) {
    case WSDDecayStyle::kExponential: return "exponential";
    case WSDDecayStyle::kLinear: return "linear";
    case WSDDecayStyle::kCosine: return "cosine";
    case WSDDecayStyle::kMinusSqrt: return "minus_sqrt";
  }
  return "?";
}

std::optional<LRDecayStyle> parse_lr_decay_style(const std::string_view text) {
  for (const LRDecayStyle style : {LRDecayStyle::kConstant, LRDecayStyle::kLinear, LRDecayStyle::kCosine,
                                   LRDecayStyle::kInverseSquareRoot, LRDecayStyle::kWSD}) {
    if (text == to_string(style)) return style;
  }
  return std::nullopt;
}

std::string to_string(const WDIncrStyle style) {
  switch (style) {
    case WDIncrStyle::kConstant: return "constant";
    case WDIncrStyle::kLinear: return "linear";
    case WDIncrStyle::kCosine: return "cosine";
  }
  return "?";
}

std::optional<WDIncrStyle> parse_wd_incr_style(const std::string_view text) {
  for (const WDIncrStyle style : {WDIncrStyle::kConstant, WDIncrStyle::kLinear, WDIncrStyle::kCosine}) {
    if (text == to_string(style)) return style;
  }
  return std::nullopt;
}

std::optional<WSDDecayStyle> parse_wsd_decay_style(const std::string_view text) {
  for (const WSDDecayStyle style :
       {WSDDecayStyle::kExponential, WSDDecayStyle::kLinear, WSDDecayStyle::kCosine, WSDDecayStyle::kMinusSqrt}) {
    if (text == to_string(style)) return style;
  }
  return std::nullopt;
}

LRSchedule::LRSchedule(const LRScheduleConfig& config) : config_(config) {
  require(config.global_batch_size > 0, "global batch size must be positive for the learning-rate schedule");
  require(config.min_lr >= 0.0, "--min-lr must be non-negative (got " + number(config.min_lr) + ")");
  require(config.max_lr >= config.min_lr,
          "--min-lr (" + number(config.min_lr) + ") must not exceed --lr (" + number(config.max_lr) + ")");
  require(config.init_lr <= config.max_lr,
          "--lr-warmup-init (" + number(config.init_lr) + ") must not exceed --lr (" + number(config.max_lr) + ")");
  require(config.decay_iters > 0, "--lr-decay-iters must be positive (got " + std::to_string(config.decay_iters) + ")");
  require(config.warmup_iters >= 0,
          "--lr-warmup-iters must be non-negative (got " + std::to_string(config.warmup_iters) + ")");
  require(!config.warmup_fraction.has_value() || config.warmup_iters == 0,
          "can only specify one of --lr-warmup-fraction and --lr-warmup-iters");
  require(!config.warmup_fraction.has_value() || *config.warmup_fraction >= 0.0,
          "--lr-warmup-fraction must be non-negative");
  require(config.wd_incr_iters > 0, "--train-iters must be positive for the weight-decay schedule");
  require(config.wd_incr_style != WDIncrStyle::kConstant || config.start_wd == config.end_wd,
          "--weight-decay-incr-style constant needs --start-weight-decay equal to --end-weight-decay");

  const double gbs = static_cast<double>(config.global_batch_size);
  state_.max_lr = config.max_lr;
  state_.min_lr = config.min_lr;
  state_.lr_decay_style = config.decay_style;
  state_.lr_decay_steps = static_cast<double>(config.decay_iters) * gbs;
  state_.lr_warmup_steps = config.warmup_fraction.has_value() ? *config.warmup_fraction * state_.lr_decay_steps
                                                              : static_cast<double>(config.warmup_iters) * gbs;
  state_.start_wd = config.start_wd;
  state_.end_wd = config.end_wd;
  state_.wd_incr_steps = static_cast<double>(config.wd_incr_iters) * gbs;
  state_.wd_incr_style = config.wd_incr_style;
  require(state_.lr_warmup_steps < state_.lr_decay_steps,
          "learning-rate warmup (" + number(state_.lr_warmup_steps / gbs) +
              " iterations) must be shorter than the decay (" + std::to_string(config.decay_iters) +
              " iterations, --lr-decay-iters or --train-iters)");
  if (config.decay_style == LRDecayStyle::kWSD) {
    require(config.wsd_decay_iters.has_value(), "--lr-decay-style WSD requires --lr-wsd-decay-iters");
    require(*config.wsd_decay_iters > 0 && *config.wsd_decay_iters <= config.decay_iters,
            "--lr-wsd-decay-iters (" + std::to_string(*config.wsd_decay_iters) +
                ") must be positive and at most the decay length (" + std::to_string(config.decay_iters) + ")");
    wsd_decay_steps_ = static_cast<double>(*config.wsd_decay_iters) * gbs;
  }
}

void LRSchedule::validate() const {
  const SchedulerState& s = state_;
  require(s.min_lr >= 0.0 && s.max_lr >= s.min_lr, "the scheduler's min_lr " + number(s.min_lr) + " and max_lr " +
                                                       number(s.max_lr) +
                                                       " do not make a schedule (0 <= min_lr <= max_lr)");
  require(s.lr_decay_steps > 0.0 && s.lr_warmup_steps >= 0.0 && s.lr_warmup_steps < s.lr_decay_steps,
          "the scheduler's lr_warmup_steps " + number(s.lr_warmup_steps) + " and lr_decay_steps " +
              number(s.lr_decay_steps) + " do not make a schedule (0 <= warmup < decay)");
  require(s.lr_decay_style != LRDecayStyle::kWSD || wsd_decay_steps_ <= s.lr_decay_steps,
          "the scheduler's lr_decay_steps " + number(s.lr_decay_steps) + " are shorter than --lr-wsd-decay-iters");
  require(s.wd_incr_steps > 0.0, "the scheduler's wd_incr_steps must be positive");
  require(s.wd_incr_style != WDIncrStyle::kConstant || s.start_wd == s.end_wd,
          "the scheduler's weight-decay increment style is constant but start_wd " + number(s.start_wd) +
              " differs from end_wd " + number(s.end_wd));
  require(std::isfinite(s.num_steps) && s.num_steps >= 0.0,
          "the scheduler's num_steps " + number(s.num_steps) + " is not a sample count");
}

void LRSchedule::load(const SchedulerState& stored, const SchedulerLoadMode mode) {
  const auto check_and_set = [mode](auto& mine, const auto& theirs, const std::string& field, const std::string& flag,
                                    const auto& show) {
    if (mode == SchedulerLoadMode::kOverride) return;
    if (mode == SchedulerLoadMode::kCheck && !(mine == theirs)) {
      std::ostringstream msg;
      msg << "OptimizerParamScheduler: " << flag << " gives lr_scheduler." << field << " " << show(mine)
          << " but the checkpoint has " << show(theirs)
          << " (pass --override-opt_param-scheduler or --use-checkpoint-opt_param-scheduler)";
      throw ConfigError(msg.str());
    }
    mine = theirs;
  };
  const auto num = [](const double v) {
    std::ostringstream out;
    out << v;
    return out.str();
  };
  const auto lr_style = [](const LRDecayStyle v) { return to_string(v); };
  const auto wd_style = [](const WDIncrStyle v) { return to_string(v); };
  SchedulerState& s = state_;
  check_and_set(s.max_lr, stored.max_lr, "max_lr", "--lr", num);
  check_and_set(s.min_lr, stored.min_lr, "min_lr", "--min-lr", num);
  check_and_set(s.lr_warmup_steps, stored.lr_warmup_steps, "lr_warmup_steps", "--lr-warmup-iters x --global-batch-size",
                num);
  check_and_set(s.lr_decay_steps, stored.lr_decay_steps, "lr_decay_steps", "--lr-decay-iters x --global-batch-size",
                num);
  check_and_set(s.lr_decay_style, stored.lr_decay_style, "lr_decay_style", "--lr-decay-style", lr_style);
  s.num_steps = stored.num_steps;
  check_and_set(s.start_wd, stored.start_wd, "start_wd", "--start-weight-decay (or --weight-decay)", num);
  check_and_set(s.end_wd, stored.end_wd, "end_wd", "--end-weight-decay (or --weight-decay)", num);
  check_and_set(s.wd_incr_steps, stored.wd_incr_steps, "wd_incr_steps", "--train-iters x --global-batch-size", num);
  check_and_set(s.wd_incr_style, stored.wd_incr_style, "wd_incr_style", "--weight-decay-incr-style", wd_style);
  validate();
}

double LRSchedule::lr_at(const int64_t completed_iterations) const {
  return lr_at_steps(static_cast<double>(completed_iterations) * static_cast<double>(config_.global_batch_size));
}

double LRSchedule::wd_at_steps(const double num_steps) const {
  const SchedulerState& s = state_;
  if (num_steps > s.wd_incr_steps || s.wd_incr_style == WDIncrStyle::kConstant) return s.end_wd;
  const double incr_ratio = num_steps / s.wd_incr_steps;
  const double coeff = s.wd_incr_style == WDIncrStyle::kLinear
                           ? incr_ratio
                           : 0.5 * (std::cos(std::numbers::pi * (1.0 - incr_ratio)) + 1.0);
  return s.start_wd + coeff * (s.end_wd - s.start_wd);
}

double LRSchedule::lr_at_steps(const double num_steps) const {
  const double max_lr = state_.max_lr;
  const double min_lr = state_.min_lr;
  const double warmup_steps = state_.lr_warmup_steps;
  const double decay_steps = state_.lr_decay_steps;
  const LRDecayStyle style = state_.lr_decay_style;

  if (warmup_steps > 0.0 && num_steps <= warmup_steps) {
    return config_.init_lr + (max_lr - config_.init_lr) * num_steps / warmup_steps;
  }
  if (style == LRDecayStyle::kConstant) return max_lr;
  if (num_steps > decay_steps) return min_lr;

  if (style == LRDecayStyle::kInverseSquareRoot) {
    const double warmup = std::max(warmup_steps, 1.0);
    const double steps = std::max(num_steps, 1.0);
    return std::max(min_lr, max_lr * std::sqrt(warmup) / std::sqrt(steps));
  }

  const double decay_ratio = (num_steps - warmup_steps) / (decay_steps - warmup_steps);
  double coeff = 1.0;
  switch (style) {
    case LRDecayStyle::kLinear: coeff = 1.0 - decay_ratio; break;
    case LRDecayStyle::kCosine: coeff = 0.5 * (std::cos(std::numbers::pi * decay_ratio) + 1.0); break;
    case LRDecayStyle::kWSD: {
      const double anneal_start = decay_steps - wsd_decay_steps_;
      if (num_steps <= anneal_start) break;  // the stable phase: coeff stays 1
      const double wsd_ratio = (num_steps - anneal_start) / wsd_decay_steps_;
      switch (config_.wsd_decay_style) {
        case WSDDecayStyle::kLinear: coeff = 1.0 - wsd_ratio; break;
        case WSDDecayStyle::kCosine: coeff = 0.5 * (std::cos(std::numbers::pi * wsd_ratio) + 1.0); break;
        case WSDDecayStyle::kExponential: coeff = 2.0 * std::pow(0.5, wsd_ratio) - 1.0; break;
        case WSDDecayStyle::kMinusSqrt: coeff = 1.0 - std::sqrt(wsd_ratio); break;
      }
      break;
    }
    case LRDecayStyle::kConstant:
    case LRDecayStyle::kInverseSquareRoot: break;  // handled above
  }
  return min_lr + coeff * (max_lr - min_lr);
}

}  // namespace moecore
