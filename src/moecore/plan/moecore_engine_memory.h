// Memory of moecore's own CPU engine (`moecore plan --gpu cpu`): what its MemoryTracker
// (src/moecore/tensor/memory_tracker.cpp) counts per category for one training step, as the training log prints it:
// each category's peak over the step, the maximum over the ranks, and the "total peak" of all categories (the
// communication buffers included). Parameters and gradients are fp32 storage whatever the precision flags; under
// --bf16 / --fp16 activations, saved tensors and activation gradients take 2 bytes (ops/precision.h) while norm
// statistics, log-sum-exps, the router's tensors, losses and weight gradients stay 4. The terms differ from the GPU
// model (memory_model.cpp): moecore's fused output layer keeps an fp32 logits chunk instead of the logits,
// the distributed optimizer builds its flat parameter buffer while the parameters still exist, etc.
#pragma once

#include "moecore/plan/memory_model.h"
#include "moecore/plan/plan_args.h"

namespace moecore::plan {

// One StageMemory per pipeline rank; weights = the params category's peak, main_weights_and_optimizer = the optimizer
// category's peak, comm_buffers = the comm category, total() = the log's total peak. MemoryPlan::worst() is the
// per-category maximum over the ranks (moecore's log line).
MemoryPlan moecore_engine_memory(const PlanArgs& args);

}  // namespace moecore::plan
