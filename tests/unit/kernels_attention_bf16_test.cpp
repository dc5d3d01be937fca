// The attention's products on bf16 operands (kernels/cpu/attention_products.h, AttentionDims::bf16_products):
//   gemm_bf16 on every unit this CPU has (AMX tiles, AVX512-BF16, the sgemm emulation) against a naive double
//     product of the bf16-rounded operands, in all transpose combinations and at edge sizes (rows / columns not
//     multiples of 16, depths not multiples of 32, the attention's 64 / 128 / 192-deep products);
//   the fast attention with bf16 products on every unit against the reference with bf16 products (which rounds the
//     same operands), forward and backward, plain causal and block attention (documents, context-parallel indices),
//     head dims 64, 128 and 192 with narrower value heads (multi-latent attention), with and without dropout, and at
//     1 and 2 threads (bit for bit);
//   the bf16-product gradients against the exact (fp64, unrounded) gradients of the same bf16 inputs.
// Tolerances are derived from the formats: rounding an operand to bf16 moves a product by at most 2^-9 of its
// magnitude, so two results that each round their operands once differ by at most 2^-8 of the sum of the magnitudes
// of the terms (computed here in double), plus the fp32 evaluation of the sums.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "moecore/kernels/cpu/attention.h"
#include "moecore/kernels/cpu/attention_products.h"
#include "moecore/kernels/cpu/bf16_dot_rate.h"
#include "moecore/tensor/dtype.h"
#include "unit/kernel_test_util.h"

