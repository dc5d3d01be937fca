// FP8 delayed scaling of one linear layer (quant::DelayedLinearScaling through ops::linear_forward /
// linear_backward): the first step quantizes with scale 1, every later one with fp8_max x 2^-margin / amax, where
// amax is the newest recorded amax (most_recent) or the largest of the last L (max). The expected scales come from a
// model of TE's rules written out here (a queue of past amaxes), the expected products from quantizing the operands
// with those scales and multiplying in double. Also: the weight is cast once per step (TE's workspace cache), a
// forward without rows still records the weight, and the delayed recipe needs the layer's state.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <deque>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "moecore/ops/linear.h"
#include "moecore/ops/quantization.h"
#include "moecore/quant/delayed_linear_scaling.h"
#include "moecore/quant/per_tensor_scaling.h"

namespace moecore::ops {
namespace {

using quant::AmaxComputeAlgo;
using quant::DelayedForwardScales;
using quant::DelayedLinearScaling;
using quant::ElementFormat;

constexpr float kE4M3Max = 448.0f, kE5M2Max = 57344.0f;

// TE's delayed scaling for one tensor, from its description: the scale starts at 1; after each step with a nonzero
// amax, scale = fp8_max x 2^-margin / (the largest of the last L amaxes, or the newest).
struct ScaleModel {
  int64_t L;
  bool max_algo;
  int margin;
  float fp8_max;
  std::deque<float> amaxes;
  float scale = 1.0f;

  void end_step(const float amax) {
    if (amax == 0.0f) return;
    amaxes.push_back(amax);
    if (static_cast<int64_t>(amaxes.size()) > L) amaxes.pop_front();
    const float a = max_algo ? *std::max_element(amaxes.begin(), amaxes.end()) : amaxes.back();
    scale = fp8_max * std::ldexp(1.0f, -margin) / a;
  }
};

Tensor random_tensor(std::vector<int64_t> shape, std::mt19937& gen, const float scale) {
  Tensor t = Tensor::zeros(std::move(shape));
  std::normal_distribution<float> normal(0.0f, scale);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = normal(gen);
  return t;
}

float abs_max(const Tensor& t) {
  float m = 0.0f;
  for (int64_t i = 0; i < t.numel(); ++i) m = std::max(m, std::fabs(t.data<float>()[i]));
  return m;
}

// t quantized at `scale` and decoded.
std::vector<float> quantized(const Tensor& t, const ElementFormat format, const float scale) {
  return quant::quantize_with_tensor_scale(t.data<float>(), t.dim(0), t.numel() / t.dim(0), format, scale).decode();
}

// c[i, j] = sum_k a[i, k] b[j, k] (a [M, K], b [N, K]), in double.
std::vector<double> product_abt(const std::vector<float>& a, const std::vector<float>& b, const int64_t M,
                                const int64_t N, const int64_t K) {
  std::vector<double> c(static_cast<size_t>(M * N), 0.0);
  for (int64_t i = 0; i < M; ++i) {
    for (int64_t j = 0; j < N; ++j) {
      double s = 0.0;
      for (int64_t k = 0; k < K; ++k) s += double(a[i * K + k]) * b[j * K + k];
      c[i * N + j] = s;
    }
  }
  return c;
}

std::vector<float> transposed(const std::vector<float>& a, const int64_t rows, const int64_t cols) {
  std::vector<float> t(a.size());
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < cols; ++j) t[j * rows + i] = a[i * cols + j];
  }
  return t;
}

void expect_close(const Tensor& got, const std::vector<double>& want, const std::string& what) {
  double scale = 0.0;
  for (const double v : want) scale = std::max(scale, std::fabs(v));
  for (int64_t i = 0; i < got.numel(); ++i) {
    ASSERT_NEAR(got.data<float>()[i], want[static_cast<size_t>(i)], 1e-5 * scale) << what << "[" << i << "]";
  }
}

quant::QuantizedLinearConfig delayed_config(const int64_t L, const AmaxComputeAlgo algo, const int margin) {
  quant::QuantizedLinearConfig config;
  config.recipe = quant::Recipe::kDelayed;
  config.format = quant::Fp8Format::kHybrid;  // E4M3 x and W, E5M2 dy
  config.delayed = {L, algo, margin};
  return config;
}

