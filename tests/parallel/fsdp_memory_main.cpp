// Megatron-FSDP's bytes per rank: `dist_fsdp_memory_test -- <moecore train flags with --use-megatron-fsdp>` builds the
// model, gradient buffers and optimizer of the flags, trains one iteration and checks that what stays between steps
// on this rank (MemoryTracker's kParams + kGrads + kOptimizer; gathered parameters and whole unit gradients are
// transient communication buffers) is what optim_grads_params keeps, from the parameters' sizes alone:
//   parameters  4 B x (outside-unit elements + dense unit elements / dp-cp + expert unit elements / expert-DP)
//               + the model's buffers (the router's expert bias)
//   gradients   4 B x (the same elements)
//   Adam        8 B x (outside-unit and dense unit elements / dp-cp + expert unit elements / expert-DP)
// plus at most the alignment padding the buffers add: each parameter starts on a 16-element boundary and each bucket
// (one per module and group kind) ends on a multiple of lcm(group size, 128) elements, in each of the four stores.
// Exit status 1 when a rank's bytes fall outside [expected, expected + padding].
#include <cstdint>
#include <iostream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "moecore/config/arguments.h"
#include "moecore/parallel/mpi_runtime.h"
#include "moecore/parallel/parallel_state.h"
#include "moecore/tensor/memory_tracker.h"
#include "moecore/train/train_step.h"
#include "moecore/train/trainer.h"
#include "moecore/train/training_setup.h"

int main(int argc, char** argv) {
  using namespace moecore;
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty() || args[0] != "--") {
    std::cerr << "usage: dist_fsdp_memory_test -- <moecore train flags>\n";
    return 2;
  }
  std::optional<parallel::MpiRuntime> mpi;
  int world_size = 1;
  if (parallel::launched_by_mpi()) {
    mpi.emplace(&argc, &argv);
    world_size = parallel::ProcessGroup::world().size();
  }
  try {
    const TrainingArgs parsed = parse_train_args(std::vector<std::string>(args.begin() + 1, args.end()), world_size);
    if (!parsed.use_megatron_fsdp || parsed.data_parallel_sharding_strategy != "optim_grads_params") {
      throw std::invalid_argument("the flags must select Megatron-FSDP with optim_grads_params");
    }
    const parallel::ParallelState parallel = make_parallel_state(parsed);
    const Vocabulary vocabulary = build_vocabulary(parsed);
    const TrainingArgs run_args = with_padded_vocabulary(parsed, vocabulary);
    std::ostringstream log;
    const GPTDataProvider data = build_data(run_args, vocabulary.eod_id, log);

    // What the rank holds before FSDP touches anything: every local tensor whole.
    MemoryTracker& tracker = MemoryTracker::instance();
    ModelAndOptimizer built = build_model_and_optimizer(run_args, parallel);
    const int64_t dp = parallel.dp_cp.size(), edp = parallel.edp.size();
    const int64_t L = run_args.model.num_layers;
    double outside = 0, dense_unit = 0, expert_unit = 0, buffers = 0;
    int64_t num_params = 0;
    for (const Param& p : built.model->params()) {
      double n = 1;
      for (const int64_t d : shard_shape(p.shard)) n *= static_cast<double>(d);
      const bool unit = p.module >= 0 && p.module < L;
      (unit ? (p.is_expert ? expert_unit : dense_unit) : outside) += n;
      ++num_params;
    }
    for (const Buffer& b : built.model->named_buffers()) buffers += static_cast<double>(b.value.nbytes());
    const double kept = outside + dense_unit / static_cast<double>(dp) + expert_unit / static_cast<double>(edp);
    const double expected_params = 4 * kept + buffers, expected_grads = 4 * kept;
    const double expected_optimizer =
        8 * ((outside + dense_unit) / static_cast<double>(dp) + expert_unit / static_cast<double>(edp));
    const double padding =
        4.0 * 4.0 *
        (16.0 * static_cast<double>(num_params) + 128.0 * 2.0 * static_cast<double>(L + 3) * static_cast<double>(dp));

    LRSchedule schedule(lr_schedule_config(run_args));
    LossScalers scalers;
    const TrainingModules modules{*built.model, *built.ddp, *built.optimizer, schedule, data, scalers};
    const TrainingProgress progress;
    const StepResult step = train_step(run_args, modules, parallel, progress);

    const auto bytes = [&](const MemCategory c) { return static_cast<double>(tracker.current(c)); };
    const double params = bytes(MemCategory::kParams), grads = bytes(MemCategory::kGrads),
                 optimizer = bytes(MemCategory::kOptimizer);
    const double measured = params + grads + optimizer;
    const double expected = expected_params + expected_grads + expected_optimizer;
    const double whole = 16.0 * (outside + dense_unit + expert_unit) + buffers;  // every local tensor, Adam included
    const bool ok = measured >= expected && measured <= expected + padding;
    std::ostringstream line;
    line << "rank " << parallel.rank << " (dp-cp " << dp << ", expert-DP " << edp << "): params " << params
         << " B, grads " << grads << " B, optimizer " << optimizer << " B, total " << measured << " B; expected "
         << expected << " B (+ padding up to " << padding << " B); unsharded " << whole << " B (x" << measured / whole
         << "); peak transient (comm) " << tracker.peak(MemCategory::kComm) << " B; lm loss " << step.lm_loss
         << (ok ? "" : "  FAIL") << "\n";
    std::cout << line.str() << std::flush;
    int failed = ok ? 0 : 1;
    if (world_size > 1) {
      std::vector<int> all{failed};
      parallel.world.all_reduce(std::span<int>(all), parallel::ReduceOp::kMax);
      failed = all[0];
    }
    if (parallel.rank == 0) std::cout << (failed == 0 ? "PASS" : "FAILED") << " on " << world_size << " ranks\n";
    return failed;
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << '\n';
    if (world_size > 1) parallel::abort_world(1);
    return 1;
  }
}
