// fp32 GEMM throughput on moecore's shapes, side by side in one run: OpenBLAS's cblas_sgemm as Debian ships it (its
// run-time core detection) and oneDNN's dnnl_sgemm (what moecore uses, kernels/cpu/gemm.h). Row-major, 1 s per
// measurement after a warm-up call; the last column is moecore's kernels::cpu::sgemm, which runs dnnl_sgemm or oneDNN's
// fp32 matmul primitive by shape (sgemm_uses_matmul).  usage: bench_gemm [THREADS] [--peak | --choice]
// --peak: only the 2048^3 square, one machine-readable line: `peak_gflops BEST openblas X onednn Y`.
// --choice: dnnl_sgemm against the matmul primitive on the linear layers of hidden 192-2048 (2048 tokens; H -> H,
//   3H, 4H and 4H -> H; forward NT, input gradient NN, weight gradient TN with C +=) and the output layer's 512-row
//   chunk at vocabulary 32000, 0.3 s each, alternating; marks the shapes where sgemm's pick is >= 5% slower than the
//   other kernel.
#include <cblas.h>
#include <dnnl.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "moecore/kernels/cpu/gemm.h"
#include "moecore/kernels/cpu/onednn_matmul.h"

namespace {

struct Shape {
  const char* what;
  int64_t m, n, k;
  bool trans_a, trans_b;
  float beta = 0.0f;  // 1: accumulates into C, as the weight gradients do
};

template <typename F>
double gflops(const Shape& s, F&& f, const double min_seconds = 1.0) {
  f();
  const auto start = std::chrono::steady_clock::now();
  int reps = 0;
  double seconds = 0.0;
  do {
    f();
    ++reps;
    seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  } while (seconds < min_seconds);
  return 2.0 * static_cast<double>(s.m * s.n * s.k) * reps / seconds / 1e9;
}

// A and B of normal draws, C zeros, and the leading dimensions of A and B.
struct Operands {
  std::vector<float> a, b, c;
  int64_t lda, ldb;
};
Operands operands(const Shape& s) {
  Operands o{std::vector<float>(static_cast<size_t>(s.m * s.k)), std::vector<float>(static_cast<size_t>(s.k * s.n)),
             std::vector<float>(static_cast<size_t>(s.m * s.n)), s.trans_a ? s.m : s.k, s.trans_b ? s.k : s.n};
  std::mt19937 gen(1);
  std::normal_distribution<float> normal;
  for (float& x : o.a) x = normal(gen);
  for (float& x : o.b) x = normal(gen);
  return o;
}

// The --choice sweep: dnnl_sgemm and the fp32 matmul primitive side by side, best of three alternating rounds.
void choice_sweep() {
  namespace cpu = moecore::kernels::cpu;
  std::printf("threads %d, %s\n", omp_get_max_threads(), cpu::gemm_library().c_str());
  std::printf("%-28s %6s %6s %6s %9s %9s %7s  %s\n", "shape", "M", "N", "K", "sgemm", "matmul", "ratio", "pick");
  std::vector<Shape> shapes;
  std::vector<std::string> names;
  // The forward (NT), input gradient (NN) and weight gradient (TN, C +=) of a linear layer I -> O over T rows.
  const auto add_linear = [&](const std::string& name, const int64_t T, const int64_t I, const int64_t O) {
    shapes.push_back({"", T, O, I, false, true});
    names.push_back(name + " fwd NT");
    shapes.push_back({"", T, I, O, false, false, 1.0f});
    names.push_back(name + " dgrad NN");
    shapes.push_back({"", O, I, T, true, false, 1.0f});
    names.push_back(name + " wgrad TN");
  };
  const int64_t tokens = 2048, chunk_rows = 512, vocab = 32000;
  for (const int64_t H : {192, 256, 384, 512, 768, 1024, 2048}) {
    for (const auto& [I, O] : {std::pair{H, H}, std::pair{H, 3 * H}, std::pair{H, 4 * H}, std::pair{4 * H, H}}) {
      add_linear(std::to_string(I) + "->" + std::to_string(O), tokens, I, O);
    }
    add_linear("output H" + std::to_string(H), chunk_rows, H, vocab);
    // Half the rows: the chunk of fp32 logits under 16-bit activations on the convert path (model/vocab_parallel.h).
    add_linear("output/2 H" + std::to_string(H), chunk_rows / 2, H, vocab);
  }
  int wrong = 0;
  for (size_t i = 0; i < shapes.size(); ++i) {
    const Shape& s = shapes[i];
    auto [a, b, c, lda, ldb] = operands(s);
    const cpu::MatmulShape shape{
        cpu::MatmulInput::kF32, false, s.trans_a, s.trans_b, false, s.m, s.n, s.k, lda, ldb, s.n, 1.0f, s.beta,
        omp_get_max_threads()};
    double sgemm = 0.0, matmul = 0.0;
    for (int round = 0; round < 3; ++round) {
      sgemm = std::max(sgemm, gflops(
                                  s,
                                  [&] {
                                    dnnl_sgemm(s.trans_a ? 'T' : 'N', s.trans_b ? 'T' : 'N', s.m, s.n, s.k, 1.0f,
                                               a.data(), lda, b.data(), ldb, s.beta, c.data(), s.n);
                                  },
                                  0.1));
      matmul = std::max(
          matmul, gflops(
                      s, [&] { cpu::onednn_matmul("bench_gemm", shape, a.data(), b.data(), c.data(), nullptr); }, 0.1));
    }
    const bool picks_matmul = cpu::sgemm_uses_matmul(s.trans_a, s.trans_b, s.m, s.n, s.k);
    const double picked = picks_matmul ? matmul : sgemm, other = picks_matmul ? sgemm : matmul;
    const bool worse = other >= 1.05 * picked;
    wrong += worse ? 1 : 0;
    std::printf("%-28s %6lld %6lld %6lld %9.1f %9.1f %7.3f  %s%s\n", names[i].c_str(), static_cast<long long>(s.m),
                static_cast<long long>(s.n), static_cast<long long>(s.k), sgemm, matmul, matmul / sgemm,
                picks_matmul ? "matmul" : "sgemm", worse ? "  <- the other is >= 5% faster" : "");
  }
  std::printf("shapes where the pick is >= 5%% slower than the other kernel: %d of %zu\n", wrong, shapes.size());
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1) omp_set_num_threads(std::atoi(argv[1]));
  const bool peak_only = argc > 2 && std::string_view(argv[2]) == "--peak";
  if (argc > 2 && std::string_view(argv[2]) == "--choice") {
    choice_sweep();
    return 0;
  }
  if (argc > 2 && !peak_only) {
    std::fprintf(stderr, "bench_gemm: unknown argument %s (expected --peak or --choice)\n", argv[2]);
    return 1;
  }
  if (!peak_only) {
    std::printf("threads %d, %s, OpenBLAS core %s\n", omp_get_max_threads(),
                moecore::kernels::cpu::gemm_library().c_str(), openblas_get_corename());
    std::printf("%-50s %12s %12s %12s\n", "shape (M x N x K)", "OpenBLAS", "oneDNN", "moecore");
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
    auto [a, b, c, lda, ldb] = operands(s);
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
    const double moecore = gflops(s, [&] {
      moecore::kernels::cpu::sgemm(s.trans_a, s.trans_b, s.m, s.n, s.k, 1.0f, a.data(), lda, b.data(), ldb, s.beta,
                                   c.data(), s.n);
    });
    std::printf("%-50s %8.1f GF/s %8.1f GF/s %8.1f GF/s\n", s.what, openblas, onednn, moecore);
  }
}