class OpsDelayedScaling : public ::testing::TestWithParam<std::tuple<int64_t, AmaxComputeAlgo, int>> {};

TEST_P(OpsDelayedScaling, ScalesFollowTheAmaxHistory) {
  const auto [L, algo, margin] = GetParam();
  const bool max_algo = algo == AmaxComputeAlgo::kMax;
  constexpr int64_t T = 12, I = 16, O = 8;
  const quant::QuantizedLinearConfig config = delayed_config(L, algo, margin);
  DelayedLinearScaling state(config.delayed, config.format);
  ScaleModel x_model{L, max_algo, margin, kE4M3Max, {}}, w_model{L, max_algo, margin, kE4M3Max, {}};
  ScaleModel dy_model{L, max_algo, margin, kE5M2Max, {}};
  // Magnitudes that rise and fall, so max and most_recent part ways.
  const float x_mag[] = {1.0f, 8.0f, 0.5f, 2.0f, 0.25f}, w_mag[] = {0.1f, 0.05f, 0.2f, 0.1f, 0.3f};
  const float dy_mag[] = {1e-3f, 4e-3f, 1e-4f, 2e-3f, 5e-4f};
  std::mt19937 gen(17);
  for (int step = 0; step < 5; ++step) {
    const Tensor x = random_tensor({T, I}, gen, x_mag[step]), w = random_tensor({O, I}, gen, w_mag[step]);
    const Tensor dy = random_tensor({T, O}, gen, dy_mag[step]);
    Tensor y = Tensor::zeros({T, O}), dx = Tensor::zeros({T, I}), dw = Tensor::zeros({O, I});
    DelayedForwardScales used;
    {
      const ScopedLinearQuantization scope(&config);
      state.set_first_microbatch();
      linear_forward(y, x, w, nullptr, &state, &used);
      linear_backward(&dx, &dw, nullptr, dy, &x, w, &state, &used);
    }
    const std::string at = "step " + std::to_string(step + 1);
    if (step == 0) {
      EXPECT_EQ(used.input, 1.0f) << at;
      EXPECT_EQ(used.weight, 1.0f) << at;
    }
    EXPECT_FLOAT_EQ(used.input, x_model.scale) << at;
    EXPECT_FLOAT_EQ(used.weight, w_model.scale) << at;
    const std::vector<float> xq = quantized(x, ElementFormat::kE4M3, x_model.scale);
    const std::vector<float> wq = quantized(w, ElementFormat::kE4M3, w_model.scale);
    const std::vector<float> dyq = quantized(dy, ElementFormat::kE5M2, dy_model.scale);
    expect_close(y, product_abt(xq, wq, T, O, I), at + " y");
    expect_close(dx, product_abt(dyq, transposed(wq, O, I), T, I, O), at + " dx");
    expect_close(dw, product_abt(transposed(dyq, T, O), transposed(xq, T, I), O, I, T), at + " dw");
    // This step's amaxes sit in row 0 until the update.
    EXPECT_EQ(state.pending_forward_amaxes()[0], abs_max(x)) << at;
    EXPECT_EQ(state.pending_forward_amaxes()[1], abs_max(w)) << at;
    EXPECT_EQ(state.pending_backward_amaxes()[0], abs_max(dy)) << at;
    state.update_forward();
    state.update_backward();
    x_model.end_step(abs_max(x));
    w_model.end_step(abs_max(w));
    dy_model.end_step(abs_max(dy));
    EXPECT_FLOAT_EQ(state.scale_fwd()[0], x_model.scale) << at;
    EXPECT_FLOAT_EQ(state.scale_fwd()[1], w_model.scale) << at;
    EXPECT_FLOAT_EQ(state.scale_bwd()[0], dy_model.scale) << at;
  }
}

INSTANTIATE_TEST_SUITE_P(HistoryAlgoMargin, OpsDelayedScaling,
                         ::testing::Values(std::tuple{int64_t{1}, AmaxComputeAlgo::kMostRecent, 0},
                                           std::tuple{int64_t{3}, AmaxComputeAlgo::kMostRecent, 0},
                                           std::tuple{int64_t{3}, AmaxComputeAlgo::kMax, 0},
                                           std::tuple{int64_t{2}, AmaxComputeAlgo::kMax, 2},
                                           std::tuple{int64_t{1}, AmaxComputeAlgo::kMax, 1}),
                         [](const auto& param_info) {
                           return "len" + std::to_string(std::get<0>(param_info.param)) + "_" +
                                  quant::amax_compute_algo_name(std::get<1>(param_info.param)) + "_margin" +
                                  std::to_string(std::get<2>(param_info.param));
                         });

