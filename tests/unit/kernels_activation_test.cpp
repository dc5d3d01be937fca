// SwiGLU, exact GeLU and squared ReLU: published/hand-derived values, fast vs reference, and every backward vs
// central finite differences in double.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "kernel_test_util.h"
#include "moecore/kernels/cpu/activation.h"

namespace moecore::kernels {
namespace {

using test::max_rel_error;
using test::numeric_grad;
using test::random_vector;
using test::weighted_sum;

// gelu(x) = x Phi(x) with the standard normal CDF: Phi(1) = 0.8413447460685429, Phi(-1) = 0.15865525393145707,
// Phi(2) = 0.9772498680518208 (tables); silu(g) = g sigmoid(g): sigmoid(1) = 0.7310585786300049,
// sigmoid(-2) = 0.11920292202211755.
TEST(ActivationTest, KnownValues) {
  for (const bool fast : {true, false}) {
    const std::vector<double> x = {1.0, -1.0, 2.0, 0.0};
    std::vector<double> y(4);
    (fast ? cpu::gelu_forward<double> : ref::gelu_forward<double>)(y.data(), x.data(), 4);
    EXPECT_NEAR(y[0], 0.8413447460685429, 1e-15);
    EXPECT_NEAR(y[1], -0.15865525393145707, 1e-15);
    EXPECT_NEAR(y[2], 2.0 * 0.9772498680518208, 1e-15);
    EXPECT_EQ(y[3], 0.0);

    // Two tokens, F = 2: rows are [gate0, gate1 | up0, up1].
    const std::vector<double> inp = {1.0, -2.0, 2.0, 3.0, 0.0, 5.0, 7.0, 11.0};
    std::vector<double> out(4);
    (fast ? cpu::swiglu_forward<double> : ref::swiglu_forward<double>)(out.data(), inp.data(), 2, 2);
    EXPECT_NEAR(out[0], 1.0 * 0.7310585786300049 * 2.0, 1e-15);
    EXPECT_NEAR(out[1], -2.0 * 0.11920292202211755 * 3.0, 1e-15);
    EXPECT_EQ(out[2], 0.0);  // silu(0) = 0
    EXPECT_NEAR(out[3], 5.0 * (1.0 / (1.0 + std::exp(-5.0))) * 11.0, 1e-13);

    const std::vector<double> r = {-2.0, 0.0, 3.0, 0.5};
    std::vector<double> sq(4);
    (fast ? cpu::squared_relu_forward<double> : ref::squared_relu_forward<double>)(sq.data(), r.data(), 4);
    EXPECT_EQ(sq, (std::vector<double>{0.0, 0.0, 9.0, 0.25}));
  }
}

TEST(ActivationTest, SwiGluIsStableForLargeGates) {
  const std::vector<float> inp = {-100.0f, 100.0f, 2.0f, 2.0f};  // gates -100, 100; ups 2, 2
  std::vector<float> out(2), dinp(4, 0.0f);
  const std::vector<float> dout = {1.0f, 1.0f};
  cpu::swiglu_forward<float>(out.data(), inp.data(), 1, 2);
  cpu::swiglu_backward<float>(dinp.data(), dout.data(), inp.data(), 1, 2);
  EXPECT_NEAR(out[0], 0.0f, 1e-30f);
  EXPECT_NEAR(out[1], 200.0f, 1e-4f);
  for (const float g : dinp) EXPECT_TRUE(std::isfinite(g));
  EXPECT_NEAR(dinp[1], 2.0f, 1e-5f);  // d/dg [g sigmoid(g)] -> 1 for large g, times up = 2
}

template <typename T>
void check_vs_ref(int64_t n_tokens, int64_t F, double tol) {
  const int64_t n = n_tokens * F;
  const auto inp2 = random_vector<T>(n * 2, 1, T(-4), T(4));
  const auto inp = random_vector<T>(n, 2, T(-4), T(4));
  const auto dout = random_vector<T>(n, 3);
  {
    std::vector<T> y_fast(n), y_ref(n);
    cpu::swiglu_forward<T>(y_fast.data(), inp2.data(), n_tokens, F);
    ref::swiglu_forward<T>(y_ref.data(), inp2.data(), n_tokens, F);
    EXPECT_LT(max_rel_error(y_fast, y_ref), tol);
    auto d_fast = random_vector<T>(n * 2, 4), d_ref = d_fast;  // non-zero start: must accumulate
    cpu::swiglu_backward<T>(d_fast.data(), dout.data(), inp2.data(), n_tokens, F);
    ref::swiglu_backward<T>(d_ref.data(), dout.data(), inp2.data(), n_tokens, F);
    EXPECT_LT(max_rel_error(d_fast.data(), d_ref.data(), d_fast.size(), 1e-2), tol);
  }
  using Fwd = void (*)(T*, const T*, int64_t);
  using Bwd = void (*)(T*, const T*, const T*, int64_t);
  const std::vector<std::pair<Fwd, Bwd>> fast = {{cpu::gelu_forward<T>, cpu::gelu_backward<T>},
                                                 {cpu::squared_relu_forward<T>, cpu::squared_relu_backward<T>}};
  const std::vector<std::pair<Fwd, Bwd>> naive = {{ref::gelu_forward<T>, ref::gelu_backward<T>},
                                                  {ref::squared_relu_forward<T>, ref::squared_relu_backward<T>}};
  for (size_t k = 0; k < fast.size(); ++k) {
    std::vector<T> y_fast(n), y_ref(n);
    fast[k].first(y_fast.data(), inp.data(), n);
    naive[k].first(y_ref.data(), inp.data(), n);
    EXPECT_LT(max_rel_error(y_fast, y_ref), tol) << "activation " << k;
    auto d_fast = random_vector<T>(n, 5), d_ref = d_fast;
    fast[k].second(d_fast.data(), dout.data(), inp.data(), n);
    naive[k].second(d_ref.data(), dout.data(), inp.data(), n);
    EXPECT_LT(max_rel_error(d_fast.data(), d_ref.data(), n, 1e-2), tol) << "activation " << k;
  }
}

TEST(ActivationTest, MatchesReferenceFloat) { check_vs_ref<float>(37, 53, 1e-5); }
TEST(ActivationTest, MatchesReferenceDouble) { check_vs_ref<double>(37, 53, 1e-12); }
TEST(ActivationTest, MatchesReferenceParallel) {  // above the OpenMP threshold
  check_vs_ref<float>(301, 131, 1e-5);
  check_vs_ref<double>(301, 131, 1e-12);
}

// Inputs kept at least 0.05 away from 0 so squared ReLU's kink never lies inside a finite-difference stencil.
std::vector<double> inputs_away_from_zero(size_t n, uint64_t seed) {
  auto x = random_vector<double>(n, seed, -3.0, 3.0);
  for (auto& v : x) v = v < 0 ? v - 0.05 : v + 0.05;
  return x;
}

// Central differences with eps = 1e-6: truncation ~1e-12 * |f'''|, rounding ~1e-10 absolute, so a 1e-6 relative
// bound (1e-8 absolute below the 1e-2 floor) leaves a wide margin while catching any wrong derivative term.
TEST(ActivationTest, SwiGluBackwardMatchesFiniteDifferences) {
  const int64_t T = 5, F = 7;
  const auto inp = inputs_away_from_zero(T * 2 * F, 11);
  const auto R = random_vector<double>(T * F, 12);
  for (const bool fast : {true, false}) {
    const auto forward = fast ? cpu::swiglu_forward<double> : ref::swiglu_forward<double>;
    const auto backward = fast ? cpu::swiglu_backward<double> : ref::swiglu_backward<double>;
    const auto g = numeric_grad(
        [&](const std::vector<double>& v) {
          std::vector<double> y(T * F);
          forward(y.data(), v.data(), T, F);
          return weighted_sum(y, R);
        },
        inp);
    std::vector<double> d(inp.size());
    backward(d.data(), R.data(), inp.data(), T, F);
    EXPECT_LT(max_rel_error(d.data(), g.data(), d.size(), 1e-2), 1e-6) << "fast=" << fast;
  }
}

TEST(ActivationTest, PointwiseBackwardsMatchFiniteDifferences) {
  const int64_t n = 37;
  const auto x = inputs_away_from_zero(n, 21);
  const auto R = random_vector<double>(n, 22);
  using Fwd = void (*)(double*, const double*, int64_t);
  using Bwd = void (*)(double*, const double*, const double*, int64_t);
  const std::vector<std::pair<Fwd, Bwd>> kernels = {
      {cpu::gelu_forward<double>, cpu::gelu_backward<double>},
      {ref::gelu_forward<double>, ref::gelu_backward<double>},
      {cpu::squared_relu_forward<double>, cpu::squared_relu_backward<double>},
      {ref::squared_relu_forward<double>, ref::squared_relu_backward<double>}};
  for (size_t k = 0; k < kernels.size(); ++k) {
    const auto g = numeric_grad(
        [&](const std::vector<double>& v) {
          std::vector<double> y(n);
          kernels[k].first(y.data(), v.data(), n);
          return weighted_sum(y, R);
        },
        x);
    std::vector<double> d(n);
    kernels[k].second(d.data(), R.data(), x.data(), n);
    EXPECT_LT(max_rel_error(d.data(), g.data(), d.size(), 1e-2), 1e-6) << "kernel " << k;
  }
}

}  // namespace
}  // namespace moecore::kernels
