// ShardedWeightQuantizer: a weight quantized from pieces of its flat elements (the distributed optimizer's shards,
// cut anywhere, mid-block included) must give the codes and decoded values of the whole weight quantized at once by
// quant::quantize (the weight's fprop quantization), bit for bit. Also: re-quantizing the decoded weight (what the
// GEMM does with the gathered weight) changes nothing for power-of-2 scales and only the fp32 rounding of the scale
// for tensorwise and NVFP4. Delayed scaling encodes every piece with the scale it is given.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <vector>

#include "moecore/quant/quantize.h"
#include "moecore/quant/sharded_weight_quantizer.h"

namespace moecore::quant {
namespace {

// Values in [-1, 1] times a magnitude that changes every 8 rows and 24 columns (2^-6 .. 2^3), so blocks of every
// recipe get different scales; one 16x16 tile is all zero (amax 0).
std::vector<float> weight_values(const int64_t rows, const int64_t cols) {
  std::vector<float> x(static_cast<size_t>(rows * cols));
  uint64_t state = 12345;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      state = state * 6364136223846793005ULL + 1442695040888963407ULL;
      const double u = static_cast<double>(state >> 11) / 9007199254740992.0 * 2.0 - 1.0;
      const int exponent = static_cast<int>((r / 8 * 5 + c / 24 * 3) % 10) - 6;
      x[static_cast<size_t>(r * cols + c)] = static_cast<float>(std::ldexp(u, exponent));
      if (r < 16 && c >= 16 && c < 32) x[static_cast<size_t>(r * cols + c)] = 0.0f;
    }
  }
  return x;
}

struct Case {
  Recipe recipe;
  ElementFormat element;
  int64_t rows, cols;
};

// Cuts of [0, n): two ranks, three uneven ranks, and pieces of 1, 7 and 33 elements (every block cut).
std::vector<std::vector<int64_t>> cuts(const int64_t n) {
  std::vector<std::vector<int64_t>> out = {{0, n / 2, n}, {0, n / 3 + 5, 2 * n / 3 - 17, n}};
  for (const int64_t step : {int64_t{1}, int64_t{7}, int64_t{33}}) {
    std::vector<int64_t> c;
    for (int64_t i = 0; i < n; i += step) c.push_back(i);
    c.push_back(n);
    out.push_back(std::move(c));
  }
  return out;
}

class ShardedWeight : public ::testing::TestWithParam<Case> {};

TEST_P(ShardedWeight, PiecesGiveTheWholeWeightsCodesBitForBit) {
  const Case k = GetParam();
  const QuantSpec spec = make_spec(k.recipe, k.element, Role::kWeight);
  const std::vector<float> x = weight_values(k.rows, k.cols);
  const QuantizedTensor whole = quantize(x.data(), k.rows, k.cols, spec, Usage::kRowwise);
  const std::vector<float> whole_decoded = whole.decode();
  const int64_t n = k.rows * k.cols;
  for (const std::vector<int64_t>& cut : cuts(n)) {
    ShardedWeightQuantizer q(k.rows, k.cols, spec);
    ASSERT_EQ(q.num_blocks(), whole.scale_rows * whole.scale_cols);
    // Each piece's partial amaxes, then their MAX (the all-reduce), as each rank would compute them.
    std::vector<float> amax(static_cast<size_t>(q.num_blocks()), 0.0f);
    for (size_t p = 0; p + 1 < cut.size(); ++p) {
      std::vector<float> partial(amax.size(), 0.0f);
      q.accumulate_amax(cut[p], std::span<const float>(x.data() + cut[p], static_cast<size_t>(cut[p + 1] - cut[p])),
                        partial);
      for (size_t b = 0; b < amax.size(); ++b) amax[b] = std::fmax(amax[b], partial[b]);
    }
    q.set_scales(amax);
    std::vector<uint8_t> codes(static_cast<size_t>(n));
    for (size_t p = 0; p + 1 < cut.size(); ++p) {
      const auto len = static_cast<size_t>(cut[p + 1] - cut[p]);
      q.encode(cut[p], std::span<const float>(x.data() + cut[p], len), std::span<uint8_t>(codes.data() + cut[p], len));
    }
    EXPECT_EQ(codes, whole.codes) << cut.size() - 1 << " pieces";
    std::vector<float> decoded(static_cast<size_t>(n));
    q.decode(0, codes, decoded);
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_EQ(std::bit_cast<uint32_t>(decoded[static_cast<size_t>(i)]),
                std::bit_cast<uint32_t>(whole_decoded[static_cast<size_t>(i)]))
          << "element " << i << " of " << cut.size() - 1 << " pieces";
    }
  }
}

