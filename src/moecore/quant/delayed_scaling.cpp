#include "moecore/quant/delayed_scaling.h"

#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

namespace moecore::quant {

AmaxComputeAlgo parse_amax_compute_algo(const std::string_view name) {
  if (name == "max") return AmaxComputeAlgo::kMax;
  if (name == "most_recent") return AmaxComputeAlgo::kMostRecent;
  throw std::invalid_argument("unknown amax compute algo '" + std::string(name) + "' (choices: max, most_recent)");
}

DelayedScaling::DelayedScaling(const int64_t history_len, const AmaxComputeAlgo algo, const int margin,
                               const ElementFormat format)
    : algo_(algo), margin_(margin), format_(format) {
  if (history_len < 1) {
    throw std::invalid_argument("delayed scaling needs an amax history of at least 1, got " +
                                std::to_string(history_len));
  }
  if (format == ElementFormat::kE2M1) throw std::invalid_argument("delayed scaling quantizes to FP8, not e2m1");
  history_.assign(static_cast<size_t>(history_len), 0.0f);
}

void DelayedScaling::record_amax(const float amax) { history_[0] = std::fmax(history_[0], amax); }

void DelayedScaling::update() {
  const int64_t length = static_cast<int64_t>(history_.size());
  const float last_amax = history_[0];
  float amax = 0.0f;
  if (last_amax != 0.0f) {  // a NaN amax compares unequal and rolls in, as in TE
    std::vector<float> rolled(history_.size());
    for (int64_t i = 0; i < length; ++i) {
      const float a = i < length - 1 ? history_[i + 1] : last_amax;
      amax = std::fmax(amax, a);
      rolled[i] = i > 0 ? a : 0.0f;
    }
    history_ = std::move(rolled);
  }
  if (algo_ == AmaxComputeAlgo::kMostRecent) amax = last_amax;
  // scaled_max = fp8_dtype_max(fp8_dtype) * std::pow(2.f, -margin)
  const float scaled_max = format_max(format_) * std::pow(2.0f, static_cast<float>(-margin_));
  float scale = std::isfinite(amax) && amax > 0.0f ? scaled_max / amax : scale_;
  if (std::isinf(scale)) scale = std::numeric_limits<float>::max();
  scale_ = scale;
}

}  // namespace moecore::quant
