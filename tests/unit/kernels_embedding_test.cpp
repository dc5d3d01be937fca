// Embedding lookup and gradient: fast vs reference, hand-checked rows, repeated ids, out-of-range ids.
#include <gtest/gtest.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "kernel_test_util.h"
#include "moecore/kernels/cpu/embedding.h"

namespace moecore::kernels {
namespace {

using test::random_vector;

std::vector<int32_t> random_ids(size_t n, int32_t V, uint64_t seed) {
  const auto u = random_vector<double>(n, seed, 0.0, 1.0);
  std::vector<int32_t> ids(n);
  for (size_t i = 0; i < n; ++i) ids[i] = static_cast<int32_t>(u[i] * V);
  return ids;
}

template <typename T>
void check_embedding(int64_t n_tokens, int64_t V, int64_t D) {
  // V < n_tokens forces repeated ids, the case where a token-parallel backward would race.
  const auto ids = random_ids(n_tokens, static_cast<int32_t>(V), 5);
  const auto weight_VD = random_vector<T>(V * D, 6);
  std::vector<T> out_fast(n_tokens * D), out_ref(n_tokens * D);
  cpu::embedding_forward<T>(out_fast.data(), ids.data(), weight_VD.data(), n_tokens, V, D);
  ref::embedding_forward<T>(out_ref.data(), ids.data(), weight_VD.data(), n_tokens, V, D);
  EXPECT_EQ(out_fast, out_ref);
  for (int64_t t = 0; t < n_tokens; t += 7) {
    for (int64_t d = 0; d < D; ++d) ASSERT_EQ(out_fast[t * D + d], weight_VD[ids[t] * D + d]);
  }

  const auto dout_TD = random_vector<T>(n_tokens * D, 7);
  auto dweight_fast = random_vector<T>(V * D, 8);
  const auto dweight_initial = dweight_fast;
  auto dweight_ref = dweight_fast;
  cpu::embedding_backward<T>(dweight_fast.data(), dout_TD.data(), ids.data(), n_tokens, V, D);
  ref::embedding_backward<T>(dweight_ref.data(), dout_TD.data(), ids.data(), n_tokens, V, D);
  // Both sum a row's contributions in token order, so the results are bitwise equal.
  EXPECT_EQ(dweight_fast, dweight_ref);
  // Independent check in double: dweight[v] = initial[v] + sum over tokens with id v of dout[t].
  for (int64_t v = 0; v < V; ++v) {
    for (int64_t d = 0; d < D; d += 5) {
      double expected = dweight_initial[v * D + d];
      for (int64_t t = 0; t < n_tokens; ++t) {
        if (ids[t] == v) expected += dout_TD[t * D + d];
      }
      ASSERT_NEAR(dweight_fast[v * D + d], expected, 1e-5) << "v=" << v << " d=" << d;
    }
  }
}

TEST(EmbeddingTest, MatchesReferenceFloat) { check_embedding<float>(37, 11, 53); }
TEST(EmbeddingTest, MatchesReferenceDouble) { check_embedding<double>(37, 11, 53); }
// Large enough to take the OpenMP path (n_tokens * D > 32768) with many repeated ids.
TEST(EmbeddingTest, MatchesReferenceParallelFloat) { check_embedding<float>(301, 13, 389); }

TEST(EmbeddingTest, OutOfRangeIdThrowsNamingIdAndVocab) {
  const int64_t V = 10, D = 3;
  const std::vector<float> weight(V * D, 1.0f);
  std::vector<float> out(2 * D);
  for (const int32_t bad : {10, -1, 12345}) {
    const std::vector<int32_t> ids = {3, bad};
    try {
      cpu::embedding_forward<float>(out.data(), ids.data(), weight.data(), 2, V, D);
      FAIL() << "no throw for id " << bad;
    } catch (const std::out_of_range& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find(std::to_string(bad)), std::string::npos) << msg;
      EXPECT_NE(msg.find("V=10"), std::string::npos) << msg;
    }
    std::vector<float> dweight(V * D);
    EXPECT_THROW(cpu::embedding_backward<float>(dweight.data(), out.data(), ids.data(), 2, V, D), std::out_of_range);
    EXPECT_THROW(ref::embedding_forward<float>(out.data(), ids.data(), weight.data(), 2, V, D), std::out_of_range);
    EXPECT_THROW(ref::embedding_backward<float>(dweight.data(), out.data(), ids.data(), 2, V, D), std::out_of_range);
  }
}

}  // namespace
}  // namespace moecore::kernels
