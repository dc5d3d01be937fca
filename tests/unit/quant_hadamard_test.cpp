// NVFP4's random Hadamard transform (quant/hadamard.h) and its place in column-wise quantization.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "moecore/quant/hadamard.h"
#include "moecore/quant/quantize.h"
#include "moecore/tensor/rng.h"

namespace moecore::quant {
namespace {

std::vector<float> random_matrix(const int64_t n, const uint64_t seed) {
  const CounterRng rng(seed, stream_key("quant_hadamard_test"));
  std::vector<float> x(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) x[i] = static_cast<float>(rng.normal(i));
  return x;
}

TEST(QuantHadamard, UnitVectorsGiveSignedHadamardRows) {
  // e_i @ diag(s) H / 4 = s_i H[i, :] / 4, H[i][j] = (-1)^popcount(i & j).
  const RhtSigns signs = te_rht_signs();
  for (int i = 0; i < 16; ++i) {
    std::vector<float> e(16, 0.0f), y(16);
    e[i] = 1.0f;
    rht_rows(e.data(), 1, 16, signs, y.data());
    for (int j = 0; j < 16; ++j) {
      const float h = (__builtin_popcount(i & j) % 2) ? -1.0f : 1.0f;
      EXPECT_EQ(y[j], signs[i] * h * 0.25f) << i << " " << j;
    }
  }
}

TEST(QuantHadamard, IsOrthogonal) {
  const int64_t rows = 3, cols = 64;
  const std::vector<float> x = random_matrix(rows * cols, 1);
  for (const RhtSigns& signs : {te_rht_signs(), rht_signs_from_seed(5)}) {
    std::vector<float> y(x.size()), back(x.size());
    rht_rows(x.data(), rows, cols, signs, y.data());
    inverse_rht_rows(y.data(), rows, cols, signs, back.data());
    double norm_x = 0, norm_y = 0;
    for (size_t i = 0; i < x.size(); ++i) {
      EXPECT_NEAR(back[i], x[i], 1e-6 * (1 + std::fabs(x[i])));
      norm_x += double(x[i]) * x[i];
      norm_y += double(y[i]) * y[i];
    }
    EXPECT_NEAR(norm_y, norm_x, 1e-5 * norm_x);
  }
  // Dot products along a row survive the transform: the reason it can be applied to both wgrad operands.
  const std::vector<float> a = random_matrix(16, 2), b = random_matrix(16, 3);
  std::vector<float> ha(16), hb(16);
  rht_rows(a.data(), 1, 16, te_rht_signs(), ha.data());
  rht_rows(b.data(), 1, 16, te_rht_signs(), hb.data());
  double dot = 0, hdot = 0;
  for (int i = 0; i < 16; ++i) {
    dot += double(a[i]) * b[i];
    hdot += double(ha[i]) * hb[i];
  }
  EXPECT_NEAR(hdot, dot, 1e-5);
}

TEST(QuantHadamard, SeededSignsAreReproducibleAndTeSignsAreFixed) {
  EXPECT_EQ(rht_signs_from_seed(9), rht_signs_from_seed(9));
  const RhtSigns te = te_rht_signs();  // nvfp4_tensor.py get_wgrad_sign_vector
  const RhtSigns expected = {1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1};
  EXPECT_EQ(te, expected);
  std::vector<float> x(15, 1.0f), y(15);
  EXPECT_THROW(rht_rows(x.data(), 1, 15, te, y.data()), std::invalid_argument);
}

TEST(QuantHadamard, ColumnwiseNvfp4ActivationsAreTransformedAlongTheFirstDimension) {
  const int64_t rows = 32, cols = 16;
  const std::vector<float> x = random_matrix(rows * cols, 4);
  const QuantSpec spec = make_spec(Recipe::kNvfp4, ElementFormat::kE2M1, Role::kActivation);
  const QuantizedTensor q = quantize(x.data(), rows, cols, spec, Usage::kColumnwise);
  EXPECT_TRUE(q.rht);
  // Expected: transpose, transform each 16 run of the transpose's rows, quantize row-wise without RHT.
  std::vector<float> xt(x.size()), hxt(x.size());
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) xt[c * rows + r] = x[r * cols + c];
  }
  rht_rows(xt.data(), cols, rows, te_rht_signs(), hxt.data());
  QuantSpec plain = spec;
  plain.rht = false;
  const QuantizedTensor expected = quantize(hxt.data(), cols, rows, plain, Usage::kRowwise);
  EXPECT_EQ(q.codes, expected.codes);
  EXPECT_EQ(q.scales, expected.scales);
  EXPECT_EQ(q.amax, expected.amax);
  // Row-wise usage never applies it; weights never do.
  EXPECT_FALSE(quantize(x.data(), rows, cols, spec, Usage::kRowwise).rht);
  EXPECT_FALSE(
      quantize(x.data(), rows, cols, make_spec(Recipe::kNvfp4, ElementFormat::kE2M1, Role::kWeight), Usage::kColumnwise)
          .rht);
  // decode_to_source undoes the transform: close to x at NVFP4 precision.
  const Tensor decoded = decode_to_source(q);
  const float* back = decoded.data<float>();
  double err = 0, ref = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    err += (back[i] - x[i]) * (back[i] - x[i]);
    ref += x[i] * x[i];
  }
  EXPECT_LT(std::sqrt(err / ref), 0.2);
}

TEST(QuantHadamard, StochasticRoundingIsReproducibleForASeed) {
  const int64_t rows = 16, cols = 32;
  const std::vector<float> dy = random_matrix(rows * cols, 6);
  const QuantSpec spec = make_spec(Recipe::kNvfp4, ElementFormat::kE2M1, Role::kGradient);
  QuantizeOptions options;
  options.seed = 42;
  const QuantizedTensor a = quantize(dy.data(), rows, cols, spec, Usage::kRowwise, options);
  const QuantizedTensor b = quantize(dy.data(), rows, cols, spec, Usage::kRowwise, options);
  EXPECT_EQ(a.codes, b.codes);
  options.seed = 43;
  const QuantizedTensor c = quantize(dy.data(), rows, cols, spec, Usage::kRowwise, options);
  EXPECT_NE(a.codes, c.codes);
  EXPECT_EQ(a.scales, c.scales);  // only the element rounding is random
  // Each code is one of the two grid neighbours of x times the block's encode factor.
  QuantSpec nearest = spec;
  nearest.stochastic_rounding = false;
  const QuantizedTensor rn = quantize(dy.data(), rows, cols, nearest, Usage::kRowwise);
  for (size_t i = 0; i < a.codes.size(); ++i) {
    const float va = decode_e2m1(a.codes[i]);
    const float vn = decode_e2m1(rn.codes[i]);
    EXPECT_LE(std::fabs(va - vn), 2.0f) << i;  // at most one grid step apart (steps 0.5, 1, 2)
  }
}

}  // namespace
}  // namespace moecore::quant
