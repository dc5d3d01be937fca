// Low-precision GEMM throughput on moecore's shapes, side by side in one run: the fp32 sgemm (gemm.h), and bf16 / fp16
// inputs through each path of gemm_lowp.h, native (oneDNN's bf16 / fp16 matmul) and convert (fp32 tiles + sgemm).
// Forward and input-gradient shapes write a low-precision C, weight-gradient shapes accumulate into an fp32 C (beta
// 1, Megatron's fp32 main_grad), as training does. Row-major, 1 s per measurement after a warm-up call.
// usage: bench_gemm_lowp [THREADS] [--peak]
// --peak: only bf16 at 2048^3 (A @ B^T, bf16 C), best of 3, one machine-readable line:
// `bf16_peak_gflops BEST native X convert Y default PATH` (X "n/a" where oneDNN has no native bf16 matmul here).
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "moecore/kernels/cpu/gemm.h"
#include "moecore/kernels/cpu/gemm_lowp.h"
#include "moecore/tensor/dtype.h"

namespace {

using moecore::kernels::LowpType;
using moecore::kernels::cpu::LowpGemmPath;

struct Shape {
  const char* what;
  int64_t m, n, k;
  bool trans_a, trans_b, fp32_c;  // fp32_c: weight gradient into fp32 main_grad, beta 1
};

constexpr int kRounds = 3;

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
  } while (seconds < 0.3);
  return 2.0 * static_cast<double>(s.m * s.n * s.k) * reps / seconds / 1e9;
}

// One low-precision path on one shape: the inputs in the format, its timed call.
class LowpRun {
 public:
  LowpRun(const Shape& s, const LowpType type, const LowpGemmPath path, const std::vector<float>& a,
          const std::vector<float>& b)
      : s_(s),
        type_(type),
        path_(path),
        a16_(encode(type, a)),
        b16_(encode(type, b)),
        c32_(static_cast<size_t>(s.m * s.n)),
        c16_(static_cast<size_t>(s.m * s.n)) {}

  // GFLOP/s, or a negative number when the path is unavailable.
  double gflops_now() {
    if (path_ == LowpGemmPath::kNative && !moecore::kernels::cpu::lowp_native_available(type_)) return -1.0;
    const moecore::kernels::cpu::ScopedLowpGemmPath scope(path_);
    const int64_t lda = s_.trans_a ? s_.m : s_.k, ldb = s_.trans_b ? s_.k : s_.n;
    return gflops(s_, [&] {
      if (s_.fp32_c) {
        moecore::kernels::cpu::gemm_lowp(type_, s_.trans_a, s_.trans_b, s_.m, s_.n, s_.k, 1.0f, a16_.data(), lda,
                                         b16_.data(), ldb, 1.0f, c32_.data(), s_.n);
      } else {
        moecore::kernels::cpu::gemm_lowp(type_, s_.trans_a, s_.trans_b, s_.m, s_.n, s_.k, 1.0f, a16_.data(), lda,
                                         b16_.data(), ldb, 0.0f, c16_.data(), s_.n);
      }
    });
  }

 private:
  static std::vector<uint16_t> encode(const LowpType type, const std::vector<float>& x) {
    std::vector<uint16_t> out(x.size());
    for (size_t i = 0; i < x.size(); ++i) {
      out[i] = type == LowpType::kBF16 ? moecore::fp32_to_bf16(x[i]) : moecore::fp32_to_fp16(x[i]);
    }
    return out;
  }

  Shape s_;
  LowpType type_;
  LowpGemmPath path_;
  std::vector<uint16_t> a16_, b16_;
  std::vector<float> c32_;
  std::vector<uint16_t> c16_;
};

std::string cell(const double value) {
  if (value < 0) return "n/a";
  char buffer[32];
  std::snprintf(buffer, sizeof buffer, "%.1f", value);
  return buffer;
}

