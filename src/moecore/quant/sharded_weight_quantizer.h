// A weight quantized from pieces: the distributed optimizer's FP8 / FP4 parameter all-gather (Megatron's
// --fp8-param-gather / --fp4-param-gather) has each data-parallel rank quantize only its shard of a weight's flat
// elements, yet the codes must be those of the whole weight quantized at once (quantize(..., Usage::kRowwise), what
// the weight's fprop GEMM computes), whatever the cut. A shard may cut a scaling block, so the scales come from block
// amaxes reduced over the ranks, TransformerEngine's quantize_master_weights
// (transformer_engine/pytorch/tensor/utils.py, called by megatron/core/fp8_utils.py quantize_param_shard):
//   1. each rank takes max |x| of its elements into the block amaxes (zero where it holds none of a block):
//      fp8_block_scaling_compute_partial_amax, mxfp8_scaling_compute_partial_amax,
//      nvfp4_multi_tensor_compute_partial_amax; one block for per-tensor (tensorwise) scaling, compute_amax;
//   2. the caller MAX-reduces the amax vector over the ranks (every rank then holds the whole weight's amaxes);
//   3. every rank derives the same scales (set_scales) and encodes its elements (*_partial_cast), or decodes codes
//      gathered from any rank.
//
//   ShardedWeightQuantizer q(rows, cols, make_spec(Recipe::kBlockwise, ElementFormat::kE4M3, Role::kWeight));
//   std::vector<float> amax(q.num_blocks(), 0.0f);
//   q.accumulate_amax(begin, my_values, amax);      // my_values = flat elements [begin, begin + n)
//   group.all_reduce(amax, ReduceOp::kMax);
//   q.set_scales(amax);
//   q.encode(begin, my_values, my_codes);           // = quantize(whole)'s codes [begin, begin + n)
//   q.decode(0, all_codes, values);                 // = quantize(whole).decode()
//
// Scales per recipe (the same arithmetic as per_tensor_scaling, blockwise_scaling, mxfp8_scaling, nvfp4_scaling):
//   tensorwise  one block; scale = current_scaling_scale(amax), decode scale 1 / scale
//   blockwise   128x128 blocks; compute_scale_from_amax with power-of-2 scales, decode scale 1 / scale
//   mxfp8       1x32 blocks; E8M0 exponent from amax / fp8 max rounded up
//   nvfp4       16x16 blocks; global amax = max over the blocks' amaxes, E4M3 block scales from it
//   delayed     one block; the scale is given (set_tensor_scale: the weight's current scale from its amax history,
//               TE's cast_master_weights_to_fp8 for delayed scaling); the reduced amax goes into that history
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "moecore/quant/recipe.h"

namespace moecore::quant {

class ShardedWeightQuantizer {
 public:
  // A row-major [rows, cols] weight quantized row-wise with `spec` (make_spec(..., Role::kWeight)). Throws
  // std::invalid_argument for a shape the recipe cannot quantize (check_quantizable).
  ShardedWeightQuantizer(int64_t rows, int64_t cols, const QuantSpec& spec);

  int64_t rows() const { return rows_; }
  int64_t cols() const { return cols_; }
  const QuantSpec& spec() const { return spec_; }
  // Scaling blocks: ceil(rows / block rows) x ceil(cols / block cols), row-major; the length of an amax vector.
  int64_t num_blocks() const { return scale_rows_ * scale_cols_; }
  // The block of flat element i.
  int64_t block_of(int64_t i) const;

  // amax[block] = fmax(amax[block], |x|) for the flat elements [begin, begin + x.size()) (NaN skipped, as TE's
  // amax kernels). amax.size() == num_blocks().
  void accumulate_amax(int64_t begin, std::span<const float> x, std::span<float> amax) const;
  // The scales from the whole weight's block amaxes (after the MAX reduction over every piece).
  void set_scales(std::span<const float> amax);
  // Delayed scaling: the per-tensor encode scale, given (decode scale 1 / scale).
  void set_tensor_scale(float scale);
  // Codes of the flat elements [begin, begin + x.size()): one byte each (E2M1 unpacked, 0..15). After set_scales.
  void encode(int64_t begin, std::span<const float> x, std::span<uint8_t> codes) const;
  // The decoded values of codes of the flat elements [begin, begin + codes.size()), as QuantizedTensor::decode.
  void decode(int64_t begin, std::span<const uint8_t> codes, std::span<float> x) const;

 private:
  QuantSpec spec_;
  int64_t rows_ = 0, cols_ = 0;
  int64_t block_rows_ = 0, block_cols_ = 0;
  int64_t scale_rows_ = 0, scale_cols_ = 0;
  std::vector<float> encode_factor_;  // [block]: what x is multiplied by before the cast
  std::vector<float> decode_scale_;   // [block]: what a code's value is multiplied by
  bool scales_set_ = false;
};

}  // namespace moecore::quant
