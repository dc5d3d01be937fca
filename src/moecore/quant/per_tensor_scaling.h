// Per-tensor FP8 scaling: one encode scale for the whole tensor. Current scaling ("tensorwise", TE's
// Float8CurrentScaling) takes it from this tensor's amax; delayed scaling (delayed_scaling.h) from the history.
#pragma once

#include <cstdint>

#include "moecore/quant/quantized_tensor.h"
#include "moecore/quant/recipe.h"

namespace moecore::quant {

// codes = fp8(x * scale) (round to nearest even, satfinite), one decode scale 1 / scale, amax = max |x|: TE's
// per-tensor cast (transformer_engine/common/cast/fp8/quantize_fp8.cuh) and its dequantize.
QuantizedTensor quantize_with_tensor_scale(const float* x, int64_t rows, int64_t cols, ElementFormat format,
                                           float scale, Recipe recipe = Recipe::kDelayed);

// Current scaling's encode scale from amax: nvte_compute_scale_from_amax (recipe/current_scaling.cu), i.e.
// compute_scale_from_amax(amax, format max, spec.pow2_scales, spec.amax_epsilon, value_for_inf = FLT_MAX).
float current_scaling_scale(float amax, const QuantSpec& spec);

// The "tensorwise" recipe: amax of x, its scale, then quantize_with_tensor_scale.
QuantizedTensor quantize_current_scaling(const float* x, int64_t rows, int64_t cols, const QuantSpec& spec);

}  // namespace moecore::quant
