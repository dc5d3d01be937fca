// The quantized linear GEMMs (quant/quantized_gemm.h) against a test-local computation: each operand quantized
// with the recipe's codec in the layout and block TE uses for that GEMM (written out here, not taken from
// make_spec), decoded, multiplied by the reference GEMM.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "moecore/kernels/cpu/gemm.h"
#include "moecore/quant/blockwise_scaling.h"
#include "moecore/quant/hadamard.h"
#include "moecore/quant/mxfp8_scaling.h"
#include "moecore/quant/nvfp4_scaling.h"
#include "moecore/quant/per_tensor_scaling.h"
#include "moecore/quant/quantized_gemm.h"
#include "moecore/quant/stochastic_rounding.h"
#include "moecore/tensor/rng.h"

namespace moecore::quant {
namespace {

constexpr int64_t T = 64, K = 128, N = 96;

float abs_max_of(const std::vector<float>& x) {
  float m = 0;
  for (float v : x) m = std::max(m, std::fabs(v));
  return m;
}

std::vector<float> random_matrix(const int64_t n, const uint64_t seed, const float scale) {
  const CounterRng rng(seed, stream_key("quant_gemm_test"));
  std::vector<float> x(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) x[i] = scale * static_cast<float>(rng.normal(i));
  x[3] *= 40.0f;  // an outlier
  return x;
}

struct Case {
  Recipe recipe;
  Fp8Format format;
};

class QuantGemm : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    x_TK = random_matrix(T * K, 1, 1.0f);
    w_NK = random_matrix(N * K, 2, 0.05f);
    dy_TN = random_matrix(T * N, 3, 1e-3f);
    config.recipe = GetParam().recipe;
    config.format = GetParam().format;
    config.seed = 1234;
    const bool hybrid = config.format == Fp8Format::kHybrid;
    x_state = DelayedScaling(4, AmaxComputeAlgo::kMax, 0, ElementFormat::kE4M3);
    w_state = DelayedScaling(4, AmaxComputeAlgo::kMax, 0, ElementFormat::kE4M3);
    dy_state = DelayedScaling(4, AmaxComputeAlgo::kMax, 0, hybrid ? ElementFormat::kE5M2 : ElementFormat::kE4M3);
    // A previous step with somewhat larger amaxes, so the scales are neither 1 nor saturating.
    x_state.record_amax(1.5f * abs_max_of(x_TK));
    w_state.record_amax(1.5f * abs_max_of(w_NK));
    dy_state.record_amax(1.5f * abs_max_of(dy_TN));
    for (DelayedScaling* s : {&x_state, &w_state, &dy_state}) s->update();
    config.x = x_state.operand();
    config.w = w_state.operand();
    config.dy = dy_state.operand();
  }

  // The operand as TE quantizes it for one GEMM, decoded in its stored layout.
  std::vector<float> expected_operand(const std::vector<float>& src, const int64_t rows, const int64_t cols,
                                      const Role role, const bool columnwise) const {
    const Recipe recipe = config.recipe;
    std::vector<float> data = src;
    int64_t r = rows, c = cols;
    if (columnwise) {
      for (int64_t i = 0; i < rows; ++i) {
        for (int64_t j = 0; j < cols; ++j) data[j * rows + i] = src[i * cols + j];
      }
      std::swap(r, c);
      if (recipe == Recipe::kNvfp4 && role != Role::kWeight) {  // RHT on wgrad's operands
        std::vector<float> h(data.size());
        rht_rows(data.data(), r, c, te_rht_signs(), h.data());
        data = h;
      }
    }
    QuantSpec spec;
    spec.recipe = recipe;
    spec.element =
        (config.format == Fp8Format::kHybrid && role == Role::kGradient) ? ElementFormat::kE5M2 : ElementFormat::kE4M3;
    switch (recipe) {
      case Recipe::kDelayed: {
        const DelayedScaling& state = role == Role::kActivation ? x_state : role == Role::kWeight ? w_state : dy_state;
        return quantize_with_tensor_scale(data.data(), r, c, spec.element, state.scale()).decode();
      }
      case Recipe::kTensorwise: return quantize_current_scaling(data.data(), r, c, spec).decode();
      case Recipe::kBlockwise:
        spec.block_rows = role == Role::kWeight ? 128 : 1;
        spec.block_cols = 128;
        spec.pow2_scales = true;
        return quantize_blockwise(data.data(), r, c, spec).decode();
      case Recipe::kMxfp8:
        spec.block_rows = 1;
        spec.block_cols = 32;
        return quantize_mxfp8(data.data(), r, c, spec).decode();
      case Recipe::kNvfp4: {
        spec.element = ElementFormat::kE2M1;
        spec.block_rows = role == Role::kWeight ? 16 : 1;
        spec.block_cols = 16;
        const RoundingStream stream{1234, columnwise ? columnwise_rounding_key() : rowwise_rounding_key()};
        return quantize_nvfp4(data.data(), r, c, spec, role == Role::kGradient ? &stream : nullptr).decode();
      }
    }
    return {};
  }

