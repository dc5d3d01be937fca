// Low-precision GEMM throughput on moecore's shapes, side by side in one run: the fp32 sgemm (gemm.h), and bf16 / fp16
// inputs through each path of gemm_lowp.h, native (oneDNN's bf16 / fp16 matmul) and convert (fp32 tiles + sgemm).
// Forward and input-gradient shapes write a low-precision C, weight-gradient shapes accumulate into an fp32 C (beta
// 1, Megatron's fp32 main_grad), as training does. Row-major, 1 s per measurement after a warm-up call.
// usage: bench_gemm_lowp [THREADS]
#include <omp.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
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

// GFLOP/s of one low-precision path, or a negative number when the path is unavailable.
double lowp_gflops(const Shape& s, const LowpType type, const LowpGemmPath path, const std::vector<float>& a,
                   const std::vector<float>& b) {
  if (path == LowpGemmPath::kNative && !moecore::kernels::cpu::lowp_native_available(type)) return -1.0;
  const moecore::kernels::cpu::ScopedLowpGemmPath scope(path);
  const auto encode = [type](const std::vector<float>& x) {
    std::vector<uint16_t> out(x.size());
    for (size_t i = 0; i < x.size(); ++i) {
      out[i] = type == LowpType::kBF16 ? moecore::fp32_to_bf16(x[i]) : moecore::fp32_to_fp16(x[i]);
    }
    return out;
  };
  const std::vector<uint16_t> a16 = encode(a), b16 = encode(b);
  const int64_t lda = s.trans_a ? s.m : s.k, ldb = s.trans_b ? s.k : s.n;
  std::vector<float> c32(static_cast<size_t>(s.m * s.n));
  std::vector<uint16_t> c16(static_cast<size_t>(s.m * s.n));
  return gflops(s, [&] {
    if (s.fp32_c) {
      moecore::kernels::cpu::gemm_lowp(type, s.trans_a, s.trans_b, s.m, s.n, s.k, 1.0f, a16.data(), lda, b16.data(),
                                       ldb, 1.0f, c32.data(), s.n);
    } else {
      moecore::kernels::cpu::gemm_lowp(type, s.trans_a, s.trans_b, s.m, s.n, s.k, 1.0f, a16.data(), lda, b16.data(),
                                       ldb, 0.0f, c16.data(), s.n);
    }
  });
}

std::string cell(const double value) {
  if (value < 0) return "n/a";
  char buffer[32];
  std::snprintf(buffer, sizeof buffer, "%.1f", value);
  return buffer;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1) omp_set_num_threads(std::atoi(argv[1]));
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
  };
  for (const Shape& s : shapes) {
    std::vector<float> a(static_cast<size_t>(s.m * s.k)), b(static_cast<size_t>(s.k * s.n)),
        c(static_cast<size_t>(s.m * s.n));
    std::mt19937 gen(1);
    std::normal_distribution<float> normal;
    for (float& x : a) x = normal(gen);
    for (float& x : b) x = normal(gen);
    const int64_t lda = s.trans_a ? s.m : s.k, ldb = s.trans_b ? s.k : s.n;
    const double fp32 = gflops(s, [&] {
      k::cpu::sgemm(s.trans_a, s.trans_b, s.m, s.n, s.k, 1.0f, a.data(), lda, b.data(), ldb, s.fp32_c ? 1.0f : 0.0f,
                    c.data(), s.n);
    });
    const double bf16_native = lowp_gflops(s, LowpType::kBF16, LowpGemmPath::kNative, a, b);
    const double bf16_convert = lowp_gflops(s, LowpType::kBF16, LowpGemmPath::kConvert, a, b);
    const double fp16_native = lowp_gflops(s, LowpType::kF16, LowpGemmPath::kNative, a, b);
    const double fp16_convert = lowp_gflops(s, LowpType::kF16, LowpGemmPath::kConvert, a, b);
    std::printf("%-52s %9s %9s %9s %9s %9s\n", s.what, cell(fp32).c_str(), cell(bf16_native).c_str(),
                cell(bf16_convert).c_str(), cell(fp16_native).c_str(), cell(fp16_convert).c_str());
    std::fflush(stdout);
  }
}
