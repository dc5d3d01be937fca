// Quantized linear layers (ops/quantization.h): under ScopedLinearQuantization, ops::linear_forward /
// linear_backward equal quant::quantized_fprop / quantized_dgrad / quantized_wgrad called directly on the same
// operands (zero rows appended where the recipe's block needs them), bit for bit, with the bias and its gradient in
// high precision and the gradients accumulated into what the outputs held; without a config nothing changes.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "moecore/ops/linear.h"
#include "moecore/ops/quantization.h"
#include "moecore/quant/quantized_gemm.h"
#include "moecore/quant/recipe.h"

namespace moecore::ops {
namespace {

using quant::Fp8Format;
using quant::QuantizedLinearConfig;
using quant::Recipe;

Tensor random_tensor(std::vector<int64_t> shape, std::mt19937& gen) {
  Tensor t = Tensor::zeros(std::move(shape));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = normal(gen);
  return t;
}

Tensor copy_of(const Tensor& t) {
  Tensor c = Tensor::zeros(t.shape());
  std::copy_n(t.data<float>(), t.numel(), c.data<float>());
  return c;
}

// The first T rows of t, then Tp - T zero rows.
std::vector<float> padded(const Tensor& t, const int64_t T, const int64_t C, const int64_t Tp) {
  std::vector<float> out(static_cast<size_t>(Tp * C), 0.0f);
  std::copy_n(t.data<float>(), T * C, out.begin());
  return out;
}

void expect_bitwise(const float* got, const float* want, const int64_t n, const std::string& what) {
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(got[i], want[i]) << what << "[" << i << "]";
}

class OpsQuantization : public ::testing::TestWithParam<std::tuple<Recipe, Fp8Format, int64_t>> {};

TEST_P(OpsQuantization, LinearOpsEqualTheQuantizedGemms) {
  const auto [recipe, format, T] = GetParam();
  constexpr int64_t I = 64, O = 32;
  const int64_t multiple = quantization_row_multiple(recipe);
  const int64_t Tp = (T + multiple - 1) / multiple * multiple;
  std::mt19937 gen(1234);
  const Tensor x = random_tensor({T, I}, gen), w = random_tensor({O, I}, gen), b = random_tensor({O}, gen);
  const Tensor dy = random_tensor({T, O}, gen);
  const Tensor dx0 = random_tensor({T, I}, gen), dw0 = random_tensor({O, I}, gen), db0 = random_tensor({O}, gen);
  QuantizedLinearConfig config;
  config.recipe = recipe;
  config.format = format;
  config.seed = 77;

  // The expected values: the quant GEMMs on padded operands, the bias and dbias unquantized.
  const std::vector<float> x_pad = padded(x, T, I, Tp), dy_pad = padded(dy, T, O, Tp);
  std::vector<float> y_want(static_cast<size_t>(Tp * O));
  quant::quantized_fprop(x_pad.data(), w.data<float>(), y_want.data(), Tp, I, O, config, Device::kCPU);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t o = 0; o < O; ++o) y_want[t * O + o] += b.data<float>()[o];
  }
  QuantizedLinearConfig backward_config = config;
  backward_config.seed = quantization_seed(config.seed, gradient_fingerprint(dy.data<float>(), T * O));
  std::vector<float> dx_want(static_cast<size_t>(Tp * I)), dw_want(static_cast<size_t>(O * I));
  quant::quantized_dgrad(dy_pad.data(), w.data<float>(), dx_want.data(), Tp, I, O, backward_config, Device::kCPU);
  quant::quantized_wgrad(dy_pad.data(), x_pad.data(), dw_want.data(), Tp, I, O, backward_config, Device::kCPU);
  for (int64_t i = 0; i < T * I; ++i) dx_want[i] += dx0.data<float>()[i];
  for (int64_t i = 0; i < O * I; ++i) dw_want[i] += dw0.data<float>()[i];
  Tensor db_want = copy_of(db0);
  linear_backward(nullptr, nullptr, &db_want, dy, nullptr, w);  // unquantized

