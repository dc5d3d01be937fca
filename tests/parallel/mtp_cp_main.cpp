// Multi-Token Prediction under context parallelism (mpirun -np 2, CP 2): each CP rank rolls its two sequence chunks
// as the whole sequence rolls (Megatron's roll_tensor with its boundary exchange), so the depths see the tokens,
// labels and mask of the positions k+1 later, 0 past the end. Megatron's CP losses are each rank's own means; with a
// loss mask that gives both CP ranks as many unmasked tokens for the main loss and for every depth, the CP objective
// equals the one-process one, so: the mean of the ranks' MTP losses and main losses equals the one-process model's,
// and every gradient averaged over the CP ranks equals the one-process gradient (rel 1e-4 per tensor).
// Exit status 1 on any mismatch, on any rank.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "../unit/test_recipe.h"
#include "moecore/config/arguments.h"
#include "moecore/model/gpt_model.h"
#include "moecore/parallel/mpi_runtime.h"
#include "moecore/parallel/parallel_layout.h"
#include "moecore/parallel/process_group.h"

namespace {

using namespace moecore;
using parallel::ParallelState;
using parallel::ProcessGroup;

constexpr int64_t kS = 8, kB = 2, kDepths = 2;
constexpr uint64_t kSeed = 11;
int failures = 0;

void check(const bool ok, const std::string& what) {
  if (ok) return;
  ++failures;
  std::printf("FAIL: %s\n", what.c_str());
}

// The recipe configs/mixtral-tiny-mtp.args (a MoE model with 2 MTP depths) on 8-token sequences of a 64-token
// vocabulary.
ModelConfig config() {
  std::vector<std::string> flags = test::recipe_flags("mixtral-tiny-mtp");
  flags.insert(flags.end(), {"--seq-length", std::to_string(kS), "--max-position-embeddings", std::to_string(kS)});
  ModelConfig c = parse_train_args(flags).model;
  c.vocab_size = 64;
  if (c.mtp_num_layers != kDepths) throw std::runtime_error("the recipe no longer has 2 MTP depths");
  return c;
}

struct Run {
  double loss = 0.0;
  std::vector<double> mtp_losses;
};

Run forward_backward(GPTModel& model, const std::vector<int32_t>& tokens, const std::vector<int32_t>& labels,
                     const std::vector<float>& mask) {
  std::unique_ptr<MicroBatchContext> ctx;
  ForwardOptions options;
  Run run;
  run.loss = model.forward(ctx, tokens.data(), labels.data(), mask.data(), kB, kS, options);
  run.mtp_losses = model.take_mtp_stats().loss_sums;
  model.backward(std::move(ctx), 1.0);
  return run;
}

}  // namespace

int main(int argc, char** argv) {
  const parallel::MpiRuntime mpi(&argc, &argv);
  const ProcessGroup world = ProcessGroup::world();
  try {
    ParallelSizes sizes;
    sizes.world_size = world.size();
    sizes.context_parallel_size = world.size();
    const ParallelState ps = ParallelState::create(sizes, false, world);
    std::vector<int32_t> tokens(kB * kS), labels(kB * kS);
    for (int64_t i = 0; i < kB * kS; ++i) {
      tokens[static_cast<size_t>(i)] = static_cast<int32_t>((i * 37 + 5) % 64);
      labels[static_cast<size_t>(i)] = static_cast<int32_t>((i * 23 + 11) % 64);
    }
    // CP 2 holds positions {0, 1, 6, 7} and {2, 3, 4, 5}: each sample's mask leaves both ranks as many unmasked tokens
    // for the main loss and after shifts 1 and 2.
    const std::vector<float> mask = {0, 0, 1, 1, 0, 0, 1, 1, 0, 0, 0, 1, 0, 0, 0, 1};
    GPTModel whole(config(), kSeed);
    const Run want = forward_backward(whole, tokens, labels, mask);
    GPTModel cp(config(), kSeed, ps);
    Run got = forward_backward(cp, tokens, labels, mask);
    const double ranks = world.size();
    got.loss = parallel::sum_double(world, got.loss) / ranks;
    check(std::abs(got.loss - want.loss) <= 1e-5 * std::abs(want.loss),
          "lm loss " + std::to_string(got.loss) + " vs " + std::to_string(want.loss));
    check(got.mtp_losses.size() == kDepths && want.mtp_losses.size() == kDepths, "MTP losses of every depth");
    for (size_t k = 0; k < got.mtp_losses.size() && k < want.mtp_losses.size(); ++k) {
      const double mean = parallel::sum_double(world, got.mtp_losses[k]) / ranks;
      check(std::abs(mean - want.mtp_losses[k]) <= 1e-5 * std::abs(want.mtp_losses[k]),
            "mtp_" + std::to_string(k + 1) + " loss " + std::to_string(mean) + " vs " +
                std::to_string(want.mtp_losses[k]));
    }
    double worst = 0.0;
    std::string worst_name;
    for (Param& p : cp.params()) {
      std::span<float> grad = p.grad.span<float>();
      world.all_reduce<float>(grad, parallel::ReduceOp::kSum);  // the DDP's average over dp-cp
      for (float& g : grad) g /= static_cast<float>(ranks);
      const std::span<const float> ref = whole.param(p.name).grad.span<float>();
      double diff = 0.0, scale = 1e-30;
      for (size_t i = 0; i < ref.size(); ++i) {
        diff = std::max(diff, static_cast<double>(std::abs(grad[i] - ref[i])));
        scale = std::max(scale, static_cast<double>(std::abs(ref[i])));
      }
      // (a routed expert may get no tokens of these 16)
      if (p.name.starts_with("mtp.") && !p.is_expert) check(scale > 1e-20, p.name + " gets no gradient");
      if (diff / scale > worst) {
        worst = diff / scale;
        worst_name = p.name;
      }
    }
    check(worst < 1e-4, "gradient " + worst_name + " rel error " + std::to_string(worst));
    if (world.rank() == 0 && failures == 0) {
      std::printf("ok: CP %d MTP losses and gradients equal the one-process model's (worst rel %.2e, %s)\n",
                  world.size(), worst, worst_name.c_str());
    }
  } catch (const std::exception& e) {
    std::printf("FAIL: %s\n", e.what());
    ++failures;
  }
  const int total = static_cast<int>(parallel::sum_double(world, failures));
  return total == 0 ? 0 : 1;
}
