// FP8 block scaling (DeepSeek-V3 style; TE's Float8BlockScaling): one fp32 scale per block_rows x block_cols block
// of the stored data (1x128 for activations and gradients, 128x128 for weights).
#pragma once

#include <cstdint>

#include "moecore/quant/quantized_tensor.h"
#include "moecore/quant/recipe.h"

namespace moecore::quant {

// Per block: amax (NaN skipped), scale = compute_scale_from_amax(amax, format max, spec.pow2_scales,
// spec.amax_epsilon, value_for_inf = FLT_MAX: the max of the fp32 input type), codes = fp8(x * scale), decode
// scale 1 / scale (transformer_engine/common/transpose/quantize_transpose_vector_blockwise.cu,
// quantize_transpose_square_blockwise.cu, compute_scale_from_types). Shapes need not divide the block: an edge
// block covers the elements there are, as TE's unaligned kernels do.
QuantizedTensor quantize_blockwise(const float* x, int64_t rows, int64_t cols, const QuantSpec& spec);

}  // namespace moecore::quant