  Tensor y = Tensor::zeros({T, O}), dx = copy_of(dx0), dw = copy_of(dw0), db = copy_of(db0);
  {
    const ScopedLinearQuantization scope(&config);
    linear_forward(y, x, w, &b);
    linear_backward(&dx, &dw, &db, dy, &x, w);
  }
  EXPECT_EQ(linear_quantization(), nullptr);
  expect_bitwise(y.data<float>(), y_want.data(), T * O, "out");
  expect_bitwise(dx.data<float>(), dx_want.data(), T * I, "dinp");
  expect_bitwise(dw.data<float>(), dw_want.data(), O * I, "dweight");
  expect_bitwise(db.data<float>(), db_want.data<float>(), O, "dbias");

  // Quantization did happen: the plain fp32 layer differs.
  Tensor y_plain = Tensor::zeros({T, O});
  linear_forward(y_plain, x, w, &b);
  EXPECT_FALSE(std::equal(y_plain.data<float>(), y_plain.data<float>() + T * O, y.data<float>()));
}

std::string case_name(const ::testing::TestParamInfo<std::tuple<Recipe, Fp8Format, int64_t>>& info) {
  const auto [recipe, format, T] = info.param;
  return quant::recipe_name(recipe) + (format == Fp8Format::kE4M3 ? "_e4m3_" : "_hybrid_") + std::to_string(T) + "rows";
}

INSTANTIATE_TEST_SUITE_P(RecipesFormatsRows, OpsQuantization,
                         ::testing::Combine(::testing::Values(Recipe::kTensorwise, Recipe::kBlockwise, Recipe::kMxfp8,
                                                              Recipe::kNvfp4),
                                            ::testing::Values(Fp8Format::kE4M3, Fp8Format::kHybrid),
                                            ::testing::Values(int64_t{64}, int64_t{37})),
                         case_name);

TEST(OpsQuantizationScope, NullScopeAndNoScopeLeaveTheLayerUnchanged) {
  std::mt19937 gen(5);
  const Tensor x = random_tensor({8, 32}, gen), w = random_tensor({32, 32}, gen), dy = random_tensor({8, 32}, gen);
  Tensor y_plain = Tensor::zeros({8, 32}), dx_plain = Tensor::zeros({8, 32}), dw_plain = Tensor::zeros({32, 32});
  linear_forward(y_plain, x, w);
  linear_backward(&dx_plain, &dw_plain, nullptr, dy, &x, w);

  QuantizedLinearConfig config;
  config.recipe = Recipe::kTensorwise;
  const ScopedLinearQuantization outer(&config);
  EXPECT_EQ(linear_quantization(), &config);
  Tensor y = Tensor::zeros({8, 32}), dx = Tensor::zeros({8, 32}), dw = Tensor::zeros({32, 32});
  {
    const ScopedLinearQuantization off(nullptr);  // as the router opens it
    EXPECT_EQ(linear_quantization(), nullptr);
    linear_forward(y, x, w);
    linear_backward(&dx, &dw, nullptr, dy, &x, w);
  }
  EXPECT_EQ(linear_quantization(), &config);
  expect_bitwise(y.data<float>(), y_plain.data<float>(), y.numel(), "out");
  expect_bitwise(dx.data<float>(), dx_plain.data<float>(), dx.numel(), "dinp");
  expect_bitwise(dw.data<float>(), dw_plain.data<float>(), dw.numel(), "dweight");
}

TEST(OpsQuantizationScope, GradientsDrawSeedsFromTheirValues) {
  const std::vector<float> a = {1.0f, 2.0f, 3.0f}, b = {1.0f, 2.0f, 3.5f};
  EXPECT_EQ(gradient_fingerprint(a.data(), 3), gradient_fingerprint(a.data(), 3));
  EXPECT_NE(gradient_fingerprint(a.data(), 3), gradient_fingerprint(b.data(), 3));
  EXPECT_NE(gradient_fingerprint(a.data(), 3), gradient_fingerprint(a.data(), 2));
  EXPECT_NE(quantization_seed(1, 0), quantization_seed(1, 1));
  EXPECT_NE(quantization_seed(1, 0), quantization_seed(2, 0));
}

