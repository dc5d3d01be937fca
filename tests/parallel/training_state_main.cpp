// The training state under a TP2 x EP2 layout (4 ranks: TP 2 with sequence parallelism, EP 2, expert-TP 1; with or
// without --use-distributed-optimizer) against the one-process state of the same tiny MoE model (a dense and an MoE
// layer, 4 experts, gated shared expert, expert bias, untied output layer). Every rank also builds the one-process
// model. Both take one AdamW step on the same gradients: element f of parameter p gets g(p, f), a multiple of 1/64
// (TP ranks each give half of a TP-summed gradient), so every reduction is exact and the step is bit-identical.
// Checks on every rank: its keys are the one-process keys minus the routed experts other EP ranks own, with the same
// dtypes and global shapes; then, key by key, the local tensors are all-gathered and placed by their placements: every
// global element is covered, each copy equals the one-process value bit for bit (parameters, the expert-bias buffer,
// both Adam moments, scalars), and the moments are held by exactly one rank of each data-parallel group with the
// distributed optimizer (by every replica without it).
// usage: dist_training_state_test [--use-distributed-optimizer]; under mpirun -np 4 (np 1: the trivial layout).
#include <bit>
#include <cstdint>
#include <cstdio>
#include <map>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "moecore/config/arguments.h"
#include "moecore/parallel/mpi_runtime.h"
#include "moecore/parallel/parallel_state.h"
#include "moecore/train/trainer.h"
#include "moecore/train/training_setup.h"
#include "moecore/train/training_state.h"
#include "parallel/dist_checks.h"
#include "unit/training_state_fixture.h"

namespace {

using namespace moecore::test;  // NOLINT: check, g_rank, g_failures (dist_checks.h)
using namespace moecore;        // NOLINT: a test driver

std::vector<std::string> model_flags() {
  std::vector<std::string> flags = test::training_state_flags();
  flags.insert(flags.end(), {"--moe-token-dispatcher-type", "alltoall"});
  return flags;
}

TrainingArgs padded_args(const std::vector<std::string>& flags, const int64_t world_size) {
  const TrainingArgs args = parse_train_args(flags, world_size);
  return with_padded_vocabulary(args, build_vocabulary(args));
}

// Gradient of element f of the one-process parameter `name`: a multiple of 1/64 in [-4, 4].
float grad_value(const std::string& name, const int64_t f) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (const char c : name) h = (h ^ static_cast<unsigned char>(c)) * 0x100000001b3ULL;
  h ^= static_cast<uint64_t>(f) * 0x9E3779B97F4A7C15ULL;
  h = (h ^ (h >> 29)) * 0xBF58476D1CE4E5B9ULL;
  return static_cast<float>(static_cast<int>((h >> 20) % 513) - 256) / 64.0f;
}

// A trained-looking expert bias (the same in every layout; replicated).
void set_expert_bias(GPTModel& model) {
  for (Buffer& b : model.named_buffers()) {
    float* v = b.value.data<float>();
    for (int64_t e = 0; e < b.value.numel(); ++e) v[e] = 0.125f * static_cast<float>(e) - 0.2f;
  }
}

// One AdamW step on the gradients g(p, f); TP-summed gradients are split in equal halves over TP.
void one_step(ModelAndOptimizer& mo, const int tp_size) {
  mo.ddp->zero_grad();
  for (Param& p : mo.model->params()) {
    float* g = p.grad.data<float>();
    const float share = p.grad_sum_over_tp ? 1.0f / static_cast<float>(tp_size) : 1.0f;
    for (int64_t i = 0; i < p.grad.numel(); ++i) g[i] = grad_value(p.name, full_index(p.shard, i)) * share;
  }
  mo.ddp->finish_grad_sync();
  mo.optimizer->step(1e-3);
  mo.ddp->wait_param_gather();
}

