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

std::string amax_compute_algo_name(const AmaxComputeAlgo algo) {
  return algo == AmaxComputeAlgo::kMax ? "max" : "most_recent";
}

int delayed_margin_limit(const ElementFormat format) {
  switch (format) {
    case ElementFormat::kE4M3: return 17;  // floor(log2(448 / 2^-9)) = floor(17.807)
    case ElementFormat::kE5M2: return 31;  // floor(log2(57344 / 2^-16)) = floor(31.807)
    case ElementFormat::kE2M1: break;
  }
  throw std::invalid_argument("delayed scaling quantizes to FP8, not e2m1");
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

void DelayedScaling::record_amax(const float amax) { moecore::quant::record_amax(history_.data(), amax); }

void DelayedScaling::update() {
  update_amax_history_and_scale(history_.data(), static_cast<int64_t>(history_.size()), 1, scale_, algo_, margin_,
                                format_);
}

void record_amax(float* const slot, const float amax) { *slot = std::fmax(*slot, amax); }

void update_amax_history_and_scale(float* const history, const int64_t length, const int64_t stride, float& scale,
                                   const AmaxComputeAlgo algo, const int margin, const ElementFormat format) {
  // transformer_engine/common/recipe/delayed_scaling.cu, kernel_bulk.
  const float last_amax = history[0];
  float amax = 0.0f;
  if (last_amax != 0.0f) {                  // a NaN amax compares unequal and rolls in, as in TE
    for (int64_t i = 0; i < length; ++i) {  // in place: entry i reads entry i + 1 before i + 1 is written
      const float a = i < length - 1 ? history[(i + 1) * stride] : last_amax;
      amax = std::fmax(amax, a);
      history[i * stride] = i > 0 ? a : 0.0f;
    }
  }
  if (algo == AmaxComputeAlgo::kMostRecent) amax = last_amax;
  // scaled_max = fp8_dtype_max(fp8_dtype) * std::pow(2.f, -margin)
  const float scaled_max = format_max(format) * std::pow(2.0f, static_cast<float>(-margin));
  float next = std::isfinite(amax) && amax > 0.0f ? scaled_max / amax : scale;
  if (std::isinf(next)) next = std::numeric_limits<float>::max();
  scale = next;
}

}  // namespace moecore::quant