namespace moecore::kernels {
namespace {

using cpu::Bf16ProductUnit;
using test::random_vector;

double bf16_value(const double x) { return bf16_to_fp32(fp32_to_bf16(static_cast<float>(x))); }

// Every unit this CPU can run.
std::vector<Bf16ProductUnit> units() {
  std::vector<Bf16ProductUnit> u;
  for (const Bf16ProductUnit unit : {Bf16ProductUnit::kAmx, Bf16ProductUnit::kAvx512Bf16, Bf16ProductUnit::kEmulated}) {
    if (cpu::bf16_product_unit_usable(unit)) u.push_back(unit);
  }
  return u;
}

struct GemmShape {
  int64_t M, N, K;
};

TEST(AttentionProducts, Bf16GemmMatchesNaiveProductOfRoundedOperands) {
  const std::vector<GemmShape> shapes = {{1, 1, 1},      {3, 5, 7},      {16, 16, 32},  {17, 33, 31},  {31, 15, 33},
                                         {256, 256, 64}, {200, 64, 128}, {37, 96, 192}, {64, 48, 250}, {128, 192, 128}};
  for (const Bf16ProductUnit unit : units()) {
    for (const GemmShape& s : shapes) {
      for (const int combo : {0, 1, 2, 3}) {
        const bool ta = (combo & 1) != 0, tb = (combo & 2) != 0;
        for (const float beta : {0.0f, 1.0f}) {
          SCOPED_TRACE(std::string(cpu::bf16_product_unit_name(unit)) + " M=" + std::to_string(s.M) +
                       " N=" + std::to_string(s.N) + " K=" + std::to_string(s.K) + " ta=" + std::to_string(ta) +
                       " tb=" + std::to_string(tb) + " beta=" + std::to_string(beta));
          // Leading dimensions wider than the operands: the kernels must read strided views.
          const int64_t lda = (ta ? s.M : s.K) + 3, ldb = (tb ? s.K : s.N) + 5, ldc = s.N + 2;
          const auto A = random_vector<float>(static_cast<size_t>((ta ? s.K : s.M) * lda), 1 + s.M);
          const auto B = random_vector<float>(static_cast<size_t>((tb ? s.N : s.K) * ldb), 2 + s.N);
          auto C = random_vector<float>(static_cast<size_t>(s.M * ldc), 3 + s.K);
          const std::vector<float> C0 = C;
          const float alpha = 0.375f;
          cpu::gemm_bf16(unit, ta, tb, s.M, s.N, s.K, alpha, A.data(), lda, B.data(), ldb, beta, C.data(), ldc);
          for (int64_t m = 0; m < s.M; ++m) {
            for (int64_t n = 0; n < ldc; ++n) {
              const size_t at = static_cast<size_t>(m * ldc + n);
              if (n >= s.N) {  // outside C: untouched
                ASSERT_EQ(C[at], C0[at]) << "m=" << m << " n=" << n;
                continue;
              }
              double sum = 0.0, abs_sum = 0.0;
              for (int64_t k = 0; k < s.K; ++k) {
                const double a =
                    bf16_value(ta ? A[static_cast<size_t>(k * lda + m)] : A[static_cast<size_t>(m * lda + k)]);
                const double b =
                    bf16_value(tb ? B[static_cast<size_t>(n * ldb + k)] : B[static_cast<size_t>(k * ldb + n)]);
                sum += a * b;
                abs_sum += std::abs(a * b);
              }
              const double want = alpha * sum + beta * C0[at];
              // fp32 summation of K exact products, the scaling and the add of C: (K + 2) * 2^-24 of the magnitudes.
              const double bound = static_cast<double>(s.K + 2) * 0x1p-24 * (alpha * abs_sum + std::abs(C0[at]));
              ASSERT_LE(std::abs(C[at] - want), bound)
                  << "m=" << m << " n=" << n << " got " << C[at] << " want " << want;
            }
          }
        }
      }
    }
  }
}

// ---- attention ----------------------------------------------------------------------------------------------------

struct Case {
  std::string name;
  int64_t S, B, N, G, d, dv;  // dv 0: d
  int64_t Sk = 0;             // with indices: key rows
  enum Mask { kCausal, kDocuments, kRingStep } mask = kCausal;
  float dropout = 0.0f;
  int64_t value_dim() const { return dv > 0 ? dv : d; }
  int64_t key_rows() const { return Sk > 0 ? Sk : S; }
};

// Inputs that are bf16 values (as under --bf16), in [-2, 2) for q, k (scores up to ~8 in magnitude at d = 64).
std::vector<float> bf16_inputs(const size_t n, const uint64_t seed, const float bound) {
  std::vector<float> x = random_vector<float>(n, seed, -bound, bound);
  for (float& v : x) v = static_cast<float>(bf16_value(v));
  return x;
}

// A case's inputs, masks and dims.
struct Problem {
  explicit Problem(const Case& c)
      : q(bf16_inputs(static_cast<size_t>(c.S * c.B * c.N * c.d), 11, 2.0f)),
        k(bf16_inputs(static_cast<size_t>(c.key_rows() * c.B * c.G * c.d), 12, 2.0f)),
        v(bf16_inputs(static_cast<size_t>(c.key_rows() * c.B * c.G * c.value_dim()), 13, 1.0f)),
        dout(bf16_inputs(static_cast<size_t>(c.S * c.B * c.N * c.value_dim()), 14, 1.0f)),
        dropout{c.dropout, 99, 5} {
    dims.S = c.S;
    dims.B = c.B;
    dims.N = c.N;
    dims.G = c.G;
    dims.head_dim = c.d;
    dims.v_head_dim = c.dv;
    dims.scale = 1.0 / std::sqrt(static_cast<double>(c.d));
    if (c.mask == Case::kDocuments) {  // packed documents of uneven lengths
      for (int64_t s = 0; s < c.S; ++s) {
        for (int64_t b = 0; b < c.B; ++b) docs.push_back(static_cast<int32_t>((s * (b + 3)) / (c.S + 1) + s / 50));
      }
      dims.q_document_SB = dims.k_document_SB = docs.data();
    } else if (c.mask == Case::kRingStep) {  // context parallelism: queries of chunks 1 and 6 of 8, keys of 0..3
      dims.Sk = c.Sk;
      const int64_t chunk = c.S / 2;
      for (int64_t i = 0; i < c.S; ++i) q_index.push_back(i < chunk ? chunk + i : 6 * chunk + (i - chunk));
      for (int64_t j = 0; j < c.Sk; ++j) k_index.push_back(j);
      dims.q_index = q_index.data();
      dims.k_index = k_index.data();
      dims.dropout_seq_len = 8 * chunk;
    }
  }
  bool sees(const int64_t b, const int64_t i, const int64_t j) const {
    const int64_t qi = q_index.empty() ? i : q_index[static_cast<size_t>(i)];
    const int64_t kj = k_index.empty() ? j : k_index[static_cast<size_t>(j)];
    if (kj > qi) return false;
    return docs.empty() || docs[static_cast<size_t>(i * dims.B + b)] == docs[static_cast<size_t>(j * dims.B + b)];
  }