// The routed expert a key belongs to, or -1.
int64_t expert_of(const std::string& key) {
  const std::string tag = "local_experts.";
  const size_t at = key.find(tag);
  return at == std::string::npos ? -1 : std::stoll(key.substr(at + tag.size()));
}

// The parameter a key describes ("optimizer.state.exp_avg.<name>" -> name), or the key itself.
std::string param_of(const std::string& key) {
  for (const std::string prefix : {"optimizer.state.exp_avg_sq.", "optimizer.state.exp_avg."}) {
    if (key.starts_with(prefix)) return key.substr(prefix.size());
  }
  return key;
}

void check_keys(const StateDict& got, const StateDict& ref, const parallel::ParallelState& ps, const int64_t E) {
  std::set<std::string> want;
  for (const StateEntry& e : ref.entries()) {
    const int64_t expert = expert_of(e.key);
    if (expert < 0 || expert / (E / ps.ep_size()) == ps.ep_rank()) want.insert(e.key);
  }
  const std::vector<std::string> keys = got.keys();
  check(std::set<std::string>(keys.begin(), keys.end()) == want && keys.size() == want.size(),
        "the keys are the one-process keys minus other EP ranks' experts (" + std::to_string(keys.size()) + " vs " +
            std::to_string(want.size()) + ")");
  for (const StateEntry& e : got.entries()) {
    const StateEntry* r = ref.find(e.key);
    if (r == nullptr) {
      check(false, e.key + " is not a one-process key");
      continue;
    }
    check(e.dtype == r->dtype, e.key + ": dtype");
    check(e.global_shape == r->global_shape, e.key + ": global shape");
    if (r->dtype == DType::kI64) check(got.i64(e.key) == ref.i64(e.key), e.key + ": int64 value");
    if (r->dtype == DType::kF64) check(got.f64(e.key) == ref.f64(e.key), e.key + ": float64 value");
  }
}

