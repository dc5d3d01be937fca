// Grouped linear kernels: the fast kernels (row tiles of every expert on a dynamic OpenMP schedule) against the
// references (one expert at a time) on random data, float and double, experts with no rows, one row and more rows
// than a tile; the fast results are the same bit for bit on 1 and 2 threads; an expert without rows keeps its
// gradients as they are.
#include <gtest/gtest.h>
#include <omp.h>

#include <cstdint>
#include <vector>

#include "kernel_test_util.h"
#include "moecore/kernels/cpu/grouped_linear.h"

namespace moecore::kernels {
namespace {

using test::random_vector;

template <typename T>
struct Group {
  std::vector<int64_t> offsets_E1 = {0};
  std::vector<std::vector<T>> w_E, b_E;
  std::vector<const T*> w_ptr, b_ptr;
  int64_t R = 0;
};

template <typename T>
Group<T> make_group(const std::vector<int64_t>& rows_E, const int64_t I, const int64_t O) {
  Group<T> g;
  uint64_t seed = 100;
  for (const int64_t rows : rows_E) {
    g.offsets_E1.push_back(g.offsets_E1.back() + rows);
    g.w_E.push_back(random_vector<T>(static_cast<size_t>(O * I), ++seed));
    g.b_E.push_back(random_vector<T>(static_cast<size_t>(O), ++seed));
  }
  for (size_t e = 0; e < rows_E.size(); ++e) {
    g.w_ptr.push_back(g.w_E[e].data());
    g.b_ptr.push_back(g.b_E[e].data());
  }
  g.R = g.offsets_E1.back();
  return g;
}

template <typename T>
class GroupedLinearKernels : public ::testing::Test {};
using Types = ::testing::Types<float, double>;
TYPED_TEST_SUITE(GroupedLinearKernels, Types);

template <typename T>
double tolerance() {
  return sizeof(T) == 4 ? 2e-5 : 1e-12;
}

// 600 rows: three tiles of 200; 257: two tiles; 0 and 1 rows.
const std::vector<int64_t> kRows = {600, 0, 1, 257, 40};
constexpr int64_t kI = 48, kO = 40;

TYPED_TEST(GroupedLinearKernels, ForwardMatchesReference) {
  using T = TypeParam;
  const Group<T> g = make_group<T>(kRows, kI, kO);
  const auto x = random_vector<T>(static_cast<size_t>(g.R * kI), 1);
  const auto E = static_cast<int64_t>(kRows.size());
  std::vector<T> ref(static_cast<size_t>(g.R * kO), T(3));
  ref::grouped_linear_forward(ref.data(), x.data(), g.w_ptr.data(), g.b_ptr.data(), g.offsets_E1.data(), E, kI, kO);
  std::vector<std::vector<T>> fast_by_threads;
  for (const int threads : {1, 2}) {
    omp_set_num_threads(threads);
    std::vector<T> fast(static_cast<size_t>(g.R * kO), T(-3));
    cpu::grouped_linear_forward(fast.data(), x.data(), g.w_ptr.data(), g.b_ptr.data(), g.offsets_E1.data(), E, kI, kO);
    EXPECT_LT(test::max_rel_error(fast, ref, 1.0), tolerance<T>()) << threads << " threads";
    fast_by_threads.push_back(fast);
  }
  EXPECT_EQ(fast_by_threads[0], fast_by_threads[1]) << "1 vs 2 threads";
}

TYPED_TEST(GroupedLinearKernels, BackwardMatchesReference) {
  using T = TypeParam;
  const Group<T> g = make_group<T>(kRows, kI, kO);
  const auto E = static_cast<int64_t>(kRows.size());
  const auto x = random_vector<T>(static_cast<size_t>(g.R * kI), 2);
  const auto dout = random_vector<T>(static_cast<size_t>(g.R * kO), 3);
  const auto dx0 = random_vector<T>(static_cast<size_t>(g.R * kI), 4);
  const auto dw0 = random_vector<T>(static_cast<size_t>(kO * kI), 5);
  const auto db0 = random_vector<T>(static_cast<size_t>(kO), 6);
  struct Grads {
    std::vector<T> dx;
    std::vector<std::vector<T>> dw, db;
  };
  auto run = [&](const bool fast) {
    Grads out{dx0, std::vector<std::vector<T>>(static_cast<size_t>(E), dw0),
              std::vector<std::vector<T>>(static_cast<size_t>(E), db0)};
    std::vector<T*> dw, db;
    for (int64_t e = 0; e < E; ++e) {
      dw.push_back(out.dw[static_cast<size_t>(e)].data());
      db.push_back(out.db[static_cast<size_t>(e)].data());
    }
    (fast ? cpu::grouped_linear_backward<T> : ref::grouped_linear_backward<T>)(out.dx.data(), dw.data(), db.data(),
                                                                               dout.data(), x.data(), g.w_ptr.data(),
                                                                               g.offsets_E1.data(), E, kI, kO);
    return out;
  };
  const Grads want = run(false);
  std::vector<Grads> by_threads;
  for (const int threads : {1, 2}) {
    omp_set_num_threads(threads);
    const Grads got = run(true);
    EXPECT_LT(test::max_rel_error(got.dx, want.dx, 1.0), tolerance<T>()) << threads << " threads";
    for (int64_t e = 0; e < E; ++e) {
      EXPECT_LT(test::max_rel_error(got.dw[e], want.dw[e], 1.0), tolerance<T>()) << "expert " << e;
      EXPECT_LT(test::max_rel_error(got.db[e], want.db[e], 1.0), tolerance<T>()) << "expert " << e;
    }
    EXPECT_EQ(got.dw[1], dw0) << "an expert without rows keeps its gradient";
    EXPECT_EQ(got.db[1], db0);
    by_threads.push_back(got);
  }
  EXPECT_EQ(by_threads[0].dx, by_threads[1].dx) << "1 vs 2 threads";
  EXPECT_EQ(by_threads[0].dw, by_threads[1].dw) << "1 vs 2 threads";
}

}  // namespace
}  // namespace moecore::kernels
