// fast_exp against std::exp (evaluated in double): relative error over the normal range, swept by bit pattern so
// that tiny |x| are covered as densely as large ones, both as a scalar call and inside a loop compiled per vector
// ISA (the way the kernels use it), and the edges: 0, underflow to 0, overflow to inf, NaN.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <vector>

#include "moecore/kernels/cpu/fast_exp.h"
#include "moecore/kernels/cpu/vector_isa.h"

namespace moecore::kernels::cpu {
namespace {

constexpr float kFlushBelow = -86.9f;           // documented: exp(x) is 0 below this
constexpr float kOverflowAbove = 88.72283935f;  // ln(FLT_MAX)
// Relative error bound: 3 ulp of float (the polynomial and range reduction are about 2 ulp, and FMA contraction,
// where the compiler chooses it, changes the last bit).
constexpr double kMaxRelError = 3.0 * 0x1p-24;

MOECORE_VECTOR_CLONES void exp_loop(float* out, const float* x, const int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = fast_exp(x[i]);
}

double rel_error(const float got, const float x) {
  const double want = std::exp(static_cast<double>(x));
  return std::abs(static_cast<double>(got) - want) / want;
}

// Every 127th float in [lo, hi], both signs, walked by bit pattern.
std::vector<float> sweep(const float lo, const float hi) {
  std::vector<float> xs;
  for (uint32_t bits = 0; bits < 0x7f800000u; bits += 127) {
    const float positive = std::bit_cast<float>(bits);
    if (positive <= hi) xs.push_back(positive);
    if (-positive >= lo) xs.push_back(-positive);
  }
  return xs;
}

TEST(FastExpTest, MatchesStdExpOverTheNormalRange) {
  const std::vector<float> xs = sweep(kFlushBelow, 88.7f);
  ASSERT_GT(xs.size(), size_t{15'000'000});
  std::vector<float> vectorised(xs.size());
  exp_loop(vectorised.data(), xs.data(), static_cast<int64_t>(xs.size()));
  double worst_scalar = 0.0, worst_vector = 0.0;
  float worst_x = 0.0f;
  for (size_t i = 0; i < xs.size(); ++i) {
    const double e = rel_error(fast_exp(xs[i]), xs[i]);
    if (e > worst_scalar) {
      worst_scalar = e;
      worst_x = xs[i];
    }
    worst_vector = std::max(worst_vector, rel_error(vectorised[i], xs[i]));
  }
  EXPECT_LT(worst_scalar, kMaxRelError) << "at x = " << worst_x;
  EXPECT_LT(worst_vector, kMaxRelError);
  std::printf("worst relative error: scalar %.3g (x = %g), vectorised %.3g; ulp = %.3g\n", worst_scalar, worst_x,
              worst_vector, 0x1p-24);
}

TEST(FastExpTest, Edges) {
  EXPECT_EQ(fast_exp(0.0f), 1.0f);
  EXPECT_EQ(fast_exp(-0.0f), 1.0f);
  EXPECT_LT(rel_error(fast_exp(1.0f), 1.0f), kMaxRelError);
  EXPECT_LT(rel_error(fast_exp(-1.0f), -1.0f), kMaxRelError);
  EXPECT_LT(rel_error(fast_exp(kFlushBelow), kFlushBelow), kMaxRelError);
  // Underflow: exactly 0 below the flush point, never negative or subnormal.
  for (const float x : {std::nextafter(kFlushBelow, -1000.0f), -87.0f, -87.4f, -100.0f, -104.0f, -1e4f, -1e30f,
                        -std::numeric_limits<float>::max(), -std::numeric_limits<float>::infinity()}) {
    EXPECT_EQ(fast_exp(x), 0.0f) << "x = " << x;
    EXPECT_LT(std::exp(static_cast<double>(x)), 2.0 * std::numeric_limits<float>::min());
  }
  // Overflow: +inf above ln(FLT_MAX).
  for (const float x : {89.0f, 100.0f, 1e30f, std::numeric_limits<float>::infinity()}) {
    EXPECT_EQ(fast_exp(x), std::numeric_limits<float>::infinity()) << "x = " << x;
  }
  EXPECT_GT(fast_exp(std::nextafter(kOverflowAbove, 0.0f)), 3.0e38f);
  EXPECT_TRUE(std::isnan(fast_exp(std::numeric_limits<float>::quiet_NaN())));
  // The same edges through the vectorised loop (lanes of one vector mixing the cases).
  const std::vector<float> xs = {0.0f,  -1e30f, 1e30f, -std::numeric_limits<float>::infinity(), -87.4f, 1.0f,
                                 -1.0f, -20.0f, 20.0f, std::numeric_limits<float>::infinity(),  -86.0f, 88.0f,
                                 -0.5f, 0.5f,   -3.0f, std::numeric_limits<float>::quiet_NaN(), 2.0f};
  std::vector<float> out(xs.size());
  exp_loop(out.data(), xs.data(), static_cast<int64_t>(xs.size()));
  for (size_t i = 0; i < xs.size(); ++i) {
    const float want = fast_exp(xs[i]);
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(out[i]));
    } else if (want == 0.0f || std::isinf(want)) {
      EXPECT_EQ(out[i], want) << "x = " << xs[i];
    } else {
      EXPECT_LT(rel_error(out[i], xs[i]), kMaxRelError) << "x = " << xs[i];
    }
  }
}

