#include "moecore/plan/cpu_probe.h"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "moecore/config/memory_estimate.h"
#include "moecore/kernels/cpu/gemm.h"

namespace moecore::plan {
namespace {

template <typename F>
double best_seconds(const int repeats, F&& work) {
  double best = 1e30;
  for (int r = 0; r < repeats; ++r) {
    const auto start = std::chrono::steady_clock::now();
    work();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  return best;
}

CpuProbe measure() {
  CpuProbe probe;
  const int threads = omp_get_max_threads();
  omp_set_num_threads(1);
  constexpr int64_t kM = 1024, kN = 1024, kK = 1024;
  std::vector<float> a(kM * kK, 0.5f), b(kK * kN, 0.25f), c(kM * kN, 0.0f);
  const double gemm_s = best_seconds(
      5, [&] { kernels::cpu::sgemm(false, false, kM, kN, kK, 1.0f, a.data(), kK, b.data(), kN, 0.0f, c.data(), kN); });
  probe.sgemm_gflops = 2.0 * kM * kN * kK / gemm_s / 1e9;
  omp_set_num_threads(threads);
  constexpr size_t kBytes = size_t{64} << 20;
  std::vector<char> from(kBytes, 1), to(kBytes, 0);
  const double copy_s = best_seconds(3, [&] { std::memcpy(to.data(), from.data(), kBytes); });
  probe.copy_gbps = 2.0 * static_cast<double>(kBytes) / copy_s / 1e9;
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  probe.memory_gib =
      available_memory_per_rank().value_or(4.0 * (1 << 30)) / static_cast<double>(cores) / (1024.0 * 1024.0 * 1024.0);
  return probe;
}

}  // namespace

const CpuProbe& probe_cpu() {
  static const CpuProbe probe = measure();
  return probe;
}

}  // namespace moecore::plan
