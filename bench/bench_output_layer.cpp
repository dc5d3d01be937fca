// The output layer + cross-entropy of one micro-batch, forward and backward, unfused (whole [T, V] logits, as
// ColumnParallelLinear + vocab_parallel_cross_entropy compute it) vs fused over token chunks
// (ops::linear_cross_entropy, what GPTModel trains with), side by side: milliseconds (median) and the bytes of
// logits each keeps alive. Then the fused layer as the training step runs it in fp32 and under --bf16 (bf16
// activations, the chunk of the step's logits budget: 64 MiB of fp32 logits, half of that under 16-bit activations),
// the backward of one chunk: the fp32 linear_backward against its two whole-matrix GEMMs, and the loss pass over one
// chunk with and without the bf16 rounding. usage: bench_output_layer [--threads N]
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>

#include "moecore/kernels/cpu/convert.h"
#include "moecore/kernels/cpu/gemm.h"
#include "moecore/kernels/cpu/loss.h"
#include "moecore/ops/ops.h"
#include "moecore/ops/precision.h"
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

// One micro-batch of T tokens through the fused layer as GPTModel calls it (vocab_parallel.cpp's budget), fp32 and
// bf16 activations in alternating rounds; the bf16 path (native 16-bit GEMMs or fp32 GEMMs on bf16 values) is the
// one this CPU picks, as in training.
void bench_step_chunks(const int64_t T, const int64_t H, const int64_t V, const int rounds) {
  constexpr int64_t kF32Budget = int64_t{64} << 20;
  Tensor x_TH = random_tensor({T, H}, 1, 1.0f), weight_VH = random_tensor({V, H}, 2, 0.02f);
  ops::round_to_dtype_(x_TH, DType::kBF16);  // values of bf16, so both runs see the same inputs
  ops::round_to_dtype_(weight_VH, DType::kBF16);
  std::vector<int32_t> targets(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) targets[static_cast<size_t>(t)] = static_cast<int32_t>((t * 7919) % V);
  Tensor dlosses_T({T}, DType::kF32);
  for (float& w : dlosses_T.span<float>()) w = 1.0f / static_cast<float>(T);
  Tensor losses_T({T}, DType::kF32), dx_TH({T, H}, DType::kF32), dweight_VH({V, H}, DType::kF32);
  Tensor x16_TH({T, H}, DType::kBF16), dx16_TH({T, H}, DType::kBF16);
  ops::convert(x16_TH, x_TH);
  const int64_t rows32 = ops::linear_cross_entropy_chunk_rows(T, V, kF32Budget, 4);
  std::vector<double> fp32_ms, bf16_ms;
  int64_t rows16 = 0;
  for (int round = 0; round < rounds; ++round) {
    fp32_ms.push_back(median_ms(
        [&] { ops::linear_cross_entropy(losses_T, x_TH, weight_VH, targets, rows32, &dlosses_T, &dx_TH, &dweight_VH); },
        3));
    const ops::ScopedActivationDType bf16(DType::kBF16);
    rows16 = ops::linear_cross_entropy_chunk_rows(
        T, V, kF32Budget / 2, ops::linear_cross_entropy_logit_bytes(weight_VH, /*vocab_split=*/false));
    bf16_ms.push_back(median_ms(
        [&] {
          ops::linear_cross_entropy(losses_T, x16_TH, weight_VH, targets, rows16, &dlosses_T, &dx16_TH, &dweight_VH);
        },
        3));
  }
  std::sort(fp32_ms.begin(), fp32_ms.end());
  std::sort(bf16_ms.begin(), bf16_ms.end());
  std::printf("step chunks T=%ld H=%ld V=%ld: fp32 %ld rows %7.1f ms, bf16 activations %ld rows %7.1f ms (%.3f)\n",
              static_cast<long>(T), static_cast<long>(H), static_cast<long>(V), static_cast<long>(rows32),
              fp32_ms[fp32_ms.size() / 2], static_cast<long>(rows16), bf16_ms[bf16_ms.size() / 2],
              bf16_ms[bf16_ms.size() / 2] / fp32_ms[fp32_ms.size() / 2]);
}

// The backward of one logits chunk of `rows` rows (dinput += dlogits weight, dweight += dlogits^T input): the fp32
// kernel linear_backward (in blocks of outputs where wide_linear_backward applies) against the two whole-matrix GEMMs
// it would otherwise run, in alternating rounds on the same data.
void bench_chunk_backward(const int64_t rows, const int64_t H, const int64_t V, const int rounds) {
  const Tensor x_TH = random_tensor({rows, H}, 1, 1.0f), weight_VH = random_tensor({V, H}, 2, 0.02f);
  const Tensor dlogits_TV = random_tensor({rows, V}, 3, 1e-4f);
  Tensor dx_TH({rows, H}, DType::kF32), dweight_VH({V, H}, DType::kF32);
  const float *x = x_TH.data<float>(), *w = weight_VH.data<float>(), *dy = dlogits_TV.data<float>();
  float *dx = dx_TH.data<float>(), *dw = dweight_VH.data<float>();
  std::vector<double> gemms_ms, kernel_ms;
  for (int round = 0; round < rounds; ++round) {
    gemms_ms.push_back(median_ms(
        [&] {
          kernels::cpu::gemm<float>(false, false, rows, H, V, 1.0f, dy, V, w, H, 1.0f, dx, H);
          kernels::cpu::gemm<float>(true, false, V, H, rows, 1.0f, dy, V, x, H, 1.0f, dw, H);
        },
        5));
    kernel_ms.push_back(
        median_ms([&] { kernels::cpu::linear_backward<float>(dx, dw, nullptr, dy, x, w, rows, H, V); }, 5));
  }
  std::sort(gemms_ms.begin(), gemms_ms.end());
  std::sort(kernel_ms.begin(), kernel_ms.end());
  const double gemms = gemms_ms[gemms_ms.size() / 2], kernel = kernel_ms[kernel_ms.size() / 2];
  std::printf("chunk backward rows=%ld H=%ld V=%ld: two GEMMs %6.2f ms, linear_backward %6.2f ms (%.3f)\n",
              static_cast<long>(rows), static_cast<long>(H), static_cast<long>(V), gemms, kernel, kernel / gemms);
}