  std::vector<float> q, k, v, dout;
  std::vector<int32_t> docs;
  std::vector<int64_t> q_index, k_index;
  AttentionDims dims;
  DropoutSpec dropout;
};

struct Outputs {
  std::vector<double> out, lse, dq, dk, dv;
};

template <typename T>
std::vector<double> to_double(const std::vector<T>& x) {
  return std::vector<double>(x.begin(), x.end());
}

// Forward, then backward from the forward's own out and lse, gradients from zero. kFast: cpu:: in float, else ref::
// in double.
template <bool kFast>
Outputs run(const Problem& pb, const bool bf16_products) {
  using T = std::conditional_t<kFast, float, double>;
  AttentionDims dims = pb.dims;
  dims.bf16_products = bf16_products;
  const std::vector<T> q(pb.q.begin(), pb.q.end()), k(pb.k.begin(), pb.k.end()), v(pb.v.begin(), pb.v.end()),
      dout(pb.dout.begin(), pb.dout.end());
  std::vector<T> out(dout.size()), lse(static_cast<size_t>(dims.B * dims.N * dims.S)), dq(q.size()), dk(k.size()),
      dv(v.size());
  if constexpr (kFast) {
    cpu::attention_forward(out.data(), lse.data(), q.data(), k.data(), v.data(), dims, pb.dropout);
    cpu::attention_backward(dq.data(), dk.data(), dv.data(), dout.data(), q.data(), k.data(), v.data(), out.data(),
                            lse.data(), dims, pb.dropout);
  } else {
    ref::attention_forward(out.data(), lse.data(), q.data(), k.data(), v.data(), dims, pb.dropout);
    ref::attention_backward(dq.data(), dk.data(), dv.data(), dout.data(), q.data(), k.data(), v.data(), out.data(),
                            lse.data(), dims, pb.dropout);
  }
  return {to_double(out), to_double(lse), to_double(dq), to_double(dk), to_double(dv)};
}

// For every output element the sum of the magnitudes of the terms of its product, in double, with exact
// probabilities P and the dropout multiplier 1 / (1 - p) on every term (an upper bound):
//   out[i]: sum_j P_ij |v_j| / (1 - p)        dv[j]: sum_i P_ij |dout_i| / (1 - p)
//   dq[i]:  sum_j A_ij |k_j|                  dk[j]: sum_i A_ij |q_i|
// with A_ij = scale P_ij (|dP_ij| / (1 - p) + D_i) >= |dS_ij| and D_i = sum_c |dout_ic| out[i, c] (the out magnitude
// above) >= |delta_i| = |dout_i . out_i|.
Outputs magnitudes(const Problem& pb, const Outputs& exact) {
  const AttentionDims& dm = pb.dims;
  const int64_t S = dm.S, Sk = dm.Sk > 0 ? dm.Sk : dm.S, B = dm.B, N = dm.N, G = dm.G, d = dm.head_dim,
                dv = dm.v_head_dim > 0 ? dm.v_head_dim : d;
  const double keep = 1.0 / (1.0 - static_cast<double>(pb.dropout.p));
  Outputs m{std::vector<double>(pb.dout.size()),
            {},
            std::vector<double>(pb.q.size()),
            std::vector<double>(pb.k.size()),
            std::vector<double>(pb.v.size())};
  std::vector<double> P(static_cast<size_t>(Sk)), dP(static_cast<size_t>(Sk));
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < N; ++h) {
      const int64_t g = h / (N / G);
      auto qa = [&](int64_t i, int64_t c) { return static_cast<double>(pb.q[((i * B + b) * N + h) * d + c]); };
      auto ka = [&](int64_t j, int64_t c) { return static_cast<double>(pb.k[((j * B + b) * G + g) * d + c]); };
      auto va = [&](int64_t j, int64_t c) { return static_cast<double>(pb.v[((j * B + b) * G + g) * dv + c]); };
      auto da = [&](int64_t i, int64_t c) { return static_cast<double>(pb.dout[((i * B + b) * N + h) * dv + c]); };
      for (int64_t i = 0; i < S; ++i) {
        const double lse = exact.lse[static_cast<size_t>((b * N + h) * S + i)];
        double* out_mag = m.out.data() + ((i * B + b) * N + h) * dv;
        for (int64_t j = 0; j < Sk; ++j) {
          P[static_cast<size_t>(j)] = 0.0;
          dP[static_cast<size_t>(j)] = 0.0;
          if (!pb.sees(b, i, j) || std::isinf(lse)) continue;
          double s = 0.0, dp = 0.0;
          for (int64_t c = 0; c < d; ++c) s += qa(i, c) * ka(j, c);
          for (int64_t c = 0; c < dv; ++c) dp += da(i, c) * va(j, c);
          P[static_cast<size_t>(j)] = std::exp(s * dm.scale - lse) * keep;
          dP[static_cast<size_t>(j)] = std::abs(dp);
          for (int64_t c = 0; c < dv; ++c) out_mag[c] += P[static_cast<size_t>(j)] * std::abs(va(j, c));
        }
        double D = 0.0;
        for (int64_t c = 0; c < dv; ++c) D += std::abs(da(i, c)) * out_mag[c];
        for (int64_t j = 0; j < Sk; ++j) {
          const double p = P[static_cast<size_t>(j)];
          if (p == 0.0) continue;
          const double a = dm.scale * p / keep * (dP[static_cast<size_t>(j)] * keep + D);
          for (int64_t c = 0; c < dv; ++c)
            m.dv[static_cast<size_t>(((j * B + b) * G + g) * dv + c)] += p * std::abs(da(i, c));
          for (int64_t c = 0; c < d; ++c) {
            m.dq[static_cast<size_t>(((i * B + b) * N + h) * d + c)] += a * std::abs(ka(j, c));
            m.dk[static_cast<size_t>(((j * B + b) * G + g) * d + c)] += a * std::abs(qa(i, c));
          }
        }
      }
    }
  }
  return m;
}

