// Saving a linear layer's input quantized for the weight gradient (quant/quantized_gemm.h quantize_wgrad_input /
// quantized_wgrad_saved, quant/packed_quantized_tensor.h): for every recipe the weight gradient from the saved
// quantization equals, bit for bit, the one that quantizes the input in backward; the packed tensors hold the codes
// and scales exactly (odd E2M1 counts, NaN blocks), take the bytes TE's quantized tensors take, and live in the
// category they were packed under.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "moecore/quant/quantize.h"
#include "moecore/quant/quantized_gemm.h"
#include "moecore/tensor/memory_tracker.h"
#include "moecore/tensor/rng.h"

namespace moecore::quant {
namespace {

constexpr int64_t T = 64, K = 96, N = 32;

std::vector<float> random_matrix(const int64_t n, const uint64_t seed, const float scale) {
  const CounterRng rng(seed, stream_key("quant_saved_input_test"));
  std::vector<float> x(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) x[static_cast<size_t>(i)] = scale * static_cast<float>(rng.normal(i));
  x[5] *= 30.0f;  // an outlier
  return x;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

class SavedInput : public ::testing::TestWithParam<Recipe> {};

TEST_P(SavedInput, WgradFromTheSavedInputIsBitIdentical) {
  const std::vector<float> x_TK = random_matrix(T * K, 1, 1.0f), dy_TN = random_matrix(T * N, 2, 1e-3f);
  QuantizedLinearConfig config;
  config.recipe = GetParam();
  config.format = Fp8Format::kHybrid;
  config.seed = 1234;  // the backward's stochastic-rounding seed (gradients only)
  float amax_slot = 0.0f;
  if (config.recipe == Recipe::kDelayed) config.x = {0.37f, &amax_slot};
  std::vector<float> dw_now(N * K), dw_saved(N * K);
  quantized_wgrad(dy_TN.data(), x_TK.data(), dw_now.data(), T, K, N, config, Device::kCPU);
  amax_slot = 0.0f;
  QuantizedLinearConfig forward = config;
  forward.seed = 99;  // the forward knows no gradient: x's quantization must not depend on the seed
  const int64_t activations_before = MemoryTracker::instance().current(MemCategory::kActivations);
  const PackedQuantizedTensor saved =
      quantize_wgrad_input(x_TK.data(), T, K, forward, MemCategory::kActivations, Device::kCPU);
  const int64_t activations_saved = MemoryTracker::instance().current(MemCategory::kActivations) - activations_before;
  quantized_wgrad_saved(dy_TN.data(), saved, dw_saved.data(), T, K, N, config, Device::kCPU);
  EXPECT_TRUE(same_bits(dw_now, dw_saved));
  EXPECT_EQ(amax_slot, 0.0f) << "the saved copy records no amax";
  // Bytes: one a code (E2M1: half), plus the scales as TE stores them.
  const int64_t n = T * K;
  int64_t expected = 0;
  switch (config.recipe) {
    case Recipe::kDelayed:
    case Recipe::kTensorwise: expected = n + 4; break;
    case Recipe::kBlockwise: expected = n + 4 * K * ((T + 127) / 128); break;
    case Recipe::kMxfp8: expected = n + n / 32; break;
    case Recipe::kNvfp4: expected = n / 2 + n / 16; break;
  }
  EXPECT_EQ(saved.bytes(), expected);
  EXPECT_EQ(activations_saved, expected) << "the saved input is counted as activations";
}

TEST_P(SavedInput, PackUnpackKeepsEveryCodeAndScale) {
  const Recipe recipe = GetParam();
  const int64_t rows = 32, cols = 64;  // E2M1: an even count; the odd one is below
  std::vector<float> x = random_matrix(rows * cols, 3, 1.0f);
  x[17] = std::numeric_limits<float>::quiet_NaN();  // a NaN block (NVFP4: the E4M3 NaN scale)
  const QuantSpec spec =
      make_spec(recipe, element_format_for(recipe, Fp8Format::kE4M3, Role::kActivation), Role::kActivation);
  const QuantizedTensor q = quantize(x.data(), rows, cols, spec, Usage::kColumnwise);
  const QuantizedTensor back = unpack(pack(q, Device::kCPU, MemCategory::kOther));
  EXPECT_EQ(back.codes, q.codes);
  EXPECT_EQ(back.scale_codes, q.scale_codes);
  ASSERT_EQ(back.scales.size(), q.scales.size());
  EXPECT_EQ(std::memcmp(back.scales.data(), q.scales.data(), q.scales.size() * sizeof(float)), 0);
  EXPECT_EQ(back.amax, q.amax);
  EXPECT_EQ(back.rht, q.rht);
}

INSTANTIATE_TEST_SUITE_P(Recipes, SavedInput,
                         ::testing::Values(Recipe::kDelayed, Recipe::kTensorwise, Recipe::kBlockwise, Recipe::kMxfp8,
                                           Recipe::kNvfp4),
                         [](const auto& param_info) { return recipe_name(param_info.param); });

TEST(SavedInputPacking, OddE2M1CountKeepsTheLastCode) {
  QuantizedTensor q;
  q.recipe = Recipe::kNvfp4;
  q.format = ElementFormat::kE2M1;
  q.rows = 1;
  q.cols = 3;
  q.codes = {0x1, 0xF, 0x7};
  q.scales = {1.0f};
  q.scale_codes = {0x38};  // E4M3 1.0
  const PackedQuantizedTensor p = pack(q, Device::kCPU, MemCategory::kOther);
  EXPECT_EQ(p.codes.numel(), 2);
  const QuantizedTensor back = unpack(p);
  EXPECT_EQ(back.codes, q.codes);
  EXPECT_EQ(back.scales, q.scales);
}

TEST(SavedInputPacking, SavedInputOfAnotherShapeIsRefused) {
  const std::vector<float> x_TK = random_matrix(T * K, 4, 1.0f), dy_TN = random_matrix(T * N, 5, 1e-3f);
  QuantizedLinearConfig config;
  config.recipe = Recipe::kTensorwise;
  const PackedQuantizedTensor saved =
      quantize_wgrad_input(x_TK.data(), T, K, config, MemCategory::kOther, Device::kCPU);
  std::vector<float> dw(N * K);
  EXPECT_THROW(quantized_wgrad_saved(dy_TN.data(), saved, dw.data(), T, K / 2, N, config, Device::kCPU),
               std::invalid_argument);
}

}  // namespace
}  // namespace moecore::quant