// The loss pass over one logits chunk of `rows` rows as the fused layer runs it (cross_entropy_fused: loss and
// gradient in place), in alternating rounds on the same logits: fp32, with the bf16 rounding of the logits and the
// gradient that --bf16 adds (in the pass's registers), that rounding as passes of their own around the unfused
// kernels (round, forward, backward, round: the same bits), and --fp16's rounding in the pass.
void bench_loss_pass(const int64_t rows, const int64_t V, const int rounds) {
  const Tensor source_TV = random_tensor({rows, V}, 4, 2.0f);
  Tensor logits_TV({rows, V}, DType::kF32);
  std::vector<float> losses(static_cast<size_t>(rows)), lse(static_cast<size_t>(rows));
  const std::vector<float> dlosses(static_cast<size_t>(rows), 1.0f / static_cast<float>(rows));
  std::vector<int32_t> targets(static_cast<size_t>(rows));
  for (int64_t t = 0; t < rows; ++t) targets[static_cast<size_t>(t)] = static_cast<int32_t>((t * 7919) % V);
  float* logits = logits_TV.data<float>();
  const auto timed = [&](const std::function<void()>& fn) {
    std::vector<double> times;
    for (int r = 0; r < 5; ++r) {
      std::memcpy(logits, source_TV.data<float>(), static_cast<size_t>(rows * V) * sizeof(float));
      const auto start = std::chrono::steady_clock::now();
      fn();
      times.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
    }
    std::sort(times.begin(), times.end());
    return times[times.size() / 2];
  };
  const auto fused = [&](const kernels::ActivationRounding rounding) {
    kernels::cpu::cross_entropy_fused<float>(losses.data(), lse.data(), logits, dlosses.data(), nullptr, targets.data(),
                                             rounding, rows, V);
  };
  std::vector<double> fp32_ms, bf16_ms, passes_ms, fp16_ms;
  for (int round = 0; round < rounds; ++round) {
    fp32_ms.push_back(timed([&] { fused(kernels::ActivationRounding::kNone); }));
    bf16_ms.push_back(timed([&] { fused(kernels::ActivationRounding::kBF16); }));
    fp16_ms.push_back(timed([&] { fused(kernels::ActivationRounding::kF16); }));
    passes_ms.push_back(timed([&] {
      kernels::cpu::round_bf16(logits, rows * V);
      kernels::cpu::cross_entropy_forward<float>(losses.data(), lse.data(), logits, targets.data(), rows, V);
      kernels::cpu::cross_entropy_backward<float>(logits, dlosses.data(), logits, lse.data(), targets.data(), rows, V);
      kernels::cpu::round_bf16(logits, rows * V);
    }));
  }
  for (auto* times : {&fp32_ms, &bf16_ms, &passes_ms, &fp16_ms}) std::sort(times->begin(), times->end());
  const double fp32 = fp32_ms[fp32_ms.size() / 2], bf16 = bf16_ms[bf16_ms.size() / 2];
  const double passes = passes_ms[passes_ms.size() / 2], fp16 = fp16_ms[fp16_ms.size() / 2];
  std::printf(
      "loss pass rows=%ld V=%ld: fp32 %6.2f ms, bf16 rounding in the pass %6.2f ms (%.3f), as passes of their "
      "own %6.2f ms (%.3f); fp16 rounding in the pass %6.2f ms (%.3f)\n",
      static_cast<long>(rows), static_cast<long>(V), fp32, bf16, bf16 / fp32, passes, passes / fp32, fp16, fp16 / fp32);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 3 && std::strcmp(argv[1], "--threads") == 0) omp_set_num_threads(std::atoi(argv[2]));
  std::printf("threads: %d, GEMM: %s\n", omp_get_max_threads(), ops::gemm_library().c_str());
  bench(2048, 512, 32000);  // the MoE benchmark configuration: 4 x 512 tokens
  bench(2048, 192, 50304);  // the demo model: 8 x 256 tokens, GPT-2's padded vocabulary
  for (const int64_t rows : {128, 256, 512}) bench_chunk_backward(rows, 512, 32000, 5);
  for (const int64_t rows : {160, 320}) bench_chunk_backward(rows, 192, 50304, 5);
  bench_loss_pass(256, 32000, 5);          // the MoE benchmark's chunk under --bf16
  bench_loss_pass(160, 50304, 5);          // the demo's
  bench_step_chunks(2048, 512, 32000, 5);  // the MoE benchmark's micro-batch
  bench_step_chunks(1024, 192, 50304, 5);  // the demo's micro-batch: 4 x 256 tokens
  return 0;
}
