// Causal GQA attention: fast kernel vs the naive reference, causality, backward vs float64 finite differences
// (with and without dropout), and the dropout mask vs CounterRng evaluated directly from the documented counter.
// Block attention (query / key indices, documents, Sk != S): fast vs reference on packed documents, context-parallel
// chunks and random index sets, rows that see no key, the counters of the dropout mask, and the ring-attention
// identity: a sequence split over context-parallel ranks and key blocks, forward per block + attention_merge and
// backward per block with the final out / lse, equals the one-process attention and its gradients. Value heads of
// another width than the query / key heads (multi-latent attention, AttentionDims::v_head_dim) on all of these paths.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
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
  int64_t dv = 0;  // value head width (0: d)
  int64_t value_dim() const { return dv > 0 ? dv : d; }
};

AttentionDims make_dims(const Shape& shape) {
  AttentionDims dims{shape.S, shape.B, shape.N, shape.G, shape.d, 1.0 / std::sqrt(static_cast<double>(shape.d))};
  dims.v_head_dim = shape.dv;
  return dims;
}

std::string describe(const Shape& s) {
  return "S=" + std::to_string(s.S) + " B=" + std::to_string(s.B) + " N=" + std::to_string(s.N) +
         " G=" + std::to_string(s.G) + " d=" + std::to_string(s.d) + " dv=" + std::to_string(s.dv);
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
        v(random_vector<T>(shape.S * shape.B * shape.G * shape.value_dim(), seed + 2)),
        dout(random_vector<T>(shape.S * shape.B * shape.N * shape.value_dim(), seed + 3)) {}
  AttentionDims dims;
  std::vector<T> q, k, v, dout;
};

template <typename T>
struct Forward {
  std::vector<T> out, lse;
};

