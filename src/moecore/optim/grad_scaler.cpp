#include "moecore/optim/grad_scaler.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

namespace moecore {
namespace {

constexpr float kGrowthFactor = 2.0f;   // Megatron's optimizer/__init__.py: growth_factor=2.0
constexpr float kBackoffFactor = 0.5f;  // backoff_factor=0.5

void require(const bool ok, const std::string& message) {
  if (!ok) throw std::invalid_argument(message);
}

}  // namespace

GradScaler GradScaler::constant(const double scale) {
  require(std::isfinite(scale) && scale > 0.0,
          "--loss-scale must be a positive finite number, got " + std::to_string(scale));
  GradScaler scaler;
  scaler.scale_ = static_cast<float>(scale);
  require(std::isfinite(scaler.scale_) && scaler.scale_ > 0.0f,
          "--loss-scale " + std::to_string(scale) + " is not representable in fp32");
  return scaler;
}

GradScaler GradScaler::dynamic(const DynamicLossScaleOptions& options) {
  require(std::isfinite(options.initial_scale) && options.initial_scale > 0.0,
          "--initial-loss-scale must be a positive finite number");
  require(std::isfinite(options.min_scale) && options.min_scale > 0.0,
          "--min-loss-scale must be a positive finite number");
  require(options.min_scale <= options.initial_scale, "--min-loss-scale must not exceed --initial-loss-scale");
  require(options.growth_interval >= 1, "--loss-scale-window must be at least 1");
  require(options.hysteresis >= 1, "--hysteresis must be at least 1");
  GradScaler scaler;
  scaler.dynamic_ = true;
  scaler.scale_ = static_cast<float>(options.initial_scale);
  scaler.min_scale_ = static_cast<float>(options.min_scale);
  require(std::isfinite(scaler.scale_), "--initial-loss-scale is not representable in fp32");
  scaler.growth_interval_ = options.growth_interval;
  scaler.hysteresis_ = options.hysteresis;
  scaler.hysteresis_tracker_ = options.hysteresis;
  return scaler;
}

float GradScaler::inv_scale() const { return static_cast<float>(1.0 / static_cast<double>(scale_)); }

void GradScaler::update(const bool found_inf) {
  if (!dynamic_) return;
  if (found_inf) {
    growth_tracker_ = 0;
    hysteresis_tracker_ -= 1;
    if (hysteresis_tracker_ <= 0) scale_ = std::max(scale_ * kBackoffFactor, min_scale_);
    return;
  }
  growth_tracker_ += 1;
  if (growth_tracker_ == growth_interval_) {
    growth_tracker_ = 0;
    hysteresis_tracker_ = hysteresis_;
    scale_ = scale_ * kGrowthFactor;
  }
}

void GradScaler::load_state(const State& state) {
  if (!dynamic_) return;  // Megatron's ConstantGradScaler.load_state_dict ignores the state
  require(std::isfinite(state.scale) && state.scale > 0.0f, "loss scale in the checkpoint is not a positive number");
  scale_ = state.scale;
  growth_tracker_ = state.growth_tracker;
  hysteresis_tracker_ = state.hysteresis_tracker;
}

}  // namespace moecore