// The bf16 GEMM peak: the 2048^3 square on each path, best of kRounds.
void print_bf16_peak() {
  namespace k = moecore::kernels;
  const Shape s{"square 2048", 2048, 2048, 2048, false, true, false};
  std::vector<float> a(static_cast<size_t>(s.m * s.k)), b(static_cast<size_t>(s.k * s.n));
  std::mt19937 gen(1);
  std::normal_distribution<float> normal;
  for (float& x : a) x = normal(gen);
  for (float& x : b) x = normal(gen);
  LowpRun native(s, LowpType::kBF16, LowpGemmPath::kNative, a, b);
  LowpRun convert(s, LowpType::kBF16, LowpGemmPath::kConvert, a, b);
  double best_native = 0.0, best_convert = 0.0;
  for (int round = 0; round < kRounds; ++round) {
    const double value = native.gflops_now();
    best_native = value < 0 ? value : std::max(best_native, value);
    best_convert = std::max(best_convert, convert.gflops_now());
  }
  std::printf("bf16_peak_gflops %.1f native %s convert %.1f default %s\n", std::max(best_native, best_convert),
              cell(best_native).c_str(), best_convert,
              std::string(k::cpu::lowp_gemm_path_name(k::cpu::lowp_gemm_path(LowpType::kBF16))).c_str());
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1) omp_set_num_threads(std::atoi(argv[1]));
  if (argc > 3 || (argc == 3 && std::string_view(argv[2]) != "--peak")) {
    std::fprintf(stderr,
                 "bench_gemm_lowp: unknown arguments after THREADS (usage: bench_gemm_lowp [THREADS] [--peak])\n");
    return 2;
  }
  if (argc == 3) {
    print_bf16_peak();
    return 0;
  }
  namespace k = moecore::kernels;
  std::printf("threads %d\n", omp_get_max_threads());
  std::printf("fp32: %s\n", k::cpu::gemm_library().c_str());
  for (const LowpType type : {LowpType::kBF16, LowpType::kF16}) {
    std::printf("%s: default %s; native: %s; convert: %s\n", std::string(k::lowp_type_name(type)).c_str(),
                std::string(k::cpu::lowp_gemm_path_name(k::cpu::lowp_gemm_path(type))).c_str(),
                k::cpu::gemm_lowp_library(type, LowpGemmPath::kNative).c_str(),
                k::cpu::gemm_lowp_library(type, LowpGemmPath::kConvert).c_str());
  }
  std::printf("%-52s %9s %9s %9s %9s %9s  (GFLOP/s)\n", "shape (M x N x K)", "fp32", "bf16 nat", "bf16 cvt", "fp16 nat",
              "fp16 cvt");
  // Tokens 4096 (8 x 512), hidden 512, dense ffn 1408; MoE experts of ffn 512 (SwiGLU fc1 1024 wide) holding 512 rows
  // each (top-2 of 16 experts over 4096 tokens).
  const Shape shapes[] = {
      {"dense fc1 fwd (4096 x 1408 x 512)", 4096, 1408, 512, false, true, false},
      {"dense fc2 fwd (4096 x 512 x 1408)", 4096, 512, 1408, false, true, false},
      {"dense fc2 input grad (4096 x 1408 x 512, NN)", 4096, 1408, 512, false, false, false},
      {"dense fc1 weight grad (1408 x 512 x 4096, TN, fp32 C)", 1408, 512, 4096, true, false, true},
      {"expert fc1 fwd (512 x 1024 x 512)", 512, 1024, 512, false, true, false},
      {"expert fc2 input grad (512 x 512 x 512, NN)", 512, 512, 512, false, false, false},
      {"expert fc1 weight grad (1024 x 512 x 512, TN, fp32 C)", 1024, 512, 512, true, false, true},
      // The output layer's chunk GEMMs (vocabulary 32128, hidden 512) at a row count that is a multiple of 64 and
      // at one that is not (ops::linear_cross_entropy_chunk_rows keeps 16-bit logits' chunks a multiple of 64); the
      // input gradient also into fp32 C, as the fused output layer accumulates it (gemm_lowp's K blocks), and the
      // weight gradient also over the 256 rows of the convert path's fp32 logits chunk (the sgemm's row blocks).
      {"output fwd (512 x 32128 x 512)", 512, 32128, 512, false, true, false},
      {"output fwd (522 x 32128 x 512)", 522, 32128, 512, false, true, false},
      {"output input grad (512 x 512 x 32128, NN)", 512, 512, 32128, false, false, false},
      {"output input grad (522 x 512 x 32128, NN)", 522, 512, 32128, false, false, false},
      {"output input grad (512 x 512 x 32128, NN, fp32 C)", 512, 512, 32128, false, false, true},
      {"output weight grad (32128 x 512 x 512, TN, fp32 C)", 32128, 512, 512, true, false, true},
      {"output weight grad (32128 x 512 x 256, TN, fp32 C)", 32128, 512, 256, true, false, true},
  };
  for (const Shape& s : shapes) {
    std::vector<float> a(static_cast<size_t>(s.m * s.k)), b(static_cast<size_t>(s.k * s.n)),
        c(static_cast<size_t>(s.m * s.n));
    std::mt19937 gen(1);
    std::normal_distribution<float> normal;
    for (float& x : a) x = normal(gen);
    for (float& x : b) x = normal(gen);
    const int64_t lda = s.trans_a ? s.m : s.k, ldb = s.trans_b ? s.k : s.n;
    LowpRun runs[] = {{s, LowpType::kBF16, LowpGemmPath::kNative, a, b},
                      {s, LowpType::kBF16, LowpGemmPath::kConvert, a, b},
                      {s, LowpType::kF16, LowpGemmPath::kNative, a, b},
                      {s, LowpType::kF16, LowpGemmPath::kConvert, a, b}};
    double best[5] = {0.0, 0.0, 0.0, 0.0, 0.0};
    for (int round = 0; round < kRounds; ++round) {
      best[0] = std::max(best[0], gflops(s, [&] {
                           k::cpu::sgemm(s.trans_a, s.trans_b, s.m, s.n, s.k, 1.0f, a.data(), lda, b.data(), ldb,
                                         s.fp32_c ? 1.0f : 0.0f, c.data(), s.n);
                         }));
      for (int i = 0; i < 4; ++i) {
        const double value = runs[i].gflops_now();
        best[i + 1] = value < 0 ? value : std::max(best[i + 1], value);
      }
    }
    const double fp32 = best[0], bf16_native = best[1], bf16_convert = best[2], fp16_native = best[3],
                 fp16_convert = best[4];
    std::printf("%-52s %9s %9s %9s %9s %9s\n", s.what, cell(fp32).c_str(), cell(bf16_native).c_str(),
                cell(bf16_convert).c_str(), cell(fp16_native).c_str(), cell(fp16_convert).c_str());
    std::fflush(stdout);
  }
}
