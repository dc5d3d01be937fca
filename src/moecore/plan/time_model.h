// Estimated time of one training step: a roofline per GEMM and attention with an efficiency table, alpha-beta
// costs for each collective over the links its group crosses, Megatron's 1F1B / interleaved pipeline bubble, the
// data-parallel gradient and parameter collectives and the optimizer step.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "moecore/plan/memory_model.h"
#include "moecore/plan/plan_args.h"

namespace moecore::plan {

struct StepTime {
  double compute_s = 0;    // GEMMs, attention and memory-bound work of the slowest stage, every micro-batch
  double recompute_s = 0;  // forward work repeated by recomputation (inside compute_s)
  double tp_comm_s = 0;    // exposed communication by kind
  double cp_comm_s = 0;
  double ep_comm_s = 0;
  double pp_comm_s = 0;
  double dp_comm_s = 0;
  double bubble_s = 0;  // pipeline fill and drain
  double optimizer_s = 0;
  double total_s = 0;
  double flops_per_step = 0;  // Megatron's num_floating_point_operations of one global batch
  double tflops_per_gpu = 0;  // Megatron's throughput figure: flops / (step time * 1e12 * GPUs)
  double tokens_per_s_per_gpu = 0;
  int64_t slowest_pp_rank = 0;
};

// `memory` is estimate_plan_memory(args) (the data-parallel collectives move the slowest rank's weights and
// gradients); the one-argument form computes it.
StepTime estimate_step_time(const PlanArgs& args, const MemoryPlan& memory);
StepTime estimate_step_time(const PlanArgs& args);

}  // namespace moecore::plan
