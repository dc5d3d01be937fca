// Times the MoE layer's parts on their own: the router (forward in training mode with the aux loss, backward) and
// the grouped experts (forward, backward), at a given number of experts. Prints one line per part: median and
// minimum milliseconds over the repeats (the minimum is the steadier figure on a shared machine) and, for the experts,
// GFLOP/s of the median.
// usage: bench_moe router E [T H REPEATS]
//        bench_moe experts E [ROWS H F REPEATS SKEW DTYPE]   (ROWS routed rows in all; SKEW 0 = even, 1 = Zipf-like;
//                                                        DTYPE fp32 or bf16: the training step's --bf16 path, 16-bit
//                                                        activations and the step's kept weight casts)
//        bench_moe bandwidth
// `bandwidth` prints the copy bandwidth the planner probes (plan/cpu_probe.h: memcpy of 64 MiB, one thread, bytes
// read + written per second) and the same copy split over all OpenMP threads, measured in this process.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "moecore/model/config.h"
#include "moecore/moe/experts.h"
#include "moecore/moe/router.h"
#include "moecore/ops/convert.h"
#include "moecore/ops/precision.h"
#include "moecore/ops/weight_casts.h"
#include "moecore/plan/cpu_probe.h"
#include "moecore/tensor/rng.h"

