#include "moecore/quant/per_tensor_scaling.h"

#include <limits>

#include "moecore/quant/scale_math.h"

namespace moecore::quant {

QuantizedTensor quantize_with_tensor_scale(const float* x, const int64_t rows, const int64_t cols,
                                           const ElementFormat format, const float scale, const Recipe recipe) {
  QuantizedTensor q;
  q.recipe = recipe;
  q.format = format;
  q.rows = rows;
  q.cols = cols;
  q.block_rows = rows > 0 ? rows : 1;
  q.block_cols = cols > 0 ? cols : 1;
  q.scale_rows = 1;
  q.scale_cols = 1;
  q.codes.resize(static_cast<size_t>(rows * cols));
  const int64_t n = rows * cols;
  for (int64_t i = 0; i < n; ++i) q.codes[i] = encode(format, x[i] * scale);
  q.scales = {reciprocal(scale)};
  q.amax = abs_max(x, n);
  return q;
}

float current_scaling_scale(const float amax, const QuantSpec& spec) {
  return compute_scale_from_amax(amax, format_max(spec.element), spec.pow2_scales, spec.amax_epsilon,
                                 std::numeric_limits<float>::max());
}

QuantizedTensor quantize_current_scaling(const float* x, const int64_t rows, const int64_t cols,
                                         const QuantSpec& spec) {
  const float scale = current_scaling_scale(abs_max(x, rows * cols), spec);
  return quantize_with_tensor_scale(x, rows, cols, spec.element, scale, Recipe::kTensorwise);
}

}  // namespace moecore::quant