TEST(OpsQuantizationScope, NoRowsLeaveTheGradientsUnchanged) {  // an expert without tokens
  std::mt19937 gen(3);
  const Tensor x = Tensor::zeros({0, 32}), dy = Tensor::zeros({0, 32}), w = random_tensor({32, 32}, gen);
  const Tensor dw0 = random_tensor({32, 32}, gen), db0 = random_tensor({32}, gen);
  Tensor y = Tensor::zeros({0, 32}), dx = Tensor::zeros({0, 32}), dw = copy_of(dw0), db = copy_of(db0);
  for (const Recipe recipe : {Recipe::kTensorwise, Recipe::kBlockwise, Recipe::kMxfp8, Recipe::kNvfp4}) {
    QuantizedLinearConfig config;
    config.recipe = recipe;
    const ScopedLinearQuantization scope(&config);
    linear_forward(y, x, w, &db);
    linear_backward(&dx, &dw, &db, dy, &x, w);
    expect_bitwise(dw.data<float>(), dw0.data<float>(), dw.numel(), "dweight");
    expect_bitwise(db.data<float>(), db0.data<float>(), db.numel(), "dbias");
  }
}

// The quantized operands are staged in the layer's device memory: its MemoryTracker counts them and, on the
// reference device, its guard bytes fence them.
TEST(OpsQuantizationScope, QuantizedOperandsLiveOnTheLayersDevice) {
  constexpr int64_t T = 64, I = 64, O = 32;
  std::mt19937 gen(11);
  const Tensor x = random_tensor({T, I}, gen).to(Device::kReference);
  const Tensor w = random_tensor({O, I}, gen).to(Device::kReference);
  const Tensor dy = random_tensor({T, O}, gen).to(Device::kReference);
  Tensor y({T, O}, DType::kF32, MemCategory::kOther, Device::kReference);
  Tensor dx({T, I}, DType::kF32, MemCategory::kOther, Device::kReference);
  Tensor dw({O, I}, DType::kF32, MemCategory::kOther, Device::kReference);
  MemoryTracker& tracker = MemoryTracker::instance(Device::kReference);
  QuantizedLinearConfig config;
  config.recipe = Recipe::kTensorwise;
  const ScopedLinearQuantization scope(&config, Device::kReference);

  tracker.reset_peaks();
  const int64_t before = tracker.current(MemCategory::kOther);
  linear_forward(y, x, w);
  EXPECT_EQ(tracker.current(MemCategory::kOther), before);                         // freed after the GEMM
  const int64_t operands = (T * I + O * I) * static_cast<int64_t>(sizeof(float));  // x and w decoded
  EXPECT_GE(tracker.peak(MemCategory::kOther) - before, operands);

  tracker.reset_peaks();
  linear_backward(&dx, &dw, nullptr, dy, &x, w);
  // wgrad holds dy and x decoded (column-wise) beside its output dw.
  const int64_t wgrad = (T * O + T * I + O * I) * static_cast<int64_t>(sizeof(float));
  EXPECT_GE(tracker.peak(MemCategory::kOther) - before, wgrad);
  for (const Tensor* t : {&y, &dx, &dw}) EXPECT_EQ(outside_writes(*t), "");
}

TEST(OpsQuantizationScope, FeaturesTheBlocksCannotCoverAreAnError) {
  std::mt19937 gen(9);
  const Tensor x = random_tensor({32, 40}, gen), w = random_tensor({32, 40}, gen);
  Tensor y = Tensor::zeros({32, 32});
  QuantizedLinearConfig config;
  config.recipe = Recipe::kMxfp8;
  const ScopedLinearQuantization scope(&config);
  EXPECT_THROW(linear_forward(y, x, w), std::exception);
}

}  // namespace
}  // namespace moecore::ops
