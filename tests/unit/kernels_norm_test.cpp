// RMSNorm and LayerNorm: fast vs reference (forward, saved statistics, backward), defining properties of the
// forward, and every backward gradient vs central finite differences in double.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "kernel_test_util.h"
#include "moecore/kernels/cpu/norm.h"

namespace moecore::kernels {
namespace {

using test::max_rel_error;
using test::numeric_grad;
using test::random_vector;
using test::weighted_sum;

// Sums of mixed-sign terms (row statistics, x - mean, weight/bias gradients over rows) can cancel towards zero,
// and then two correct summation orders differ by a few ulps of the terms, not of the result. Below the floor
// errors are judged in absolute terms: all values here are O(1), so float uses 1 (absolute error of a few ulps
// of O(1) terms) and double 1e-2.
constexpr double kFloor = 1e-2;
template <typename T>
constexpr double floor_for() {
  return sizeof(T) == 4 ? 1.0 : kFloor;
}

template <typename T>
void check_rmsnorm_vs_ref(int64_t R, int64_t D, double tol) {
  const auto x = random_vector<T>(R * D, 1, T(-2), T(2));
  const auto w = random_vector<T>(D, 2, T(0.5), T(1.5));
  const auto dy = random_vector<T>(R * D, 3);
  std::vector<T> y_fast(R * D), y_ref(R * D), rstd_fast(R), rstd_ref(R);
  cpu::rmsnorm_forward<T>(y_fast.data(), rstd_fast.data(), x.data(), w.data(), R, D, 1e-5);
  ref::rmsnorm_forward<T>(y_ref.data(), rstd_ref.data(), x.data(), w.data(), R, D, 1e-5);
  EXPECT_LT(max_rel_error(y_fast.data(), y_ref.data(), y_fast.size(), floor_for<T>()), tol);
  EXPECT_LT(max_rel_error(rstd_fast, rstd_ref), tol);

  auto dx_fast = random_vector<T>(R * D, 4), dx_ref = dx_fast;  // non-zero start: must accumulate
  auto dw_fast = random_vector<T>(D, 5), dw_ref = dw_fast;
  cpu::rmsnorm_backward<T>(dx_fast.data(), dw_fast.data(), dy.data(), x.data(), w.data(), rstd_ref.data(), R, D);
  ref::rmsnorm_backward<T>(dx_ref.data(), dw_ref.data(), dy.data(), x.data(), w.data(), rstd_ref.data(), R, D);
  EXPECT_LT(max_rel_error(dx_fast.data(), dx_ref.data(), dx_fast.size(), floor_for<T>()), tol);
  EXPECT_LT(max_rel_error(dw_fast.data(), dw_ref.data(), dw_fast.size(), floor_for<T>()), tol);
}

template <typename T>
void check_layernorm_vs_ref(int64_t R, int64_t D, bool with_bias, double tol) {
  const auto x = random_vector<T>(R * D, 11, T(-1), T(3));  // non-zero mean
  const auto w = random_vector<T>(D, 12, T(0.5), T(1.5));
  const auto b = random_vector<T>(D, 13);
  const T* bias = with_bias ? b.data() : nullptr;
  const auto dy = random_vector<T>(R * D, 14);
  std::vector<T> y_fast(R * D), y_ref(R * D), mean_fast(R), mean_ref(R), rstd_fast(R), rstd_ref(R);
  cpu::layernorm_forward<T>(y_fast.data(), mean_fast.data(), rstd_fast.data(), x.data(), w.data(), bias, R, D, 1e-5);
  ref::layernorm_forward<T>(y_ref.data(), mean_ref.data(), rstd_ref.data(), x.data(), w.data(), bias, R, D, 1e-5);
  EXPECT_LT(max_rel_error(y_fast.data(), y_ref.data(), y_fast.size(), floor_for<T>()), tol);
  EXPECT_LT(max_rel_error(mean_fast, mean_ref), tol);
  EXPECT_LT(max_rel_error(rstd_fast, rstd_ref), tol);

  auto dx_fast = random_vector<T>(R * D, 15), dx_ref = dx_fast;
  auto dw_fast = random_vector<T>(D, 16), dw_ref = dw_fast;
  auto db_fast = random_vector<T>(D, 17), db_ref = db_fast;
  cpu::layernorm_backward<T>(dx_fast.data(), dw_fast.data(), db_fast.data(), dy.data(), x.data(), w.data(),
                             mean_ref.data(), rstd_ref.data(), R, D);
  ref::layernorm_backward<T>(dx_ref.data(), dw_ref.data(), db_ref.data(), dy.data(), x.data(), w.data(),
                             mean_ref.data(), rstd_ref.data(), R, D);
  EXPECT_LT(max_rel_error(dx_fast.data(), dx_ref.data(), dx_fast.size(), floor_for<T>()), tol);
  EXPECT_LT(max_rel_error(dw_fast.data(), dw_ref.data(), dw_fast.size(), floor_for<T>()), tol);
  EXPECT_LT(max_rel_error(db_fast.data(), db_ref.data(), db_fast.size(), floor_for<T>()), tol);
}

TEST(RmsNormTest, MatchesReferenceFloat) { check_rmsnorm_vs_ref<float>(37, 53, 1e-5); }
TEST(RmsNormTest, MatchesReferenceDouble) { check_rmsnorm_vs_ref<double>(37, 53, 1e-12); }
// R * D above the OpenMP threshold: per-thread weight-gradient partials are exercised.
TEST(RmsNormTest, MatchesReferenceParallelFloat) { check_rmsnorm_vs_ref<float>(301, 67, 1e-5); }
TEST(RmsNormTest, MatchesReferenceParallelDouble) { check_rmsnorm_vs_ref<double>(301, 67, 1e-12); }

TEST(LayerNormTest, MatchesReferenceFloat) {
  check_layernorm_vs_ref<float>(37, 53, true, 1e-5);
  check_layernorm_vs_ref<float>(37, 53, false, 1e-5);
}
TEST(LayerNormTest, MatchesReferenceDouble) {
  check_layernorm_vs_ref<double>(37, 53, true, 1e-12);
  check_layernorm_vs_ref<double>(37, 53, false, 1e-12);
}
TEST(LayerNormTest, MatchesReferenceParallel) {
  check_layernorm_vs_ref<float>(301, 67, true, 1e-5);
  check_layernorm_vs_ref<double>(301, 67, true, 1e-12);
}

// Defining properties, independent of either implementation: with w = 1 and eps = 0, every RMSNorm output
// row has mean square 1, and every LayerNorm row has mean 0 and (biased) variance 1.
TEST(NormTest, NormalizedRowsHaveUnitStatistics) {
  const int64_t R = 9, D = 53;
  const auto x = random_vector<double>(R * D, 21, -3.0, 5.0);
  const std::vector<double> ones(D, 1.0);
  for (const bool fast : {true, false}) {
    std::vector<double> y(R * D), mean(R), rstd(R);
    (fast ? cpu::rmsnorm_forward<double> : ref::rmsnorm_forward<double>)(y.data(), rstd.data(), x.data(), ones.data(),
                                                                         R, D, 0.0);
    for (int64_t r = 0; r < R; ++r) {
      double sum_sq = 0.0, x_sq = 0.0;
      for (int64_t d = 0; d < D; ++d) sum_sq += y[r * D + d] * y[r * D + d], x_sq += x[r * D + d] * x[r * D + d];
      EXPECT_NEAR(sum_sq / D, 1.0, 1e-12);
      EXPECT_NEAR(rstd[r], 1.0 / std::sqrt(x_sq / D), 1e-12);
    }
    (fast ? cpu::layernorm_forward<double> : ref::layernorm_forward<double>)(y.data(), mean.data(), rstd.data(),
                                                                             x.data(), ones.data(), nullptr, R, D, 0.0);
    for (int64_t r = 0; r < R; ++r) {
      double sum = 0.0, sum_sq = 0.0, x_sum = 0.0;
      for (int64_t d = 0; d < D; ++d) sum += y[r * D + d], sum_sq += y[r * D + d] * y[r * D + d], x_sum += x[r * D + d];
      EXPECT_NEAR(sum / D, 0.0, 1e-12);
      EXPECT_NEAR(sum_sq / D, 1.0, 1e-12);
      EXPECT_NEAR(mean[r], x_sum / D, 1e-12);
    }
  }
}

TEST(NormTest, EpsilonEntersUnderTheSquareRoot) {
  const std::vector<double> x = {3.0, -4.0}, w = {1.0, 2.0};
  std::vector<double> y(2), rstd(1);
  cpu::rmsnorm_forward<double>(y.data(), rstd.data(), x.data(), w.data(), 1, 2, 0.5);
  // mean(x^2) = 12.5; rstd = 1 / sqrt(13).
  EXPECT_NEAR(rstd[0], 1.0 / std::sqrt(13.0), 1e-15);
  EXPECT_NEAR(y[1], -8.0 / std::sqrt(13.0), 1e-15);
}

// loss = sum(norm(x, w, b) * dy); the analytic gradients must match central differences. eps = 1e-6 gives
// truncation error ~1e-12 and rounding ~1e-10 absolute, far below the 1e-6 relative / 1e-8 absolute bound.
template <typename Fwd, typename Bwd>
void check_rmsnorm_fd(Fwd forward, Bwd backward) {
  const int64_t R = 5, D = 11;
  const auto x = random_vector<double>(R * D, 31, -2.0, 2.0);
  const auto w = random_vector<double>(D, 32, 0.5, 1.5);
  const auto dy = random_vector<double>(R * D, 33);
  const double eps = 1e-3;  // large enough that the eps term's contribution to the gradient is tested too
  auto loss = [&](const std::vector<double>& xv, const std::vector<double>& wv) {
    std::vector<double> y(R * D), rstd(R);
    forward(y.data(), rstd.data(), xv.data(), wv.data(), R, D, eps);
    return weighted_sum(y, dy);
  };
  const auto gx = numeric_grad([&](const std::vector<double>& v) { return loss(v, w); }, x);
  const auto gw = numeric_grad([&](const std::vector<double>& v) { return loss(x, v); }, w);
  std::vector<double> y(R * D), rstd(R), dx(R * D), dw(D);
  forward(y.data(), rstd.data(), x.data(), w.data(), R, D, eps);
  backward(dx.data(), dw.data(), dy.data(), x.data(), w.data(), rstd.data(), R, D);
  EXPECT_LT(max_rel_error(dx.data(), gx.data(), dx.size(), kFloor), 1e-6);
  EXPECT_LT(max_rel_error(dw.data(), gw.data(), dw.size(), kFloor), 1e-6);
}

template <typename Fwd, typename Bwd>
void check_layernorm_fd(Fwd forward, Bwd backward) {
  const int64_t R = 5, D = 11;
  const auto x = random_vector<double>(R * D, 41, -1.0, 3.0);
  const auto w = random_vector<double>(D, 42, 0.5, 1.5);
  const auto b = random_vector<double>(D, 43);
  const auto dy = random_vector<double>(R * D, 44);
  const double eps = 1e-3;
  auto loss = [&](const std::vector<double>& xv, const std::vector<double>& wv, const std::vector<double>& bv) {
    std::vector<double> y(R * D), mean(R), rstd(R);
    forward(y.data(), mean.data(), rstd.data(), xv.data(), wv.data(), bv.data(), R, D, eps);
    return weighted_sum(y, dy);
  };
  const auto gx = numeric_grad([&](const std::vector<double>& v) { return loss(v, w, b); }, x);
  const auto gw = numeric_grad([&](const std::vector<double>& v) { return loss(x, v, b); }, w);
  const auto gb = numeric_grad([&](const std::vector<double>& v) { return loss(x, w, v); }, b);
  std::vector<double> y(R * D), mean(R), rstd(R), dx(R * D), dw(D), db(D);
  forward(y.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), R, D, eps);
  backward(dx.data(), dw.data(), db.data(), dy.data(), x.data(), w.data(), mean.data(), rstd.data(), R, D);
  EXPECT_LT(max_rel_error(dx.data(), gx.data(), dx.size(), kFloor), 1e-6);
  EXPECT_LT(max_rel_error(dw.data(), gw.data(), dw.size(), kFloor), 1e-6);
  EXPECT_LT(max_rel_error(db.data(), gb.data(), db.size(), kFloor), 1e-6);
}

TEST(RmsNormTest, BackwardMatchesFiniteDifferences) {
  check_rmsnorm_fd(cpu::rmsnorm_forward<double>, cpu::rmsnorm_backward<double>);
  check_rmsnorm_fd(ref::rmsnorm_forward<double>, ref::rmsnorm_backward<double>);
}

TEST(LayerNormTest, BackwardMatchesFiniteDifferences) {
  check_layernorm_fd(cpu::layernorm_forward<double>, cpu::layernorm_backward<double>);
  check_layernorm_fd(ref::layernorm_forward<double>, ref::layernorm_backward<double>);
}

TEST(LayerNormTest, NullBiasGradientIsSkipped) {
  const int64_t R = 3, D = 7;
  const auto x = random_vector<double>(R * D, 51), w = random_vector<double>(D, 52),
             dy = random_vector<double>(R * D, 53);
  std::vector<double> y(R * D), mean(R), rstd(R);
  cpu::layernorm_forward<double>(y.data(), mean.data(), rstd.data(), x.data(), w.data(), nullptr, R, D, 1e-5);
  std::vector<double> dx_fast(R * D), dw_fast(D), dx_ref(R * D), dw_ref(D);
  cpu::layernorm_backward<double>(dx_fast.data(), dw_fast.data(), nullptr, dy.data(), x.data(), w.data(), mean.data(),
                                  rstd.data(), R, D);
  ref::layernorm_backward<double>(dx_ref.data(), dw_ref.data(), nullptr, dy.data(), x.data(), w.data(), mean.data(),
                                  rstd.data(), R, D);
  EXPECT_LT(max_rel_error(dx_fast.data(), dx_ref.data(), dx_fast.size(), kFloor), 1e-12);
  EXPECT_LT(max_rel_error(dw_fast.data(), dw_ref.data(), dw_fast.size(), kFloor), 1e-12);
}

}  // namespace
}  // namespace moecore::kernels
