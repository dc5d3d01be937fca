// The small-tile bf16 products (small_rows_bf16.h) against their naive references on random bf16 values, over row
// counts 1 .. 33 and shapes with partial 16- and 32-column stretches and a partial weight block: the data kernel bit
// for bit (vdpbf16ps's order and rounding, which the reference follows; the widened one in o order), the forward within
// the fp32 sums' rounding, and each row's forward bit for bit that of the row alone.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "moecore/kernels/cpu/small_rows_bf16.h"
#include "moecore/tensor/dtype.h"

namespace moecore::kernels {
namespace {

std::vector<uint16_t> random_bf16(const int64_t n, std::mt19937& gen) {
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<uint16_t> v(static_cast<size_t>(n));
  for (uint16_t& x : v) x = fp32_to_bf16(dist(gen));
  return v;
}

std::vector<float> widened(const std::vector<uint16_t>& bits) {
  std::vector<float> v(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) v[i] = bf16_to_fp32(bits[i]);
  return v;
}

struct Shape {
  int64_t I, O;
};
constexpr Shape kShapes[] = {{192, 512}, {256, 192}, {100, 37}, {7, 5}, {32, 16}, {65, 33}};

using DataKernel = void (*)(float*, const float*, const uint16_t*, int64_t, int64_t, int64_t);

// A data kernel against its reference on random bf16 values, bit for bit, over rows 1 .. 9, 17, 25, 33.
void expect_data_bit_for_bit(const DataKernel kernel, const DataKernel reference, const unsigned seed) {
  std::mt19937 gen(seed);
  for (const Shape s : kShapes) {
    for (int64_t n = 1; n <= 33; n += (n < 9 ? 1 : 8)) {
      const std::vector<float> dy = widened(random_bf16(n * s.O, gen)), dx0 = widened(random_bf16(n * s.I, gen));
      const std::vector<uint16_t> w = random_bf16(s.O * s.I, gen);
      std::vector<float> got = dx0, want = dx0;
      kernel(got.data(), dy.data(), w.data(), n, s.I, s.O);
      reference(want.data(), dy.data(), w.data(), n, s.I, s.O);
      const std::string what = "n " + std::to_string(n) + " I " + std::to_string(s.I) + " O " + std::to_string(s.O);
      for (size_t i = 0; i < got.size(); ++i) {
        ASSERT_EQ(got[i], want[i]) << what << " element " << i;
      }
    }
  }
}

TEST(SmallRowsBf16, DataMatchesTheReferenceBitForBit) {
  if (!cpu::small_rows_bf16_usable()) GTEST_SKIP() << "this CPU has no AVX512-BF16";
  expect_data_bit_for_bit(cpu::small_rows_data_bf16, ref::small_rows_data_bf16, 3);
}

TEST(SmallRowsBf16, WidenedDataMatchesTheReferenceBitForBit) {
  if (!cpu::small_rows_bf16_usable()) GTEST_SKIP() << "this CPU has no AVX512-BF16";
  expect_data_bit_for_bit(cpu::small_rows_data_widened, ref::small_rows_data_widened, 6);
}

TEST(SmallRowsBf16, ForwardMatchesTheReference) {
  if (!cpu::small_rows_bf16_usable()) GTEST_SKIP() << "this CPU has no AVX512-BF16";
  std::mt19937 gen(4);
  for (const Shape s : kShapes) {
    for (int64_t n = 1; n <= 33; n += (n < 17 ? 1 : 8)) {
      const std::vector<uint16_t> x = random_bf16(n * s.I, gen), w = random_bf16(s.O * s.I, gen);
      std::vector<float> got(static_cast<size_t>(n * s.O), -1.0f), want(got.size());
      cpu::small_rows_forward_bf16(got.data(), x.data(), w.data(), n, s.I, s.O);
      ref::small_rows_forward_bf16(want.data(), x.data(), w.data(), n, s.I, s.O);
      const std::vector<float> xf = widened(x), wf = widened(w);
      for (int64_t r = 0; r < n; ++r) {
        for (int64_t o = 0; o < s.O; ++o) {
          // I fp32 roundings of partial sums, each at most the sum of the products' magnitudes.
          double magnitude = 0.0;
          for (int64_t i = 0; i < s.I; ++i)
            magnitude += std::abs(static_cast<double>(xf[r * s.I + i]) * wf[o * s.I + i]);
          const size_t at = static_cast<size_t>(r * s.O + o);
          ASSERT_NEAR(got[at], want[at], static_cast<double>(s.I) * 0x1p-24 * magnitude)
              << "n " << n << " I " << s.I << " O " << s.O << " row " << r << " column " << o;
        }
      }
    }
  }
}

// Each row's forward outputs are those of the row alone, bit for bit, whichever row it is paired with (the kernel runs
// rows two at a time) and however many rows the call has: an odd last row, a row written twice over garbage, no row
// written past the output.
TEST(SmallRowsBf16, ForwardOfEachRowIsTheRowAloneBitForBit) {
  if (!cpu::small_rows_bf16_usable()) GTEST_SKIP() << "this CPU has no AVX512-BF16";
  std::mt19937 gen(5);
  for (const Shape s : kShapes) {
    for (const int64_t n : {int64_t{2}, int64_t{5}, int64_t{16}}) {
      const std::vector<uint16_t> x = random_bf16(n * s.I, gen), w = random_bf16(s.O * s.I, gen);
      std::vector<float> got(static_cast<size_t>((n + 1) * s.O), -1.0f);
      cpu::small_rows_forward_bf16(got.data(), x.data(), w.data(), n, s.I, s.O);
      for (int64_t r = 0; r < n; ++r) {
        std::vector<float> alone(static_cast<size_t>(s.O), -1.0f);
        cpu::small_rows_forward_bf16(alone.data(), x.data() + r * s.I, w.data(), 1, s.I, s.O);
        for (int64_t o = 0; o < s.O; ++o) {
          ASSERT_EQ(std::memcmp(&got[static_cast<size_t>(r * s.O + o)], &alone[static_cast<size_t>(o)], sizeof(float)),
                    0)
              << "n " << n << " I " << s.I << " O " << s.O << " row " << r << " column " << o;
        }
      }
      for (int64_t o = 0; o < s.O; ++o) ASSERT_EQ(got[static_cast<size_t>(n * s.O + o)], -1.0f) << "written past";
    }
  }
}

}  // namespace
}  // namespace moecore::kernels