// The GEMM quantizes the weight it is given, here the decoded weight. Power-of-2 scales (blockwise, MXFP8): the
// decoded block amax is code_max x 2^-k with code_max in [224, 448] (blockwise: amax x scale in (224, 448]) or <= 448
// (MXFP8), so the new scale is the same power of two or a larger one, and rescaling codes by a power of two is exact:
// identical values. Tensorwise: the decoded amax is 448 x fl(1 / scale), so the new scale differs from the old by
// fp32 rounding only (a few ulps), the codes are unchanged (E4M3 neighbours are >= 2^-4 apart, relatively) and the
// values differ by that rounding of the decode scale. NVFP4 likewise (global amax 6 x 448 x amax / 2688), as long as
// no block scale is an E4M3 subnormal (a block 2^-6 x 6 / 2688 below the global amax), which the data avoids.
TEST_P(ShardedWeight, RequantizingTheDecodedWeightKeepsItsValues) {
  const Case k = GetParam();
  const QuantSpec spec = make_spec(k.recipe, k.element, Role::kWeight);
  std::vector<float> x = weight_values(k.rows, k.cols);
  if (k.recipe == Recipe::kNvfp4) {
    for (float& v : x) v = v == 0.0f ? 0.0f : std::copysign(0.5f + 0.5f * std::fabs(v) / 8.0f, v);  // in [0.5, 1]
  }
  const std::vector<float> once = quantize(x.data(), k.rows, k.cols, spec, Usage::kRowwise).decode();
  const QuantizedTensor again_q = quantize(once.data(), k.rows, k.cols, spec, Usage::kRowwise);
  const std::vector<float> again = again_q.decode();
  const bool pow2 = k.recipe == Recipe::kBlockwise || k.recipe == Recipe::kMxfp8;
  const QuantizedTensor first = quantize(x.data(), k.rows, k.cols, spec, Usage::kRowwise);
  if (!pow2) {
    EXPECT_EQ(again_q.codes, first.codes);
  }
  for (size_t i = 0; i < once.size(); ++i) {
    if (pow2) {
      ASSERT_EQ(std::bit_cast<uint32_t>(again[i]), std::bit_cast<uint32_t>(once[i])) << "element " << i;
    } else {
      ASSERT_NEAR(again[i], once[i], std::ldexp(std::fabs(once[i]), -20)) << "element " << i;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Recipes, ShardedWeight,
                         ::testing::Values(Case{Recipe::kTensorwise, ElementFormat::kE4M3, 48, 40},
                                           Case{Recipe::kTensorwise, ElementFormat::kE5M2, 48, 40},
                                           Case{Recipe::kBlockwise, ElementFormat::kE4M3, 200, 300},
                                           Case{Recipe::kMxfp8, ElementFormat::kE4M3, 64, 96},
                                           Case{Recipe::kNvfp4, ElementFormat::kE2M1, 48, 64}));

// Delayed scaling: the scale comes from the weight's amax history, not the data, so every piece is encoded with the
// given scale; the codes and values are those of quantize() with that tensor scale (a scale of 2^5 saturates the
// weight's largest elements, 2^-3 below its amax x 448 leaves them unsaturated).
TEST(ShardedWeightQuantizer, DelayedScalingEncodesEveryPieceWithTheGivenScale) {
  const QuantSpec spec = make_spec(Recipe::kDelayed, ElementFormat::kE4M3, Role::kWeight);
  constexpr int64_t rows = 48, cols = 40, n = rows * cols;
  const std::vector<float> x = weight_values(rows, cols);
  for (const float scale : {32.0f, 0.125f, 3.7f}) {
    QuantizeOptions options;
    options.tensor_scale = scale;
    const QuantizedTensor whole = quantize(x.data(), rows, cols, spec, Usage::kRowwise, options);
    const std::vector<float> whole_decoded = whole.decode();
    for (const std::vector<int64_t>& cut : cuts(n)) {
      ShardedWeightQuantizer q(rows, cols, spec);
      ASSERT_EQ(q.num_blocks(), 1);
      std::vector<float> amax(1, 0.0f);
      EXPECT_THROW(q.set_scales(amax), std::logic_error);  // delayed scaling takes no scale from the data
      q.set_tensor_scale(scale);
      std::vector<uint8_t> codes(static_cast<size_t>(n));
      for (size_t p = 0; p + 1 < cut.size(); ++p) {
        const auto len = static_cast<size_t>(cut[p + 1] - cut[p]);
        q.encode(cut[p], std::span<const float>(x.data() + cut[p], len),
                 std::span<uint8_t>(codes.data() + cut[p], len));
      }
      EXPECT_EQ(codes, whole.codes) << "scale " << scale << ", " << cut.size() - 1 << " pieces";
      std::vector<float> decoded(static_cast<size_t>(n));
      q.decode(0, codes, decoded);
      for (int64_t i = 0; i < n; ++i) {
        ASSERT_EQ(std::bit_cast<uint32_t>(decoded[static_cast<size_t>(i)]),
                  std::bit_cast<uint32_t>(whole_decoded[static_cast<size_t>(i)]))
            << "element " << i;
      }
    }
  }
  ShardedWeightQuantizer current(4, 4, make_spec(Recipe::kTensorwise, ElementFormat::kE4M3, Role::kWeight));
  EXPECT_THROW(current.set_tensor_scale(2.0f), std::logic_error);  // current scaling computes its own
}

TEST(ShardedWeightQuantizer, RejectsShapesTheRecipeCannotBlock) {
  EXPECT_THROW(ShardedWeightQuantizer(32, 40, make_spec(Recipe::kMxfp8, ElementFormat::kE4M3, Role::kWeight)),
               std::invalid_argument);
  ShardedWeightQuantizer q(4, 4, make_spec(Recipe::kTensorwise, ElementFormat::kE4M3, Role::kWeight));
  std::vector<float> amax(1, 0.0f);
  const std::vector<float> x(5, 1.0f);
  EXPECT_THROW(q.accumulate_amax(12, x, amax), std::out_of_range);
}

TEST(ShardedWeightQuantizer, BlockGridOfEachRecipe) {
  // 200 x 300 weight: blockwise 128x128 -> 2 x 3 blocks (edge blocks partial); tensorwise one block.
  EXPECT_EQ(
      ShardedWeightQuantizer(200, 300, make_spec(Recipe::kBlockwise, ElementFormat::kE4M3, Role::kWeight)).num_blocks(),
      6);
  EXPECT_EQ(ShardedWeightQuantizer(200, 300, make_spec(Recipe::kTensorwise, ElementFormat::kE4M3, Role::kWeight))
                .num_blocks(),
            1);
  // MXFP8 1x32 row blocks: 64 x (96 / 32); NVFP4 16x16 tiles: (48 / 16) x (64 / 16).
  const ShardedWeightQuantizer mx(64, 96, make_spec(Recipe::kMxfp8, ElementFormat::kE4M3, Role::kWeight));
  EXPECT_EQ(mx.num_blocks(), 192);
  EXPECT_EQ(mx.block_of(96 + 33), 3 + 1);  // row 1, column 33: second block of row 1
  EXPECT_EQ(ShardedWeightQuantizer(48, 64, make_spec(Recipe::kNvfp4, ElementFormat::kE2M1, Role::kWeight)).num_blocks(),
            12);
}

}  // namespace
}  // namespace moecore::quant