  static void expect_close(const std::vector<float>& got, const std::vector<float>& expected,
                           const std::vector<float>& exact, const double max_relative_error) {
    double max_abs = 0, err = 0, ref = 0;
    for (float v : expected) max_abs = std::max(max_abs, double(std::fabs(v)));
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_NEAR(got[i], expected[i], 1e-5 * max_abs) << i;
      err += (double(got[i]) - exact[i]) * (double(got[i]) - exact[i]);
      ref += double(exact[i]) * exact[i];
    }
    EXPECT_LT(std::sqrt(err / ref), max_relative_error);  // and it is close to the fp32 product
  }

  double tolerance() const { return config.recipe == Recipe::kNvfp4 ? 0.3 : 0.1; }

  std::vector<float> x_TK, w_NK, dy_TN;
  QuantizedLinearConfig config;
  DelayedScaling x_state{1, AmaxComputeAlgo::kMax, 0, ElementFormat::kE4M3};
  DelayedScaling w_state{1, AmaxComputeAlgo::kMax, 0, ElementFormat::kE4M3};
  DelayedScaling dy_state{1, AmaxComputeAlgo::kMax, 0, ElementFormat::kE4M3};
};

TEST_P(QuantGemm, Fprop) {
  std::vector<float> y(T * N), expected(T * N), exact(T * N);
  quantized_fprop(x_TK.data(), w_NK.data(), y.data(), T, K, N, config, Device::kCPU);
  const auto xq = expected_operand(x_TK, T, K, Role::kActivation, false);
  const auto wq = expected_operand(w_NK, N, K, Role::kWeight, false);
  kernels::ref::gemm<float>(false, true, T, N, K, 1.0f, xq.data(), K, wq.data(), K, 0.0f, expected.data(), N);
  kernels::ref::gemm<float>(false, true, T, N, K, 1.0f, x_TK.data(), K, w_NK.data(), K, 0.0f, exact.data(), N);
  expect_close(y, expected, exact, tolerance());
  if (config.recipe == Recipe::kDelayed) {  // the step's amaxes were recorded
    EXPECT_EQ(x_state.amax_history()[0], abs_max_of(x_TK));
    EXPECT_EQ(w_state.amax_history()[0], abs_max_of(w_NK));
  }
}

TEST_P(QuantGemm, Dgrad) {
  std::vector<float> dx(T * K), expected(T * K), exact(T * K);
  quantized_dgrad(dy_TN.data(), w_NK.data(), dx.data(), T, K, N, config, Device::kCPU);
  const auto dyq = expected_operand(dy_TN, T, N, Role::kGradient, false);
  const auto wq_KN = expected_operand(w_NK, N, K, Role::kWeight, true);
  kernels::ref::gemm<float>(false, true, T, K, N, 1.0f, dyq.data(), N, wq_KN.data(), N, 0.0f, expected.data(), K);
  kernels::ref::gemm<float>(false, false, T, K, N, 1.0f, dy_TN.data(), N, w_NK.data(), K, 0.0f, exact.data(), K);
  expect_close(dx, expected, exact, tolerance());
}

TEST_P(QuantGemm, Wgrad) {
  std::vector<float> dw(N * K), expected(N * K), exact(N * K);
  quantized_wgrad(dy_TN.data(), x_TK.data(), dw.data(), T, K, N, config, Device::kCPU);
  const auto dyq_NT = expected_operand(dy_TN, T, N, Role::kGradient, true);
  const auto xq_KT = expected_operand(x_TK, T, K, Role::kActivation, true);
  kernels::ref::gemm<float>(false, true, N, K, T, 1.0f, dyq_NT.data(), T, xq_KT.data(), T, 0.0f, expected.data(), K);
  kernels::ref::gemm<float>(true, false, N, K, T, 1.0f, dy_TN.data(), N, x_TK.data(), K, 0.0f, exact.data(), K);
  expect_close(dw, expected, exact, tolerance());
}

INSTANTIATE_TEST_SUITE_P(
    Recipes, QuantGemm,
    ::testing::Values(Case{Recipe::kDelayed, Fp8Format::kHybrid}, Case{Recipe::kDelayed, Fp8Format::kE4M3},
                      Case{Recipe::kTensorwise, Fp8Format::kHybrid}, Case{Recipe::kTensorwise, Fp8Format::kE4M3},
                      Case{Recipe::kBlockwise, Fp8Format::kHybrid}, Case{Recipe::kBlockwise, Fp8Format::kE4M3},
                      Case{Recipe::kMxfp8, Fp8Format::kHybrid}, Case{Recipe::kMxfp8, Fp8Format::kE4M3},
                      Case{Recipe::kNvfp4, Fp8Format::kE4M3}),
    [](const auto& param_info) {
      return recipe_name(param_info.param.recipe) +
             (param_info.param.format == Fp8Format::kHybrid ? "_hybrid" : "_e4m3");
    });

}  // namespace
}  // namespace moecore::quant
