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

std::vector<float> QuantizedTensor::decode() const {
  std::vector<float> out(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) out[r * cols + c] = decode_element(r, c);
  }
  return out;
}

}  // namespace moecore::quant