MOECORE_VECTOR_CLONES void exp_loop_double(double* out, const double* x, const int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = fast_exp_nonpositive(x[i]);
}

// fast_exp_nonpositive against expl over [-708, 0]: evenly spaced points, every power of two's neighbourhood
// (tiny |x|), scalar and in a vectorised loop. The routing kernels' bound (routing.cpp) assumes at most 8 ulp.
TEST(FastExpTest, DoubleMatchesExplOverItsRange) {
  std::vector<double> xs;
  for (int64_t i = 0; i <= 4'000'000; ++i) xs.push_back(-708.0 * static_cast<double>(i) / 4'000'000.0);
  for (int p = -60; p < 10; ++p) {
    for (int j = -64; j <= 64; ++j) xs.push_back(-std::ldexp(1.0 + j * 0x1p-20, p));
  }
  std::vector<double> vectorised(xs.size());
  exp_loop_double(vectorised.data(), xs.data(), static_cast<int64_t>(xs.size()));
  double worst = 0.0, worst_x = 0.0;
  for (size_t i = 0; i < xs.size(); ++i) {
    if (xs[i] < -708.0) continue;
    const long double want = std::exp(static_cast<long double>(xs[i]));
    for (const double got : {fast_exp_nonpositive(xs[i]), vectorised[i]}) {
      const double e = static_cast<double>(std::fabs((static_cast<long double>(got) - want) / want));
      if (e > worst) {
        worst = e;
        worst_x = xs[i];
      }
    }
  }
  EXPECT_LT(worst, 4.0 * 0x1p-52) << "at x = " << worst_x;
  std::printf("double: worst relative error %.3g (x = %.17g); ulp = %.3g\n", worst, worst_x, 0x1p-52);
}

TEST(FastExpTest, DoubleEdges) {
  EXPECT_EQ(fast_exp_nonpositive(0.0), 1.0);
  EXPECT_EQ(fast_exp_nonpositive(-0.0), 1.0);
  for (const double x : {-708.5, -745.0, -1e300, -std::numeric_limits<double>::infinity()}) {
    EXPECT_EQ(fast_exp_nonpositive(x), 0.0) << "x = " << x;
  }
  EXPECT_GT(fast_exp_nonpositive(-708.0), 0.0);
  EXPECT_TRUE(std::isnan(fast_exp_nonpositive(std::numeric_limits<double>::quiet_NaN())));
}

}  // namespace
}  // namespace moecore::kernels::cpu
