// Scales and codes of each recipe on small tensors, expected values derived by hand from TransformerEngine's
// formulas (cited in quant/*.h).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <stdexcept>
#include <vector>

#include "moecore/quant/nvfp4_scaling.h"
#include "moecore/quant/per_tensor_scaling.h"
#include "moecore/quant/quantize.h"

namespace moecore::quant {
namespace {

constexpr float kFltMax = std::numeric_limits<float>::max();
constexpr float kInf = std::numeric_limits<float>::infinity();

QuantizedTensor rowwise(const std::vector<float>& x, const int64_t rows, const int64_t cols, const Recipe recipe,
                        const ElementFormat element, const Role role) {
  return quantize(x.data(), rows, cols, make_spec(recipe, element, role), Usage::kRowwise);
}

TEST(QuantRecipes, DefaultsFollowTransformerEngine) {
  EXPECT_EQ(element_format_for(Recipe::kDelayed, Fp8Format::kHybrid, Role::kGradient), ElementFormat::kE5M2);
  EXPECT_EQ(element_format_for(Recipe::kDelayed, Fp8Format::kHybrid, Role::kActivation), ElementFormat::kE4M3);
  EXPECT_EQ(element_format_for(Recipe::kMxfp8, Fp8Format::kE4M3, Role::kGradient), ElementFormat::kE4M3);
  EXPECT_EQ(element_format_for(Recipe::kNvfp4, Fp8Format::kHybrid, Role::kGradient), ElementFormat::kE2M1);
  const QuantSpec bw_x = make_spec(Recipe::kBlockwise, ElementFormat::kE4M3, Role::kActivation);
  EXPECT_EQ(bw_x.block_rows, 1);
  EXPECT_EQ(bw_x.block_cols, 128);
  EXPECT_TRUE(bw_x.pow2_scales);
  const QuantSpec bw_w = make_spec(Recipe::kBlockwise, ElementFormat::kE4M3, Role::kWeight);
  EXPECT_EQ(bw_w.block_rows, 128);
  EXPECT_EQ(bw_w.block_cols, 128);
  EXPECT_FALSE(make_spec(Recipe::kTensorwise, ElementFormat::kE4M3, Role::kWeight).pow2_scales);
  const QuantSpec nv_w = make_spec(Recipe::kNvfp4, ElementFormat::kE4M3, Role::kWeight);
  EXPECT_EQ(nv_w.element, ElementFormat::kE2M1);
  EXPECT_EQ(nv_w.block_rows, 16);
  EXPECT_FALSE(nv_w.rht);
  EXPECT_FALSE(nv_w.stochastic_rounding);
  const QuantSpec nv_x = make_spec(Recipe::kNvfp4, ElementFormat::kE4M3, Role::kActivation);
  EXPECT_EQ(nv_x.block_rows, 1);
  EXPECT_TRUE(nv_x.rht);
  EXPECT_FALSE(nv_x.stochastic_rounding);
  const QuantSpec nv_g = make_spec(Recipe::kNvfp4, ElementFormat::kE4M3, Role::kGradient);
  EXPECT_TRUE(nv_g.rht);
  EXPECT_TRUE(nv_g.stochastic_rounding);
  EXPECT_THROW(parse_recipe("fp8"), std::invalid_argument);
  EXPECT_THROW(make_spec(Recipe::kBlockwise, ElementFormat::kE2M1, Role::kWeight), std::invalid_argument);
}

TEST(QuantRecipes, TensorwiseScaleIsFormatMaxOverAmax) {
  // amax 3: scale = 448 / 3 (fp32), codes = e4m3(x * scale), decode scale 1 / scale.
  const std::vector<float> x = {3.0f, 0.1f, -1.0f, 0.0f};
  const QuantizedTensor q = rowwise(x, 2, 2, Recipe::kTensorwise, ElementFormat::kE4M3, Role::kActivation);
  const float scale = 448.0f / 3.0f;
  ASSERT_EQ(q.scales.size(), 1u);
  EXPECT_EQ(q.scales[0], 1.0f / scale);
  EXPECT_EQ(q.amax, 3.0f);
  EXPECT_EQ(q.codes[0], 0x7E);  // 3 x 149.333 = 448 (to fp32 rounding) -> 448
  // 0.1 x 149.333 = 14.93 lies between 14 and 15 (spacing 1 in [8, 16)): 15 = 1.875 x 2^3 -> 0x57.
  EXPECT_EQ(q.codes[1], 0x57);
  EXPECT_EQ(q.decode()[1], 15.0f * (1.0f / scale));
  EXPECT_EQ(q.decode()[2], decode_e4m3(encode_e4m3(-scale)) * (1.0f / scale));
  // E5M2: scale 57344 / 3.
  const QuantizedTensor q5 = rowwise(x, 2, 2, Recipe::kTensorwise, ElementFormat::kE5M2, Role::kGradient);
  EXPECT_EQ(q5.scales[0], 1.0f / (57344.0f / 3.0f));
  EXPECT_EQ(q5.codes[0], 0x7B);
}

TEST(QuantRecipes, TensorwiseEdgeAmaxes) {
  QuantSpec spec = make_spec(Recipe::kTensorwise, ElementFormat::kE4M3, Role::kActivation);
  EXPECT_EQ(current_scaling_scale(0.0f, spec), 1.0f);       // amax 0 -> 1
  EXPECT_EQ(current_scaling_scale(kInf, spec), 1.0f);       // Inf -> 1
  EXPECT_EQ(current_scaling_scale(1e-40f, spec), kFltMax);  // 448 / 1e-40 overflows -> FLT_MAX
  spec.amax_epsilon = 1.0f;
  EXPECT_EQ(current_scaling_scale(0.5f, spec), 448.0f);  // amax floored at epsilon
  EXPECT_EQ(current_scaling_scale(0.0f, spec), 448.0f);
  spec.amax_epsilon = 0.0f;
  spec.pow2_scales = true;
  EXPECT_EQ(current_scaling_scale(3.0f, spec), 128.0f);  // 149.33 rounded down to a power of two
  // All zeros: scale 1, every code 0; a NaN is skipped by the amax and encodes as the NaN code.
  const std::vector<float> zeros = {0.0f, 0.0f, std::numeric_limits<float>::quiet_NaN(), 2.0f};
  const QuantizedTensor q = rowwise(zeros, 1, 4, Recipe::kTensorwise, ElementFormat::kE4M3, Role::kActivation);
  EXPECT_EQ(q.amax, 2.0f);
  EXPECT_EQ(q.scales[0], 1.0f / 224.0f);
  EXPECT_EQ(q.codes[2], 0x7F);
}

TEST(QuantRecipes, BlockwiseOneByOneTwentyEightPowerOfTwoScales) {
  // [2, 260] activation: 1x128 blocks -> grid [2, 3], the last block 4 wide.
  std::vector<float> x(2 * 260, 0.0f);
  x[5] = 3.0f;       // row 0 block 0: amax 3 -> 448 / 3 = 149.3 -> 128
  x[130] = 500.0f;   // row 0 block 1: 448 / 500 = 0.896 -> 0.5
  x[258] = -448.0f;  // row 0 block 2 (edge): 448 / 448 = 1
  // row 1 block 0 stays zero: scale 1
  x[260 + 200] = 1e-3f;  // row 1 block 1: 448000 -> 2^18
  const QuantizedTensor q = rowwise(x, 2, 260, Recipe::kBlockwise, ElementFormat::kE4M3, Role::kActivation);
  ASSERT_EQ(q.scale_rows, 2);
  ASSERT_EQ(q.scale_cols, 3);
  EXPECT_EQ(q.scales[0], 1.0f / 128.0f);
  EXPECT_EQ(q.scales[1], 2.0f);
  EXPECT_EQ(q.scales[2], 1.0f);
  EXPECT_EQ(q.scales[3], 1.0f);
  EXPECT_EQ(q.scales[4], std::ldexp(1.0f, -18));
  EXPECT_EQ(q.scales[5], 1.0f);
  EXPECT_EQ(q.codes[5], encode_e4m3(384.0f));  // 3 x 128
  EXPECT_EQ(q.decode()[130], 512.0f);          // 500 x 0.5 = 250 -> 256 (spacing 16 in [128, 256)) -> 256 x 2
}

TEST(QuantRecipes, BlockwiseWeightsShareOneScalePerTile) {
  // [256, 128] weight: 128x128 tiles -> grid [2, 1]; one large value in row 127 sets tile 0's scale.
  std::vector<float> w(256 * 128, 0.25f);
  w[127 * 128 + 3] = 7.0f;  // 448 / 7 = 64
  const QuantizedTensor q = rowwise(w, 256, 128, Recipe::kBlockwise, ElementFormat::kE4M3, Role::kWeight);
  ASSERT_EQ(q.scale_rows, 2);
  ASSERT_EQ(q.scale_cols, 1);
  EXPECT_EQ(q.scales[0], 1.0f / 64.0f);
  EXPECT_EQ(q.scales[1], 1.0f / 1024.0f);  // 448 / 0.25 = 1792 -> 1024
  EXPECT_EQ(q.codes[0], encode_e4m3(16.0f));
  // Column-wise data of a 2D-scaled weight is the transpose with the same tiles.
  const QuantizedTensor qt = quantize(
      w.data(), 256, 128, make_spec(Recipe::kBlockwise, ElementFormat::kE4M3, Role::kWeight), Usage::kColumnwise);
  ASSERT_EQ(qt.rows, 128);
  ASSERT_EQ(qt.scale_cols, 2);
  EXPECT_EQ(qt.scales[0], q.scales[0]);
  EXPECT_EQ(qt.scales[1], q.scales[1]);
  for (int64_t r = 0; r < 256; ++r) {
    for (int64_t c = 0; c < 128; ++c) ASSERT_EQ(qt.codes[c * 256 + r], q.codes[r * 128 + c]);
  }
}

TEST(QuantRecipes, BlockwiseColumnwiseBlocksRunDownColumns) {
  // [128, 2] activation, column-wise: the transpose [2, 128] is stored with 1x128 blocks, i.e. 128x1 blocks of x.
  std::vector<float> x(128 * 2, 0.0f);
  x[64 * 2 + 0] = 3.0f;  // column 0
  x[10 * 2 + 1] = 7.0f;  // column 1
  const QuantizedTensor q = quantize(
      x.data(), 128, 2, make_spec(Recipe::kBlockwise, ElementFormat::kE4M3, Role::kActivation), Usage::kColumnwise);
  ASSERT_EQ(q.rows, 2);
  ASSERT_EQ(q.cols, 128);
  ASSERT_EQ(q.scale_rows, 2);
  ASSERT_EQ(q.scale_cols, 1);
  EXPECT_EQ(q.scales[0], 1.0f / 128.0f);
  EXPECT_EQ(q.scales[1], 1.0f / 64.0f);
  EXPECT_EQ(q.codes[64], encode_e4m3(384.0f));
}

TEST(QuantRecipes, Mxfp8E8M0ScaleIsAmaxOverMaxRoundedUp) {
  // Blocks of 32: amax 3.5 -> 3.5 x fp32(1/448) = 2^-7 exactly -> e = 120; amax 3.6 -> just above 2^-7 -> 2^-6;
  // a zero block -> e = 0 (2^-127); amax 448 -> 1 (e = 127).
  std::vector<float> x(32 * 4, 0.0f);
  x[0] = 3.5f;
  x[1] = 1.0f;
  x[32] = -3.6f;
  x[96] = 448.0f;
  x[97] = 0.01f;
  std::vector<float> padded(32 * 32 * 4, 0.0f);  // [32, 128]: both dimensions divisible by 32
  std::copy(x.begin(), x.end(), padded.begin());
  const QuantizedTensor q = rowwise(padded, 32, 128, Recipe::kMxfp8, ElementFormat::kE4M3, Role::kActivation);
  ASSERT_EQ(q.scale_rows, 32);
  ASSERT_EQ(q.scale_cols, 4);
  EXPECT_EQ(q.scale_codes[0], 120);
  EXPECT_EQ(q.scales[0], 0.0078125f);
  EXPECT_EQ(q.codes[0], 0x7E);  // 3.5 x 128 = 448
  EXPECT_EQ(q.decode()[1], 1.0f);
  EXPECT_EQ(q.scale_codes[1], 121);
  EXPECT_EQ(q.decode()[32], -3.5f);  // -3.6 x 64 = -230.4 -> -224 (spacing 16) -> / 64
  EXPECT_EQ(q.scale_codes[2], 0);
  EXPECT_EQ(q.scales[2], std::ldexp(1.0f, -127));
  EXPECT_EQ(q.scale_codes[3], 127);
  EXPECT_EQ(q.decode()[97], decode_e4m3(encode_e4m3(0.01f)));
  // E5M2: amax 3.5 x fp32(1 / 57344) lies in (2^-15, 2^-14] -> e = 113.
  const QuantizedTensor q5 = rowwise(padded, 32, 128, Recipe::kMxfp8, ElementFormat::kE5M2, Role::kGradient);
  EXPECT_EQ(q5.scale_codes[0], 113);
}

TEST(QuantRecipes, Mxfp8InfinityGivesTheLargestScale) {
  std::vector<float> x(32 * 32, 1.0f);
  x[0] = kInf;
  const QuantizedTensor q = rowwise(x, 32, 32, Recipe::kMxfp8, ElementFormat::kE4M3, Role::kActivation);
  EXPECT_EQ(q.scale_codes[0], 254);
  EXPECT_EQ(q.codes[0], 0x7E);       // Inf x 2^-127 -> satfinite
  EXPECT_EQ(q.codes[1], 0x00);       // 1 x 2^-127 underflows
  EXPECT_EQ(q.scale_codes[1], 119);  // 1 x fp32(1/448) in (2^-9, 2^-8] -> 2^-8
}

TEST(QuantRecipes, Nvfp4TwoLevelScales) {
  // [16, 32]: global amax 2688 -> S_enc = 2688 / 2688 = 1. Block (row 0, cols 0-15) amax 2688 -> e4m3(2688 / 6)
  // saturates to 448; block (row 0, cols 16-31) amax 6 -> e4m3(6 x fp32(1/6)) = 1.
  std::vector<float> x(16 * 32, 0.0f);
  x[0] = 2688.0f;
  x[1] = 1000.0f;
  x[16] = 6.0f;
  x[17] = 1.2f;
  x[18] = -2.6f;
  const QuantizedTensor q = rowwise(x, 16, 32, Recipe::kNvfp4, ElementFormat::kE4M3, Role::kActivation);
  EXPECT_EQ(q.amax, 2688.0f);
  ASSERT_EQ(q.scale_rows, 16);
  ASSERT_EQ(q.scale_cols, 2);
  EXPECT_EQ(q.scale_codes[0], 0x7E);
  EXPECT_EQ(q.scales[0], 448.0f);
  EXPECT_EQ(q.scales[1], 1.0f);
  EXPECT_EQ(q.scales[2], 0.0f);  // an all-zero block: scale 0, encode factor FLT_MAX, codes 0
  // Block 0: factor = 1 / (448 x 1) -> 2688 / 448 = 6, 1000 / 448 = 2.23 -> 2.
  EXPECT_EQ(q.codes[0], 0x7);
  EXPECT_EQ(q.codes[1], 0x4);
  // Block 1: factor 1 -> 6, 1.2 -> 1, -2.6 -> -3.
  EXPECT_EQ(q.codes[16], 0x7);
  EXPECT_EQ(q.codes[17], 0x2);
  EXPECT_EQ(q.codes[18], 0xD);
  // Decoded: e2m1 x ((block scale x global amax) x fp32(1 / 2688)).
  const float k = 1.0f / 2688.0f;
  EXPECT_EQ(q.decode()[0], 6.0f * ((448.0f * 2688.0f) * k));
  EXPECT_EQ(q.decode()[18], -3.0f * ((1.0f * 2688.0f) * k));
  EXPECT_EQ(q.decode()[32], 0.0f);
}

TEST(QuantRecipes, Nvfp4NanDecodesToNan) {
  // E2M1 has no NaN: the cast writes +6 for it (TE's satfinite) with the block scale of its finite neighbours, and the
  // block's scale becomes the E4M3 NaN, so the whole block decodes to NaN; other blocks are untouched.
  std::vector<float> x(16 * 32, 1.0f);
  x[5] = std::numeric_limits<float>::quiet_NaN();
  for (const Role role : {Role::kActivation, Role::kWeight}) {
    const QuantizedTensor q = rowwise(x, 16, 32, Recipe::kNvfp4, ElementFormat::kE4M3, role);
    EXPECT_EQ(q.amax, 1.0f);  // the global amax skips NaN
    EXPECT_EQ(q.codes[5], 0x7);
    EXPECT_EQ(q.scale_codes[0], 0x7F);
    EXPECT_TRUE(std::isnan(q.scales[0]));
    EXPECT_TRUE(std::isnan(q.decode()[5]));
    EXPECT_TRUE(std::isnan(q.decode()[0]));  // the NaN's block
    EXPECT_FLOAT_EQ(q.decode()[16], 1.0f);   // the block beside it (cols 16..31 of row 0)
  }
}

TEST(QuantRecipes, Nvfp4GlobalScaleEdges) {
  EXPECT_EQ(nvfp4_global_encode_scale(0.0f), 1.0f);
  EXPECT_EQ(nvfp4_global_encode_scale(kInf), 1.0f);
  EXPECT_EQ(nvfp4_global_encode_scale(6.0f), 448.0f);
  EXPECT_EQ(nvfp4_global_encode_scale(1e-40f), kFltMax);
  EXPECT_EQ(nvfp4_block_scale_code(6.0f, 448.0f), encode_e4m3(6.0f * (448.0f * (1.0f / 6.0f))));
}

TEST(QuantRecipes, Nvfp4WeightsUseSixteenBySixteenTiles) {
  std::vector<float> w(32 * 16, 0.5f);
  w[15 * 16 + 4] = 6.0f;  // row 15 sets the scale of tile (0, 0) for rows 0..15
  const QuantizedTensor q = rowwise(w, 32, 16, Recipe::kNvfp4, ElementFormat::kE4M3, Role::kWeight);
  ASSERT_EQ(q.scale_rows, 2);
  ASSERT_EQ(q.scale_cols, 1);
  // S_enc = 2688 / 6 = 448; tile 0: e4m3(6 x (448 x fp32(1/6))) = 448; tile 1: e4m3(0.5 x 74.67) = 36 (spacing 4).
  EXPECT_EQ(q.scales[0], 448.0f);
  EXPECT_EQ(q.scales[1], 36.0f);
  EXPECT_EQ(q.codes[0], encode_e2m1(0.5f * (1.0f / (448.0f * (1.0f / 448.0f)))));
}

TEST(QuantRecipes, ShapesNotDivisibleByTheBlockAreRejected) {
  const std::vector<float> x(33 * 64, 1.0f);
  const QuantSpec mx = make_spec(Recipe::kMxfp8, ElementFormat::kE4M3, Role::kActivation);
  EXPECT_THROW(quantize(x.data(), 33, 64, mx, Usage::kRowwise), std::invalid_argument);
  EXPECT_THROW(quantize(x.data(), 64, 33, mx, Usage::kRowwise), std::invalid_argument);
  const QuantSpec nv = make_spec(Recipe::kNvfp4, ElementFormat::kE4M3, Role::kActivation);
  EXPECT_THROW(quantize(x.data(), 33, 64, nv, Usage::kRowwise), std::invalid_argument);
  try {
    quantize(x.data(), 33, 64, mx, Usage::kRowwise);
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()),
              "mxfp8 needs both dimensions divisible by its 32-element block, got shape [33, 64]");
  }
  // Blockwise and per-tensor scaling take any shape.
  const QuantSpec bw = make_spec(Recipe::kBlockwise, ElementFormat::kE4M3, Role::kWeight);
  EXPECT_EQ(quantize(x.data(), 33, 64, bw, Usage::kRowwise).scale_rows, 1);
}

}  // namespace
}  // namespace moecore::quant
