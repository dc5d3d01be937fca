// Dropout from the counter RNG: mask defined by CounterRng, drop rate, scaling, determinism per (seed, key),
// backward consistent with forward, fast vs reference.
#include <gtest/gtest.h>

#include <cmath>
#include <stdexcept>
#include <vector>

#include "kernel_test_util.h"
#include "moecore/kernels/cpu/dropout.h"
#include "moecore/tensor/rng.h"

namespace moecore::kernels {
namespace {

using test::random_vector;

// Inputs bounded away from zero, so "output == 0" identifies exactly the dropped elements.
std::vector<float> nonzero_inputs(size_t n, uint64_t seed) {
  auto x = random_vector<float>(n, seed, 0.5f, 2.0f);
  for (size_t i = 0; i < n; i += 2) x[i] = -x[i];
  return x;
}

std::vector<bool> dropped_mask(const std::vector<float>& out) {
  std::vector<bool> mask(out.size());
  for (size_t i = 0; i < out.size(); ++i) mask[i] = out[i] == 0.0f;
  return mask;
}

TEST(DropoutTest, DropRateAndScalingMatchP) {
  const int64_t n = 100000;
  const auto x = nonzero_inputs(n, 1);
  for (const float p : {0.1f, 0.5f, 0.9f}) {
    std::vector<float> y(n);
    cpu::dropout_forward<float>(y.data(), x.data(), n, DropoutSpec{p, 1234, 7});
    int64_t n_dropped = 0;
    for (int64_t i = 0; i < n; ++i) {
      if (y[i] == 0.0f) {
        ++n_dropped;
      } else {
        ASSERT_NEAR(y[i], x[i] / (1.0 - p), 1e-6 * std::abs(x[i] / (1.0 - p))) << "i=" << i << " p=" << p;
      }
    }
    // Binomial(n, p): within 4 standard deviations.
    const double sigma = std::sqrt(n * p * (1.0 - p));
    EXPECT_NEAR(static_cast<double>(n_dropped), n * static_cast<double>(p), 4.0 * sigma) << "p=" << p;
  }
}

TEST(DropoutTest, MaskIsDefinedByCounterRng) {
  const int64_t n = 4097;
  const auto x = nonzero_inputs(n, 2);
  const DropoutSpec spec{0.3f, 99, 5};
  std::vector<float> y(n);
  cpu::dropout_forward<float>(y.data(), x.data(), n, spec);
  const CounterRng rng(spec.seed, spec.key);
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(y[i] == 0.0f, rng.uniform(static_cast<uint64_t>(i)) < spec.p) << i;
}

TEST(DropoutTest, SameSeedAndKeyGiveSameMaskOtherwiseDifferent) {
  const int64_t n = 20000;
  const auto x = nonzero_inputs(n, 3);
  const float p = 0.5f;
  auto mask_for = [&](uint64_t seed, uint64_t key) {
    std::vector<float> y(n);
    cpu::dropout_forward<float>(y.data(), x.data(), n, DropoutSpec{p, seed, key});
    return dropped_mask(y);
  };
  const auto base = mask_for(10, 20);
  EXPECT_EQ(base, mask_for(10, 20));
  for (const auto& other : {mask_for(10, 21), mask_for(11, 20)}) {
    int64_t n_differ = 0;
    for (int64_t i = 0; i < n; ++i) n_differ += base[i] != other[i];
    // Independent masks differ with probability 2 p (1 - p) = 0.5 per element.
    EXPECT_NEAR(static_cast<double>(n_differ), 0.5 * n, 4.0 * std::sqrt(n * 0.25));
  }
}

TEST(DropoutTest, BackwardUsesTheForwardMask) {
  const int64_t n = 30011;  // above the OpenMP threshold
  const auto x = nonzero_inputs(n, 4);
  const auto dy = nonzero_inputs(n, 5);
  const DropoutSpec spec{0.25f, 42, 3};
  std::vector<float> y(n);
  cpu::dropout_forward<float>(y.data(), x.data(), n, spec);
  const auto initial = random_vector<float>(n, 6);
  auto dx = initial;
  cpu::dropout_backward<float>(dx.data(), dy.data(), n, spec);
  for (int64_t i = 0; i < n; ++i) {
    // dropout is linear: y = m x / (1 - p), so dx = m dy / (1 - p) = dy * (y / x), accumulated.
    const double expected = initial[i] + static_cast<double>(dy[i]) * (static_cast<double>(y[i]) / x[i]);
    ASSERT_NEAR(dx[i], expected, 1e-6 * (1.0 + std::abs(expected))) << "i=" << i;
  }
}

template <typename T>
void check_vs_ref(int64_t n, float p) {
  const auto x = random_vector<T>(n, 7);
  const auto dy = random_vector<T>(n, 8);
  const DropoutSpec spec{p, 777, 888};
  std::vector<T> y_fast(n), y_ref(n);
  cpu::dropout_forward<T>(y_fast.data(), x.data(), n, spec);
  ref::dropout_forward<T>(y_ref.data(), x.data(), n, spec);
  // x * (1 / (1 - p)) vs x / (1 - p): at most one rounding apart.
  EXPECT_LT(test::max_rel_error(y_fast, y_ref), sizeof(T) == 4 ? 1e-6 : 1e-15);
  auto dx_fast = random_vector<T>(n, 9), dx_ref = dx_fast;
  cpu::dropout_backward<T>(dx_fast.data(), dy.data(), n, spec);
  ref::dropout_backward<T>(dx_ref.data(), dy.data(), n, spec);
  // initial + dy * scale can cancel; values are O(1), so below 1 the error is judged in absolute terms.
  EXPECT_LT(test::max_rel_error(dx_fast.data(), dx_ref.data(), dx_fast.size(), 1.0), sizeof(T) == 4 ? 1e-6 : 1e-15);
}

TEST(DropoutTest, MatchesReferenceFloat) {
  check_vs_ref<float>(37 * 53, 0.2f);
  check_vs_ref<float>(30011, 0.7f);
}

TEST(DropoutTest, MatchesReferenceDouble) {
  check_vs_ref<double>(37 * 53, 0.2f);
  check_vs_ref<double>(30011, 0.7f);
}

TEST(DropoutTest, ZeroProbabilityIsIdentity) {
  const int64_t n = 1001;
  const auto x = random_vector<double>(n, 10);
  std::vector<double> y(n);
  cpu::dropout_forward<double>(y.data(), x.data(), n, DropoutSpec{0.0f, 1, 2});
  EXPECT_EQ(y, x);
  auto dx = random_vector<double>(n, 11);
  const auto initial = dx;
  cpu::dropout_backward<double>(dx.data(), x.data(), n, DropoutSpec{0.0f, 1, 2});
  for (int64_t i = 0; i < n; ++i) EXPECT_EQ(dx[i], initial[i] + x[i]);
}

TEST(DropoutTest, ProbabilityOneDropsEverything) {
  const auto x = random_vector<float>(100, 12);
  std::vector<float> y(100, 5.0f);
  cpu::dropout_forward<float>(y.data(), x.data(), 100, DropoutSpec{1.0f, 1, 2});
  for (const float v : y) EXPECT_EQ(v, 0.0f);
}

TEST(DropoutTest, RejectsInvalidProbability) {
  std::vector<float> buf(4);
  for (const float p : {-0.1f, 1.5f, std::nanf("")}) {
    EXPECT_THROW(cpu::dropout_forward<float>(buf.data(), buf.data(), 4, DropoutSpec{p, 0, 0}), std::invalid_argument);
    EXPECT_THROW(cpu::dropout_backward<float>(buf.data(), buf.data(), 4, DropoutSpec{p, 0, 0}), std::invalid_argument);
  }
}

}  // namespace
}  // namespace moecore::kernels