template <typename T, bool kFast>
Forward<T> run_forward(const Problem<T>& pb, const DropoutSpec& drop) {
  Forward<T> f{std::vector<T>(pb.dout.size()), std::vector<T>(pb.dims.B * pb.dims.N * pb.dims.S)};
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
  for (const Shape& shape : {Shape{5, 2, 4, 2, 3}, Shape{4, 1, 2, 2, 2}, Shape{6, 1, 3, 1, 2}, Shape{5, 2, 4, 2, 3, 2},
                             Shape{4, 1, 2, 1, 2, 5}}) {
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
void expect_shapes_match_ref(const std::vector<Shape>& shapes, double tol) {
  for (const Shape& shape : shapes) {
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

TEST(AttentionTest, TiledShapesMatchRefFloat) { expect_shapes_match_ref<float>(kTiledShapes, 1e-5); }
TEST(AttentionTest, TiledShapesMatchRefDouble) { expect_shapes_match_ref<double>(kTiledShapes, 1e-12); }

// Value heads narrower and wider than the query / key heads (multi-latent attention: d = 192, dv = 128): one block on
// one thread, several query blocks and key tiles in parallel, GQA, MQA and MHA.
const std::vector<Shape> kValueHeadShapes = {{7, 2, 4, 2, 8, 5},     {65, 2, 4, 1, 12, 8},  {130, 2, 4, 4, 16, 24},
                                             {257, 2, 8, 2, 24, 16}, {300, 1, 8, 1, 8, 12}, {600, 1, 4, 2, 16, 4}};

TEST(AttentionTest, ValueHeadSizeMatchesRefFloat) { expect_shapes_match_ref<float>(kValueHeadShapes, 1e-5); }
TEST(AttentionTest, ValueHeadSizeMatchesRefDouble) { expect_shapes_match_ref<double>(kValueHeadShapes, 1e-12); }

// v_head_dim = head_dim is the default (0): the same bits.
TEST(AttentionTest, ValueHeadSizeEqualToHeadDimIsTheDefault) {
  for (const Shape& shape : {Shape{130, 2, 4, 4, 16}, Shape{600, 1, 4, 2, 16}}) {
    SCOPED_TRACE(describe(shape));
    const Problem<float> pb(shape, 85);
    Problem<float> explicit_dv = pb;
    explicit_dv.dims.v_head_dim = shape.d;
    const Forward<float> a = run_forward<float, true>(pb, kDropout),
                         b = run_forward<float, true>(explicit_dv, kDropout);
    EXPECT_TRUE(a.out == b.out && a.lse == b.lse);
    const Grads<float> ga = run_backward<float, true>(pb, a, kDropout, false);
    const Grads<float> gb = run_backward<float, true>(explicit_dv, a, kDropout, false);
    EXPECT_TRUE(ga.dq == gb.dq && ga.dk == gb.dk && ga.dv == gb.dv);
  }
}

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

// ---- block attention --------------------------------------------------------------------------------------------

// A block problem: S query rows against Sk key rows with their indices and documents (empty: none).
template <typename T>
struct BlockProblem {
  BlockProblem(const Shape& s, int64_t key_rows, uint64_t seed)
      : shape(s),
        Sk(key_rows),
        q(random_vector<T>(s.S * s.B * s.N * s.d, seed, T(-2), T(2))),
        k(random_vector<T>(key_rows * s.B * s.G * s.d, seed + 1, T(-2), T(2))),
        v(random_vector<T>(key_rows * s.B * s.G * s.value_dim(), seed + 2)),
        dout(random_vector<T>(s.S * s.B * s.N * s.value_dim(), seed + 3)) {}
  AttentionDims dims() const {
    AttentionDims dims = make_dims(shape);
    dims.Sk = Sk;
    dims.q_index = q_index.empty() ? nullptr : q_index.data();
    dims.k_index = k_index.empty() ? nullptr : k_index.data();
    dims.q_document_SB = q_doc.empty() ? nullptr : q_doc.data();
    dims.k_document_SB = k_doc.empty() ? nullptr : k_doc.data();
    dims.dropout_seq_len = dropout_seq_len;
    return dims;
  }
  Shape shape;
  int64_t Sk;
  std::vector<int64_t> q_index, k_index;
  std::vector<int32_t> q_doc, k_doc;
  int64_t dropout_seq_len = 0;
  std::vector<T> q, k, v, dout;
};

template <typename T>
Forward<T> block_forward(const bool fast, const BlockProblem<T>& pb, const DropoutSpec& drop) {
  Forward<T> f{std::vector<T>(pb.dout.size(), T(7)), std::vector<T>(pb.shape.B * pb.shape.N * pb.shape.S, T(7))};
  (fast ? cpu::attention_forward<T> : ref::attention_forward<T>)(f.out.data(), f.lse.data(), pb.q.data(), pb.k.data(),
                                                                 pb.v.data(), pb.dims(), drop);
  return f;
}

// Gradients start from the given values (accumulation); out and lse are the forward's or the merged final ones.
template <typename T>
void block_backward(const bool fast, Grads<T>& g, const BlockProblem<T>& pb, const Forward<T>& f,
                    const DropoutSpec& drop) {
  (fast ? cpu::attention_backward<T>
        : ref::attention_backward<T>)(g.dq.data(), g.dk.data(), g.dv.data(), pb.dout.data(), pb.q.data(), pb.k.data(),
                                      pb.v.data(), f.out.data(), f.lse.data(), pb.dims(), drop);
}

template <typename T>
Grads<T> prefilled_grads(const BlockProblem<T>& pb) {
  return {random_vector<T>(pb.q.size(), 91), random_vector<T>(pb.k.size(), 92), random_vector<T>(pb.v.size(), 93)};
}

// Documents of random lengths in [1, max_len] covering the S rows of each batch row: [S, B], ids increasing along the
// sequence from a different start in every batch row.
std::vector<int32_t> random_documents(const int64_t S, const int64_t B, const int64_t max_len, const uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::uniform_int_distribution<int64_t> length(1, max_len);
  std::vector<int32_t> doc_SB(static_cast<size_t>(S * B));
  for (int64_t b = 0; b < B; ++b) {
    auto id = static_cast<int32_t>(100 * b - 7);
    for (int64_t s = 0; s < S; ++id) {
      for (int64_t end = std::min(S, s + length(gen)); s < end; ++s) doc_SB[static_cast<size_t>(s * B + b)] = id;
    }
  }
  return doc_SB;
}

// Context-parallel rank r of cp: chunks r and 2 cp - 1 - r of the 2 cp chunks of `chunk` rows (Megatron's
// load-balanced causal split).
std::vector<int64_t> cp_rows(const int64_t cp, const int64_t r, const int64_t chunk) {
  std::vector<int64_t> rows;
  for (const int64_t c : {r, 2 * cp - 1 - r}) {
    for (int64_t i = 0; i < chunk; ++i) rows.push_back(c * chunk + i);
  }
  return rows;
}

// n distinct values of [0, limit) in random order.
std::vector<int64_t> random_index_set(const int64_t n, const int64_t limit, const uint64_t seed) {
  std::vector<int64_t> all(static_cast<size_t>(limit));
  std::iota(all.begin(), all.end(), 0);
  std::mt19937_64 gen(seed);
  std::shuffle(all.begin(), all.end(), gen);
  all.resize(static_cast<size_t>(n));
  return all;
}

// Rows `rows` of a row-major [R, width] array.
template <typename T>
std::vector<T> take_rows(const std::vector<T>& x, const std::vector<int64_t>& rows, const int64_t width) {
  std::vector<T> out;
  for (const int64_t r : rows) out.insert(out.end(), x.begin() + r * width, x.begin() + (r + 1) * width);
  return out;
}

// x[rows[i]] += part[i] for rows of `width` values.
template <typename T>
void add_rows(std::vector<T>& x, const std::vector<T>& part, const std::vector<int64_t>& rows, const int64_t width) {
  for (size_t i = 0; i < rows.size(); ++i) {
    for (int64_t c = 0; c < width; ++c) x[rows[i] * width + c] += part[i * width + c];
  }
}

// Columns `cols` of each of the `n` rows of a [n, S] array (lse_BNS's sequence axis).
template <typename T>
std::vector<T> take_columns(const std::vector<T>& x, const std::vector<int64_t>& cols, const int64_t S) {
  std::vector<T> out;
  for (size_t r = 0; r < x.size() / static_cast<size_t>(S); ++r) {
    for (const int64_t c : cols) out.push_back(x[r * S + c]);
  }
  return out;
}

// Both vectors have -inf at the same places, no NaN, and agree elsewhere (normwise over the finite entries).
template <typename T>
::testing::AssertionResult lse_agree(const std::vector<T>& got, const std::vector<T>& want, const double tol) {
  std::vector<double> got_finite, want_finite;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isnan(got[i]) || std::isinf(got[i]) != std::isinf(want[i])) {
      return ::testing::AssertionFailure() << "lse " << i << " is " << got[i] << ", expected " << want[i];
    }
    if (std::isinf(got[i])) {
      if (got[i] > 0 || want[i] > 0) return ::testing::AssertionFailure() << "lse " << i << " is +inf";
      continue;
    }
    got_finite.push_back(got[i]);
    want_finite.push_back(want[i]);
  }
  const double error = max_rel_error(got_finite, want_finite, 1.0);
  if (error < tol) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "lse error " << error;
}

template <typename T>
bool all_finite(const std::vector<T>& x) {
  return std::all_of(x.begin(), x.end(), [](const T v) { return std::isfinite(v); });
}

// Block problems of every kind the general path meets, with query blocks of 128, 64 and 32 rows and several key
// tiles: packed documents (self-attention), context-parallel ring steps (diagonal, lower and upper triangle) with and
// without documents, random index sets with Sk != S (rows that see no key), and a key set with gaps in its indices;
// value heads dv wide (0: as wide as the query / key heads).
template <typename T>
std::vector<std::pair<std::string, BlockProblem<T>>> block_problems(const int64_t dv = 0) {
  std::vector<std::pair<std::string, BlockProblem<T>>> out;
  {
    BlockProblem<T> pb(Shape{300, 2, 4, 2, 16, dv}, 300, 110);
    pb.q_doc = pb.k_doc = random_documents(300, 2, 90, 1);
    out.emplace_back("documents", pb);
  }
  // Ring steps of rank r against rank s's keys, cp = 3, chunks of 70 rows: L = 420.
  for (const auto& [r, s] : std::vector<std::pair<int64_t, int64_t>>{{1, 1}, {2, 0}, {0, 2}}) {
    BlockProblem<T> pb(Shape{140, 2, 8, 2, 8, dv}, 140, 120 + static_cast<uint64_t>(r));
    pb.q_index = cp_rows(3, r, 70);
    pb.k_index = cp_rows(3, s, 70);
    pb.dropout_seq_len = 420;
    out.emplace_back("cp_r" + std::to_string(r) + "_s" + std::to_string(s), pb);
    // The same with documents of the whole sequence (THD under context parallelism).
    const std::vector<int32_t> docs = random_documents(420, 2, 150, 2);
    pb.q_doc = take_rows(docs, pb.q_index, 2);
    pb.k_doc = take_rows(docs, pb.k_index, 2);
    out.emplace_back("cp_documents_r" + std::to_string(r) + "_s" + std::to_string(s), pb);
  }
  {
    BlockProblem<T> pb(Shape{150, 2, 4, 1, 12, dv}, 230, 130);  // MQA, 64-row blocks
    pb.q_index = random_index_set(150, 400, 3);
    pb.k_index = random_index_set(230, 380, 4);  // indices from 20: the queries below see no key
    for (int64_t& index : pb.k_index) index += 20;
    pb.dropout_seq_len = 400;
    out.emplace_back("random_indices", pb);
    pb.q_doc = random_documents(150, 2, 40, 5);
    for (int32_t& doc : pb.q_doc) doc %= 3;
    pb.k_doc = random_documents(230, 2, 40, 6);
    for (int32_t& doc : pb.k_doc) doc %= 3;
    out.emplace_back("random_indices_documents", pb);
  }
  {
    BlockProblem<T> pb(Shape{97, 1, 4, 2, 8, dv}, 260, 140);  // queries past the keys; key indices with gaps
    pb.q_index.resize(97);
    std::iota(pb.q_index.begin(), pb.q_index.end(), 500);
    for (int64_t j = 0; j < 260; ++j) pb.k_index.push_back(2 * j + (j > 100 ? 37 : 0));
    pb.dropout_seq_len = 600;
    out.emplace_back("gapped_keys", pb);
  }
  {
    BlockProblem<T> pb(Shape{70, 3, 8, 1, 8, dv}, 200, 150);  // Sk != S without indices: query i sees keys 0..i
    pb.dropout_seq_len = 200;
    out.emplace_back("more_keys_than_queries", pb);
  }
  return out;
}

template <typename T>
void expect_block_matches_ref(const double tol, const int64_t dv = 0) {
  for (const auto& [name, pb] : block_problems<T>(dv)) {
    for (const DropoutSpec& drop : {kNoDropout, kDropout}) {
      SCOPED_TRACE(name + " dv=" + std::to_string(dv) + " p=" + std::to_string(drop.p));
      const Forward<T> fast = block_forward(true, pb, drop);
      const Forward<T> naive = block_forward(false, pb, drop);
      EXPECT_TRUE(all_finite(fast.out));
      EXPECT_LT(normwise_rel_error(fast.out, naive.out), tol);
      EXPECT_TRUE(lse_agree(fast.lse, naive.lse, tol));
      Grads<T> naive_grads = prefilled_grads(pb);
      block_backward(false, naive_grads, pb, fast, drop);
      for (const int threads : {1, 3}) {
        SCOPED_TRACE("threads=" + std::to_string(threads));
        const ThreadCount thread_count(threads);
        Grads<T> fast_grads = prefilled_grads(pb);
        block_backward(true, fast_grads, pb, fast, drop);
        EXPECT_TRUE(all_finite(fast_grads.dq) && all_finite(fast_grads.dk) && all_finite(fast_grads.dv));
        EXPECT_LT(normwise_rel_error(fast_grads.dq, naive_grads.dq), tol);
        EXPECT_LT(normwise_rel_error(fast_grads.dk, naive_grads.dk), tol);
        EXPECT_LT(normwise_rel_error(fast_grads.dv, naive_grads.dv), tol);
      }
    }
  }
}

TEST(BlockAttentionTest, MatchesRefFloat) { expect_block_matches_ref<float>(1e-5); }
TEST(BlockAttentionTest, MatchesRefDouble) { expect_block_matches_ref<double>(1e-12); }
// Value heads 5 wide (narrower than every problem's query / key heads) in float, 20 wide (wider) in double.
TEST(BlockAttentionTest, ValueHeadSizeMatchesRefFloat) { expect_block_matches_ref<float>(1e-5, 5); }
TEST(BlockAttentionTest, ValueHeadSizeMatchesRefDouble) { expect_block_matches_ref<double>(1e-12, 20); }

// The mask, pair by pair: key j is visible to query i iff k_index[j] <= q_index[i] and the documents agree. Changing
// the values of the keys a query row does not see leaves its output unchanged; a row that sees no key has out 0 and
// lse -inf, on both backends.
TEST(BlockAttentionTest, RowsDependOnlyOnVisibleKeys) {
  for (auto [name, pb] : block_problems<double>()) {
    SCOPED_TRACE(name);
    const AttentionDims dims = pb.dims();
    const Shape& sh = pb.shape;
    const int64_t i = sh.S / 2, b = sh.B - 1;  // one query row (i, b)
    auto sees = [&](const int64_t j) {
      const int64_t qi = dims.q_index ? dims.q_index[i] : i, kj = dims.k_index ? dims.k_index[j] : j;
      return kj <= qi &&
             (dims.q_document_SB == nullptr || dims.q_document_SB[i * sh.B + b] == dims.k_document_SB[j * sh.B + b]);
    };
    int64_t n_visible = 0;
    for (int64_t j = 0; j < pb.Sk; ++j) n_visible += sees(j);
    for (const bool fast : {true, false}) {
      const Forward<double> before = block_forward(fast, pb, kDropout);
      BlockProblem<double> changed = pb;
      for (int64_t j = 0; j < pb.Sk; ++j) {
        if (sees(j)) continue;
        for (int64_t c = 0; c < sh.G * sh.d; ++c) {
          changed.k[(j * sh.B + b) * sh.G * sh.d + c] += 1.5;
          changed.v[(j * sh.B + b) * sh.G * sh.d + c] -= 0.5;
        }
      }
      const Forward<double> after = block_forward(fast, changed, kDropout);
      for (int64_t h = 0; h < sh.N; ++h) {
        const int64_t row = ((i * sh.B + b) * sh.N + h) * sh.d, at = (b * sh.N + h) * sh.S + i;
        EXPECT_LT(test::max_abs_error(after.out.data() + row, before.out.data() + row, sh.d), 1e-14) << fast;
        EXPECT_EQ(after.lse[at], before.lse[at]) << fast;
        if (n_visible == 0) {
          EXPECT_EQ(before.lse[at], -std::numeric_limits<double>::infinity()) << fast;
          EXPECT_EQ(test::max_abs_error(before.out.data() + row, std::vector<double>(sh.d).data(), sh.d), 0.0);
        } else {
          EXPECT_TRUE(std::isfinite(before.lse[at])) << fast;
        }
      }
    }
  }
}

// The random index problems hold rows that see no key at all; their gradients are zero, everything stays finite.
TEST(BlockAttentionTest, RowsWithoutKeysGiveZeros) {
  for (auto [name, pb] : block_problems<double>()) {
    if (name.rfind("random_indices", 0) != 0) continue;
    SCOPED_TRACE(name);
    const Shape& sh = pb.shape;
    for (const bool fast : {true, false}) {
      const Forward<double> f = block_forward(fast, pb, kDropout);
      Grads<double> g{std::vector<double>(pb.q.size()), std::vector<double>(pb.k.size()),
                      std::vector<double>(pb.v.size())};
      block_backward(fast, g, pb, f, kDropout);
      int64_t empty_rows = 0;
      for (int64_t b = 0; b < sh.B; ++b) {
        for (int64_t i = 0; i < sh.S; ++i) {
          if (f.lse[(b * sh.N) * sh.S + i] != -std::numeric_limits<double>::infinity()) continue;
          ++empty_rows;
          for (int64_t c = 0; c < sh.N * sh.d; ++c) {
            EXPECT_EQ(f.out[(i * sh.B + b) * sh.N * sh.d + c], 0.0);
            EXPECT_EQ(g.dq[(i * sh.B + b) * sh.N * sh.d + c], 0.0);
          }
        }
      }
      EXPECT_GT(empty_rows, 0) << fast;
      EXPECT_TRUE(all_finite(g.dq) && all_finite(g.dk) && all_finite(g.dv)) << fast;
    }
  }
}

// Identity indices and one document take the general path and give the plain path's results.
TEST(BlockAttentionTest, IdentityIndicesEqualThePlainPath) {
  for (const Shape& shape : {Shape{600, 1, 4, 2, 16}, Shape{257, 2, 8, 2, 8}, Shape{130, 2, 4, 4, 16}}) {
    for (const DropoutSpec& drop : {kNoDropout, kDropout}) {
      SCOPED_TRACE(describe(shape) + " p=" + std::to_string(drop.p));
      BlockProblem<float> plain(shape, shape.S, 160);
      BlockProblem<float> general = plain;
      general.q_index.resize(shape.S);
      std::iota(general.q_index.begin(), general.q_index.end(), 0);
      general.k_index = general.q_index;
      general.q_doc = general.k_doc = std::vector<int32_t>(shape.S * shape.B, 4);
      const Forward<float> a = block_forward(true, plain, drop), b = block_forward(true, general, drop);
      EXPECT_LT(normwise_rel_error(b.out, a.out), 1e-6);
      EXPECT_LT(max_rel_error(b.lse, a.lse, 1.0), 1e-6);
      Grads<float> ga = prefilled_grads(plain), gb = prefilled_grads(general);
      block_backward(true, ga, plain, a, drop);
      block_backward(true, gb, general, a, drop);
      EXPECT_LT(normwise_rel_error(gb.dq, ga.dq), 1e-6);
      EXPECT_LT(normwise_rel_error(gb.dk, ga.dk), 1e-6);
      EXPECT_LT(normwise_rel_error(gb.dv, ga.dv), 1e-6);
    }
  }
}

// With head_dim = Sk and v[j] = e_j, out row i is the dropped probability row itself: the mask is CounterRng at
// ((b * N + h) * L + q_index[i]) * L + k_index[j].
TEST(BlockAttentionTest, DropoutMaskFollowsTheGlobalCounters) {
  const Shape shape{40, 2, 2, 1, 48};
  BlockProblem<double> pb(shape, 48, 170);
  pb.q_index = random_index_set(40, 100, 7);
  pb.k_index = random_index_set(48, 100, 8);
  pb.dropout_seq_len = 100;
  std::fill(pb.v.begin(), pb.v.end(), 0.0);
  for (int64_t j = 0; j < pb.Sk; ++j) {
    for (int64_t b = 0; b < shape.B; ++b) pb.v[(j * shape.B + b) * shape.d + j] = 1.0;
  }
  const DropoutSpec drop{0.3f, 99, 5};
  for (const bool fast : {true, false}) {
    const Forward<double> plain = block_forward(fast, pb, kNoDropout), dropped = block_forward(fast, pb, drop);
    const CounterRng rng(drop.seed, drop.key);
    int64_t n_visible = 0, n_mismatch = 0;
    double worst = 0.0;
    for (int64_t b = 0; b < shape.B; ++b) {
      for (int64_t h = 0; h < shape.N; ++h) {
        for (int64_t i = 0; i < shape.S; ++i) {
          for (int64_t j = 0; j < pb.Sk; ++j) {
            if (pb.k_index[j] > pb.q_index[i]) continue;
            const size_t at = ((i * shape.B + b) * shape.N + h) * shape.d + j;
            const auto counter = static_cast<uint64_t>(((b * shape.N + h) * 100 + pb.q_index[i]) * 100 + pb.k_index[j]);
            const bool expect_drop = rng.uniform(counter) < drop.p;
            const double expected = expect_drop ? 0.0 : plain.out[at] / (1.0 - drop.p);
            n_mismatch += (dropped.out[at] == 0.0) != expect_drop;
            worst = std::max(worst, std::abs(dropped.out[at] - expected));
            ++n_visible;
          }
        }
      }
    }
    EXPECT_GT(n_visible, 1000);
    EXPECT_EQ(n_mismatch, 0) << fast;
    EXPECT_LT(worst, 1e-12) << fast;
  }
}

// The block path gives the same bits at every thread count, as the plain one.
TEST(BlockAttentionTest, ResultsDoNotDependOnThreadCount) {
  for (auto [name, pb] : block_problems<float>()) {
    for (const DropoutSpec& drop : {kNoDropout, kDropout}) {
      SCOPED_TRACE(name + " p=" + std::to_string(drop.p));
      Forward<float> f1;
      Grads<float> g1 = prefilled_grads(pb);
      {
        const ThreadCount one_thread(1);
        f1 = block_forward(true, pb, drop);
        block_backward(true, g1, pb, f1, drop);
      }
      for (const int threads : {2, 4}) {
        const ThreadCount thread_count(threads);
        const Forward<float> f = block_forward(true, pb, drop);
        Grads<float> g = prefilled_grads(pb);
        block_backward(true, g, pb, f1, drop);
        EXPECT_TRUE(f.out == f1.out && f.lse == f1.lse) << threads;
        EXPECT_TRUE(g.dq == g1.dq && g.dk == g1.dk && g.dv == g1.dv) << threads;
      }
    }
  }
}

void expect_block_backward_matches_finite_differences(const BlockProblem<double>& pb) {
  const ThreadCount one_thread(1);
  for (const DropoutSpec& drop : {kNoDropout, kDropout}) {
    for (const bool fast : {true, false}) {
      SCOPED_TRACE(std::string(fast ? "cpu" : "ref") + " dv=" + std::to_string(pb.shape.dv) +
                   " p=" + std::to_string(drop.p));
      auto loss_of = [&](int which) {
        return [&pb, &drop, fast, which](const std::vector<double>& x) {
          BlockProblem<double> perturbed = pb;
          (which == 0 ? perturbed.q : which == 1 ? perturbed.k : perturbed.v) = x;
          return test::weighted_sum(block_forward(fast, perturbed, drop).out, pb.dout);
        };
      };
      Grads<double> analytic{std::vector<double>(pb.q.size()), std::vector<double>(pb.k.size()),
                             std::vector<double>(pb.v.size())};
      block_backward(fast, analytic, pb, block_forward(fast, pb, drop), drop);
      EXPECT_LT(max_rel_error(analytic.dq, test::numeric_grad(loss_of(0), pb.q), 1e-3), 1e-6);
      EXPECT_LT(max_rel_error(analytic.dk, test::numeric_grad(loss_of(1), pb.k), 1e-3), 1e-6);
      EXPECT_LT(max_rel_error(analytic.dv, test::numeric_grad(loss_of(2), pb.v), 1e-3), 1e-6);
    }
  }
}

// d(sum(out * dout)) / d(q, k, v) by central differences against the analytic backward, on block problems (indices,
// documents, Sk != S, rows without keys), with value heads as wide as, narrower than and wider than the q / k heads.
TEST(BlockAttentionTest, BackwardMatchesFiniteDifferences) {
  for (const int64_t dv : {0, 2, 5}) {
    BlockProblem<double> pb(Shape{6, 2, 4, 2, 3, dv}, 7, 180);
    pb.q_index = {3, 9, 4, 12, 0, 7};
    pb.k_index = {2, 8, 3, 11, 5, 1, 13};
    pb.q_doc = {1, 2, 1, 2, 2, 2, 1, 2, 1, 1, 2, 2};
    pb.k_doc = {1, 2, 2, 2, 1, 1, 2, 1, 1, 2, 1, 1, 2, 2};
    pb.dropout_seq_len = 14;
    expect_block_backward_matches_finite_differences(pb);
  }
}

// Ring attention over cp ranks: rank r holds rows chunks r and 2 cp - 1 - r of the sequence; at step t it attends
// to the keys of rank (r - t) mod cp, merges the block into its (out, lse), and in backward runs each block with the
// final out and lse, adding dq and sending the block's dk, dv home. Gathered over ranks this is the one-process
// attention (forward, lse, dq, dk, dv), with and without dropout and documents, with value heads dv wide (0: d).
template <typename T>
void expect_ring_split_equals_whole(const bool fast, const int64_t cp, const bool documents, const DropoutSpec& drop,
                                    const double tol, const int64_t dv = 0) {
  const int64_t chunk = 23, L = 2 * cp * chunk;
  const Shape whole_shape{L, 2, 4, 2, 8, dv};
  const Shape& sh = whole_shape;
  BlockProblem<T> whole(whole_shape, L, 200 + static_cast<uint64_t>(cp));
  if (documents) whole.q_doc = whole.k_doc = random_documents(L, sh.B, 40, 9);
  const Forward<T> want = block_forward(fast, whole, drop);
  Grads<T> want_grads{std::vector<T>(whole.q.size()), std::vector<T>(whole.k.size()), std::vector<T>(whole.v.size())};
  block_backward(fast, want_grads, whole, want, drop);

  const int64_t q_width = sh.B * sh.N * sh.d, kv_width = sh.B * sh.G * sh.d;
  const int64_t out_width = sh.B * sh.N * sh.value_dim(), v_width = sh.B * sh.G * sh.value_dim();
  Forward<T> got{std::vector<T>(whole.dout.size()), std::vector<T>(want.lse.size())};
  Grads<T> got_grads{std::vector<T>(whole.q.size()), std::vector<T>(whole.k.size()), std::vector<T>(whole.v.size())};
  // A rank's block problem against rank s's keys.
  auto block = [&](const int64_t r, const int64_t s) {
    BlockProblem<T> pb(Shape{2 * chunk, sh.B, sh.N, sh.G, sh.d, sh.dv}, 2 * chunk, 0);
    pb.q_index = cp_rows(cp, r, chunk);
    pb.k_index = cp_rows(cp, s, chunk);
    pb.q = take_rows(whole.q, pb.q_index, q_width);
    pb.dout = take_rows(whole.dout, pb.q_index, out_width);
    pb.k = take_rows(whole.k, pb.k_index, kv_width);
    pb.v = take_rows(whole.v, pb.k_index, v_width);
    if (documents) {
      pb.q_doc = take_rows(whole.q_doc, pb.q_index, sh.B);
      pb.k_doc = take_rows(whole.k_doc, pb.k_index, sh.B);
    }
    pb.dropout_seq_len = L;
    return pb;
  };
  for (int64_t r = 0; r < cp; ++r) {
    Forward<T> acc;
    for (int64_t t = 0; t < cp; ++t) {
      const BlockProblem<T> pb = block(r, ((r - t) % cp + cp) % cp);
      const Forward<T> part = block_forward(fast, pb, drop);
      if (t == 0) {
        acc = part;
        continue;
      }
      const AttentionDims dims = pb.dims();
      (fast ? cpu::attention_merge<T> : ref::attention_merge<T>)(acc.out.data(), acc.lse.data(), part.out.data(),
                                                                 part.lse.data(), dims);
    }
    const std::vector<int64_t> rows = cp_rows(cp, r, chunk);
    EXPECT_LT(normwise_rel_error(acc.out, take_rows(want.out, rows, out_width)), tol) << "rank " << r;
    EXPECT_TRUE(lse_agree(acc.lse, take_columns(want.lse, rows, L), tol)) << "rank " << r;
    add_rows(got.out, acc.out, rows, out_width);
    // Backward in the reverse ring order, every block with the final out and lse.
    std::vector<T> dq(rows.size() * q_width);
    for (int64_t t = cp - 1; t >= 0; --t) {
      const int64_t s = ((r - t) % cp + cp) % cp;
      const BlockProblem<T> pb = block(r, s);
      Grads<T> g{std::move(dq), std::vector<T>(pb.k.size()), std::vector<T>(pb.v.size())};
      block_backward(fast, g, pb, acc, drop);
      dq = std::move(g.dq);
      add_rows(got_grads.dk, g.dk, pb.k_index, kv_width);
      add_rows(got_grads.dv, g.dv, pb.k_index, v_width);
    }
    add_rows(got_grads.dq, dq, rows, q_width);
  }
  EXPECT_LT(normwise_rel_error(got.out, want.out), tol);
  EXPECT_LT(normwise_rel_error(got_grads.dq, want_grads.dq), tol);
  EXPECT_LT(normwise_rel_error(got_grads.dk, want_grads.dk), tol);
  EXPECT_LT(normwise_rel_error(got_grads.dv, want_grads.dv), tol);
}

template <typename T>
void expect_ring_splits(const double tol) {
  for (const int64_t cp : {2, 3, 4}) {
    for (const bool documents : {false, true}) {
      for (const DropoutSpec& drop : {kNoDropout, kDropout}) {
        for (const bool fast : {true, false}) {
          if (!fast && (cp != 2 || sizeof(T) == sizeof(float))) continue;  // the reference is slow: one case each
          SCOPED_TRACE(std::string(fast ? "cpu" : "ref") + " cp=" + std::to_string(cp) +
                       " documents=" + std::to_string(documents) + " p=" + std::to_string(drop.p));
          expect_ring_split_equals_whole<T>(fast, cp, documents, drop, tol);
        }
      }
    }
  }
}

TEST(BlockAttentionTest, RingSplitEqualsWholeFloat) { expect_ring_splits<float>(1e-5); }
TEST(BlockAttentionTest, RingSplitEqualsWholeDouble) { expect_ring_splits<double>(1e-12); }

// The ring with value heads narrower (multi-latent attention) and wider than the query / key heads (d = 8): the
// merge and the per-block backward with the final out and lse work on dv-wide rows.
TEST(BlockAttentionTest, RingSplitEqualsWholeWithValueHeadSize) {
  for (const int64_t dv : {5, 12}) {
    for (const int64_t cp : {2, 3}) {
      for (const bool fast : {true, false}) {
        if (!fast && cp != 2) continue;  // the reference is slow: one case
        SCOPED_TRACE(std::string(fast ? "cpu" : "ref") + " dv=" + std::to_string(dv) + " cp=" + std::to_string(cp));
        expect_ring_split_equals_whole<float>(fast, cp, true, kDropout, 1e-5, dv);
        expect_ring_split_equals_whole<double>(fast, cp, true, kDropout, 1e-12, dv);
      }
    }
  }
}

void expect_merge_handles_rows_without_keys(const Shape& shape) {
  SCOPED_TRACE(describe(shape));
  const AttentionDims dims = make_dims(shape);
  const int64_t width = shape.value_dim();
  const double inf = std::numeric_limits<double>::infinity();
  const std::vector<double> lse_a = {0.5, -inf, 2.0, -inf, 1.0, 30.0, -2.0, -inf, 0.0, 1.0, 2.0, 3.0};
  const std::vector<double> lse_b = {-inf, 1.5, 2.5, -inf, 1.0, -30.0, 0.0, 0.7, -inf, 3.0, 2.0, 1.0};
  const std::vector<double> out_a = random_vector<double>(3 * 2 * 2 * width, 210),
                            out_b = random_vector<double>(3 * 2 * 2 * width, 211);
  for (const bool fast : {true, false}) {
    std::vector<double> out = out_a, lse = lse_a;
    (fast ? cpu::attention_merge<double> : ref::attention_merge<double>)(out.data(), lse.data(), out_b.data(),
                                                                         lse_b.data(), dims);
    for (int64_t bh = 0; bh < 4; ++bh) {
      for (int64_t i = 0; i < 3; ++i) {
        const size_t at = static_cast<size_t>(bh * 3 + i);
        const double a = lse_a[at], b = lse_b[at];
        const double want_lse = std::max(a, b) == -inf ? -inf : std::log(std::exp(a) + std::exp(b));
        EXPECT_EQ(std::isinf(lse[at]), std::isinf(want_lse)) << at;
        if (!std::isinf(want_lse)) {
          EXPECT_NEAR(lse[at], want_lse, 1e-12) << at;
        }
        for (int64_t c = 0; c < width; ++c) {
          const size_t o = static_cast<size_t>((i * 4 + bh) * width + c);
          double want = out_a[o];  // both -inf: untouched
          if (!std::isinf(want_lse)) {
            want = (a == -inf ? 0.0 : std::exp(a - want_lse) * out_a[o]) +
                   (b == -inf ? 0.0 : std::exp(b - want_lse) * out_b[o]);
          }
          EXPECT_NEAR(out[o], want, 1e-12) << "fast=" << fast << " row " << at << " channel " << c;
        }
      }
    }
  }
}

// attention_merge on its own: -inf on either side, both, neither; fast vs reference vs the formula.
// Rows are dv wide: v_head_dim 0 (head_dim 5), 3 and 7.
TEST(BlockAttentionTest, MergeHandlesRowsWithoutKeys) {
  for (const int64_t dv : {0, 3, 7}) {
    expect_merge_handles_rows_without_keys(Shape{3, 2, 2, 2, 5, dv});
  }
}

TEST(BlockAttentionTest, RejectsBadArguments) {
  BlockProblem<float> pb(Shape{4, 1, 2, 2, 2}, 5, 220);
  std::vector<float> out(pb.q.size()), lse(8);
  const auto forward = [&](const BlockProblem<float>& p, const DropoutSpec& drop) {
    for (const bool fast : {true, false}) {
      EXPECT_THROW((fast ? cpu::attention_forward<float> : ref::attention_forward<float>)(out.data(), lse.data(),
                                                                                          p.q.data(), p.k.data(),
                                                                                          p.v.data(), p.dims(), drop),
                   std::invalid_argument);
    }
  };
  BlockProblem<float> docs_one_side = pb;
  docs_one_side.q_doc = std::vector<int32_t>(4, 0);
  forward(docs_one_side, kNoDropout);
  BlockProblem<float> negative = pb;
  negative.k_index = {0, 1, -2, 3, 4};
  forward(negative, kNoDropout);
  BlockProblem<float> past_dropout_len = pb;
  past_dropout_len.q_index = {0, 1, 2, 9};
  past_dropout_len.dropout_seq_len = 8;
  forward(past_dropout_len, kDropout);
  BlockProblem<float> keys_past_len = pb;  // 5 key rows, identity indices, L = 4
  forward(keys_past_len, kDropout);
  BlockProblem<float> negative_value_dim = pb;
  negative_value_dim.shape.dv = -1;
  forward(negative_value_dim, kNoDropout);
  AttentionDims merge_dims = negative_value_dim.dims();
  for (const bool fast : {true, false}) {
    EXPECT_THROW((fast ? cpu::attention_merge<float> : ref::attention_merge<float>)(out.data(), lse.data(), out.data(),
                                                                                    lse.data(), merge_dims),
                 std::invalid_argument);
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
