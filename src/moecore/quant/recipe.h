// Which number format and scaling block each operand of a linear layer gets under Megatron's low-precision
// recipes (--fp8-recipe {delayed,tensorwise,blockwise,mxfp8}, --fp8-format {e4m3,hybrid}, --fp4-recipe nvfp4), with
// TransformerEngine's defaults (transformer_engine/common/recipe/__init__.py):
//   delayed     per-tensor scale from an amax history (DelayedScaling; delayed_scaling.h)
//   tensorwise  per-tensor scale from this tensor's amax (Float8CurrentScaling: no power-of-2 scales, epsilon 0)
//   blockwise   Float8BlockScaling: 1x128 blocks for activations and gradients, 128x128 for weights, fp32
//               power-of-2 scales (NVTE_FP8_BLOCK_SCALING_FP32_SCALES unset), epsilon 0
//   mxfp8       MXFP8BlockScaling: 1x32 blocks, E8M0 scales
//   nvfp4       NVFP4BlockScaling: E2M1 in 1x16 blocks with E4M3 scales and an fp32 tensor scale; weights 16x16
//               blocks; gradients stochastic rounding; activations and gradients the random Hadamard transform on
//               their column-wise (wgrad) usage
// --fp8-format e4m3: every FP8 operand E4M3; hybrid: E4M3 forward (activations, weights), E5M2 gradients.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "moecore/quant/fp8_formats.h"

namespace moecore::quant {

enum class Recipe { kDelayed, kTensorwise, kBlockwise, kMxfp8, kNvfp4 };
enum class Fp8Format { kE4M3, kHybrid };
// The operand's part in the linear layer: input activation x, weight W, or output gradient dy.
enum class Role { kActivation, kWeight, kGradient };
// Row-wise: blocks along the last dimension (the reduction dimension of x W^T). Column-wise: blocks along the
// first dimension, stored transposed ([cols, rows], blocks along its last dimension) as TE's columnwise data, for
// the GEMMs that reduce over the first dimension (dgrad's W, wgrad's dy and x).
enum class Usage { kRowwise, kColumnwise };

// Parse "delayed" / "tensorwise" / "blockwise" / "mxfp8" / "nvfp4", "e4m3" / "hybrid", "activation" / "weight" /
// "gradient", "rowwise" / "columnwise"; std::invalid_argument naming the choices otherwise.
Recipe parse_recipe(std::string_view name);
Fp8Format parse_fp8_format(std::string_view name);
Role parse_role(std::string_view name);
Usage parse_usage(std::string_view name);
std::string recipe_name(Recipe recipe);
std::string role_name(Role role);
std::string usage_name(Usage usage);

// The element format of an operand: E2M1 under nvfp4, else E4M3, or E5M2 for gradients under hybrid.
ElementFormat element_format_for(Recipe recipe, Fp8Format format, Role role);

// How one operand is quantized.
struct QuantSpec {
  Recipe recipe = Recipe::kTensorwise;
  ElementFormat element = ElementFormat::kE4M3;
  // Scaling block [rows, cols] of the stored data; 0 x 0 = one scale for the whole tensor. Column-wise data is
  // stored transposed, so the same block there is the transposed block of the source (1x128 -> 128x1).
  int64_t block_rows = 0;
  int64_t block_cols = 0;
  bool pow2_scales = false;          // blockwise: scales rounded down to powers of two
  float amax_epsilon = 0.0f;         // tensorwise / blockwise amax floor
  bool rht = false;                  // nvfp4: random Hadamard transform of the column-wise data
  bool stochastic_rounding = false;  // nvfp4: E2M1 codes rounded stochastically
};

// TE's defaults for (recipe, role) with the given element format (element_format_for, or any FP8 format for the
// `moecore quantize` tool; nvfp4 always uses E2M1).
QuantSpec make_spec(Recipe recipe, ElementFormat element, Role role);

}  // namespace moecore::quant