// Gathers every fp32 entry over the world by placement and compares with the one-process values bit for bit.
void check_values(const StateDict& got, const StateDict& ref, const parallel::ParallelState& ps,
                  const bool distributed_optimizer) {
  const int W = ps.world.size();
  std::map<std::string, std::vector<float>> param_copies;  // copies of each parameter element over the world
  for (const StateEntry& r : ref.entries()) {
    if (r.dtype != DType::kF32) continue;
    const int64_t N = r.local.numel();  // one process: local == global
    std::vector<float> values(static_cast<size_t>(N), 0.0f), covered(static_cast<size_t>(N), 0.0f);
    if (const StateEntry* e = got.find(r.key)) {
      const float* local = e->local.data<float>();
      for (int64_t i = 0; i < e->local.numel(); ++i) {
        const auto g = static_cast<size_t>(global_index(e->placement, i));
        check(g < values.size() && covered[g] == 0.0f, r.key + ": a local element placed twice or outside");
        if (g >= values.size()) break;
        values[g] = local[i];
        covered[g] = 1.0f;
      }
    }
    std::vector<float> all_values(values.size() * static_cast<size_t>(W)), all_covered(all_values.size());
    ps.world.all_gather(std::span<const float>(values), std::span<float>(all_values));
    ps.world.all_gather(std::span<const float>(covered), std::span<float>(all_covered));
    const float* want = r.local.data<float>();
    std::vector<float> copies(static_cast<size_t>(N), 0.0f);
    int64_t mismatches = 0;
    for (int w = 0; w < W; ++w) {
      for (int64_t g = 0; g < N; ++g) {
        const size_t at = static_cast<size_t>(w) * static_cast<size_t>(N) + static_cast<size_t>(g);
        if (all_covered[at] == 0.0f) continue;
        copies[static_cast<size_t>(g)] += 1.0f;
        if (std::bit_cast<uint32_t>(all_values[at]) != std::bit_cast<uint32_t>(want[g])) ++mismatches;
      }
    }
    check(mismatches == 0, r.key + ": " + std::to_string(mismatches) + " gathered elements differ from one process");
    const std::string param = param_of(r.key);
    if (param == r.key) {
      int64_t uncovered = 0;
      for (const float c : copies) uncovered += c == 0.0f ? 1 : 0;
      check(uncovered == 0, r.key + ": " + std::to_string(uncovered) + " elements no rank holds");
      param_copies[r.key] = copies;
      continue;
    }
    // Optimizer moments: each data-parallel group holds one copy with the distributed optimizer, every replica
    // without it.
    const auto it = param_copies.find(param);
    if (it == param_copies.end()) continue;  // a buffer-like key; none today
    const bool expert = expert_of(param) >= 0;
    const float dp = distributed_optimizer ? static_cast<float>(expert ? ps.edp.size() : ps.dp_cp_size()) : 1.0f;
    int64_t wrong = 0;
    for (int64_t g = 0; g < N; ++g) wrong += copies[static_cast<size_t>(g)] * dp != it->second[static_cast<size_t>(g)];
    check(wrong == 0, r.key + ": " + std::to_string(wrong) + " elements held by the wrong number of ranks");
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::optional<parallel::MpiRuntime> mpi;
  int world_size = 1;
  if (parallel::launched_by_mpi()) {
    mpi.emplace(&argc, &argv);
    world_size = parallel::ProcessGroup::world().size();
  }
  const bool distributed_optimizer = argc > 1 && std::string(argv[1]) == "--use-distributed-optimizer";
  try {
    std::vector<std::string> flags = model_flags();
    if (world_size == 4) {
      for (const char* f : {"--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-model-parallel-size",
                            "2", "--expert-tensor-parallel-size", "1"}) {
        flags.emplace_back(f);
      }
    } else if (world_size != 1) {
      throw std::runtime_error("run with 1 or 4 ranks");
    }
    if (distributed_optimizer) flags.emplace_back("--use-distributed-optimizer");
    const TrainingArgs args = padded_args(flags, world_size);
    const TrainingArgs ref_args = padded_args(model_flags(), 1);
    const parallel::ParallelState ps = make_parallel_state(args);
    g_rank = ps.rank;

    ModelAndOptimizer mo = build_model_and_optimizer(args, ps);
    ModelAndOptimizer ref = build_model_and_optimizer(ref_args, parallel::ParallelState::single_process());
    set_expert_bias(*mo.model);
    set_expert_bias(*ref.model);
    one_step(mo, ps.tp_size());
    one_step(ref, 1);

    TrainingProgress progress;
    progress.iteration = 1;
    progress.consumed_train_samples = 8;
    progress.floating_point_operations_so_far = 1.25e9;
    const StateDict got =
        training_state(*mo.model, *mo.optimizer, LRSchedule(lr_schedule_config(args)), progress, args.seed);
    const StateDict want =
        training_state(*ref.model, *ref.optimizer, LRSchedule(lr_schedule_config(ref_args)), progress, ref_args.seed);
    check(got.i64("optimizer.step") == 1, "one optimizer step");
    check(mo.optimizer->distributed() == distributed_optimizer, "the optimizer kind");
    check_keys(got, want, ps, args.model.moe.num_experts);
    check_values(got, want, ps, distributed_optimizer);

    std::vector<float> failures = {static_cast<float>(g_failures)};
    ps.world.all_reduce(std::span<float>(failures), parallel::ReduceOp::kSum);
    if (ps.rank == 0) {
      std::printf("%s: %zu keys on rank 0 (%zu one-process), %d ranks%s\n", failures[0] == 0 ? "PASS" : "FAILED",
                  got.size(), want.size(), world_size, distributed_optimizer ? ", distributed optimizer" : "");
    }
    return failures[0] == 0 ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "[rank %d] error: %s\n", g_rank, e.what());
    if (world_size > 1) parallel::abort_world(1);
    return 1;
  }
}