// |got - want| <= factor * magnitude. out and dv (factor 2^-8 + 2^-12): each side rounds each term's bf16 operand
// once (2^-9 of the term each); 2^-12 covers the fp32 evaluation of the scores (d <= 256 products), exp, the row
// sums and dP - delta, all below 2^-15 of the terms at these sizes. dq and dk (factor 2^-7 + 2^-10): each side
// rounds dS once (2^-8 of A together), and each side's delta comes from its own out, which differ by out's bound
// (2^-8 + 2^-12 of D).
::testing::AssertionResult within_bf16_bound(const char* what, const std::vector<double>& got,
                                             const std::vector<double>& want, const std::vector<double>& magnitude,
                                             const double factor) {
  if (got.size() != want.size() || got.size() != magnitude.size()) return ::testing::AssertionFailure() << "sizes";
  for (size_t i = 0; i < got.size(); ++i) {
    const double bound = factor * magnitude[i];
    if (!(std::abs(got[i] - want[i]) <= bound)) {
      return ::testing::AssertionFailure()
             << what << "[" << i << "] = " << got[i] << ", expected " << want[i] << ", bound " << bound;
    }
  }
  return ::testing::AssertionSuccess();
}
constexpr double kProductBound = 0x1p-8 + 0x1p-12, kScoreGradientBound = 0x1p-7 + 0x1p-10;

const std::vector<Case>& cases() {
  static const std::vector<Case> all = {
      {"tiny", 7, 2, 4, 2, 64, 0},
      {"gqa_d64", 130, 2, 4, 2, 64, 0},
      {"mha_d64_dropout", 100, 1, 4, 4, 64, 0, 0, Case::kCausal, 0.2f},
      {"d128", 90, 1, 2, 1, 128, 0},
      {"mla_d192_dv128", 70, 1, 2, 2, 192, 128},
      {"odd_d40_dv24", 45, 2, 2, 1, 40, 24},
      {"documents", 150, 2, 4, 2, 64, 0, 0, Case::kDocuments},
      {"documents_dropout", 120, 1, 2, 1, 64, 0, 0, Case::kDocuments, 0.1f},
      {"ring_step", 64, 1, 4, 2, 64, 0, 128, Case::kRingStep},
      {"ring_step_mla", 48, 1, 2, 1, 192, 128, 96, Case::kRingStep},
  };
  return all;
}

class AttentionBf16 : public ::testing::TestWithParam<size_t> {};

