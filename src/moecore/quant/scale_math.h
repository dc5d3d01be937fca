// The scale arithmetic TransformerEngine's recipes share.
#pragma once

#include <cstdint>

namespace moecore::quant {

// max |x| over the values, skipping NaN, starting from 0: TE's amax reductions are chains of fmaxf(amax, |x|)
// (transformer_engine/common/recipe/current_scaling.cu amax_kernel and every cast kernel), and fmaxf returns the
// other operand when one is NaN. +-Inf gives Inf.
float abs_max(const float* x, int64_t n);
// The same over a [rows, cols] block of a row-major matrix with leading dimension ld.
float abs_max_block(const float* x, int64_t ld, int64_t rows, int64_t cols);

// TE's compute_scale_from_amax (transformer_engine/common/recipe/recipe_common.cuh), the encode scale of current
// and blockwise scaling: amax < epsilon -> epsilon; Inf, NaN or 0 -> 1; else max_fp8 / amax, an infinite
// quotient (a tiny amax) -> value_for_inf; with force_pow_2_scales the mantissa bits are cleared (rounded down to
// a power of two).
float compute_scale_from_amax(float amax, float max_fp8, bool force_pow_2_scales, float epsilon, float value_for_inf);

// The decode scale TE stores beside the codes: scale_inv = 1 / scale (cast kernels' `1.0 / scale`).
float reciprocal(float scale);

}  // namespace moecore::quant
