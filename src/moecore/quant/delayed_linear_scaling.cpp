#include "moecore/quant/delayed_linear_scaling.h"

#include <stdexcept>
#include <string>

namespace moecore::quant {

DelayedLinearScaling::DelayedLinearScaling(const DelayedScalingOptions& options, const Fp8Format format)
    : options_(options),
      forward_format_(element_format_for(Recipe::kDelayed, format, Role::kActivation)),
      grad_format_(element_format_for(Recipe::kDelayed, format, Role::kGradient)) {
  const int64_t L = options.amax_history_len;
  if (L < 1) {
    throw std::invalid_argument("delayed scaling needs an amax history of at least 1, got " + std::to_string(L));
  }
  scale_fwd_.assign(kForwardSlots, 1.0f);
  amax_history_fwd_.assign(static_cast<size_t>(L * kForwardSlots), 0.0f);
  scale_bwd_.assign(kBackwardSlots, 1.0f);
  amax_history_bwd_.assign(static_cast<size_t>(L * kBackwardSlots), 0.0f);
}

DelayedOperand DelayedLinearScaling::weight_for_forward() {
  if (!first_microbatch_) return {cached_weight_scale_, nullptr};
  first_microbatch_ = false;
  cached_weight_scale_ = scale_fwd_[1];
  return {cached_weight_scale_, &amax_history_fwd_[1]};
}

void DelayedLinearScaling::update_forward() {
  for (int64_t slot = 0; slot < kForwardSlots; ++slot) {
    update_amax_history_and_scale(&amax_history_fwd_[static_cast<size_t>(slot)], options_.amax_history_len,
                                  kForwardSlots, scale_fwd_[static_cast<size_t>(slot)], options_.amax_compute_algo,
                                  options_.margin, forward_format_);
  }
}

void DelayedLinearScaling::update_backward() {
  for (int64_t slot = 0; slot < kBackwardSlots; ++slot) {
    update_amax_history_and_scale(&amax_history_bwd_[static_cast<size_t>(slot)], options_.amax_history_len,
                                  kBackwardSlots, scale_bwd_[static_cast<size_t>(slot)], options_.amax_compute_algo,
                                  options_.margin, grad_format_);
  }
}

}  // namespace moecore::quant
