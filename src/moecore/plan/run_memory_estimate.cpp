#include "moecore/plan/run_memory_estimate.h"

#include "moecore/plan/moecore_engine_memory.h"
#include "moecore/plan/plan_args.h"

namespace moecore::plan {

MemoryEstimate estimate_run_memory(const TrainingArgs& args) {
  const MemoryPlan plan = moecore_engine_memory(plan_args_of_run(args));
  const StageMemory& worst = plan.worst();
  MemoryEstimate estimate;
  estimate.parameters = worst.weights;
  estimate.gradients = worst.grads;
  estimate.optimizer = worst.main_weights_and_optimizer;
  estimate.activations = worst.activations + worst.comm_buffers;
  estimate.data_indices = data_index_bytes(args);
  return estimate;
}

}  // namespace moecore::plan
