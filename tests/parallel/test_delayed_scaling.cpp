// FP8 delayed scaling under data parallelism: the amaxes are MAX-reduced over the amax reduction group (TP x DP x CP,
// Megatron's get_amax_reduction_group), so DP ranks that each run half of a batch end every update with the scales and
// amax histories of one process running the whole batch. A tiny MoE GPT (a dense and a MoE layer, delayed scaling with
// an amax history of 2 and algo max, no aux losses, whose statistics are per micro-batch) runs three steps of forward
// and backward (each DP rank's loss scaled by 1 / DP, as the gradient average); after every forward and backward all
// states (scale_fwd, amax_history_fwd, scale_bwd, amax_history_bwd of every linear) are compared with the one-process
// model run on every rank, within 1e-6 relative. Runs as one process (DP 1) or under mpirun -np 2.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "moecore/model/gpt_model.h"
#include "moecore/parallel/mpi_runtime.h"
#include "moecore/parallel/parallel_state.h"
#include "unit/tiny_model_fixture.h"

namespace {

using namespace moecore;
using parallel::ProcessGroup;

constexpr int64_t kS = 16, kBatch = 4;  // the global batch: kBatch sequences, split over DP
constexpr uint64_t kSeed = 21;

int g_rank = 0;
int g_failures = 0;

// The tiny MoE model over kS positions, delayed scaling with an amax history of 2 and algo max.
ModelConfig config() {
  ModelConfig c = test::tiny_moe_config(kS);
  c.quantization = test::fp8_delayed(2, quant::AmaxComputeAlgo::kMax);
  return c;
}

void compare(const GPTModel& dp_model, const GPTModel& reference, const std::string& when) {
  const auto& got = dp_model.delayed_scaling().entries();
  const auto& want = reference.delayed_scaling().entries();
  if (got.size() != want.size()) {
    ++g_failures;
    std::fprintf(stderr, "[rank %d] %s: %zu states vs %zu\n", g_rank, when.c_str(), got.size(), want.size());
    return;
  }
  for (size_t i = 0; i < got.size(); ++i) {
    const quant::DelayedLinearScaling &a = *got[i].state, &b = *want[i].state;
    const std::vector<std::pair<std::span<const float>, std::span<const float>>> tensors = {
        {a.scale_fwd(), b.scale_fwd()},
        {a.amax_history_fwd(), b.amax_history_fwd()},
        {a.scale_bwd(), b.scale_bwd()},
        {a.amax_history_bwd(), b.amax_history_bwd()}};
    for (const auto& [x, y] : tensors) {
      for (size_t j = 0; j < x.size(); ++j) {
        if (std::fabs(x[j] - y[j]) <= 1e-6f * std::fabs(y[j])) continue;
        ++g_failures;
        std::fprintf(stderr, "[rank %d] %s: %s differs: %g vs one process %g\n", g_rank, when.c_str(),
                     got[i].name.c_str(), double(x[j]), double(y[j]));
        return;
      }
    }
  }
}

void run(const ProcessGroup& world) {
  ParallelSizes sizes;
  sizes.world_size = world.size();
  const parallel::ParallelState ps = parallel::ParallelState::create(sizes, false, world);
  const int dp = ps.dp_size(), d = ps.dp_rank();
  if (kBatch % dp != 0) throw std::runtime_error("the batch does not split over " + std::to_string(dp) + " DP ranks");
  const int64_t b_local = kBatch / dp;
  const ModelConfig c = config();
  GPTModel model(c, kSeed, ps);
  GPTModel reference(c, kSeed);
  std::mt19937 gen(3);
  std::uniform_int_distribution<int32_t> id(0, static_cast<int32_t>(c.vocab_size - 1));
  ForwardOptions options, reference_options;
  options.backward_seed = 1.0 / dp;  // the backward's loss scale below
  for (int step = 1; step <= 3; ++step) {
    std::vector<int32_t> tokens(kBatch * kS), labels(kBatch * kS);  // [B, S]
    for (size_t i = 0; i < tokens.size(); ++i) {
      tokens[i] = id(gen);
      labels[i] = id(gen);
    }
    const auto mine = [&](const std::vector<int32_t>& all) {
      return std::vector<int32_t>(all.begin() + d * b_local * kS, all.begin() + (d + 1) * b_local * kS);
    };
    const std::vector<int32_t> my_tokens = mine(tokens), my_labels = mine(labels);
    std::unique_ptr<MicroBatchContext> ctx, ref_ctx;
    model.forward(ctx, my_tokens.data(), my_labels.data(), nullptr, b_local, kS, options);
    reference.forward(ref_ctx, tokens.data(), labels.data(), nullptr, kBatch, kS, reference_options);
    compare(model, reference, "step " + std::to_string(step) + " after forward");
    model.backward(std::move(ctx), 1.0 / dp);
    reference.backward(std::move(ref_ctx), 1.0);
    compare(model, reference, "step " + std::to_string(step) + " after backward");
  }
  // The states moved: the scales are not all still 1.
  const quant::DelayedLinearScaling& first = *reference.delayed_scaling().entries().front().state;
  if (first.scale_fwd()[0] == 1.0f || first.scale_bwd()[0] == 1.0f) {
    ++g_failures;
    std::fprintf(stderr, "[rank %d] the reference's scales never moved\n", g_rank);
  }
}

}  // namespace

int main(int argc, char** argv) {
  const parallel::MpiRuntime mpi(&argc, &argv);
  try {
    const ProcessGroup world = ProcessGroup::world();
    g_rank = world.rank();
    run(world);
    std::vector<float> failed{g_failures > 0 ? 1.0f : 0.0f};
    world.all_reduce<float>(failed, parallel::ReduceOp::kMax);
    if (g_rank == 0) {
      std::printf("%s delayed scaling under DP%d equals one process\n", failed[0] > 0 ? "FAIL" : "ok  ", world.size());
    }
    return failed[0] > 0 ? 1 : 0;
  } catch (const std::exception& error) {
    std::fprintf(stderr, "[rank %d] fatal: %s\n", g_rank, error.what());
    return 1;
  }
}
