// Causal GQA attention: fast kernel vs the naive reference, causality, backward vs float64 finite differences
// (with and without dropout), and the dropout mask vs CounterRng evaluated directly from the documented counter.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "moecore/kernels/cpu/attention.h"
#include "moecore/tensor/rng.h"
#include "unit/kernel_test_util.h"

namespace moecore::kernels {
namespace {

using test::max_rel_error;
using test::random_vector;

struct Shape {
  int64_t S, B, N, G, d;
};

AttentionDims make_dims(const Shape& shape) {
  return AttentionDims{shape.S, shape.B, shape.N, shape.G, shape.d, 1.0 / std::sqrt(static_cast<double>(shape.d))};
}

std::string describe(const Shape& s) {
  return "S=" + std::to_string(s.S) + " B=" + std::to_string(s.B) + " N=" + std::to_string(s.N) +
         " G=" + std::to_string(s.G) + " d=" + std::to_string(s.d);
}

// Restores the OpenMP thread count when a test changes it.
class ThreadCount {
 public:
  explicit ThreadCount(int n) : saved_(omp_get_max_threads()) { omp_set_num_threads(n); }
  ~ThreadCount() { omp_set_num_threads(saved_); }
  ThreadCount(const ThreadCount&) = delete;
  ThreadCount& operator=(const ThreadCount&) = delete;

