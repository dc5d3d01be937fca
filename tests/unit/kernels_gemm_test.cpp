// GEMM and linear layer: CBLAS version vs the triple-loop reference, and linear_backward vs finite differences.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "kernel_test_util.h"
#include "moecore/kernels/cpu/gemm.h"
#include "moecore/kernels/cpu/wide_linear_backward.h"

namespace moecore::kernels {
namespace {

using test::max_rel_error;
using test::numeric_grad;
using test::random_vector;

// Entries below this magnitude are compared in absolute terms: a float dot product of K O(1) terms carries an
// absolute rounding error ~sqrt(K) * 6e-8 whatever its result, so a result that cancels to nearly zero has a
// large relative error that says nothing about the kernel. Values here are O(1..5).
constexpr double kFloor = 1.0;

template <typename T>
void check_gemm_combo(bool trans_a, bool trans_b, double tolerance) {
  const int64_t M = 37, N = 53, K = 29;
  // Leading dimensions strictly larger than the stored column counts, so padding must be skipped.
  const int64_t a_rows = trans_a ? K : M, a_cols = trans_a ? M : K;
  const int64_t b_rows = trans_b ? N : K, b_cols = trans_b ? K : N;
  const int64_t lda = a_cols + 3, ldb = b_cols + 5, ldc = N + 2;
  const auto A = random_vector<T>(static_cast<size_t>(a_rows * lda), 11);
  const auto B = random_vector<T>(static_cast<size_t>(b_rows * ldb), 12);
  const auto C0 = random_vector<T>(static_cast<size_t>(M * ldc), 13);
  const T alpha = T(0.75), beta = T(-0.5);

  auto C_fast = C0, C_ref = C0;
  cpu::gemm<T>(trans_a, trans_b, M, N, K, alpha, A.data(), lda, B.data(), ldb, beta, C_fast.data(), ldc);
  ref::gemm<T>(trans_a, trans_b, M, N, K, alpha, A.data(), lda, B.data(), ldb, beta, C_ref.data(), ldc);
  EXPECT_LT(max_rel_error(C_fast.data(), C_ref.data(), C_fast.size(), kFloor), tolerance)
      << "trans_a=" << trans_a << " trans_b=" << trans_b;

  // Independent spot check of one entry straight from the definition, and that ldc padding is untouched.
  double expected = 0.0;
  for (int64_t k = 0; k < K; ++k) {
    const double a = trans_a ? A[k * lda + 2] : A[2 * lda + k];
    const double b = trans_b ? B[5 * ldb + k] : B[k * ldb + 5];
    expected += a * b;
  }
  expected = alpha * expected + beta * static_cast<double>(C0[2 * ldc + 5]);
  EXPECT_NEAR(C_fast[2 * ldc + 5], expected, 1e-5);
  for (int64_t i = 0; i < M; ++i) {
    for (int64_t j = N; j < ldc; ++j) EXPECT_EQ(C_fast[i * ldc + j], C0[i * ldc + j]);
  }
}

TEST(GemmTest, AllTransposeCombosMatchReferenceFloat) {
  for (const bool ta : {false, true}) {
    for (const bool tb : {false, true}) check_gemm_combo<float>(ta, tb, 1e-5);
  }
}

struct GemmShape {
  bool trans_a, trans_b;
  int64_t M, N, K;
};

// cpu::gemm<float> on strided operands against the reference within the fp32 summation bound K u sum |alpha a b| +
// u |beta c| per entry, C's padding untouched.
void expect_within_summation_bound(const GemmShape& s, const float alpha, const float beta) {
  constexpr double kUnitRoundoff = 0x1p-24;
  const int64_t a_rows = s.trans_a ? s.K : s.M, a_cols = s.trans_a ? s.M : s.K;
  const int64_t b_rows = s.trans_b ? s.N : s.K, b_cols = s.trans_b ? s.K : s.N;
  const int64_t lda = a_cols + 16, ldb = b_cols + 32, ldc = s.N + 16;
  const auto A = random_vector<float>(static_cast<size_t>(a_rows * lda), 21);
  const auto B = random_vector<float>(static_cast<size_t>(b_rows * ldb), 22);
  const auto C0 = random_vector<float>(static_cast<size_t>(s.M * ldc), 23);
  auto C_fast = C0;
  std::vector<double> C_ref(C0.begin(), C0.end()), abs_A(A.size()), abs_B(B.size()), bound(C0.size(), 0.0);
  for (size_t i = 0; i < A.size(); ++i) abs_A[i] = std::fabs(A[i]);
  for (size_t i = 0; i < B.size(); ++i) abs_B[i] = std::fabs(B[i]);
  const std::vector<double> A64(A.begin(), A.end()), B64(B.begin(), B.end());
  cpu::gemm<float>(s.trans_a, s.trans_b, s.M, s.N, s.K, alpha, A.data(), lda, B.data(), ldb, beta, C_fast.data(), ldc);
  ref::gemm<double>(s.trans_a, s.trans_b, s.M, s.N, s.K, alpha, A64.data(), lda, B64.data(), ldb, beta, C_ref.data(),
                    ldc);
  ref::gemm<double>(s.trans_a, s.trans_b, s.M, s.N, s.K, alpha, abs_A.data(), lda, abs_B.data(), ldb, 0.0, bound.data(),
                    ldc);
  int64_t outside = 0;
  for (int64_t i = 0; i < s.M; ++i) {
    for (int64_t j = 0; j < s.N; ++j) {
      const size_t at = static_cast<size_t>(i * ldc + j);
      const double allowed = (static_cast<double>(s.K) + 2.0) * kUnitRoundoff * bound[at] +
                             2.0 * kUnitRoundoff * (std::fabs(C0[at]) + std::fabs(C_ref[at]));
      outside += std::fabs(C_fast[at] - C_ref[at]) > allowed ? 1 : 0;
    }
    for (int64_t j = s.N; j < ldc; ++j) ASSERT_EQ(C_fast[i * ldc + j], C0[i * ldc + j]) << "ldc padding written";
  }
  EXPECT_EQ(outside, 0) << "M=" << s.M << " N=" << s.N << " K=" << s.K << " trans_a=" << s.trans_a
                        << " trans_b=" << s.trans_b
                        << " matmul=" << cpu::sgemm_uses_matmul(s.trans_a, s.trans_b, s.M, s.N, s.K);
}

// The fp32 GEMM runs some shapes on oneDNN's matmul primitive instead of dnnl_sgemm (cpu::sgemm_uses_matmul): one
// shape of each of the table's rows (but the output layer's weight gradient, too big for the reference here), with
// strided operands, alpha and beta, against the reference, and through the primitive on a CPU where the table applies
// (AVX-512).
TEST(GemmTest, MatmulPrimitiveShapesMatchReference) {
  const GemmShape shapes[] = {
      {false, true, 16, 16384, 512},   // output layer forward
      {true, false, 1024, 192, 256},   // up-projection weight gradient
      {false, true, 32, 256, 1024},    // down-projection forward
      {false, false, 1024, 512, 512},  // 512 -> 512 input gradient
  };
  for (const GemmShape& s : shapes) expect_within_summation_bound(s, 0.75f, 1.0f);
  if (cpu::gemm_library().find("fp32 matmul") == std::string::npos) {
    GTEST_SKIP() << "the fp32 matmul table does not apply on this CPU (" << cpu::gemm_library()
                 << "): the shapes above ran on dnnl_sgemm";
  }
  for (const GemmShape& s : shapes) EXPECT_TRUE(cpu::sgemm_uses_matmul(s.trans_a, s.trans_b, s.M, s.N, s.K));
  EXPECT_TRUE(cpu::sgemm_uses_matmul(true, false, 32000, 512, 512));    // the output layer's weight gradient
  EXPECT_TRUE(cpu::sgemm_uses_matmul(true, false, 512, 512, 2048));     // 512 -> 512 weight gradient
  EXPECT_FALSE(cpu::sgemm_uses_matmul(false, true, 2048, 2048, 2048));  // square: dnnl_sgemm
  EXPECT_FALSE(cpu::sgemm_uses_matmul(false, true, 15, 16384, 512));    // not a multiple of 16: dnnl_sgemm
}

// Accumulating into an fp32 C of >= 8 Mi elements over a short K (an output layer's weight gradient over a chunk of
// rows) runs in blocks of rows through a buffer: M not a multiple of the blocks' rows, both layouts of A.
TEST(GemmTest, AccumulationIntoALargeCMatchesReference) {
  for (const bool trans_a : {true, false}) expect_within_summation_bound({trans_a, false, 16500, 512, 24}, 0.75f, 1.0f);
}

TEST(GemmTest, AllTransposeCombosMatchReferenceDouble) {
  for (const bool ta : {false, true}) {
    for (const bool tb : {false, true}) check_gemm_combo<double>(ta, tb, 1e-12);
  }
}

TEST(GemmTest, BetaZeroIgnoresGarbageInC) {
  const int64_t M = 5, N = 7, K = 3;
  const auto A = random_vector<double>(M * K, 1);
  const auto B = random_vector<double>(K * N, 2);
  std::vector<double> C_fast(M * N, std::numeric_limits<double>::quiet_NaN()), C_ref = C_fast;
  cpu::gemm<double>(false, false, M, N, K, 1.0, A.data(), K, B.data(), N, 0.0, C_fast.data(), N);
  ref::gemm<double>(false, false, M, N, K, 1.0, A.data(), K, B.data(), N, 0.0, C_ref.data(), N);
  EXPECT_LT(max_rel_error(C_fast.data(), C_ref.data(), C_fast.size()), 1e-13);
}

TEST(GemmTest, RejectsTooSmallLeadingDimension) {
  const std::vector<float> buf(100, 1.0f);
  std::vector<float> C(100);
  EXPECT_THROW(cpu::gemm<float>(false, false, 4, 4, 4, 1.0f, buf.data(), 3, buf.data(), 4, 0.0f, C.data(), 4),
               std::invalid_argument);
  EXPECT_THROW(cpu::gemm<float>(false, false, -1, 4, 4, 1.0f, buf.data(), 4, buf.data(), 4, 0.0f, C.data(), 4),
               std::invalid_argument);
}

template <typename T>
void check_linear_matches_reference(bool with_bias, double tolerance) {
  const int64_t n_tokens = 37, in_features = 53, out_features = 31;
  const auto inp_TI = random_vector<T>(n_tokens * in_features, 21);
  const auto weight_OI = random_vector<T>(out_features * in_features, 22);
  const auto bias_O = random_vector<T>(out_features, 23);
  const T* bias = with_bias ? bias_O.data() : nullptr;
  std::vector<T> out_fast(n_tokens * out_features), out_ref(n_tokens * out_features);
  cpu::linear_forward<T>(out_fast.data(), inp_TI.data(), weight_OI.data(), bias, n_tokens, in_features, out_features);
  ref::linear_forward<T>(out_ref.data(), inp_TI.data(), weight_OI.data(), bias, n_tokens, in_features, out_features);
  EXPECT_LT(max_rel_error(out_fast.data(), out_ref.data(), out_fast.size(), kFloor), tolerance);

  // Gradients start non-zero to check accumulation.
  const auto dout_TO = random_vector<T>(n_tokens * out_features, 24);
  auto dinp_fast = random_vector<T>(n_tokens * in_features, 25), dinp_ref = dinp_fast;
  auto dweight_fast = random_vector<T>(out_features * in_features, 26), dweight_ref = dweight_fast;
  auto dbias_fast = random_vector<T>(out_features, 27), dbias_ref = dbias_fast;
  cpu::linear_backward<T>(dinp_fast.data(), dweight_fast.data(), dbias_fast.data(), dout_TO.data(), inp_TI.data(),
                          weight_OI.data(), n_tokens, in_features, out_features);
  ref::linear_backward<T>(dinp_ref.data(), dweight_ref.data(), dbias_ref.data(), dout_TO.data(), inp_TI.data(),
                          weight_OI.data(), n_tokens, in_features, out_features);
  EXPECT_LT(max_rel_error(dinp_fast.data(), dinp_ref.data(), dinp_fast.size(), kFloor), tolerance);
  EXPECT_LT(max_rel_error(dweight_fast.data(), dweight_ref.data(), dweight_fast.size(), kFloor), tolerance);
  EXPECT_LT(max_rel_error(dbias_fast.data(), dbias_ref.data(), dbias_fast.size(), kFloor), tolerance);
}

TEST(LinearTest, MatchesReferenceFloat) {
  check_linear_matches_reference<float>(true, 1e-5);
  check_linear_matches_reference<float>(false, 1e-5);
}

TEST(LinearTest, MatchesReferenceDouble) {
  check_linear_matches_reference<double>(true, 1e-12);
  check_linear_matches_reference<double>(false, 1e-12);
}

// Few tokens, many outputs (the output layer on a logits chunk): the backward runs in blocks of outputs
// (wide_linear_backward.h). Each shape there against the reference, one at each edge of the range, the outputs not a
// multiple of the block; the bits the same on 1 and 2 threads (each block one single-threaded GEMM, the dinp partial
// sums a fixed count).
TEST(LinearTest, WideBackwardMatchesReference) {
  namespace wide = cpu::wide_linear_backward;
  struct Shape {
    int64_t T, I, O;
  };
  for (const Shape s : {Shape{1, 8, wide::kMinOutputs}, Shape{37, 53, wide::kMinOutputs + 77},
                        Shape{wide::kMaxTokens, 64, 2 * wide::kMinOutputs + 300}}) {
    ASSERT_TRUE(wide::applies(s.T, s.I, s.O));
    const auto inp_TI = random_vector<float>(s.T * s.I, 31), weight_OI = random_vector<float>(s.O * s.I, 32);
    const auto dout_TO = random_vector<float>(s.T * s.O, 33);
    const auto dinp0 = random_vector<float>(s.T * s.I, 34), dweight0 = random_vector<float>(s.O * s.I, 35);
    const auto dbias0 = random_vector<float>(s.O, 36);
    auto dinp_ref = dinp0, dweight_ref = dweight0, dbias_ref = dbias0;
    ref::linear_backward<float>(dinp_ref.data(), dweight_ref.data(), dbias_ref.data(), dout_TO.data(), inp_TI.data(),
                                weight_OI.data(), s.T, s.I, s.O);
    std::vector<std::vector<float>> dinp_by_threads, dweight_by_threads;
    const int threads_before = omp_get_max_threads();
    for (const int threads : {1, 2}) {
      omp_set_num_threads(threads);
      auto dinp = dinp0, dweight = dweight0, dbias = dbias0;
      cpu::linear_backward<float>(dinp.data(), dweight.data(), dbias.data(), dout_TO.data(), inp_TI.data(),
                                  weight_OI.data(), s.T, s.I, s.O);
      const std::string where = "T=" + std::to_string(s.T) + " I=" + std::to_string(s.I) + " O=" + std::to_string(s.O) +
                                " threads=" + std::to_string(threads);
      // dinp sums O products of O(1) terms: fp32 rounding errors (2^-24 each) add up as a random walk, sqrt(O) of
      // them, and the largest of T * I entries lies several standard deviations out (the two whole-matrix GEMMs
      // measured 1.9e-5 and 4.0e-5 on the last two shapes, this path 1.3e-5 and 3.5e-5).
      const double dinp_tolerance = 8.0 * std::sqrt(static_cast<double>(s.O)) * std::ldexp(1.0, -24);
      EXPECT_LT(max_rel_error(dinp.data(), dinp_ref.data(), dinp.size(), kFloor), dinp_tolerance) << where;
      EXPECT_LT(max_rel_error(dweight.data(), dweight_ref.data(), dweight.size(), kFloor), 1e-5) << where;
      EXPECT_LT(max_rel_error(dbias.data(), dbias_ref.data(), dbias.size(), kFloor), 1e-5) << where;
      dinp_by_threads.push_back(dinp);
      dweight_by_threads.push_back(dweight);
    }
    omp_set_num_threads(threads_before);
    EXPECT_EQ(dinp_by_threads[0], dinp_by_threads[1]) << "T=" << s.T;
    EXPECT_EQ(dweight_by_threads[0], dweight_by_threads[1]) << "T=" << s.T;
  }
  EXPECT_FALSE(wide::applies(wide::kMaxTokens + 1, 64, wide::kMinOutputs));
  EXPECT_FALSE(wide::applies(64, 64, wide::kMinOutputs - 1));
  EXPECT_FALSE(wide::applies(64, wide::kMaxInputs + 1, wide::kMinOutputs));
}

TEST(LinearTest, NullGradientsAreSkipped) {
  const int64_t T = 4, I = 3, O = 5;
  const auto inp = random_vector<float>(T * I, 1), weight = random_vector<float>(O * I, 2);
  const auto dout = random_vector<float>(T * O, 3);
  auto dweight = random_vector<float>(O * I, 4);
  auto dweight_ref = dweight;
  cpu::linear_backward<float>(nullptr, dweight.data(), nullptr, dout.data(), inp.data(), weight.data(), T, I, O);
  ref::linear_backward<float>(nullptr, dweight_ref.data(), nullptr, dout.data(), inp.data(), weight.data(), T, I, O);
  EXPECT_LT(max_rel_error(dweight.data(), dweight_ref.data(), dweight.size(), kFloor), 1e-5);
}

// loss = sum(linear(inp, weight, bias) * R); each analytic gradient must equal central differences. The loss
// is linear in each argument, so the finite difference is exact up to rounding (~1e-16 |loss| / eps ~ 1e-9
// absolute); the floor 1e-2 turns that into a bound of 1e-8 absolute on small entries.
template <typename Kernel>
void check_linear_grads_fd(Kernel /*tag*/) {
  const int64_t T = 5, I = 7, O = 6;
  const auto inp = random_vector<double>(T * I, 31);
  const auto weight = random_vector<double>(O * I, 32);
  const auto bias = random_vector<double>(O, 33);
  const auto R = random_vector<double>(T * O, 34);
  auto loss = [&](const std::vector<double>& x, const std::vector<double>& w, const std::vector<double>& b) {
    std::vector<double> out(T * O);
    Kernel::forward(out.data(), x.data(), w.data(), b.data(), T, I, O);
    return test::weighted_sum(out, R);
  };
  const auto g_inp = numeric_grad([&](const std::vector<double>& v) { return loss(v, weight, bias); }, inp);
  const auto g_weight = numeric_grad([&](const std::vector<double>& v) { return loss(inp, v, bias); }, weight);
  const auto g_bias = numeric_grad([&](const std::vector<double>& v) { return loss(inp, weight, v); }, bias);

  std::vector<double> dinp(T * I), dweight(O * I), dbias(O);
  Kernel::backward(dinp.data(), dweight.data(), dbias.data(), R.data(), inp.data(), weight.data(), T, I, O);
  EXPECT_LT(max_rel_error(dinp.data(), g_inp.data(), dinp.size(), 1e-2), 1e-6);
  EXPECT_LT(max_rel_error(dweight.data(), g_weight.data(), dweight.size(), 1e-2), 1e-6);
  EXPECT_LT(max_rel_error(dbias.data(), g_bias.data(), dbias.size(), 1e-2), 1e-6);
}

struct CpuLinear {
  static constexpr auto forward = cpu::linear_forward<double>;
  static constexpr auto backward = cpu::linear_backward<double>;
};
struct RefLinear {
  static constexpr auto forward = ref::linear_forward<double>;
  static constexpr auto backward = ref::linear_backward<double>;
};

TEST(LinearTest, BackwardMatchesFiniteDifferencesCpu) { check_linear_grads_fd(CpuLinear{}); }
TEST(LinearTest, BackwardMatchesFiniteDifferencesRef) { check_linear_grads_fd(RefLinear{}); }

}  // namespace
}  // namespace moecore::kernels
