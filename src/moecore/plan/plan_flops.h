// The planner's FLOPs model: Megatron's num_floating_point_operations (config/flops.h) of a PlanModel, with its
// multi-latent attention and multi-token prediction.
#pragma once

#include <cstdint>

#include "moecore/config/flops.h"
#include "moecore/plan/plan_model.h"

namespace moecore::plan {

// The figures Megatron's formula reads from the model: train's shape plus MLA and MTP.
FlopsShape flops_shape(const PlanModel& model);

// FLOPs (forward + backward) of one sequence of config.seq_length tokens, divided by seq_length: the per-token
// figure, with the causal attention term of a full-length sequence.
double flops_per_token(const PlanModel& model);

// FLOPs of one iteration over a global batch of `global_batch_size` sequences of config.seq_length tokens, as
// Megatron's num_floating_point_operations(args, global_batch_size) (no packing).
double flops_per_step(const PlanModel& model, int64_t global_batch_size);

}  // namespace moecore::plan
