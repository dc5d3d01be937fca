// --search: every layout of --num-gpus GPUs for the model (TP, PP, VPP, CP, EP, ETP, with Parallel Folding: the
// expert grid's ETP x EP independent of the attention grid's TP x CP), checked by train's parser (Megatron's
// constraints and messages) and by memory, ranked by estimated throughput.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "moecore/plan/memory_model.h"
#include "moecore/plan/plan_args.h"
#include "moecore/plan/time_model.h"

namespace moecore::plan {

struct Candidate {
  LayoutChoice layout;
  bool fits = false;
  std::string reason;  // why it wins (the first) or how it falls short; the first reason a layout is rejected
  std::optional<StageMemory> memory;  // the worst rank; absent when the layout is invalid
  std::optional<StepTime> time;
};

// A pipeline layout string for PP x VPP stages when the decoder layers do not split evenly: the embedding and
// the loss (and MTP layers) count as a layer each, the rest spread as evenly as possible. None when they do split.
std::optional<std::string> balanced_pipeline_layout(int64_t num_layers, int64_t mtp_layers, int64_t pp, int64_t vpp);

std::vector<Candidate> search_layouts(const PlanArgs& args);

}  // namespace moecore::plan