TEST(OpsDelayedScalingWeightCache, TheWeightIsCastOncePerStep) {
  const quant::QuantizedLinearConfig config = delayed_config(1, AmaxComputeAlgo::kMostRecent, 0);
  DelayedLinearScaling state(config.delayed, config.format);
  std::mt19937 gen(3);
  const Tensor w = random_tensor({8, 16}, gen, 0.1f);
  const Tensor x1 = random_tensor({4, 16}, gen, 1.0f), x2 = random_tensor({4, 16}, gen, 3.0f);
  Tensor y = Tensor::zeros({4, 8});
  const ScopedLinearQuantization scope(&config);
  // Micro-batch 1 casts W at the current scale (1) and records its amax; the update after its forward moves the
  // weight's scale to 448 / amax(W).
  state.set_first_microbatch();
  DelayedForwardScales first, second, next_step;
  linear_forward(y, x1, w, nullptr, &state, &first);
  state.update_forward();
  EXPECT_FLOAT_EQ(state.scale_fwd()[1], kE4M3Max / abs_max(w));
  EXPECT_FLOAT_EQ(state.scale_fwd()[0], kE4M3Max / abs_max(x1));
  // Micro-batch 2 reuses the FP8 weight of micro-batch 1: scale 1, nothing recorded; its input uses the new scale.
  linear_forward(y, x2, w, nullptr, &state, &second);
  EXPECT_EQ(second.weight, first.weight);
  EXPECT_EQ(second.weight, 1.0f);
  EXPECT_FLOAT_EQ(second.input, kE4M3Max / abs_max(x1));
  EXPECT_EQ(state.pending_forward_amaxes()[1], 0.0f);
  EXPECT_EQ(state.pending_forward_amaxes()[0], abs_max(x2));
  state.update_forward();  // the weight's row 0 is 0: its history does not roll and its scale stays
  EXPECT_FLOAT_EQ(state.scale_fwd()[1], kE4M3Max / abs_max(w));
  // The next step casts the weight afresh.
  state.set_first_microbatch();
  linear_forward(y, x1, w, nullptr, &state, &next_step);
  EXPECT_FLOAT_EQ(next_step.weight, kE4M3Max / abs_max(w));
}

TEST(OpsDelayedScalingWeightCache, AForwardWithoutRowsRecordsTheWeight) {  // an expert without tokens
  const quant::QuantizedLinearConfig config = delayed_config(2, AmaxComputeAlgo::kMax, 0);
  DelayedLinearScaling state(config.delayed, config.format);
  std::mt19937 gen(4);
  const Tensor w = random_tensor({8, 16}, gen, 0.1f), x = Tensor::zeros({0, 16});
  Tensor y = Tensor::zeros({0, 8});
  const ScopedLinearQuantization scope(&config);
  linear_forward(y, x, w, nullptr, &state);
  EXPECT_EQ(state.pending_forward_amaxes()[0], 0.0f);
  EXPECT_EQ(state.pending_forward_amaxes()[1], abs_max(w));
}

TEST(OpsDelayedScalingWeightCache, TheDelayedRecipeNeedsTheLayersState) {
  const quant::QuantizedLinearConfig config = delayed_config(1, AmaxComputeAlgo::kMostRecent, 0);
  std::mt19937 gen(5);
  const Tensor w = random_tensor({8, 16}, gen, 0.1f), x = random_tensor({4, 16}, gen, 1.0f);
  const Tensor dy = random_tensor({4, 8}, gen, 1.0f);
  Tensor y = Tensor::zeros({4, 8}), dx = Tensor::zeros({4, 16});
  const ScopedLinearQuantization scope(&config);
  EXPECT_THROW(linear_forward(y, x, w), std::exception);
  DelayedLinearScaling state(config.delayed, config.format);
  EXPECT_THROW(linear_backward(&dx, nullptr, nullptr, dy, nullptr, w, &state, nullptr), std::exception);
}

}  // namespace
}  // namespace moecore::ops
