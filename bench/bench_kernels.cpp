// Times the fast kernels against their naive references at training sizes; prints one line per kernel.
// usage: bench_kernels [--threads N] [--repeats N] [--attention] [--case NAME] [--no-ref]
//   --attention: only the attention cases; --case: only that attention case (demo, moe, gqa, drop, long);
//   --no-ref: skip the naive references (slow).
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
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

void bench_cross_entropy(const bool with_ref) {
  const int64_t T = 2048, V = 50304;
  const std::vector<float> logits = random_floats(static_cast<size_t>(T * V), 1, 2.0f);
  std::vector<float> dlogits(logits.size()), lse(T), losses(T), dlosses(T, 1.0f / T);
  std::vector<int32_t> targets(T);
  for (int64_t t = 0; t < T; ++t) targets[t] = static_cast<int32_t>((t * 7919) % V);
  for (const bool fast : {true, false}) {
    if (!fast && !with_ref) continue;
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

struct AttentionCase {
  const char* name;
  int64_t S, B, N, G, d;
  float dropout;
  bool with_ref;  // the naive reference is slow (minutes at S = 2048): only on the smallest case
};

// Forward and backward of the causal attention kernel, fp32, median of `repeats` calls each.
void bench_attention(const AttentionCase& c, const int repeats, const bool allow_ref) {
  kernels::AttentionDims dims;
  dims.S = c.S;
  dims.B = c.B;
  dims.N = c.N;
  dims.G = c.G;
  dims.head_dim = c.d;
  dims.scale = 1.0 / std::sqrt(static_cast<double>(c.d));
  const size_t q_size = static_cast<size_t>(dims.S * dims.B * dims.N * dims.head_dim);
  const size_t kv_size = static_cast<size_t>(dims.S * dims.B * dims.G * dims.head_dim);
  const std::vector<float> q = random_floats(q_size, 2, 1.0f), k = random_floats(kv_size, 3, 1.0f),
                           v = random_floats(kv_size, 4, 1.0f), dout = random_floats(q_size, 5, 1.0f);
  std::vector<float> out(q_size), lse(static_cast<size_t>(dims.B * dims.N * dims.S)), dq(q_size), dk(kv_size),
      dv(kv_size);
  const kernels::DropoutSpec dropout{c.dropout, 7, 11};
  for (const bool fast : {true, false}) {
    if (!fast && !(c.with_ref && allow_ref)) continue;
    auto forward = fast ? kernels::cpu::attention_forward<float> : kernels::ref::attention_forward<float>;
    auto backward = fast ? kernels::cpu::attention_backward<float> : kernels::ref::attention_backward<float>;
    const int n = fast ? repeats : 1;
    const double fwd =
        time_ms([&] { forward(out.data(), lse.data(), q.data(), k.data(), v.data(), dims, dropout); }, n);
    const double bwd = time_ms(
        [&] {
          backward(dq.data(), dk.data(), dv.data(), dout.data(), q.data(), k.data(), v.data(), out.data(), lse.data(),
                   dims, dropout);
        },
        n);
    std::printf(
        "attention     %-4s %-5s S=%ld B=%ld N=%ld G=%ld d=%ld p=%.1f fp32: forward %.1f ms, backward %.1f ms\n",
        fast ? "cpu" : "ref", c.name, static_cast<long>(c.S), static_cast<long>(c.B), static_cast<long>(c.N),
        static_cast<long>(c.G), static_cast<long>(c.d), static_cast<double>(c.dropout), fwd, bwd);
  }
}

// The demo model's shape, the MoE benchmark's (S=512, B=4, 8 heads of 64), a GQA variant of it, the same with
// attention dropout, and a long sequence with GQA.
const AttentionCase kAttentionCases[] = {
    {"demo", 256, 8, 8, 8, 64, 0.0f, true},   {"moe", 512, 4, 8, 8, 64, 0.0f, false},
    {"gqa", 512, 4, 8, 2, 64, 0.0f, false},   {"drop", 512, 4, 8, 8, 64, 0.1f, false},
    {"long", 2048, 1, 8, 2, 64, 0.0f, false},
};

}  // namespace

int main(int argc, char** argv) {
  bool attention_only = false, with_ref = true;
  const char* only_case = nullptr;
  int repeats = 5;
  for (int a = 1; a < argc; ++a) {
    if (std::strcmp(argv[a], "--threads") == 0 && a + 1 < argc) {
      omp_set_num_threads(std::atoi(argv[++a]));
    } else if (std::strcmp(argv[a], "--repeats") == 0 && a + 1 < argc) {
      repeats = std::max(1, std::atoi(argv[++a]));
    } else if (std::strcmp(argv[a], "--attention") == 0) {
      attention_only = true;
    } else if (std::strcmp(argv[a], "--case") == 0 && a + 1 < argc) {
      only_case = argv[++a];
      attention_only = true;
    } else if (std::strcmp(argv[a], "--no-ref") == 0) {
      with_ref = false;
    } else {
      std::fprintf(stderr, "usage: bench_kernels [--threads N] [--repeats N] [--attention] [--case NAME] [--no-ref]\n");
      return 2;
    }
  }
  std::printf("threads: %d\n", omp_get_max_threads());
  if (!attention_only) bench_cross_entropy(with_ref);
  for (const AttentionCase& c : kAttentionCases) {
    if (only_case == nullptr || std::strcmp(only_case, c.name) == 0) bench_attention(c, repeats, with_ref);
  }
  return 0;
}
