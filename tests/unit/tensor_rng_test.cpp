// Counter-based RNG: Philox4x32-10 known answers (Random123 kat_vectors), determinism, independence of call
// order, stream separation, and the range and moments of uniform / normal draws.
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <vector>

#include "moecore/tensor/rng.h"

namespace moecore {
namespace {

// philox4x32(seed, key, counter) maps to Random123's philox4x32_10 with ctr = {counter lo, counter hi,
// key lo, key hi} and key = {seed lo, seed hi}.
TEST(PhiloxTest, MatchesRandom123KnownAnswers) {
  EXPECT_EQ(philox4x32(0, 0, 0), (std::array<uint32_t, 4>{0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}));
  EXPECT_EQ(philox4x32(~0ull, ~0ull, ~0ull), (std::array<uint32_t, 4>{0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}));
  EXPECT_EQ(philox4x32(0x299f31d0a4093822ull, 0x0370734413198a2eull, 0x85a308d3243f6a88ull),
            (std::array<uint32_t, 4>{0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}));
}

TEST(CounterRngTest, ValuesDependOnlyOnSeedKeyAndIndex) {
  const CounterRng rng(7, stream_key("layers.0.mlp.weight"));
  const int n = 1000;
  std::vector<float> forward(n), backward(n);
  for (int i = 0; i < n; ++i) forward[i] = rng.uniform(i);
  for (int i = n - 1; i >= 0; --i) backward[i] = rng.uniform(i);  // reverse call order
  EXPECT_EQ(forward, backward);
  // A fresh generator with the same (seed, key) reproduces any single element.
  const CounterRng again(7, stream_key("layers.0.mlp.weight"));
  EXPECT_EQ(again.uniform(537), forward[537]);
  EXPECT_EQ(again.normal(12), rng.normal(12));
  EXPECT_EQ(rng.normal(12), rng.normal(12));
}

TEST(CounterRngTest, DifferentSeedsAndKeysGiveDifferentStreams) {
  const CounterRng a(1, 100), b(1, 101), c(2, 100);
  int same_key = 0, same_seed = 0;
  for (int i = 0; i < 1000; ++i) {
    same_key += a.uniform(i) == c.uniform(i);
    same_seed += a.uniform(i) == b.uniform(i);
  }
  // Two independent 24-bit uniforms collide with probability 2^-24.
  EXPECT_LE(same_key, 1);
  EXPECT_LE(same_seed, 1);
  EXPECT_NE(stream_key("a.weight"), stream_key("a.bias"));
}

TEST(CounterRngTest, StreamKeyIsFnv1a64) {
  // FNV-1a 64: offset basis 0xcbf29ce484222325, prime 0x100000001b3; published test values.
  EXPECT_EQ(stream_key(""), 0xcbf29ce484222325ull);
  EXPECT_EQ(stream_key("a"), 0xaf63dc4c8601ec8cull);
  EXPECT_EQ(stream_key("foobar"), 0x85944171f73967e8ull);
}

TEST(CounterRngTest, UniformIsInUnitIntervalWithRightMoments) {
  const CounterRng rng(123, 456);
  const int n = 200000;
  double sum = 0.0, sum_sq = 0.0;
  float lo = 1.0f, hi = 0.0f;
  for (int i = 0; i < n; ++i) {
    const float u = rng.uniform(i);
    ASSERT_GE(u, 0.0f);
    ASSERT_LT(u, 1.0f);
    lo = std::min(lo, u);
    hi = std::max(hi, u);
    sum += u;
    sum_sq += static_cast<double>(u) * u;
  }
  const double mean = sum / n, var = sum_sq / n - mean * mean;
  // Standard error of the mean: sqrt(1/12 / n) = 6.5e-4; allow 5 sigma.
  EXPECT_NEAR(mean, 0.5, 5 * std::sqrt(1.0 / 12.0 / n));
  EXPECT_NEAR(var, 1.0 / 12.0, 2e-3);
  EXPECT_LT(lo, 1e-4f);
  EXPECT_GT(hi, 1.0f - 1e-4f);
  // Large counters (above 2^32) work and stay in range.
  const float far = rng.uniform(0x123456789abcdefull);
  EXPECT_GE(far, 0.0f);
  EXPECT_LT(far, 1.0f);
  EXPECT_NE(rng.uniform(1ull << 32), rng.uniform(0));  // the high counter word is used
}

TEST(CounterRngTest, NormalHasZeroMeanUnitVariance) {
  const CounterRng rng(9, 10);
  const int n = 200000;
  double sum = 0.0, sum_sq = 0.0, sum_4 = 0.0;
  int beyond_3_sigma = 0;
  for (int i = 0; i < n; ++i) {
    const double z = rng.normal(i);
    ASSERT_TRUE(std::isfinite(z));
    sum += z;
    sum_sq += z * z;
    sum_4 += z * z * z * z;
    beyond_3_sigma += std::abs(z) > 3.0;
  }
  const double mean = sum / n;
  EXPECT_NEAR(mean, 0.0, 5.0 / std::sqrt(n));
  EXPECT_NEAR(sum_sq / n, 1.0, 5.0 * std::sqrt(2.0 / n));
  EXPECT_NEAR(sum_4 / n, 3.0, 0.1);  // kurtosis of a normal
  // P(|z| > 3) = 0.0026998.
  EXPECT_NEAR(beyond_3_sigma, 0.0026998 * n, 5.0 * std::sqrt(0.0027 * n));
}

}  // namespace
}  // namespace moecore
