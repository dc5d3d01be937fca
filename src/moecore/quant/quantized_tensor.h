// A quantized matrix: one code per element plus the decode scales of its blocks.
#pragma once

#include <cstdint>
#include <vector>

#include "moecore/quant/fp8_formats.h"
#include "moecore/quant/recipe.h"

namespace moecore::quant {

struct QuantizedTensor {
  Recipe recipe = Recipe::kTensorwise;
  ElementFormat format = ElementFormat::kE4M3;
  Usage usage = Usage::kRowwise;
  // The stored data: the source [rows, cols] for row-wise usage, its transpose for column-wise usage.
  int64_t rows = 0;
  int64_t cols = 0;
  std::vector<uint8_t> codes;  // [rows, cols] row-major, one byte per element (E2M1 unpacked: 0..15)
  // Scaling block of the stored data and the block grid (ceil(rows / block_rows) x ceil(cols / block_cols)).
  int64_t block_rows = 0;
  int64_t block_cols = 0;
  int64_t scale_rows = 0;
  int64_t scale_cols = 0;
  // Decode scale of each block, [scale_rows, scale_cols]: scale_inv (1 / scale) for per-tensor and blockwise FP8,
  // 2^(e - 127) for MXFP8, the E4M3 block scale's value for NVFP4 (which decodes with `amax` as well).
  std::vector<float> scales;
  std::vector<uint8_t> scale_codes;  // the E8M0 (MXFP8) or E4M3 (NVFP4) byte of each block; empty otherwise
  // amax of the data that was quantized (after the Hadamard transform where applied): NVFP4's global amax; the
  // amax a delayed-scaling step records.
  float amax = 0.0f;
  bool rht = false;  // the stored data is the Hadamard transform of the transposed source

  int64_t block_index(const int64_t r, const int64_t c) const { return (r / block_rows) * scale_cols + c / block_cols; }
  // The fp32 value of element (r, c) of the stored data, as TE's dequantize kernels compute it: code value x
  // decode scale (transformer_engine/common/cast/fp8/dequantize_fp8.cuh, mxfp8/dequantize_mxfp8.cuh); NVFP4:
  // e2m1 x ((e4m3 scale x amax) x 1 / (6 x 448)) (nvfp4/dequantize_nvfp4.cuh).
  float decode_element(int64_t r, int64_t c) const;
  // Every element into out [rows, cols] row-major.
  void decode_into(float* out) const;
  // Every element, [rows, cols] row-major, in a host vector (for inspection; the GEMMs decode into device scratch).
  std::vector<float> decode() const;
};

// A [rows, cols] tensor in blocks of spec.block_rows x spec.block_cols (a partial edge block is a block of its own):
// recipe, format and block grid set, codes and scales (with scale_codes, their bytes too) allocated, amax 0.
QuantizedTensor make_blocked(Recipe recipe, ElementFormat format, int64_t rows, int64_t cols, const QuantSpec& spec,
                             bool with_scale_codes);

}  // namespace moecore::quant
