// The cross-entropy's row pieces (kernels/cpu/softmax_rows.h): the AVX-512 loops give the bits of the AVX2 loops
// (sum_exp's sixteen-wide steps add their halves to the eight-lane sums in the AVX2 order; every exponential the same
// polynomial), and both stay within the exponential's error of std::exp. Rows of every tail length (0-47 elements
// past the vector steps) and the vocabulary's 32128, with values that underflow (below -87 after the shift), zeros
// and ties at the maximum.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "moecore/kernels/cpu/softmax_rows.h"

namespace moecore::kernels::cpu::softmax_rows {
namespace {

#if defined(MOECORE_HAVE_AVX2_PATH)
// A row of V logits: normal draws of spread `scale`, with a zero, a tie at the maximum and, for wide rows, values far
// enough below it to underflow.
std::vector<float> logits_row(const int64_t V, const float scale, std::mt19937& gen) {
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> row(static_cast<size_t>(V));
  for (float& x : row) x = normal(gen);
  if (V > 2) {
    row[static_cast<size_t>(V / 2)] = 0.0f;
    row[static_cast<size_t>(V - 1)] = row_max(row.data(), V);
  }
  if (V > 8) row[3] = row_max(row.data(), V) - 100.0f;
  return row;
}

bool same_bits(const float* a, const float* b, const int64_t n) {
  return std::memcmp(a, b, static_cast<size_t>(n) * sizeof(float)) == 0;
}

TEST(SoftmaxRows, Avx512LoopsGiveTheBitsOfTheAvx2Loops) {
  if (!cpu_has_avx512f()) GTEST_SKIP() << "this CPU has no AVX-512";
  std::mt19937 gen(7);
  std::vector<int64_t> widths;
  for (int64_t V = 1; V <= 47; ++V) widths.push_back(V);
  widths.push_back(32128);
  for (const float scale : {1.0f, 30.0f}) {
    for (const int64_t V : widths) {
      const std::vector<float> row = logits_row(V, scale, gen);
      const float shift = row_max(row.data(), V);
      double sum16 = 0.25, sum8 = 0.25;  // the functions add to what the sum holds
      const int64_t used16 = sum_exp_avx512(sum16, row.data(), V, shift);
      const int64_t used8 = sum_exp_avx2(sum8, row.data(), V, shift);
      EXPECT_EQ(used16, used8) << "V=" << V;
      EXPECT_EQ(std::memcmp(&sum16, &sum8, sizeof(double)), 0) << "V=" << V << ": " << sum16 << " vs " << sum8;

      const float lse = shift + static_cast<float>(std::log(sum8));
      std::vector<float> out16(row.size(), -1.0f), out8(row.size(), -1.0f);
      const int64_t wrote16 = scaled_softmax_avx512(out16.data(), row.data(), V, lse, 0.3f);
      const int64_t wrote8 = scaled_softmax_avx2(out8.data(), row.data(), V, lse, 0.3f);
      EXPECT_EQ(wrote16, wrote8) << "V=" << V;
      EXPECT_TRUE(same_bits(out16.data(), out8.data(), V)) << "V=" << V;
    }
  }
}

TEST(SoftmaxRows, VectorExponentialsStayWithinTheirErrorOfStdExp) {
  if (!cpu_has_avx2_fma()) GTEST_SKIP() << "this CPU has no AVX2 + FMA";
  std::mt19937 gen(8);
  const int64_t V = 32128;
  const std::vector<float> row = logits_row(V, 10.0f, gen);
  const float max_logit = row_max(row.data(), V);
  std::vector<float> out(row.size());
  const int64_t wrote = cpu_has_avx512f() ? scaled_softmax_avx512(out.data(), row.data(), V, max_logit, 1.0f)
                                          : scaled_softmax_avx2(out.data(), row.data(), V, max_logit, 1.0f);
  ASSERT_EQ(wrote, V / 8 * 8);
  for (int64_t v = 0; v < wrote; ++v) {
    const double x = row[static_cast<size_t>(v)] - max_logit;  // the difference in float, as the loops take it
    const double want = x < -87.0 ? 0.0 : std::exp(x);
    EXPECT_LE(std::abs(out[static_cast<size_t>(v)] - want), 2.0 * 0x1p-24 * want) << "x=" << x;
  }
}
#endif

}  // namespace
}  // namespace moecore::kernels::cpu::softmax_rows