// Fast (bf16 products) against the reference (bf16 products), and both against the exact fp64 attention of the same
// bf16 inputs (no rounding of P and dS): forward and backward.
TEST_P(AttentionBf16, FastMatchesReferenceAndExactWithinBf16Rounding) {
  const Case& c = cases()[GetParam()];
  const Problem pb(c);
  const Outputs reference = run<false>(pb, true);
  const Outputs exact = run<false>(pb, false);
  const Outputs mag = magnitudes(pb, exact);
  for (const Bf16ProductUnit unit : units()) {
    const cpu::ScopedBf16ProductUnit on(unit);
    const Outputs fast = run<true>(pb, true);
    for (const auto& [name, want] :
         {std::pair<const char*, const Outputs*>{"reference", &reference}, {"exact", &exact}}) {
      SCOPED_TRACE(c.name + std::string(" on ") + std::string(cpu::bf16_product_unit_name(unit)) + " vs " + name);
      EXPECT_TRUE(within_bf16_bound("out", fast.out, want->out, mag.out, kProductBound));
      EXPECT_TRUE(within_bf16_bound("dq", fast.dq, want->dq, mag.dq, kScoreGradientBound));
      EXPECT_TRUE(within_bf16_bound("dk", fast.dk, want->dk, mag.dk, kScoreGradientBound));
      EXPECT_TRUE(within_bf16_bound("dv", fast.dv, want->dv, mag.dv, kProductBound));
      // lse does not depend on the rounding of P: fp32 scores only.
      EXPECT_LT(test::max_rel_error(fast.lse, want->lse, 1.0), 1e-5);
    }
  }
  // The reference itself rounds: it differs from the exact attention (a check that cannot pass by accident).
  EXPECT_GT(test::max_abs_error(reference.dq.data(), exact.dq.data(), exact.dq.size()), 0.0);
}

// Every output is a fixed sequence of tile operations whatever the thread count, with bf16 products too.
TEST_P(AttentionBf16, ResultsDoNotDependOnThreadCount) {
  const Case& c = cases()[GetParam()];
  const Problem pb(c);
  const int saved = omp_get_max_threads();
  for (const Bf16ProductUnit unit : units()) {
    SCOPED_TRACE(cpu::bf16_product_unit_name(unit));
    const cpu::ScopedBf16ProductUnit on(unit);
    omp_set_num_threads(1);
    const Outputs one = run<true>(pb, true);
    omp_set_num_threads(2);
    const Outputs two = run<true>(pb, true);
    omp_set_num_threads(saved);
    EXPECT_EQ(one.out, two.out);
    EXPECT_EQ(one.lse, two.lse);
    EXPECT_EQ(one.dq, two.dq);
    EXPECT_EQ(one.dk, two.dk);
    EXPECT_EQ(one.dv, two.dv);
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, AttentionBf16, ::testing::Range<size_t>(0, 10),
                         [](const ::testing::TestParamInfo<size_t>& param) { return cases()[param.param].name; });

TEST(AttentionProducts, PathFromItsNames) {
  EXPECT_EQ(cpu::parse_attention_product_path("bf16"), cpu::AttentionProductPath::kBF16);
  EXPECT_EQ(cpu::parse_attention_product_path("fp32"), cpu::AttentionProductPath::kF32);
  EXPECT_THROW(cpu::parse_attention_product_path("fp16"), std::invalid_argument);
  {
    const cpu::ScopedAttentionProductPath forced(cpu::AttentionProductPath::kF32);
    EXPECT_EQ(cpu::attention_product_path(), cpu::AttentionProductPath::kF32);
  }
}

TEST(AttentionProducts, DefaultUnitIsTheFastestThisCpuHas) {
  const cpu::Bf16ProductUnit unit = cpu::best_bf16_product_unit();
  if (cpu::bf16_product_unit_usable(cpu::Bf16ProductUnit::kAmx)) {
    EXPECT_EQ(unit, cpu::Bf16ProductUnit::kAmx);
  } else if (cpu::avx512_bf16_outpaces_fp32()) {
    EXPECT_EQ(unit, cpu::Bf16ProductUnit::kAvx512Bf16);
  } else {
    EXPECT_EQ(unit, cpu::Bf16ProductUnit::kEmulated);
  }
  if (std::getenv("MOECORE_ATTENTION_PRODUCTS") == nullptr) {
    EXPECT_EQ(cpu::attention_product_path(), unit == cpu::Bf16ProductUnit::kEmulated
                                                 ? cpu::AttentionProductPath::kF32
                                                 : cpu::AttentionProductPath::kBF16);
  }
}

}  // namespace
}  // namespace moecore::kernels
