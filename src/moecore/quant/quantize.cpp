#include "moecore/quant/quantize.h"

#include <stdexcept>
#include <string>

#include "moecore/quant/blockwise_scaling.h"
#include "moecore/quant/mxfp8_scaling.h"
#include "moecore/quant/nvfp4_scaling.h"
#include "moecore/quant/per_tensor_scaling.h"
#include "moecore/quant/stochastic_rounding.h"

namespace moecore::quant {
namespace {

// out [cols, rows] = x [rows, cols] transposed.
void transpose(const float* x, const int64_t rows, const int64_t cols, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) out[c * rows + r] = x[r * cols + c];
  }
}

std::string shape_text(const int64_t rows, const int64_t cols) {
  return "[" + std::to_string(rows) + ", " + std::to_string(cols) + "]";
}

}  // namespace

void check_quantizable(const int64_t rows, const int64_t cols, const QuantSpec& spec) {
  if (rows < 0 || cols < 0) throw std::invalid_argument("negative shape " + shape_text(rows, cols));
  int64_t multiple = 0;
  if (spec.recipe == Recipe::kMxfp8) multiple = 32;
  if (spec.recipe == Recipe::kNvfp4) multiple = 16;
  if (multiple != 0 && (rows % multiple != 0 || cols % multiple != 0)) {
    throw std::invalid_argument(recipe_name(spec.recipe) + " needs both dimensions divisible by its " +
                                std::to_string(multiple) + "-element block, got shape " + shape_text(rows, cols));
  }
}

QuantizedTensor quantize(const float* x, const int64_t rows, const int64_t cols, const QuantSpec& spec,
                         const Usage usage, const QuantizeOptions& options) {
  check_quantizable(rows, cols, spec);
  Tensor stored_data;
  const float* data = x;
  int64_t data_rows = rows;
  int64_t data_cols = cols;
  const bool rht = usage == Usage::kColumnwise && spec.rht && spec.recipe == Recipe::kNvfp4;
  if (usage == Usage::kColumnwise) {
    stored_data = Tensor({cols, rows}, DType::kF32, MemCategory::kOther, options.device);
    transpose(x, rows, cols, stored_data.data<float>());
    if (rht) {
      Tensor transformed({cols, rows}, DType::kF32, MemCategory::kOther, options.device);
      rht_rows(stored_data.data<float>(), cols, rows, options.rht_signs, transformed.data<float>());
      stored_data = std::move(transformed);
    }
    data = stored_data.data<float>();
    data_rows = cols;
    data_cols = rows;
  }
  QuantizedTensor q;
  switch (spec.recipe) {
    case Recipe::kDelayed:
      q = quantize_with_tensor_scale(data, data_rows, data_cols, spec.element, options.tensor_scale);
      break;
    case Recipe::kTensorwise: q = quantize_current_scaling(data, data_rows, data_cols, spec); break;
    case Recipe::kBlockwise: q = quantize_blockwise(data, data_rows, data_cols, spec); break;
    case Recipe::kMxfp8: q = quantize_mxfp8(data, data_rows, data_cols, spec); break;
    case Recipe::kNvfp4: {
      const RoundingStream stream{options.seed,
                                  usage == Usage::kRowwise ? rowwise_rounding_key() : columnwise_rounding_key()};
      q = quantize_nvfp4(data, data_rows, data_cols, spec, spec.stochastic_rounding ? &stream : nullptr);
      break;
    }
  }
  q.usage = usage;
  q.rht = rht;
  return q;
}

Tensor decode_to_source(const QuantizedTensor& q, const RhtSigns& signs, const Device device,
                        const MemCategory category) {
  Tensor decoded({q.rows, q.cols}, DType::kF32, category, device);
  q.decode_into(decoded.data<float>());
  if (q.usage == Usage::kRowwise) return decoded;
  if (q.rht) {
    Tensor restored({q.rows, q.cols}, DType::kF32, category, device);
    inverse_rht_rows(decoded.data<float>(), q.rows, q.cols, signs, restored.data<float>());
    decoded = std::move(restored);
  }
  Tensor source({q.cols, q.rows}, DType::kF32, category, device);
  transpose(decoded.data<float>(), q.rows, q.cols, source.data<float>());
  return source;
}

}  // namespace moecore::quant