namespace {

using namespace moecore;

std::vector<float> random_floats(const size_t n, const uint64_t key, const float scale) {
  const CounterRng rng(1, key);
  std::vector<float> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = scale * static_cast<float>(rng.normal(i));
  return out;
}

struct Timing {
  double median_ms = 0, min_ms = 0;
};

// `repeats` timed calls after one warm-up call; `prepare` (untimed) runs before each call.
Timing time_ms(const std::function<void()>& prepare, const std::function<void()>& fn, const int repeats) {
  prepare();
  fn();
  std::vector<double> times;
  for (int r = 0; r < repeats; ++r) {
    prepare();
    const auto start = std::chrono::steady_clock::now();
    fn();
    times.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
  }
  std::sort(times.begin(), times.end());
  return {times[times.size() / 2], times.front()};
}

void fill(Param& p, const uint64_t key, const float scale) {
  const std::vector<float> v = random_floats(static_cast<size_t>(p.value.numel()), key, scale);
  std::copy(v.begin(), v.end(), p.value.data<float>());
}

// The demo model's router: softmax top-2, aux loss 1e-2, fp32.
void bench_router(const int64_t E, const int64_t T, const int64_t H, const int repeats) {
  MoEConfig config;
  config.num_experts = E;
  config.topk = 2;
  config.load_balancing_types = {LoadBalancingType::kAuxLoss};
  config.aux_loss_coeffs = {1e-2};
  ParamStore params;
  TopKRouter router(config, H, false, "decoder.layers.0.", params);
  fill(params[0], 7, 0.02f);
  std::vector<float> x_values = random_floats(static_cast<size_t>(T * H), 8, 1.0f);
  std::vector<float> dprobs_values = random_floats(static_cast<size_t>(T * E), 9, 1e-3f);
  const Tensor x_TH = Tensor::from_blob(x_values.data(), {T, H});
  const Tensor dprobs_TE = Tensor::from_blob(dprobs_values.data(), {T, E});
  Tensor dx_TH({T, H}, DType::kF32);
  RouterActivations saved;
  RouterOutput out;
  const Timing fwd = time_ms([] {}, [&] { out = router.forward(x_TH, T, 1, true, 1, 2, saved); }, repeats);
  const Timing bwd = time_ms([] {}, [&] { router.backward(&dx_TH, dprobs_TE, 0.5, saved, out); }, repeats);
  std::printf("router  E=%4lld T=%lld H=%lld  forward %8.3f ms (min %8.3f)  backward %8.3f ms (min %8.3f)\n",
              static_cast<long long>(E), static_cast<long long>(T), static_cast<long long>(H), fwd.median_ms,
              fwd.min_ms, bwd.median_ms, bwd.min_ms);
}

// SwiGLU experts without bias (the demo model's), `rows` rows spread over E experts evenly or Zipf-like.
void bench_experts(const int64_t E, const int64_t rows, const int64_t H, const int64_t F, const int repeats,
                   const bool skew, const bool bf16) {
  ModelConfig model;
  model.num_layers = 4;
  model.hidden_size = H;
  model.ffn_hidden_size = 4 * H;
  model.activation = Activation::kSwiGLU;
  model.add_bias_linear = false;
  MoEConfig moe;
  moe.num_experts = E;
  moe.ffn_hidden_size = F;
  moe.topk = 2;
  moe.grouped_gemm = true;
  ParamStore params;
  auto experts = make_experts(moe, model, "decoder.layers.0.", params);
  uint64_t key = 100;
  for (Param& p : params) fill(p, ++key, 0.02f);

  std::vector<int64_t> tokens_E(static_cast<size_t>(E), 0);
  std::vector<double> weight_E(static_cast<size_t>(E));
  double total = 0;
  for (int64_t e = 0; e < E; ++e) total += weight_E[e] = skew ? 1.0 / static_cast<double>(e + 1) : 1.0;
  int64_t assigned = 0;
  for (int64_t e = 0; e < E; ++e) {
    tokens_E[e] = static_cast<int64_t>(std::floor(static_cast<double>(rows) * weight_E[e] / total));
    assigned += tokens_E[e];
  }
  for (int64_t e = 0; assigned < rows; e = (e + 1) % E, ++assigned) ++tokens_E[e];

  const std::vector<float> x_RH = random_floats(static_cast<size_t>(rows * H), 11, 1.0f);
  const std::vector<float> probs_R = random_floats(static_cast<size_t>(rows), 12, 0.3f);
  const std::vector<float> dy_RH = random_floats(static_cast<size_t>(rows * H), 13, 1e-2f);
  std::vector<float> dx_RH(static_cast<size_t>(rows * H)), dprobs_R(static_cast<size_t>(rows));
  const Tensor x32 = Tensor::from_blob(x_RH.data(), {rows, H}), probs = Tensor::from_blob(probs_R.data(), {rows});
  const Tensor dy32 = Tensor::from_blob(dy_RH.data(), {rows, H});
  Tensor dx32 = Tensor::from_blob(dx_RH.data(), {rows, H}), dprobs = Tensor::from_blob(dprobs_R.data(), {rows});
  std::optional<ops::ScopedActivationDType> bf16_scope;
  std::optional<ops::ScopedWeightCasts> casts;  // one per step in training: the casts stay for forward and backward
  if (bf16) {
    bf16_scope.emplace(DType::kBF16);
    casts.emplace();
  }
  const auto activation = [&](const Tensor& t32) {
    if (!bf16) return t32;
    Tensor t16(t32.shape(), DType::kBF16);
    ops::convert(t16, t32);
    return t16;
  };
  const Tensor x = activation(x32), dy = activation(dy32);
  Tensor dx = activation(dx32);
  ExpertActivations saved;
  const Timing fwd = time_ms([] {}, [&] { experts->forward(x, probs, tokens_E, saved); }, repeats);
  const Timing bwd = time_ms([] {}, [&] { experts->backward(dx, dprobs, dy, saved); }, repeats);
  std::function<void()> weight_grads;
  const Timing data = time_ms([] {}, [&] { experts->backward(dx, dprobs, dy, saved, &weight_grads); }, repeats);
  const Timing weights =
      time_ms([&] { experts->backward(dx, dprobs, dy, saved, &weight_grads); }, [&] { weight_grads(); }, repeats);
  // The first micro-batch's weight gradients: the step's zero_grad has just zeroed them (Param::grad_zero).
  const Timing first = time_ms(
      [&] {
        for (Param& p : params) {
          p.grad.zero_();
          p.grad_zero = true;
        }
        experts->backward(dx, dprobs, dy, saved, &weight_grads);
      },
      [&] { weight_grads(); }, repeats);
  // fc1 H -> 2F and fc2 F -> H: 2 * rows * H * 3F multiply-adds forward, twice that backward.
  const double fwd_flop = 2.0 * static_cast<double>(rows) * static_cast<double>(H) * 3.0 * static_cast<double>(F);
  std::printf(
      "experts E=%4lld rows=%lld H=%lld F=%lld %s %s forward %8.3f ms (min %8.3f, %6.1f GFLOP/s)  backward %8.3f ms "
      "(min %8.3f, %6.1f GFLOP/s; data %.3f, weights %.3f, into zeroed gradients %.3f)\n",
      static_cast<long long>(E), static_cast<long long>(rows), static_cast<long long>(H), static_cast<long long>(F),
      skew ? "zipf" : "even", bf16 ? "bf16" : "fp32", fwd.median_ms, fwd.min_ms, fwd_flop / fwd.median_ms * 1e-6,
      bwd.median_ms, bwd.min_ms, 2.0 * fwd_flop / bwd.median_ms * 1e-6, data.median_ms, weights.median_ms,
      first.median_ms);
}

// The planner's copy probe, then the same 64 MiB memcpy cut in one contiguous half per thread (best of 5).
void bench_bandwidth() {
  const double one_thread = plan::probe_cpu().copy_gbps;
  constexpr int64_t kBytes = int64_t{64} << 20;
  std::vector<char> from(static_cast<size_t>(kBytes), 1), to(static_cast<size_t>(kBytes), 0);
  const int threads = omp_get_max_threads();
  const auto copy = [&] {
#pragma omp parallel for schedule(static)
    for (int t = 0; t < threads; ++t) {
      const int64_t begin = kBytes * t / threads, end = kBytes * (t + 1) / threads;
      std::memcpy(to.data() + begin, from.data() + begin, static_cast<size_t>(end - begin));
    }
  };
  const Timing timing = time_ms([] {}, copy, 5);
  std::printf("copy bandwidth: %.2f GB/s (planner probe, 1 thread), %.2f GB/s (%d threads, best of 5)\n", one_thread,
              2.0 * static_cast<double>(kBytes) / timing.min_ms * 1e-6, threads);
}

int64_t arg(const int argc, char** argv, const int i, const int64_t fallback) {
  return argc > i ? std::atoll(argv[i]) : fallback;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 2 && std::string(argv[1]) == "bandwidth") {
    bench_bandwidth();
    return 0;
  }
  if (argc < 3) {
    std::fprintf(
        stderr,
        "usage: bench_moe router E [T H REPEATS] | bench_moe experts E [ROWS H F REPEATS SKEW DTYPE] | bench_moe "
        "bandwidth\n");
    return 2;
  }
  const std::string what = argv[1];
  const int64_t E = std::atoll(argv[2]);
  if (what == "router") {
    bench_router(E, arg(argc, argv, 3, 1024), arg(argc, argv, 4, 192), static_cast<int>(arg(argc, argv, 5, 9)));
  } else if (what == "experts") {
    bench_experts(E, arg(argc, argv, 3, 2048), arg(argc, argv, 4, 192), arg(argc, argv, 5, 256),
                  static_cast<int>(arg(argc, argv, 6, 9)), arg(argc, argv, 7, 0) != 0,
                  argc > 8 && std::string(argv[8]) == "bf16");
  } else {
    std::fprintf(stderr, "bench_moe: unknown part '%s' (router or experts)\n", what.c_str());
    return 2;
  }
  return 0;
}
