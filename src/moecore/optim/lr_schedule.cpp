#include "moecore/optim/lr_schedule.h"

#include <algorithm>
#include <cmath>
#include <numbers>

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

  const double gbs = static_cast<double>(config.global_batch_size);
  decay_steps_ = static_cast<double>(config.decay_iters) * gbs;
  warmup_steps_ = config.warmup_fraction.has_value() ? *config.warmup_fraction * decay_steps_
                                                     : static_cast<double>(config.warmup_iters) * gbs;
  require(warmup_steps_ < decay_steps_,
          "learning-rate warmup (" + number(warmup_steps_ / gbs) + " iterations) must be shorter than the decay (" +
              std::to_string(config.decay_iters) + " iterations, --lr-decay-iters or --train-iters)");
  if (config.decay_style == LRDecayStyle::kWSD) {
    require(config.wsd_decay_iters.has_value(), "--lr-decay-style WSD requires --lr-wsd-decay-iters");
    require(*config.wsd_decay_iters > 0 && *config.wsd_decay_iters <= config.decay_iters,
            "--lr-wsd-decay-iters (" + std::to_string(*config.wsd_decay_iters) +
                ") must be positive and at most the decay length (" + std::to_string(config.decay_iters) + ")");
    wsd_decay_steps_ = static_cast<double>(*config.wsd_decay_iters) * gbs;
  }
}

double LRSchedule::lr_at(const int64_t completed_iterations) const {
  const double num_steps = static_cast<double>(completed_iterations) * static_cast<double>(config_.global_batch_size);
  const double max_lr = config_.max_lr;
  const double min_lr = config_.min_lr;

  if (warmup_steps_ > 0.0 && num_steps <= warmup_steps_) {
    return config_.init_lr + (max_lr - config_.init_lr) * num_steps / warmup_steps_;
  }
  if (config_.decay_style == LRDecayStyle::kConstant) return max_lr;
  if (num_steps > decay_steps_) return min_lr;

  if (config_.decay_style == LRDecayStyle::kInverseSquareRoot) {
    const double warmup = std::max(warmup_steps_, 1.0);
    const double steps = std::max(num_steps, 1.0);
    return std::max(min_lr, max_lr * std::sqrt(warmup) / std::sqrt(steps));
  }

  const double decay_ratio = (num_steps - warmup_steps_) / (decay_steps_ - warmup_steps_);
  double coeff = 1.0;
  switch (config_.decay_style) {
    case LRDecayStyle::kLinear: coeff = 1.0 - decay_ratio; break;
    case LRDecayStyle::kCosine: coeff = 0.5 * (std::cos(std::numbers::pi * decay_ratio) + 1.0); break;
    case LRDecayStyle::kWSD: {
      const double anneal_start = decay_steps_ - wsd_decay_steps_;
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
