// Vector helpers: add, scale, sum of squares (double accumulation), finiteness check.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "kernel_test_util.h"
#include "moecore/kernels/cpu/elementwise.h"

namespace moecore::kernels {
namespace {

using test::random_vector;

TEST(ElementwiseTest, AddAndScaleMatchLoops) {
  for (const int64_t n : {int64_t{37}, int64_t{100003}}) {  // small, and above the OpenMP threshold
    const auto x = random_vector<float>(n, 1);
    auto y = random_vector<float>(n, 2);
    const auto y0 = y;
    cpu::add_inplace<float>(y.data(), x.data(), n);
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(y[i], y0[i] + x[i]);
    cpu::scale_inplace<float>(y.data(), -0.375f, n);
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(y[i], (y0[i] + x[i]) * -0.375f);
  }
}

TEST(ElementwiseTest, SumSquaresAccumulatesInDouble) {
  // 1 + n * (2^-12)^2: each small term is below half an ulp of 1.0f, so a float accumulator would stay at 1.
  const int64_t n = 200001;
  std::vector<float> x(n, 1.0f / 4096.0f);
  x[0] = 1.0f;
  const double expected = 1.0 + static_cast<double>(n - 1) / (4096.0 * 4096.0);
  EXPECT_NEAR(cpu::sum_squares<float>(x.data(), n), expected, 1e-12);

  const auto r = random_vector<double>(1001, 3);
  double naive = 0.0;
  for (const double v : r) naive += v * v;
  EXPECT_NEAR(cpu::sum_squares<double>(r.data(), 1001), naive, 1e-12 * naive);
}

// Every element counted once, whatever the chunking: sizes that leave ragged quarter streams and tails, one chunk,
// several, and more than one thread's share.
TEST(ElementwiseTest, SumSquaresCountsEveryElementOnce) {
  for (const int64_t n : {int64_t{1}, int64_t{3}, int64_t{4097}, int64_t{65537}, int64_t{(1 << 18) + 5},
                          int64_t{3 * (1 << 18) + 7}, int64_t{(1 << 21) + 3}}) {
    const auto x = random_vector<float>(n, 11);
    double naive = 0.0;
    for (const float v : x) naive += static_cast<double>(v) * static_cast<double>(v);
    EXPECT_NEAR(cpu::sum_squares<float>(x.data(), n), naive, 1e-12 * naive) << "n " << n;
  }
}

// The vector kernel against the naive loop, across chunk boundaries and with zeros of both signs.
TEST(ElementwiseTest, CountZerosMatchesReference) {
  for (const int64_t n : {int64_t{1}, int64_t{37}, int64_t{100003}, int64_t{(1 << 21) + 3}}) {
    auto x = random_vector<float>(n, 12);
    for (int64_t i = 0; i < n; i += 5) x[static_cast<size_t>(i)] = i % 2 == 0 ? 0.0f : -0.0f;
    int64_t naive = 0;
    for (const float v : x) naive += v == 0.0f ? 1 : 0;
    EXPECT_EQ(cpu::count_zeros<float>(x.data(), n), naive) << "n " << n;
    EXPECT_EQ(ref::count_zeros<float>(x.data(), n), naive) << "n " << n;
  }
}

TEST(ElementwiseTest, AllFiniteDetectsNanAndInf) {
  for (const int64_t n : {int64_t{37}, int64_t{100003}}) {
    auto x = random_vector<double>(n, 4);
    EXPECT_TRUE(cpu::all_finite<double>(x.data(), n));
    x[n - 1] = std::numeric_limits<double>::quiet_NaN();
    EXPECT_FALSE(cpu::all_finite<double>(x.data(), n));
    x[n - 1] = 0.0;
    x[n / 2] = -std::numeric_limits<double>::infinity();
    EXPECT_FALSE(cpu::all_finite<double>(x.data(), n));
  }
  std::vector<float> f = {1.0f, std::numeric_limits<float>::infinity()};
  EXPECT_FALSE(cpu::all_finite<float>(f.data(), 2));
  EXPECT_TRUE(cpu::all_finite<float>(f.data(), 1));
}

}  // namespace
}  // namespace moecore::kernels
