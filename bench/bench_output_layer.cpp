// The output layer + cross-entropy of one micro-batch, forward and backward, unfused (whole [T, V] logits, as
// ColumnParallelLinear + vocab_parallel_cross_entropy compute it) vs fused over token chunks
// (ops::linear_cross_entropy, what GPTModel trains with), side by side: milliseconds (median) and the bytes of
// logits each keeps alive. usage: bench_output_layer [--threads N]
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>

#include "moecore/ops/ops.h"
#include "moecore/tensor/rng.h"

namespace {

using namespace moecore;

Tensor random_tensor(const std::vector<int64_t>& shape, const uint64_t key, const float scale) {
  Tensor t(shape, DType::kF32);
  const CounterRng rng(1, key);
  float* data = t.data<float>();
  for (int64_t i = 0; i < t.numel(); ++i) data[i] = scale * static_cast<float>(rng.normal(static_cast<uint64_t>(i)));
  return t;
}

double median_ms(const std::function<void()>& fn, const int repeats) {
  fn();
  std::vector<double> times;
  for (int r = 0; r < repeats; ++r) {
    const auto start = std::chrono::steady_clock::now();
    fn();
    times.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

void bench(const int64_t T, const int64_t H, const int64_t V) {
  const Tensor x_TH = random_tensor({T, H}, 1, 1.0f), weight_VH = random_tensor({V, H}, 2, 0.02f);
  std::vector<int32_t> targets(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) targets[static_cast<size_t>(t)] = static_cast<int32_t>((t * 7919) % V);
  Tensor dlosses_T({T}, DType::kF32);
  for (float& w : dlosses_T.span<float>()) w = 1.0f / static_cast<float>(T);
  Tensor losses_T({T}, DType::kF32), dx_TH({T, H}, DType::kF32), dweight_VH({V, H}, DType::kF32);
  const double gflop = 6.0 * static_cast<double>(T * H * V) * 1e-9;
  const auto report = [&](const char* what, const double ms, const int64_t logits_bytes) {
    std::printf("output layer + loss T=%ld H=%ld V=%ld %-24s %7.1f ms  %6.1f GFLOP/s  logits alive %6.1f MiB\n",
                static_cast<long>(T), static_cast<long>(H), static_cast<long>(V), what, ms, gflop / (ms * 1e-3),
                static_cast<double>(logits_bytes) / (1 << 20));
  };
  const double unfused = median_ms(
      [&] {
        Tensor logits_TV({T, V}, DType::kF32);
        ops::linear_forward(logits_TV, x_TH, weight_VH);
        Tensor lse_T({T}, DType::kF32);
        ops::cross_entropy_forward(losses_T, lse_T, logits_TV, targets);
        ops::cross_entropy_backward(logits_TV, dlosses_T, logits_TV, lse_T, targets);
        ops::linear_backward(&dx_TH, &dweight_VH, nullptr, logits_TV, &x_TH, weight_VH);
      },
      3);
  report("unfused", unfused, T * V * 4);
  for (const int64_t budget_mib : {8, 32, 128}) {
    const int64_t rows = ops::linear_cross_entropy_chunk_rows(T, V, budget_mib << 20);
    const double fused = median_ms(
        [&] { ops::linear_cross_entropy(losses_T, x_TH, weight_VH, targets, rows, &dlosses_T, &dx_TH, &dweight_VH); },
        3);
    char what[64];
    std::snprintf(what, sizeof(what), "fused, %ld-row chunks", static_cast<long>(rows));
    report(what, fused, rows * V * 4);
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 3 && std::strcmp(argv[1], "--threads") == 0) omp_set_num_threads(std::atoi(argv[2]));
  std::printf("threads: %d, GEMM: %s\n", omp_get_max_threads(), ops::gemm_library().c_str());
  bench(2048, 512, 32000);  // the MoE benchmark configuration: 4 x 512 tokens
  bench(2048, 192, 50304);  // the demo model: 8 x 256 tokens, GPT-2's padded vocabulary
  return 0;
}
