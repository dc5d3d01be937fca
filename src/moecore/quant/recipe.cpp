#include "moecore/quant/recipe.h"

#include <stdexcept>

namespace moecore::quant {
namespace {

[[noreturn]] void bad_choice(const std::string_view what, const std::string_view name, const std::string_view choices) {
  throw std::invalid_argument("unknown " + std::string(what) + " '" + std::string(name) +
                              "' (choices: " + std::string(choices) + ")");
}

}  // namespace

Recipe parse_recipe(const std::string_view name) {
  if (name == "delayed") return Recipe::kDelayed;
  if (name == "tensorwise") return Recipe::kTensorwise;
  if (name == "blockwise") return Recipe::kBlockwise;
  if (name == "mxfp8") return Recipe::kMxfp8;
  if (name == "nvfp4") return Recipe::kNvfp4;
  bad_choice("recipe", name, "delayed, tensorwise, blockwise, mxfp8, nvfp4");
}

Fp8Format parse_fp8_format(const std::string_view name) {
  if (name == "e4m3") return Fp8Format::kE4M3;
  if (name == "hybrid") return Fp8Format::kHybrid;
  bad_choice("fp8 format", name, "e4m3, hybrid");
}

Role parse_role(const std::string_view name) {
  if (name == "activation") return Role::kActivation;
  if (name == "weight") return Role::kWeight;
  if (name == "gradient") return Role::kGradient;
  bad_choice("role", name, "activation, weight, gradient");
}

Usage parse_usage(const std::string_view name) {
  if (name == "rowwise") return Usage::kRowwise;
  if (name == "columnwise") return Usage::kColumnwise;
  bad_choice("usage", name, "rowwise, columnwise");
}

std::string recipe_name(const Recipe recipe) {
  switch (recipe) {
    case Recipe::kDelayed: return "delayed";
    case Recipe::kTensorwise: return "tensorwise";
    case Recipe::kBlockwise: return "blockwise";
    case Recipe::kMxfp8: return "mxfp8";
    case Recipe::kNvfp4: return "nvfp4";
  }
  throw std::logic_error("unknown recipe");
}

std::string role_name(const Role role) {
  switch (role) {
    case Role::kActivation: return "activation";
    case Role::kWeight: return "weight";
    case Role::kGradient: return "gradient";
  }
  throw std::logic_error("unknown role");
}

std::string usage_name(const Usage usage) { return usage == Usage::kRowwise ? "rowwise" : "columnwise"; }

ElementFormat element_format_for(const Recipe recipe, const Fp8Format format, const Role role) {
  if (recipe == Recipe::kNvfp4) return ElementFormat::kE2M1;
  // Format.HYBRID: max_fwd from E4M3, max_bwd from E5M2 (recipe/__init__.py Format).
  if (format == Fp8Format::kHybrid && role == Role::kGradient) return ElementFormat::kE5M2;
  return ElementFormat::kE4M3;
}

QuantSpec make_spec(const Recipe recipe, const ElementFormat element, const Role role) {
  QuantSpec spec;
  spec.recipe = recipe;
  spec.element = recipe == Recipe::kNvfp4 ? ElementFormat::kE2M1 : element;
  if (recipe != Recipe::kNvfp4 && spec.element == ElementFormat::kE2M1) {
    throw std::invalid_argument(recipe_name(recipe) + " quantizes to FP8 (e4m3 or e5m2), not e2m1");
  }
  switch (recipe) {
    case Recipe::kDelayed:
    case Recipe::kTensorwise:
      // Float8CurrentScaling: QParams(power_2_scale=NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES (off), amax_epsilon=0).
      break;
    case Recipe::kBlockwise:
      // Float8BlockScaling: x_block_scaling_dim = grad_block_scaling_dim = 1 (1x128), w_block_scaling_dim = 2
      // (128x128); power_2_scale = not NVTE_FP8_BLOCK_SCALING_FP32_SCALES (on).
      spec.block_rows = role == Role::kWeight ? 128 : 1;
      spec.block_cols = 128;
      spec.pow2_scales = true;
      break;
    case Recipe::kMxfp8:
      spec.block_rows = 1;  // MXFP8BlockScaling: 1D 1x32 blocks for every operand (enable_2d_quantization off)
      spec.block_cols = 32;
      break;
    case Recipe::kNvfp4:
      // NVFP4BlockScaling.__post_init__: fp4_quant_fwd_inp (RHT), fp4_quant_fwd_weight (2D 16x16),
      // fp4_quant_bwd_grad (RHT + stochastic rounding).
      spec.block_rows = role == Role::kWeight ? 16 : 1;
      spec.block_cols = 16;
      spec.rht = role != Role::kWeight;
      spec.stochastic_rounding = role == Role::kGradient;
      break;
  }
  return spec;
}

}  // namespace moecore::quant