 private:
  int saved_;
};

template <typename T>
struct Problem {
  Problem(const Shape& shape, uint64_t seed)
      : dims(make_dims(shape)),
        q(random_vector<T>(shape.S * shape.B * shape.N * shape.d, seed, T(-2), T(2))),
        k(random_vector<T>(shape.S * shape.B * shape.G * shape.d, seed + 1, T(-2), T(2))),
        v(random_vector<T>(shape.S * shape.B * shape.G * shape.d, seed + 2)),
        dout(random_vector<T>(q.size(), seed + 3)) {}
  AttentionDims dims;
  std::vector<T> q, k, v, dout;
};

template <typename T>
struct Forward {
  std::vector<T> out, lse;
};

template <typename T, bool kFast>
Forward<T> run_forward(const Problem<T>& pb, const DropoutSpec& drop) {
  Forward<T> f{std::vector<T>(pb.q.size()), std::vector<T>(pb.dims.B * pb.dims.N * pb.dims.S)};
  if constexpr (kFast) {
    cpu::attention_forward(f.out.data(), f.lse.data(), pb.q.data(), pb.k.data(), pb.v.data(), pb.dims, drop);
  } else {
    ref::attention_forward(f.out.data(), f.lse.data(), pb.q.data(), pb.k.data(), pb.v.data(), pb.dims, drop);
  }
  return f;
}

template <typename T>
struct Grads {
  std::vector<T> dq, dk, dv;
};

// Gradients start from nonzero values so that accumulation (+=) is checked too.
template <typename T, bool kFast>
Grads<T> run_backward(const Problem<T>& pb, const Forward<T>& f, const DropoutSpec& drop, bool zero_init) {
  Grads<T> g{random_vector<T>(pb.q.size(), 91), random_vector<T>(pb.k.size(), 92), random_vector<T>(pb.v.size(), 93)};
  if (zero_init) {
    std::fill(g.dq.begin(), g.dq.end(), T(0));
    std::fill(g.dk.begin(), g.dk.end(), T(0));
    std::fill(g.dv.begin(), g.dv.end(), T(0));
  }
  if constexpr (kFast) {
    cpu::attention_backward(g.dq.data(), g.dk.data(), g.dv.data(), pb.dout.data(), pb.q.data(), pb.k.data(),
                            pb.v.data(), f.out.data(), f.lse.data(), pb.dims, drop);
  } else {
    ref::attention_backward(g.dq.data(), g.dk.data(), g.dv.data(), pb.dout.data(), pb.q.data(), pb.k.data(),
                            pb.v.data(), f.out.data(), f.lse.data(), pb.dims, drop);
  }
  return g;
}

// S values around the 64-row block edge, GQA (G < N), MQA (G == 1), MHA (G == N), B > 1; small shapes run on one
// thread, the larger ones (S^2 B N d > 2^18) in parallel.
const std::vector<Shape> kShapes = {{1, 1, 1, 1, 4},    {7, 2, 4, 2, 8},    {64, 1, 2, 2, 16}, {65, 2, 4, 1, 8},
                                    {130, 2, 4, 4, 16}, {100, 3, 6, 3, 12}, {200, 1, 4, 2, 16}};
const DropoutSpec kNoDropout{};
const DropoutSpec kDropout{0.3f, 1234, 77};

// Normwise relative error max_i |fast_i - ref_i| / max_i |ref_i|. Elementwise relative error is not meaningful
// here: outputs are sums of many terms of both signs, and an entry that cancels to near zero keeps the absolute
// rounding error of its summands. In float the fast kernel computes in float, the reference in double.
template <typename T>
double normwise_rel_error(const std::vector<T>& fast, const std::vector<T>& reference) {
  double largest = 0.0;
  for (const T x : reference) largest = std::max(largest, std::abs(static_cast<double>(x)));
  const double error = test::max_abs_error(fast.data(), reference.data(), fast.size());
  return largest > 0.0 ? error / largest : error;
}

template <typename T>
void expect_forward_matches_ref(double tol) {
  for (const Shape& shape : kShapes) {
    for (const DropoutSpec& drop : {kNoDropout, kDropout}) {
      SCOPED_TRACE(describe(shape) + " p=" + std::to_string(drop.p));
      const Problem<T> pb(shape, 10);
      const Forward<T> fast = run_forward<T, true>(pb, drop);
      const Forward<T> naive = run_forward<T, false>(pb, drop);
      EXPECT_LT(normwise_rel_error(fast.out, naive.out), tol);
      // lse enters backward as exp(s - lse): its absolute error is the relative error of P, hence floor 1.
      EXPECT_LT(max_rel_error(fast.lse, naive.lse, 1.0), tol);
    }
  }
}

TEST(AttentionTest, ForwardMatchesRefFloat) { expect_forward_matches_ref<float>(1e-5); }
TEST(AttentionTest, ForwardMatchesRefDouble) { expect_forward_matches_ref<double>(1e-12); }

// 1 thread and many (b, group) pairs take the per-group schedule; few pairs on several threads take the two-pass
// key-block / query-block schedule. Both must agree with the reference.
template <typename T>
void expect_backward_matches_ref(double tol) {
  for (const Shape& shape : kShapes) {
    for (const DropoutSpec& drop : {kNoDropout, kDropout}) {
      const Problem<T> pb(shape, 20);
      const Forward<T> f = run_forward<T, true>(pb, drop);
      const Grads<T> naive = run_backward<T, false>(pb, f, drop, false);
      for (const int threads : {1, 2, 4}) {
        SCOPED_TRACE(describe(shape) + " p=" + std::to_string(drop.p) + " threads=" + std::to_string(threads));
        const ThreadCount thread_count(threads);
        const Grads<T> fast = run_backward<T, true>(pb, f, drop, false);
        EXPECT_LT(normwise_rel_error(fast.dq, naive.dq), tol);
        EXPECT_LT(normwise_rel_error(fast.dk, naive.dk), tol);
        EXPECT_LT(normwise_rel_error(fast.dv, naive.dv), tol);
      }
    }
  }
}

TEST(AttentionTest, BackwardMatchesRefFloat) { expect_backward_matches_ref<float>(1e-5); }
TEST(AttentionTest, BackwardMatchesRefDouble) { expect_backward_matches_ref<double>(1e-12); }

TEST(AttentionTest, ForwardIsCausal) {
  const Shape shape{150, 2, 4, 2, 8};
  const int64_t i_fixed = 70, row_elems = shape.B * shape.N * shape.d;
  Problem<double> pb(shape, 30);
  const Forward<double> before = run_forward<double, true>(pb, kDropout);
  const std::vector<double> noise = random_vector<double>(pb.k.size(), 31);
  for (size_t e = (i_fixed + 1) * shape.B * shape.G * shape.d; e < pb.k.size(); ++e) {
    pb.k[e] += noise[e];
    pb.v[e] -= noise[e];
  }
  const Forward<double> after = run_forward<double, true>(pb, kDropout);
  const size_t split = (i_fixed + 1) * row_elems;
  EXPECT_LT(test::max_abs_error(after.out.data(), before.out.data(), split), 1e-14);
  EXPECT_GT(test::max_abs_error(after.out.data() + split, before.out.data() + split, after.out.size() - split), 1e-3);
}

// d(sum(out * dout))/d(q, k, v) by central differences in float64 vs the analytic backward. The many tiny forwards
// run on one thread; the analytic backward runs on 1 thread (per-group schedule) and 4 threads (two-pass schedule).
template <bool kFast>
void expect_backward_matches_finite_differences(const Shape& shape, const DropoutSpec& drop) {
  SCOPED_TRACE(describe(shape) + " p=" + std::to_string(drop.p) + (kFast ? " cpu" : " ref"));
  const Problem<double> pb(shape, 40);
  auto loss_of = [&](int which) {
    return [&pb, &drop, which](const std::vector<double>& x) {
      Problem<double> perturbed = pb;
      (which == 0 ? perturbed.q : which == 1 ? perturbed.k : perturbed.v) = x;
      return test::weighted_sum(run_forward<double, kFast>(perturbed, drop).out, pb.dout);
    };
  };
  std::vector<double> numeric_dq, numeric_dk, numeric_dv;
  {
    const ThreadCount one_thread(1);
    numeric_dq = test::numeric_grad(loss_of(0), pb.q);
    numeric_dk = test::numeric_grad(loss_of(1), pb.k);
    numeric_dv = test::numeric_grad(loss_of(2), pb.v);
  }
  for (const int threads : {1, 4}) {
    const ThreadCount thread_count(threads);
    const Grads<double> analytic = run_backward<double, kFast>(pb, run_forward<double, kFast>(pb, drop), drop, true);
    EXPECT_LT(max_rel_error(analytic.dq, numeric_dq, 1e-3), 1e-6) << threads << " threads";
    EXPECT_LT(max_rel_error(analytic.dk, numeric_dk, 1e-3), 1e-6) << threads << " threads";
    EXPECT_LT(max_rel_error(analytic.dv, numeric_dv, 1e-3), 1e-6) << threads << " threads";
  }
}

TEST(AttentionTest, BackwardMatchesFiniteDifferences) {
  for (const Shape& shape : {Shape{5, 2, 4, 2, 3}, Shape{4, 1, 2, 2, 2}, Shape{6, 1, 3, 1, 2}}) {
    for (const DropoutSpec& drop : {kNoDropout, kDropout}) {
      expect_backward_matches_finite_differences<true>(shape, drop);
      expect_backward_matches_finite_differences<false>(shape, drop);
    }
  }
}

// With head_dim = S and v[j] = e_j, out row i is the (dropped) probability row i itself, so the mask can be read
// off and compared with CounterRng at counter ((b * N + h) * S + i) * S + j.
TEST(AttentionTest, DropoutMaskFollowsCounterRng) {
  const Shape shape{64, 2, 2, 1, 64};
  Problem<double> pb(shape, 50);
  std::fill(pb.v.begin(), pb.v.end(), 0.0);
  for (int64_t j = 0; j < shape.S; ++j) {
    for (int64_t b = 0; b < shape.B; ++b) pb.v[(j * shape.B + b) * shape.d + j] = 1.0;
  }
  const DropoutSpec drop{0.3f, 99, 5};
  const Forward<double> plain = run_forward<double, true>(pb, kNoDropout);
  const Forward<double> dropped = run_forward<double, true>(pb, drop);
  EXPECT_LT(max_rel_error(dropped.lse, plain.lse), 1e-14);  // lse is taken before dropout
  const CounterRng rng(drop.seed, drop.key);
  int64_t n_dropped = 0, n_total = 0, n_mismatch = 0;
  double worst = 0.0;
  for (int64_t b = 0; b < shape.B; ++b) {
    for (int64_t h = 0; h < shape.N; ++h) {
      for (int64_t i = 0; i < shape.S; ++i) {
        for (int64_t j = 0; j <= i; ++j) {
          const size_t at = ((i * shape.B + b) * shape.N + h) * shape.d + j;
          const bool expect_drop =
              rng.uniform(static_cast<uint64_t>(((b * shape.N + h) * shape.S + i) * shape.S + j)) < drop.p;
          const double expected = expect_drop ? 0.0 : plain.out[at] / (1.0 - drop.p);
          n_mismatch += (dropped.out[at] == 0.0) != expect_drop;
          worst = std::max(worst, std::abs(dropped.out[at] - expected));
          n_dropped += expect_drop;
          ++n_total;
        }
      }
    }
  }
  EXPECT_EQ(n_mismatch, 0);
  EXPECT_LT(worst, 1e-12);
  EXPECT_NEAR(static_cast<double>(n_dropped) / static_cast<double>(n_total), drop.p, 0.03);
  // A different key gives a different mask.
  const Forward<double> other = run_forward<double, true>(pb, DropoutSpec{0.3f, 99, 6});
  EXPECT_GT(test::max_abs_error(other.out.data(), dropped.out.data(), other.out.size()), 1e-3);
}

// Shapes for the tiled kernel: sequences over several key tiles (forward tiles of 256 keys, backward tiles of 128,
// tiles of 32 keys where the causal mask cuts) and query blocks (128, 64 and 32 query rows per head with 1-2, 3-4
// and 8 heads per group), none a multiple of a tile; GQA with 2, 3 and 4 heads per group, MQA over 4 and 8 heads.
const std::vector<Shape> kTiledShapes = {{600, 1, 4, 2, 16}, {257, 2, 8, 2, 8}, {300, 1, 8, 1, 8},
                                         {129, 3, 4, 1, 12}, {520, 1, 2, 2, 8}, {150, 2, 6, 2, 8}};

template <typename T>
void expect_tiled_matches_ref(double tol) {
  for (const Shape& shape : kTiledShapes) {
    for (const DropoutSpec& drop : {kNoDropout, kDropout}) {
      SCOPED_TRACE(describe(shape) + " p=" + std::to_string(drop.p));
      const Problem<T> pb(shape, 70);
      const Forward<T> fast = run_forward<T, true>(pb, drop);
      const Forward<T> naive = run_forward<T, false>(pb, drop);
      EXPECT_LT(normwise_rel_error(fast.out, naive.out), tol);
      EXPECT_LT(max_rel_error(fast.lse, naive.lse, 1.0), tol);
      const Grads<T> naive_grads = run_backward<T, false>(pb, fast, drop, false);
      for (const int threads : {1, 3}) {
        SCOPED_TRACE("threads=" + std::to_string(threads));
        const ThreadCount thread_count(threads);
        const Grads<T> fast_grads = run_backward<T, true>(pb, fast, drop, false);
        EXPECT_LT(normwise_rel_error(fast_grads.dq, naive_grads.dq), tol);
        EXPECT_LT(normwise_rel_error(fast_grads.dk, naive_grads.dk), tol);
        EXPECT_LT(normwise_rel_error(fast_grads.dv, naive_grads.dv), tol);
      }
    }
  }
}

TEST(AttentionTest, TiledShapesMatchRefFloat) { expect_tiled_matches_ref<float>(1e-5); }
TEST(AttentionTest, TiledShapesMatchRefDouble) { expect_tiled_matches_ref<double>(1e-12); }

// Every output element is computed in a fixed order whatever the thread count: forward and both backward schedules
// (per group on 1 thread or many groups, per key tile / query block otherwise) give the same bits.
TEST(AttentionTest, ResultsDoNotDependOnThreadCount) {
  for (const Shape& shape : {Shape{600, 1, 4, 2, 16}, Shape{200, 3, 4, 2, 16}, Shape{130, 2, 4, 4, 16}}) {
    for (const DropoutSpec& drop : {kNoDropout, kDropout}) {
      SCOPED_TRACE(describe(shape) + " p=" + std::to_string(drop.p));
      const Problem<float> pb(shape, 80);
      Forward<float> f1;
      Grads<float> g1;
      {
        const ThreadCount one_thread(1);
        f1 = run_forward<float, true>(pb, drop);
        g1 = run_backward<float, true>(pb, f1, drop, false);
      }
      for (const int threads : {2, 3, 4, 8}) {
        SCOPED_TRACE("threads=" + std::to_string(threads));
        const ThreadCount thread_count(threads);
        const Forward<float> f = run_forward<float, true>(pb, drop);
        const Grads<float> g = run_backward<float, true>(pb, f1, drop, false);
        EXPECT_TRUE(f.out == f1.out);
        EXPECT_TRUE(f.lse == f1.lse);
        EXPECT_TRUE(g.dq == g1.dq);
        EXPECT_TRUE(g.dk == g1.dk);
        EXPECT_TRUE(g.dv == g1.dv);
      }
    }
  }
}

// Tensor-parallel head offsets put the dropout counters past 2^32 (and rows of one head across the 2^32 boundary):
// the mask still follows CounterRng at the documented counter, as the reference draws it.
TEST(AttentionTest, DropoutCountersAbove32Bits) {
  const Shape shape{70, 2, 4, 2, 8};
  // With this offset head 1 of batch 0 starts 4596 counters below 2^32: its row 65 runs across the boundary.
  const int64_t crossing = (int64_t{1} << 32) / (shape.S * shape.S) - 1;
  for (const int64_t head_offset : {int64_t{1} << 20, crossing, (int64_t{3} << 21) + 5}) {
    SCOPED_TRACE("head offset " + std::to_string(head_offset));
    Problem<double> pb(shape, 90);
    pb.dims.dropout_total_heads = int64_t{1} << 23;
    pb.dims.dropout_head_offset = head_offset;
    const Forward<double> fast = run_forward<double, true>(pb, kDropout);
    const Forward<double> naive = run_forward<double, false>(pb, kDropout);
    EXPECT_LT(normwise_rel_error(fast.out, naive.out), 1e-12);
    const Grads<double> fast_grads = run_backward<double, true>(pb, fast, kDropout, false);
    const Grads<double> naive_grads = run_backward<double, false>(pb, fast, kDropout, false);
    EXPECT_LT(normwise_rel_error(fast_grads.dq, naive_grads.dq), 1e-12);
    EXPECT_LT(normwise_rel_error(fast_grads.dk, naive_grads.dk), 1e-12);
    EXPECT_LT(normwise_rel_error(fast_grads.dv, naive_grads.dv), 1e-12);
    // And it differs from the mask without the offset.
    Problem<double> no_offset = pb;
    no_offset.dims.dropout_total_heads = 0;
    no_offset.dims.dropout_head_offset = 0;
    EXPECT_GT(test::max_abs_error(run_forward<double, true>(no_offset, kDropout).out.data(), fast.out.data(),
                                  fast.out.size()),
              1e-3);
  }
}

TEST(AttentionTest, RejectsBadArguments) {
  const Problem<float> pb(Shape{4, 1, 3, 2, 2}, 60);  // N not divisible by G
  std::vector<float> out(pb.q.size()), lse(4 * 3);
  EXPECT_THROW(
      cpu::attention_forward(out.data(), lse.data(), pb.q.data(), pb.k.data(), pb.v.data(), pb.dims, kNoDropout),
      std::invalid_argument);
  AttentionDims good = pb.dims;
  good.G = 3;
  EXPECT_THROW(cpu::attention_forward(out.data(), lse.data(), pb.q.data(), pb.q.data(), pb.q.data(), good,
                                      DropoutSpec{1.0f, 0, 0}),
               std::invalid_argument);
}

}  // namespace
}  // namespace moecore::kernels
