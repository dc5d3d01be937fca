#include "moecore/quant/sharded_weight_quantizer.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

#include "moecore/quant/fp8_formats.h"
#include "moecore/quant/nvfp4_scaling.h"
#include "moecore/quant/per_tensor_scaling.h"
#include "moecore/quant/quantize.h"
#include "moecore/quant/scale_math.h"

namespace moecore::quant {
namespace {

void check_range(const int64_t begin, const size_t n, const int64_t numel, const char* what) {
  if (begin < 0 || begin + static_cast<int64_t>(n) > numel) {
    throw std::out_of_range(std::string(what) + ": elements [" + std::to_string(begin) + ", " +
                            std::to_string(begin + static_cast<int64_t>(n)) + ") outside a weight of " +
                            std::to_string(numel));
  }
}

}  // namespace

ShardedWeightQuantizer::ShardedWeightQuantizer(const int64_t rows, const int64_t cols, const QuantSpec& spec)
    : spec_(spec), rows_(rows), cols_(cols) {
  check_quantizable(rows, cols, spec);
  const bool per_tensor = spec.block_rows == 0 || spec.block_cols == 0;
  block_rows_ = per_tensor ? std::max<int64_t>(rows, 1) : spec.block_rows;
  block_cols_ = per_tensor ? std::max<int64_t>(cols, 1) : spec.block_cols;
  scale_rows_ = (rows + block_rows_ - 1) / block_rows_;
  scale_cols_ = (cols + block_cols_ - 1) / block_cols_;
  if (per_tensor) scale_rows_ = scale_cols_ = 1;
  encode_factor_.assign(static_cast<size_t>(num_blocks()), 1.0f);
  decode_scale_.assign(static_cast<size_t>(num_blocks()), 1.0f);
}

int64_t ShardedWeightQuantizer::block_of(const int64_t i) const {
  const int64_t r = i / cols_, c = i % cols_;
  return (r / block_rows_) * scale_cols_ + c / block_cols_;
}

void ShardedWeightQuantizer::accumulate_amax(const int64_t begin, const std::span<const float> x,
                                             const std::span<float> amax) const {
  check_range(begin, x.size(), rows_ * cols_, "accumulate_amax");
  if (static_cast<int64_t>(amax.size()) != num_blocks()) throw std::invalid_argument("accumulate_amax: amax size");
  for (size_t k = 0; k < x.size(); ++k) {
    float& a = amax[static_cast<size_t>(block_of(begin + static_cast<int64_t>(k)))];
    a = std::fmax(a, std::fabs(x[k]));
  }
}

void ShardedWeightQuantizer::set_scales(const std::span<const float> amax) {
  if (static_cast<int64_t>(amax.size()) != num_blocks()) throw std::invalid_argument("set_scales: amax size");
  const float fp8_max = format_max(spec_.element);
  // Quantized_Limits<OType>::max_norm_rcp, a double quotient stored as float (as quantize_mxfp8).
  const float max_norm_rcp = static_cast<float>(1.0 / static_cast<double>(fp8_max));
  float global_amax = 0.0f;  // nvfp4: the tensor's amax is the max over its blocks' amaxes
  for (const float a : amax) global_amax = std::fmax(global_amax, a);
  const float s_enc = nvfp4_global_encode_scale(global_amax);
  const float s_dec = 1.0f / s_enc;
  for (size_t b = 0; b < amax.size(); ++b) {
    switch (spec_.recipe) {
      case Recipe::kDelayed: throw std::logic_error("delayed scaling takes its scale from set_tensor_scale");
      case Recipe::kTensorwise: {
        const float scale = current_scaling_scale(amax[b], spec_);
        encode_factor_[b] = scale;
        decode_scale_[b] = reciprocal(scale);
        break;
      }
      case Recipe::kBlockwise: {
        const float scale = compute_scale_from_amax(amax[b], fp8_max, spec_.pow2_scales, spec_.amax_epsilon,
                                                    std::numeric_limits<float>::max());
        encode_factor_[b] = scale;
        decode_scale_[b] = reciprocal(scale);
        break;
      }
      case Recipe::kMxfp8: {
        const uint8_t e = e8m0_round_up(amax[b] * max_norm_rcp);
        encode_factor_[b] = e8m0_reciprocal(e);
        decode_scale_[b] = decode_e8m0(e);
        break;
      }
      case Recipe::kNvfp4: {
        constexpr float kFactorInv = 1.0f / (6.0f * 448.0f);
        const float block_scale = decode_e4m3(nvfp4_block_scale_code(amax[b], s_enc));
        encode_factor_[b] = std::fmin(1.0f / (block_scale * s_dec), std::numeric_limits<float>::max());
        decode_scale_[b] = (block_scale * global_amax) * kFactorInv;
        break;
      }
    }
  }
  scales_set_ = true;
}

void ShardedWeightQuantizer::set_tensor_scale(const float scale) {
  if (spec_.recipe != Recipe::kDelayed) throw std::logic_error("set_tensor_scale: only delayed scaling");
  encode_factor_[0] = scale;
  decode_scale_[0] = reciprocal(scale);  // as quantize_with_tensor_scale
  scales_set_ = true;
}

void ShardedWeightQuantizer::encode(const int64_t begin, const std::span<const float> x,
                                    const std::span<uint8_t> codes) const {
  check_range(begin, x.size(), rows_ * cols_, "encode");
  if (!scales_set_) throw std::logic_error("ShardedWeightQuantizer::encode before set_scales");
  if (codes.size() != x.size()) throw std::invalid_argument("encode: codes and values differ in size");
  for (size_t k = 0; k < x.size(); ++k) {
    const float scaled = x[k] * encode_factor_[static_cast<size_t>(block_of(begin + static_cast<int64_t>(k)))];
    codes[k] = quant::encode(spec_.element, scaled);
  }
}

void ShardedWeightQuantizer::decode(const int64_t begin, const std::span<const uint8_t> codes,
                                    const std::span<float> x) const {
  check_range(begin, codes.size(), rows_ * cols_, "decode");
  if (!scales_set_) throw std::logic_error("ShardedWeightQuantizer::decode before set_scales");
  if (codes.size() != x.size()) throw std::invalid_argument("decode: codes and values differ in size");
  for (size_t k = 0; k < codes.size(); ++k) {
    x[k] = quant::decode(spec_.element, codes[k]) *
           decode_scale_[static_cast<size_t>(block_of(begin + static_cast<int64_t>(k)))];
  }
}

}  // namespace moecore::quant
