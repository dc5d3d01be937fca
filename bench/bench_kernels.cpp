// Times the fast kernels against their naive references at training sizes; prints one line per kernel.
// usage: bench_kernels [--threads N]
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>

#include "moecore/kernels/cpu/attention.h"
#include "moecore/kernels/cpu/loss.h"
#include "moecore/tensor/rng.h"

namespace {

using namespace moecore;

std::vector<float> random_floats(const size_t n, const uint64_t key, const float scale) {
  const CounterRng rng(1, key);
  std::vector<float> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = scale * static_cast<float>(rng.normal(i));
  return out;
}

// Median milliseconds of `repeats` calls after one warm-up call.
double time_ms(const std::function<void()>& fn, const int repeats) {
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

void bench_cross_entropy() {
  const int64_t T = 2048, V = 50304;
  const std::vector<float> logits = random_floats(static_cast<size_t>(T * V), 1, 2.0f);
  std::vector<float> dlogits(logits.size()), lse(T), losses(T), dlosses(T, 1.0f / T);
  std::vector<int32_t> targets(T);
  for (int64_t t = 0; t < T; ++t) targets[t] = static_cast<int32_t>((t * 7919) % V);
  for (const bool fast : {true, false}) {
    const double fwd = time_ms(
        [&] {
          (fast ? kernels::cpu::cross_entropy_forward<float>
                : kernels::ref::cross_entropy_forward<float>)(losses.data(), lse.data(), logits.data(), targets.data(),
                                                              T, V);
        },
        5);
    const double bwd = time_ms(
        [&] {
          (fast ? kernels::cpu::cross_entropy_backward<float>
                : kernels::ref::cross_entropy_backward<float>)(dlogits.data(), dlosses.data(), logits.data(),
                                                               lse.data(), targets.data(), T, V);
        },
        5);
    std::printf("cross_entropy %-4s T=%ld V=%ld fp32: forward %.1f ms, backward %.1f ms\n", fast ? "cpu" : "ref",
                static_cast<long>(T), static_cast<long>(V), fwd, bwd);
  }
}

void bench_attention() {
  kernels::AttentionDims dims;
  dims.S = 256;
  dims.B = 8;
  dims.N = 8;
  dims.G = 8;
  dims.head_dim = 64;
  dims.scale = 0.125;
  const size_t q_size = static_cast<size_t>(dims.S * dims.B * dims.N * dims.head_dim);
  const size_t kv_size = static_cast<size_t>(dims.S * dims.B * dims.G * dims.head_dim);
  const std::vector<float> q = random_floats(q_size, 2, 1.0f), k = random_floats(kv_size, 3, 1.0f),
                           v = random_floats(kv_size, 4, 1.0f), dout = random_floats(q_size, 5, 1.0f);
  std::vector<float> out(q_size), lse(static_cast<size_t>(dims.B * dims.N * dims.S)), dq(q_size), dk(kv_size),
      dv(kv_size);
  const kernels::DropoutSpec no_dropout;
  for (const bool fast : {true, false}) {
    auto forward = fast ? kernels::cpu::attention_forward<float> : kernels::ref::attention_forward<float>;
    auto backward = fast ? kernels::cpu::attention_backward<float> : kernels::ref::attention_backward<float>;
    const int repeats = fast ? 5 : 1;
    const double fwd =
        time_ms([&] { forward(out.data(), lse.data(), q.data(), k.data(), v.data(), dims, no_dropout); }, repeats);
    const double bwd = time_ms(
        [&] {
          backward(dq.data(), dk.data(), dv.data(), dout.data(), q.data(), k.data(), v.data(), out.data(), lse.data(),
                   dims, no_dropout);
        },
        repeats);
    std::printf("attention     %-4s S=256 B=8 N=G=8 d=64 fp32: forward %.1f ms, backward %.1f ms\n",
                fast ? "cpu" : "ref", fwd, bwd);
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 3 && std::strcmp(argv[1], "--threads") == 0) omp_set_num_threads(std::atoi(argv[2]));
  std::printf("threads: %d\n", omp_get_max_threads());
  bench_cross_entropy();
  bench_attention();
  return 0;
}
