// fp32 GEMM throughput on moecore's shapes, side by side in one run: OpenBLAS's cblas_sgemm as Debian ships it (its
// run-time core detection) and oneDNN's dnnl_sgemm (what moecore uses, kernels/cpu/gemm.h). Row-major, 1 s per
// measurement after a warm-up call.  usage: bench_gemm [THREADS] [--peak]
// --peak: only the 2048^3 square, one machine-readable line: `peak_gflops BEST openblas X onednn Y`.
#include <cblas.h>
#include <dnnl.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string_view>
#include <vector>

#include "moecore/kernels/cpu/gemm.h"

namespace {

struct Shape {
  const char* what;
  int64_t m, n, k;
  bool trans_a, trans_b;
  float beta = 0.0f;  // 1: accumulates into C, as the weight gradients do
};

template <typename F>
double gflops(const Shape& s, F&& f) {
  f();
  const auto start = std::chrono::steady_clock::now();
  int reps = 0;
  double seconds = 0.0;
  do {
    f();
    ++reps;
    seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  } while (seconds < 1.0);
  return 2.0 * static_cast<double>(s.m * s.n * s.k) * reps / seconds / 1e9;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1) omp_set_num_threads(std::atoi(argv[1]));
  const bool peak_only = argc > 2 && std::string_view(argv[2]) == "--peak";
  if (!peak_only) {
    std::printf("threads %d, %s, OpenBLAS core %s\n", omp_get_max_threads(),
                moecore::kernels::cpu::gemm_library().c_str(), openblas_get_corename());
    std::printf("%-50s %12s %12s\n", "shape (M x N x K)", "OpenBLAS", "oneDNN");
  }
  const Shape shapes[] = {
      {"square 2048", 2048, 2048, 2048, false, true},
      {"demo qkv fwd (T=2048, H=192 -> 384)", 2048, 384, 192, false, true},
      {"demo expert fc1 fwd (512 rows, 192 -> 512)", 512, 512, 192, false, true},
      {"demo fc1 weight grad (512x192 over 2048 tokens)", 512, 192, 2048, true, false},
      {"demo output layer fwd (2048 x 50304 x 192)", 2048, 50304, 192, false, true},
      // The e16 model's output layer (vocabulary 32000, hidden 512) per logits chunk of 256 rows (the fp32 chunk of
      // the 32 MiB budget), 512 and 2048 rows.
      {"e16 output fwd (256 x 32000 x 512)", 256, 32000, 512, false, true},
      {"e16 output fwd (512 x 32000 x 512)", 512, 32000, 512, false, true},
      {"e16 output fwd (2048 x 32000 x 512)", 2048, 32000, 512, false, true},
      {"e16 output input grad (256 x 512 x 32000, NN)", 256, 512, 32000, false, false},
      {"e16 output input grad (512 x 512 x 32000, NN)", 512, 512, 32000, false, false},
      {"e16 output input grad (2048 x 512 x 32000, NN)", 2048, 512, 32000, false, false},
      {"e16 output weight grad (32000 x 512 x 256, TN, C +=)", 32000, 512, 256, true, false, 1.0f},
      {"e16 output weight grad (32000 x 512 x 512, TN, C +=)", 32000, 512, 512, true, false, 1.0f},
      {"e16 output weight grad (32000 x 512 x 2048, TN, C +=)", 32000, 512, 2048, true, false, 1.0f},
  };
  for (const Shape& s : shapes) {
    std::vector<float> a(static_cast<size_t>(s.m * s.k)), b(static_cast<size_t>(s.k * s.n)),
        c(static_cast<size_t>(s.m * s.n));
    std::mt19937 gen(1);
    std::normal_distribution<float> normal;
    for (float& x : a) x = normal(gen);
    for (float& x : b) x = normal(gen);
    const int64_t lda = s.trans_a ? s.m : s.k, ldb = s.trans_b ? s.k : s.n;
    const double openblas = gflops(s, [&] {
      cblas_sgemm(CblasRowMajor, s.trans_a ? CblasTrans : CblasNoTrans, s.trans_b ? CblasTrans : CblasNoTrans,
                  static_cast<blasint>(s.m), static_cast<blasint>(s.n), static_cast<blasint>(s.k), 1.0f, a.data(),
                  static_cast<blasint>(lda), b.data(), static_cast<blasint>(ldb), s.beta, c.data(),
                  static_cast<blasint>(s.n));
    });
    const double onednn = gflops(s, [&] {
      dnnl_sgemm(s.trans_a ? 'T' : 'N', s.trans_b ? 'T' : 'N', s.m, s.n, s.k, 1.0f, a.data(), lda, b.data(), ldb,
                 s.beta, c.data(), s.n);
    });
    if (peak_only) {
      std::printf("peak_gflops %.1f openblas %.1f onednn %.1f\n", std::max(openblas, onednn), openblas, onednn);
      return 0;
    }
    std::printf("%-50s %8.1f GF/s %8.1f GF/s\n", s.what, openblas, onednn);
  }
}
