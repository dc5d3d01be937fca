// rank_update (c += a^T b over few rows; its AVX-512 code where the CPU has it, and the portable vector loops) against
// its naive reference: the same products added in the same row order,
// so bit for bit, on random data over shapes that cover whole 64-column stretches, a tail, a row shorter than a
// stretch and no rows; and the reference against the sum in double (the reference itself is the transposed product).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "moecore/kernels/cpu/rank_update.h"

namespace moecore::kernels {
namespace {

std::vector<float> random_values(const int64_t n, std::mt19937& gen) {
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = dist(gen);
  return v;
}

struct Shape {
  int64_t n, O, I;
};

TEST(RankUpdate, MatchesTheReferenceBitForBit) {
  std::mt19937 gen(17);
  for (const Shape s : {Shape{8, 512, 192}, Shape{32, 192, 256}, Shape{1, 3, 64}, Shape{5, 7, 100}, Shape{3, 4, 7},
                        Shape{0, 6, 80}, Shape{13, 1, 129}}) {
    const std::vector<float> a = random_values(s.n * s.O, gen), b = random_values(s.n * s.I, gen);
    const std::vector<float> c0 = random_values(s.O * s.I, gen);
    std::vector<float> got = c0, portable = c0, want = c0;
    cpu::rank_update(got.data(), a.data(), b.data(), s.n, s.O, s.I);
    cpu::rank_update_portable(portable.data(), a.data(), b.data(), s.n, s.O, s.I);
    ref::rank_update(want.data(), a.data(), b.data(), s.n, s.O, s.I);
    const std::string what = "n " + std::to_string(s.n) + " O " + std::to_string(s.O) + " I " + std::to_string(s.I);
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_EQ(got[i], want[i]) << what << " element " << i;
      ASSERT_EQ(portable[i], want[i]) << what << " element " << i << " (portable loops)";
    }
    if (s.n == 0) {
      EXPECT_EQ(got, c0) << what;
    }
  }
}

// rank_update_overwrite writes what rank_update adds to a zeroed c, bit for bit: rows that are whole, partial or
// unaligned stretches of 64 columns (the streaming stores take only 64-byte aligned vectors), nothing past c.
TEST(RankUpdate, OverwriteIsTheUpdateOfZeros) {
  std::mt19937 gen(19);
  for (const Shape s : {Shape{8, 512, 192}, Shape{32, 192, 256}, Shape{5, 7, 100}, Shape{3, 4, 7}, Shape{1, 9, 64},
                        Shape{13, 3, 129}}) {
    for (const int64_t offset : {0, 1, 16}) {  // c's first element at 0, 4 or 64 bytes past a 64-byte boundary
      const std::vector<float> a = random_values(s.n * s.O, gen), b = random_values(s.n * s.I, gen);
      std::vector<float> zeros(static_cast<size_t>(s.O * s.I), 0.0f);
      cpu::rank_update(zeros.data(), a.data(), b.data(), s.n, s.O, s.I);
      std::vector<float> storage(static_cast<size_t>(s.O * s.I + 64), -7.0f);
      auto* base = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(storage.data()) + 63) & ~uintptr_t{63});
      float* c = base + offset;
      cpu::rank_update_overwrite(c, a.data(), b.data(), s.n, s.O, s.I);
      const std::string what = "n " + std::to_string(s.n) + " O " + std::to_string(s.O) + " I " + std::to_string(s.I) +
                               " offset " + std::to_string(offset);
      for (int64_t i = 0; i < s.O * s.I; ++i) {
        ASSERT_EQ(std::memcmp(&c[i], &zeros[static_cast<size_t>(i)], sizeof(float)), 0) << what << " element " << i;
      }
      for (float* q = storage.data(); q < c; ++q) ASSERT_EQ(*q, -7.0f) << what << ": written before c";
      for (float* q = c + s.O * s.I; q < storage.data() + storage.size(); ++q) {
        ASSERT_EQ(*q, -7.0f) << what << ": written past c";
      }
    }
  }
}

TEST(RankUpdate, ReferenceIsTheTransposedProduct) {
  std::mt19937 gen(18);
  const int64_t n = 9, O = 11, I = 70;
  const std::vector<float> a = random_values(n * O, gen), b = random_values(n * I, gen), c0 = random_values(O * I, gen);
  std::vector<float> c = c0;
  ref::rank_update(c.data(), a.data(), b.data(), n, O, I);
  for (int64_t o = 0; o < O; ++o) {
    for (int64_t i = 0; i < I; ++i) {
      double want = c0[o * I + i], magnitude = std::abs(want);
      for (int64_t r = 0; r < n; ++r) {
        const double product = static_cast<double>(a[r * O + o]) * b[r * I + i];
        want += product;
        magnitude += std::abs(product);
      }
      // n + 1 fp32 roundings of partial sums bounded by the sum of magnitudes.
      EXPECT_NEAR(c[o * I + i], want, 2.0 * (n + 1) * 0x1p-24 * magnitude) << "o " << o << " i " << i;
    }
  }
}

}  // namespace
}  // namespace moecore::kernels
