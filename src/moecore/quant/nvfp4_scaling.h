// NVFP4 (TE's NVFP4BlockScaling): E2M1 elements, one E4M3 scale per block of 16 (1x16, or 16x16 for weights) and an
// fp32 per-tensor scale from the tensor's amax (two-level scaling).
#pragma once

#include <cstdint>

#include "moecore/quant/quantized_tensor.h"
#include "moecore/quant/recipe.h"

namespace moecore::quant {

// S_enc = (448 x 6) / global_amax, capped at FLT_MAX; 1 when global_amax is 0 or S_enc is 0 (an infinite amax)
// (transformer_engine/common/cast/nvfp4/core_nvfp4.cuh compute_global_encode_scaling_factor_FP4).
float nvfp4_global_encode_scale(float global_amax);
// The block's E4M3 decode scale: e4m3(block_amax x (S_enc x fp32(1 / 6))) (core_nvfp4.cuh
// compute_decoding_scaling_factor).
uint8_t nvfp4_block_scale_code(float block_amax, float s_enc);

// Where stochastic rounding draws its bits (stochastic_rounding.h); element i of the stored data uses
// random_byte(seed, key, i).
struct RoundingStream {
  uint64_t seed = 0;
  uint64_t key = 0;
};

// Quantizes the stored data [rows, cols] (cols % 16 == 0 and rows % spec.block_rows == 0) with blocks
// spec.block_rows x 16 (transformer_engine/common/cast/nvfp4/quantize_transpose_nvfp4.cuh):
//   global amax = max |x| (NaN skipped); S_enc as above; S_dec = 1 / S_enc
//   per block: s = e4m3 block scale; encode factor = min(1 / (float(s) x S_dec), FLT_MAX)
//   codes = e2m1(x x factor): round to nearest even, or stochastic when `rounding` is non-null
// Decoded as e2m1 x ((float(s) x global amax) x 1 / 2688) (QuantizedTensor::decode_element).
// NaN: E2M1 has no NaN code, and TE's cast writes a NaN element as +6 (satfinite) with the block scale of its finite
// neighbours (the amax skips NaN), so the NaN would decode to a finite number. moecore keeps those codes but stores
// the E4M3 NaN (0x7F) as the scale of a block holding a NaN: the block decodes to NaN and the NaN reaches the loss.
QuantizedTensor quantize_nvfp4(const float* x, int64_t rows, int64_t cols, const QuantSpec& spec,
                               const RoundingStream* rounding);

}  // namespace moecore::quant
