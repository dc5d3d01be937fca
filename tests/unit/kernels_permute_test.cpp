// Token permutation kernels: the fast kernels equal the references bit for bit on random data (every kernel is
// copies and in-order sums), float and double, at 1 and 2 OpenMP threads, padding rows (-1) and empty chunks
// included; unsort_chunks inverts sort_chunks; moe_unpermute's rows land in ascending order per destination.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "kernel_test_util.h"
#include "moecore/kernels/cpu/permute.h"
#include "moecore/kernels/cpu/rows.h"

namespace moecore::kernels {
namespace {

using test::random_vector;

// R rows over N destinations, each destination reached several times (as top-k routing does), one in seven rows
// a padding row (-1).
std::vector<int64_t> random_index(const int64_t R, const int64_t N, const uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::uniform_int_distribution<int64_t> pick(0, N - 1);
  std::vector<int64_t> index(static_cast<size_t>(R));
  for (int64_t r = 0; r < R; ++r) index[r] = r % 7 == 3 ? -1 : pick(gen);
  return index;
}

// Chunks of random sizes (some empty) that tile [0, N) in a shuffled order: Megatron's chunk sort of the all-to-all
// output by local expert.
struct Chunks {
  std::vector<int64_t> first, rows;
};
Chunks random_chunks(const int64_t N, const int64_t C, const uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::vector<int64_t> cuts(static_cast<size_t>(C - 1));
  std::uniform_int_distribution<int64_t> at(0, N);
  for (int64_t& c : cuts) c = at(gen);
  cuts.push_back(0);
  cuts.push_back(N);
  std::sort(cuts.begin(), cuts.end());
  Chunks ch;
  for (int64_t c = 0; c < C; ++c) {
    ch.first.push_back(cuts[c]);
    ch.rows.push_back(cuts[c + 1] - cuts[c]);
  }
  std::vector<size_t> order(static_cast<size_t>(C));
  std::iota(order.begin(), order.end(), size_t{0});
  std::shuffle(order.begin(), order.end(), gen);
  Chunks shuffled;
  for (const size_t o : order) {
    shuffled.first.push_back(ch.first[o]);
    shuffled.rows.push_back(ch.rows[o]);
  }
  return shuffled;
}

template <typename T>
class PermuteKernels : public ::testing::Test {};
using Types = ::testing::Types<float, double>;
TYPED_TEST_SUITE(PermuteKernels, Types);

// Large enough that the fast kernels go parallel (R * W above their threshold).
constexpr int64_t kN = 300, kR = 700, kW = 67;

TYPED_TEST(PermuteKernels, UnpermuteEqualsReference) {
  using T = TypeParam;
  const auto in = random_vector<T>(kR * kW, 3);
  const auto probs = random_vector<T>(kR, 4, T(0.05), T(1));
  const auto out0 = random_vector<T>(kN * kW, 5);
  const auto index = random_index(kR, kN, 6);
  for (const int threads : {1, 2}) {
    omp_set_num_threads(threads);
    for (const T* p : {static_cast<const T*>(nullptr), probs.data()}) {
      std::vector<T> fast = out0, ref = out0;
      cpu::moe_unpermute(fast.data(), in.data(), index.data(), p, kR, kN, kW);
      ref::moe_unpermute(ref.data(), in.data(), index.data(), p, kR, kN, kW);
      ASSERT_EQ(fast, ref) << threads << " threads, probs " << (p != nullptr);
    }
  }
}

// Few rows over many destinations (the router's probability gradients: R = T k rows of width 1 into T E elements):
// the fast kernels take the rows in order on one thread there. Both regimes, moe_unpermute and scatter_add_rows.
TYPED_TEST(PermuteKernels, ScatterAddsEqualReferenceForFewAndManyRows) {
  using T = TypeParam;
  struct Shape {
    int64_t R, N, W;
  };
  for (const Shape shape : {Shape{2048, 262144, 1}, Shape{40, 50, 3}, Shape{kR, kN, kW}}) {
    const auto in = random_vector<T>(shape.R * shape.W, 21);
    const auto probs = random_vector<T>(shape.R, 22, T(0.05), T(1));
    const auto out0 = random_vector<T>(shape.N * shape.W, 23);
    const auto index = random_index(shape.R, shape.N, 24);
    for (const int threads : {1, 2}) {
      omp_set_num_threads(threads);
      for (const T* p : {static_cast<const T*>(nullptr), probs.data()}) {
        std::vector<T> fast = out0, ref = out0;
        cpu::moe_unpermute(fast.data(), in.data(), index.data(), p, shape.R, shape.N, shape.W);
        ref::moe_unpermute(ref.data(), in.data(), index.data(), p, shape.R, shape.N, shape.W);
        ASSERT_EQ(fast, ref) << "moe_unpermute R " << shape.R << ", " << threads << " threads, probs "
                             << (p != nullptr);
      }
      std::vector<T> fast = out0, ref = out0;
      cpu::scatter_add_rows(fast.data(), in.data(), index.data(), shape.R, shape.N, shape.W);
      ref::scatter_add_rows(ref.data(), in.data(), index.data(), shape.R, shape.N, shape.W);
      ASSERT_EQ(fast, ref) << "scatter_add_rows R " << shape.R << ", " << threads << " threads";
    }
  }
}

TYPED_TEST(PermuteKernels, UnpermuteBackwardEqualsReference) {
  using T = TypeParam;
  const auto in = random_vector<T>(kR * kW, 7);
  const auto probs = random_vector<T>(kR, 8, T(0.05), T(1));
  const auto dout = random_vector<T>(kN * kW, 9);
  const auto index = random_index(kR, kN, 10);
  for (const int threads : {1, 2}) {
    omp_set_num_threads(threads);
    for (const bool with_probs : {false, true}) {
      const T* p = with_probs ? probs.data() : nullptr;
      std::vector<T> din_fast(kR * kW, T(3)), din_ref(kR * kW, T(-3)), dp_fast(kR, T(3)), dp_ref(kR, T(-3));
      cpu::moe_unpermute_backward(din_fast.data(), with_probs ? dp_fast.data() : nullptr, dout.data(), in.data(),
                                  index.data(), p, kR, kW);
      ref::moe_unpermute_backward(din_ref.data(), with_probs ? dp_ref.data() : nullptr, dout.data(), in.data(),
                                  index.data(), p, kR, kW);
      ASSERT_EQ(din_fast, din_ref) << threads << " threads";
      if (with_probs) {
        ASSERT_EQ(dp_fast, dp_ref) << threads << " threads";
        ASSERT_EQ(dp_fast[3], T(0)) << "padding row";
      }
    }
  }
}

// A rank that receives no rows holds empty (null) buffers: empty chunks move nothing, and unsort zeroes the rows no
// chunk covers (the sanitizer build checks that no null pointer reaches memcpy).
TYPED_TEST(PermuteKernels, EmptyChunksOfEmptyBuffersMoveNothing) {
  using T = TypeParam;
  const std::vector<int64_t> first = {0, 0}, rows = {0, 0};
  for (const int threads : {1, 2}) {
    omp_set_num_threads(threads);
    cpu::sort_chunks(static_cast<T*>(nullptr), static_cast<const T*>(nullptr), first.data(), rows.data(), 2, kW);
    std::vector<T> out(2 * kW, T(5));
    cpu::unsort_chunks(out.data(), static_cast<const T*>(nullptr), first.data(), rows.data(), 2, 2, kW);
    ASSERT_EQ(out, std::vector<T>(2 * kW, T(0))) << threads << " threads";
  }
}

TYPED_TEST(PermuteKernels, SortAndUnsortChunksEqualReferenceAndInvert) {
  using T = TypeParam;
  const int64_t C = 24;
  const Chunks ch = random_chunks(kN, C, 11);
  const auto in = random_vector<T>(kN * kW, 12);
  for (const int threads : {1, 2}) {
    omp_set_num_threads(threads);
    std::vector<T> fast(kN * kW, T(5)), ref(kN * kW, T(-5));
    cpu::sort_chunks(fast.data(), in.data(), ch.first.data(), ch.rows.data(), C, kW);
    ref::sort_chunks(ref.data(), in.data(), ch.first.data(), ch.rows.data(), C, kW);
    ASSERT_EQ(fast, ref) << threads << " threads";
    std::vector<T> back_fast(kN * kW, T(9)), back_ref(kN * kW, T(-9));
    cpu::unsort_chunks(back_fast.data(), fast.data(), ch.first.data(), ch.rows.data(), C, kN, kW);
    ref::unsort_chunks(back_ref.data(), fast.data(), ch.first.data(), ch.rows.data(), C, kN, kW);
    ASSERT_EQ(back_fast, back_ref) << threads << " threads";
    ASSERT_EQ(back_fast, in) << "unsort_chunks inverts sort_chunks";
  }
  // Chunks leaving rows out (the zero-padded all-to-all buffer): those rows become zero.
  const std::vector<int64_t> first = {10, 0}, rows = {5, 4};
  const auto part = random_vector<T>(9 * kW, 13);
  std::vector<T> fast(20 * kW, T(1)), ref(20 * kW, T(-1));
  cpu::unsort_chunks(fast.data(), part.data(), first.data(), rows.data(), 2, 20, kW);
  ref::unsort_chunks(ref.data(), part.data(), first.data(), rows.data(), 2, 20, kW);
  ASSERT_EQ(fast, ref);
  for (int64_t w = 0; w < kW; ++w) {
    EXPECT_EQ(fast[5 * kW + w], T(0));
    EXPECT_EQ(fast[19 * kW + w], T(0));
    EXPECT_EQ(fast[10 * kW + w], part[w]);
  }
}

// Each destination sums its rows in ascending row order: the same bits as adding them one by one.
TEST(PermuteKernelsOrder, UnpermuteSumsInAscendingRowOrder) {
  const int64_t W = 1;
  const std::vector<float> in = {1e8f, 1.0f, -1e8f, 1.0f};
  const std::vector<int64_t> index = {0, 0, 0, 0};
  omp_set_num_threads(2);
  float expected = 0.0f;
  for (const float v : in) expected += v;
  // Few rows (one thread, in row order) and, repeated past the parallel threshold, many (parallel over destinations).
  for (const int64_t repeats : {int64_t{1}, int64_t{5000}}) {
    std::vector<float> many_in;
    std::vector<int64_t> many_index;
    for (int64_t i = 0; i < repeats; ++i) {
      many_in.insert(many_in.end(), in.begin(), in.end());
      many_index.insert(many_index.end(), index.begin(), index.end());
    }
    std::vector<float> out(1, 0.0f);
    cpu::moe_unpermute(out.data(), many_in.data(), many_index.data(), static_cast<const float*>(nullptr),
                       static_cast<int64_t>(many_in.size()), 1, W);
    float sum = 0.0f;
    for (const float v : many_in) sum += v;
    EXPECT_EQ(out[0], sum) << repeats;
  }
  EXPECT_EQ(expected, 1.0f);
}

}  // namespace
}  // namespace moecore::kernels
