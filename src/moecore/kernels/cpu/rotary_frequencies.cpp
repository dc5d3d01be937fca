#include "moecore/kernels/cpu/rotary_frequencies.h"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <stdexcept>
#include <string>

namespace moecore::kernels {
namespace {

void check_dim(const int64_t dim, const double base, const double min_base) {
  if (dim <= 0 || dim % 2 != 0) {
    throw std::invalid_argument("rotary embedding: dimension " + std::to_string(dim) + " must be positive and even");
  }
  if (!(base > min_base)) throw std::invalid_argument("rotary embedding: base " + std::to_string(base) + " too small");
}

}  // namespace

std::vector<float> rope_inv_freq(const int64_t rot_dim, const double base) {
  check_dim(rot_dim, base, 0.0);
  std::vector<float> inv_freq(static_cast<size_t>(rot_dim / 2));
  for (size_t i = 0; i < inv_freq.size(); ++i) {
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(rot_dim);
    inv_freq[i] = 1.0f / std::pow(static_cast<float>(base), exponent);
  }
  return inv_freq;
}

RopeSpec rope_spec(const int64_t head_dim, const int64_t rot_dim, const double base) {
  if (rot_dim < 0 || rot_dim > head_dim || rot_dim % 2 != 0) {
    throw std::invalid_argument("rope: rot_dim " + std::to_string(rot_dim) +
                                " must be even and in [0, head_dim=" + std::to_string(head_dim) + "]");
  }
  if (!(base > 0.0)) throw std::invalid_argument("rope: base " + std::to_string(base) + " must be positive");
  return RopeSpec{head_dim, rot_dim > 0 ? rope_inv_freq(rot_dim, base) : std::vector<float>{}};
}

YarnRange yarn_correction_range(const int64_t dim, const double base, const YarnParams& yarn) {
  const auto correction_dim = [&](const double rotations) {
    return static_cast<double>(dim) *
           std::log(static_cast<double>(yarn.original_max_position_embeddings) / (rotations * 2 * std::numbers::pi)) /
           (2 * std::log(base));
  };
  double low = correction_dim(yarn.beta_fast), high = correction_dim(yarn.beta_slow);
  if (yarn.round_to_int) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  return {std::max(low, 0.0), std::min(high, static_cast<double>(dim - 1))};
}

std::vector<float> yarn_inv_freq(const int64_t dim, const double base, const YarnParams& yarn) {
  check_dim(dim, base, 1.0);
  if (!(yarn.scaling_factor > 0)) throw std::invalid_argument("yarn: scaling factor must be positive");
  const YarnRange range = yarn_correction_range(dim, base, yarn);
  // torch: (arange(dim // 2, fp32) - min) / (max - min), clamped to [0, 1]; min / max are Python floats.
  const double high = range.high == range.low ? range.high + 0.001 : range.high;
  const float low = static_cast<float>(range.low), width = static_cast<float>(high - range.low);
  std::vector<float> inv_freq(static_cast<size_t>(dim / 2));
  for (size_t i = 0; i < inv_freq.size(); ++i) {
    const float pow_i = std::pow(static_cast<float>(base), static_cast<float>(2 * i) / static_cast<float>(dim));
    const float extra = 1.0f / pow_i;
    const float inter = 1.0f / (static_cast<float>(yarn.scaling_factor) * pow_i);
    const float ramp = std::clamp((static_cast<float>(i) - low) / width, 0.0f, 1.0f);
    const float mask = 1.0f - ramp;  // Megatron's inv_freq_mask
    inv_freq[i] = inter * (1.0f - mask) + extra * mask;
  }
  return inv_freq;
}

double yarn_get_mscale(const double scale, const double mscale) {
  return scale <= 1 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0;
}

double yarn_concentration_factor(const double scaling_factor, const double mscale, const double mscale_all_dim) {
  return yarn_get_mscale(scaling_factor, mscale) / yarn_get_mscale(scaling_factor, mscale_all_dim);
}

}  // namespace moecore::kernels
