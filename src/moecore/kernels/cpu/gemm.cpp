// Fast GEMM and the linear layer built on it: fp32 through oneDNN's dnnl_sgemm (JIT kernels for the instruction set
// the CPU has, detected at run time: AVX2, AVX-512, ...), fp64 (tests and references only) through OpenBLAS's CBLAS.
#include "moecore/kernels/cpu/gemm.h"

#include <cblas.h>
#include <dnnl.h>

#include <algorithm>
#include <climits>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "moecore/kernels/cpu/blocked_accumulate.h"
#include "moecore/kernels/cpu/onednn_matmul.h"
#include "moecore/kernels/cpu/wide_linear_backward.h"

namespace moecore::kernels::cpu {
namespace {

void check_gemm_args(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb,
                     int64_t ldc) {
  if (M < 0 || N < 0 || K < 0) {
    throw std::invalid_argument("gemm: negative size M=" + std::to_string(M) + " N=" + std::to_string(N) +
                                " K=" + std::to_string(K));
  }
  const int64_t a_cols = trans_a ? M : K;
  const int64_t b_cols = trans_b ? K : N;
  if (lda < std::max<int64_t>(1, a_cols) || ldb < std::max<int64_t>(1, b_cols) || ldc < std::max<int64_t>(1, N)) {
    throw std::invalid_argument("gemm: leading dimension too small (lda=" + std::to_string(lda) +
                                " ldb=" + std::to_string(ldb) + " ldc=" + std::to_string(ldc) + ")");
  }
  const int64_t biggest = std::max({M, N, K, lda, ldb, ldc});
  if (biggest > INT_MAX) throw std::invalid_argument("gemm: size " + std::to_string(biggest) + " exceeds BLAS int");
}

// Shapes on which oneDNN's fp32 matmul primitive (brgemm kernels) ran faster than dnnl_sgemm in sweeps of
// `bench_gemm 2 --choice` (AVX-512, 2 threads; linear layers of hidden 192-2048 at 2048 tokens and the output layer's
// 512-row chunk at vocabulary 32000; bench/RESULTS.md): the output layer's forward at hidden 512-2048 (1.15-1.37x) and
// its weight gradient at hidden 192-512 (1.06-1.21x), the weight gradient of an up-projection (1.13-1.44x) and the
// forward of a down-projection (1.05-1.19x) at hidden 256-512, and a 512 x 512 projection (1.06-1.14x; its input
// gradient 0.97-1.11x). dnnl_sgemm everywhere else, where it ran as fast or faster (up to 2.7x on a 3072 -> 768
// backward). Each dimension a multiple of 16, so the shapes recur step after step and each primitive is compiled once.
// A function of the shape alone: the two kernels differ in the last bits, and a run and its resumption must pick the
// same ones to repeat bit for bit.
bool fp32_matmul_wins(const bool trans_a, const bool trans_b, const int64_t M, const int64_t N, const int64_t K) {
  if (M % 16 != 0 || N % 16 != 0 || K % 16 != 0 || M == 0 || N == 0 || K == 0) return false;
  const bool nt = !trans_a && trans_b, tn = trans_a && !trans_b, nn = !trans_a && !trans_b;
  if (nt && N >= 16384 && K >= 512 && K <= 2048) return true;                           // output layer, forward
  if (tn && M >= 16384 && N >= 192 && N <= 512 && K >= 256) return true;                // output layer, weight gradient
  if (tn && N >= 192 && N <= 512 && M >= 1024 && M >= 3 * N && M <= 4096) return true;  // up-projection wgrad
  if (nt && N >= 256 && N <= 512 && K >= 3 * N && K <= 4 * N) return true;              // down-projection forward
  if ((nt || nn) && N == 512 && K == 512 && M >= 1024) return true;                     // 512 -> 512 forward, dgrad
  return tn && M == 512 && N == 512 && K >= 1024;                                       // 512 -> 512 wgrad
}

bool fp32_matmul_available() {
  static const bool available = [] {
    if (!onednn_matmul_built() || dnnl_get_effective_cpu_isa() < dnnl_cpu_isa_avx512_core) return false;
    MatmulShape probe;
    probe.trans_b = true;
    probe.M = probe.N = probe.K = probe.lda = probe.ldb = probe.ldc = 64;
    return onednn_matmul_impl(probe).rfind("brg:avx512", 0) == 0;
  }();
  return available;
}

}  // namespace

bool sgemm_uses_matmul(const bool trans_a, const bool trans_b, const int64_t M, const int64_t N, const int64_t K) {
  return fp32_matmul_available() && fp32_matmul_wins(trans_a, trans_b, M, N, K);
}

// dnnl_sgemm and the matmul primitive accumulating into a large C lose to the blocks of blocked_accumulate.h over a
// short K: the output layer's weight gradient over a 256-row logits chunk (32128 x 512 x 256) ran at 374-386 GFLOP/s
// with beta 1, 419-434 in blocks (the same bits), while over 512 rows the two kept pace (433-453 against 437-438).
constexpr int64_t kBlockedAccumulateMaxK = 256;

void sgemm(const bool trans_a, const bool trans_b, const int64_t M, const int64_t N, const int64_t K, const float alpha,
           const float* A, const int64_t lda, const float* B, const int64_t ldb, const float beta, float* C,
           const int64_t ldc) {
  if (beta == 1.0f && K <= kBlockedAccumulateMaxK && blocked_accumulate::applies(M, N)) {
    blocked_accumulate::run(M, N, C, ldc, onednn_matmul_threads(),
                            [&](const int64_t m0, const int64_t rows, float* buffer) {
                              const float* a = trans_a ? A + m0 : A + m0 * lda;  // op(A)'s rows m0..
                              sgemm(trans_a, trans_b, rows, N, K, alpha, a, lda, B, ldb, 0.0f, buffer, N);
                            });
    return;
  }
  if (sgemm_uses_matmul(trans_a, trans_b, M, N, K)) {
    const MatmulShape shape{MatmulInput::kF32,      false, trans_a, trans_b, false, M, N, K, lda, ldb, ldc, alpha, beta,
                            onednn_matmul_threads()};
    onednn_matmul("gemm", shape, A, B, C, nullptr);
    return;
  }
  const dnnl_status_t status =
      dnnl_sgemm(trans_a ? 'T' : 'N', trans_b ? 'T' : 'N', M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
  if (status != dnnl_success) {
    throw std::runtime_error("gemm: oneDNN's dnnl_sgemm failed (status " + std::to_string(status) +
                             ") for M=" + std::to_string(M) + " N=" + std::to_string(N) + " K=" + std::to_string(K));
  }
}

std::string gemm_library() {
  const dnnl_version_t* v = dnnl_version();
  std::string isa;
  switch (dnnl_get_effective_cpu_isa()) {
    case dnnl_cpu_isa_sse41: isa = "SSE4.1"; break;
    case dnnl_cpu_isa_avx: isa = "AVX"; break;
    case dnnl_cpu_isa_avx2: isa = "AVX2"; break;
    case dnnl_cpu_isa_avx2_vnni: isa = "AVX2-VNNI"; break;
    case dnnl_cpu_isa_avx512_core: isa = "AVX-512"; break;
    case dnnl_cpu_isa_avx512_core_vnni: isa = "AVX-512 VNNI"; break;
    case dnnl_cpu_isa_avx512_core_bf16: isa = "AVX-512 BF16"; break;
    case dnnl_cpu_isa_avx512_core_amx: isa = "AVX-512 AMX"; break;
    default: isa = "baseline"; break;
  }
  return "oneDNN " + std::to_string(v->major) + "." + std::to_string(v->minor) + "." + std::to_string(v->patch) +
         " sgemm" + (fp32_matmul_available() ? " (fp32 matmul on the shapes it wins)" : "") + ", " + isa + " kernels";
}

template <typename T>
void gemm(const bool trans_a, const bool trans_b, const int64_t M, const int64_t N, const int64_t K, const T alpha,
          const T* A, const int64_t lda, const T* B, const int64_t ldb, const T beta, T* C, const int64_t ldc) {
  check_gemm_args(trans_a, trans_b, M, N, K, lda, ldb, ldc);
  if (M == 0 || N == 0) return;
  const auto op_a = trans_a ? CblasTrans : CblasNoTrans;
  const auto op_b = trans_b ? CblasTrans : CblasNoTrans;
  const auto m = static_cast<blasint>(M), n = static_cast<blasint>(N), k = static_cast<blasint>(K);
  const auto la = static_cast<blasint>(lda), lb = static_cast<blasint>(ldb), lc = static_cast<blasint>(ldc);
  if constexpr (std::is_same_v<T, float>) {
    sgemm(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
  } else {
    cblas_dgemm(CblasRowMajor, op_a, op_b, m, n, k, alpha, A, la, B, lb, beta, C, lc);
  }
}

template <typename T>
void linear_forward(T* out_TO, const T* inp_TI, const T* weight_OI, const T* bias_O, const int64_t n_tokens,
                    const int64_t in_features, const int64_t out_features) {
  T beta = T(0);
  if (bias_O != nullptr) {
#pragma omp parallel for schedule(static) if (n_tokens * out_features > 16384)
    for (int64_t t = 0; t < n_tokens; ++t) std::copy_n(bias_O, out_features, out_TO + t * out_features);
    beta = T(1);
  }
  gemm<T>(false, true, n_tokens, out_features, in_features, T(1), inp_TI, in_features, weight_OI, in_features, beta,
          out_TO, out_features);
}

template <typename T>
void linear_backward(T* dinp_TI, T* dweight_OI, T* dbias_O, const T* dout_TO, const T* inp_TI, const T* weight_OI,
                     const int64_t n_tokens, const int64_t in_features, const int64_t out_features) {
  bool products_done = false;
  if constexpr (std::is_same_v<T, float>) {
    if (dinp_TI != nullptr && dweight_OI != nullptr &&
        wide_linear_backward::applies(n_tokens, in_features, out_features)) {
      wide_linear_backward::run(dinp_TI, dweight_OI, dout_TO, inp_TI, weight_OI, n_tokens, in_features, out_features);
      products_done = true;
    }
  }
  if (!products_done && dinp_TI != nullptr) {
    gemm<T>(false, false, n_tokens, in_features, out_features, T(1), dout_TO, out_features, weight_OI, in_features,
            T(1), dinp_TI, in_features);
  }
  if (!products_done && dweight_OI != nullptr) {
    gemm<T>(true, false, out_features, in_features, n_tokens, T(1), dout_TO, out_features, inp_TI, in_features, T(1),
            dweight_OI, in_features);
  }
  if (dbias_O != nullptr) {
    // Column sums: each thread owns a block of columns and walks all rows, so no two threads share an output.
    constexpr int64_t kBlock = 256;
    const int64_t n_blocks = (out_features + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static) if (n_tokens * out_features > 16384)
    for (int64_t block = 0; block < n_blocks; ++block) {
      const int64_t o_begin = block * kBlock;
      const int64_t o_end = std::min(out_features, o_begin + kBlock);
      for (int64_t t = 0; t < n_tokens; ++t) {
        const T* row = dout_TO + t * out_features;
#pragma omp simd
        for (int64_t o = o_begin; o < o_end; ++o) dbias_O[o] += row[o];
      }
    }
  }
}

#define MOECORE_INSTANTIATE(T)                                                                                 \
  template void gemm<T>(bool, bool, int64_t, int64_t, int64_t, T, const T*, int64_t, const T*, int64_t, T, T*, \
                        int64_t);                                                                              \
  template void linear_forward<T>(T*, const T*, const T*, const T*, int64_t, int64_t, int64_t);                \
  template void linear_backward<T>(T*, T*, T*, const T*, const T*, const T*, int64_t, int64_t, int64_t);
MOECORE_INSTANTIATE(float)
MOECORE_INSTANTIATE(double)
#undef MOECORE_INSTANTIATE

}  // namespace moecore::kernels::cpu
