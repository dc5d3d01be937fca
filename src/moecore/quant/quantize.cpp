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

std::vector<float> transpose(const float* x, const int64_t rows, const int64_t cols) {
  std::vector<float> out(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) out[c * rows + r] = x[r * cols + c];
  }
  return out;
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
  std::vector<float> stored_data;
  const float* data = x;
  int64_t data_rows = rows;
  int64_t data_cols = cols;
  const bool rht = usage == Usage::kColumnwise && spec.rht && spec.recipe == Recipe::kNvfp4;
  if (usage == Usage::kColumnwise) {
    stored_data = transpose(x, rows, cols);
    if (rht) {
      std::vector<float> transformed(stored_data.size());
      rht_rows(stored_data.data(), cols, rows, options.rht_signs, transformed.data());
      stored_data = std::move(transformed);
    }
    data = stored_data.data();
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

std::vector<float> decode_to_source(const QuantizedTensor& q, const RhtSigns& signs) {
  std::vector<float> decoded = q.decode();
  if (q.usage == Usage::kRowwise) return decoded;
  if (q.rht) {
    std::vector<float> restored(decoded.size());
    inverse_rht_rows(decoded.data(), q.rows, q.cols, signs, restored.data());
    decoded = std::move(restored);
  }
  return transpose(decoded.data(), q.rows, q.cols);
}

}  // namespace moecore::quant
