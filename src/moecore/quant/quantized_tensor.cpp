#include "moecore/quant/quantized_tensor.h"

namespace moecore::quant {

float QuantizedTensor::decode_element(const int64_t r, const int64_t c) const {
  const float value = quant::decode(format, codes[r * cols + c]);
  const float scale = scales[block_index(r, c)];
  if (recipe == Recipe::kNvfp4) {
    constexpr float kFactorInv = 1.0f / (6.0f * 448.0f);
    return value * ((scale * amax) * kFactorInv);
  }
  return value * scale;
}

QuantizedTensor make_blocked(const Recipe recipe, const ElementFormat format, const int64_t rows, const int64_t cols,
                             const QuantSpec& spec, const bool with_scale_codes) {
  QuantizedTensor q;
  q.recipe = recipe;
  q.format = format;
  q.rows = rows;
  q.cols = cols;
  q.block_rows = spec.block_rows;
  q.block_cols = spec.block_cols;
  q.scale_rows = (rows + spec.block_rows - 1) / spec.block_rows;
  q.scale_cols = (cols + spec.block_cols - 1) / spec.block_cols;
  q.codes.resize(static_cast<size_t>(rows * cols));
  q.scales.resize(static_cast<size_t>(q.scale_rows * q.scale_cols));
  if (with_scale_codes) q.scale_codes.resize(q.scales.size());
  return q;
}

void QuantizedTensor::decode_into(float* const out) const {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) out[r * cols + c] = decode_element(r, c);
  }
}

std::vector<float> QuantizedTensor::decode() const {
  std::vector<float> out(static_cast<size_t>(rows * cols));
  decode_into(out.data());
  return out;
}

}  // namespace moecore::quant
