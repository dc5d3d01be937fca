#include "moecore/quant/scale_math.h"

#include <bit>
#include <cmath>

namespace moecore::quant {

float abs_max(const float* x, const int64_t n) {
  float amax = 0.0f;
  for (int64_t i = 0; i < n; ++i) amax = std::fmax(amax, std::fabs(x[i]));
  return amax;
}

float abs_max_block(const float* x, const int64_t ld, const int64_t rows, const int64_t cols) {
  float amax = 0.0f;
  for (int64_t r = 0; r < rows; ++r) amax = std::fmax(amax, abs_max(x + r * ld, cols));
  return amax;
}

float compute_scale_from_amax(float amax, const float max_fp8, const bool force_pow_2_scales, const float epsilon,
                              const float value_for_inf) {
  if (amax < epsilon) amax = epsilon;  // a NaN amax compares false and is handled below
  if (std::isinf(amax) || amax == 0.0f || std::isnan(amax)) return 1.0f;
  float scale = max_fp8 / amax;
  if (std::isinf(scale)) scale = value_for_inf;
  if (force_pow_2_scales) scale = std::bit_cast<float>(std::bit_cast<uint32_t>(scale) & 0xFF800000u);
  return scale;
}

float reciprocal(const float scale) { return 1.0f / scale; }

}  // namespace moecore::quant
