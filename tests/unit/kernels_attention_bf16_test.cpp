// The attention's products on bf16 operands (kernels/cpu/attention_products.h, AttentionDims::bf16_products):
//   gemm_bf16 on every unit this CPU has (AMX tiles, the sgemm emulation) against a naive double product of the
//     bf16-rounded operands, in all transpose combinations and at edge sizes (rows / columns not multiples of 16,
//     depths not multiples of 32, the attention's 64 / 128 / 192-deep products);
//   the fast attention with bf16 products against the reference with bf16 products (which rounds the same operands),
//     forward and backward, plain causal and block attention (documents, context-parallel indices), head dims 64,
//     128 and 192 with narrower value heads (multi-latent attention), with and without dropout, at 1 and 2 threads;
//   the bf16-product gradients against the exact (fp64, unrounded) gradients of the same bf16 inputs.
// Tolerances are derived from the formats: rounding an operand to bf16 moves a product by at most 2^-9 of its
// magnitude, so two results that each round their operands once differ by at most 2^-8 of the sum of the magnitudes
// of the terms (computed here in double), plus the fp32 evaluation of the sums.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "moecore/kernels/cpu/attention.h"
#include "moecore/kernels/cpu/attention_products.h"
#include "moecore/tensor/dtype.h"
#include "unit/kernel_test_util.h"

namespace moecore::kernels {
namespace {

using cpu::Bf16ProductUnit;
using test::random_vector;

double bf16_value(const double x) { return bf16_to_fp32(fp32_to_bf16(static_cast<float>(x))); }

std::vector<Bf16ProductUnit> units() {
  std::vector<Bf16ProductUnit> u = {Bf16ProductUnit::kEmulated};
  if (cpu::best_bf16_product_unit() == Bf16ProductUnit::kAmx) u.push_back(Bf16ProductUnit::kAmx);
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

}  // namespace
}  // namespace moecore::kernels
