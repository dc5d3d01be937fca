// What each pipeline rank of a training run holds: weights, gradients, main weights and optimizer states,
// activations by module at their peak, and communication buffers. Sources, per term, in ARCHITECTURE.md ("The
// planner's models"): Megatron's theoretical_memory_usage.py for parameters and bytes per parameter, what Megatron /
// TransformerEngine modules save for backward for activations, and Megatron's pipeline schedules (exact closed forms
// over the schedule's order, pipeline_peak.h, not an approximation) for the micro-batches alive at the peak.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "moecore/plan/plan_args.h"

namespace moecore::plan {

struct NamedBytes {
  std::string name;
  double bytes = 0;
};

// One pipeline rank (any tensor / context / expert / data-parallel rank of it holds the same, balanced routing).
struct StageMemory {
  int64_t pp_rank = 0;
  double weights = 0;
  double grads = 0;
  double main_weights_and_optimizer = 0;
  double activations = 0;                         // at the activation peak
  double comm_buffers = 0;                        // the largest transient send / receive buffers of one layer
  std::vector<NamedBytes> activations_by_module;  // at the peak
  // moecore's CPU engine: the activations at the other moment that may hold the peak (the loss's forward or the first
  // backward); where it is near `activations`, which moment holds the peak, and so its parts, is within the model's
  // error.
  double activations_other_moment = 0;
  int64_t live_chunks_at_peak = 0;  // (micro-batch, model chunk) contexts alive at the peak
  int64_t decoder_layers = 0;       // decoder layers on this rank
  int64_t mtp_layers = 0;
  // Elements this rank holds before Megatron-FSDP's shard (after TP / EP): dense and routed-expert, those of its FSDP
  // units (the decoder layers) and the largest unit; the time model's FSDP collectives move them.
  struct FsdpElements {
    double dense = 0, expert = 0, unit_dense = 0, unit_expert = 0, largest_unit = 0;
  } fsdp;
  // moecore's CPU engine: its log's "total peak" (the categories peak at different moments, see
  // moecore_engine_memory.h); unset: the sum of the categories.
  std::optional<double> total_override;

  double weights_and_grads() const { return weights + grads; }
  double total() const {
    return total_override ? *total_override : weights + grads + main_weights_and_optimizer + activations + comm_buffers;
  }
};

struct MemoryPlan {
  std::vector<StageMemory> stages;  // by pp rank
  double total_parameters = 0;      // the whole model, MTP included
  // moecore's CPU engine: each category the maximum over the ranks (its log); worst() returns it when set.
  std::optional<StageMemory> worst_over_ranks;
  const StageMemory& worst() const;  // the rank holding the most
};

MemoryPlan estimate_plan_memory(const PlanArgs& args);

// Parameters of the whole model (MTP layers included), Megatron's count.
double count_parameters(const PlanModel& model);

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

}  // namespace moecore::plan
