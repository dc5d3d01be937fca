// `moecore plan` command line: train's model, batch, precision, recompute and layout flags (parsed by train's parser,
// with its checks and messages), and the cluster.
//
// Planner flags (the rest go to train's parser, see config/arguments.h):
//   --hf-config PATH         the model from a HuggingFace config.json, or the model folder holding it (flags given as
//                            well override it)
//   --vocab-size N           the tokenizer's vocabulary (the HF config's vocab_size); padded as Megatron does to a
//                            multiple of --make-vocab-size-divisible-by x TP. Default 32000.
//   --multi-latent-attention, --q-lora-rank, --kv-lora-rank, --qk-head-dim, --qk-pos-emb-head-dim, --v-head-dim,
//   --mtp-num-layers         Megatron's flags and defaults
//   --moe-token-dispatcher-type {allgather,alltoall,flex}, --overlap-moe-expert-parallel-comm (Megatron's 1F1B
//                            all-to-all overlap)
//   --num-gpus N (required), --gpu NAME (default H100), --gpu-memory-gib, --peak-tflops-bf16, --peak-tflops-fp8,
//   --peak-tflops-fp4, --hbm-tbps, --gpus-per-domain, --intra-domain-gbps, --inter-domain-gbps
//   --search                 rank every valid layout of --num-gpus GPUs
//   --top N                  with --search, print the N best (default 10; --json lists all)
//   --json                   one JSON object instead of text
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "moecore/config/arguments.h"
#include "moecore/plan/cluster.h"
#include "moecore/plan/plan_model.h"

namespace moecore::plan {

// Megatron's recompute settings, as train parses and checks them.
using Recompute = RecomputeConfig;

// The layout flags of one candidate (the search's unit): TP, PP, VPP, CP, EP, ETP.
struct LayoutChoice {
  int64_t tp = 1, pp = 1, vpp = 1, cp = 1, ep = 1, etp = 1;
  std::optional<std::string> pipeline_layout;  // --pipeline-model-parallel-layout (with 'm' cells)
  std::string describe() const;                // "TP1 PP4 VPP4 CP1 EP64 ETP1"
};

struct PlanArgs {
  TrainingArgs train;  // parsed by train's parser with world size = --num-gpus
  PlanModel model;     // train.model with the padded vocabulary, MLA and MTP
  Recompute recompute;
  bool memory_efficient_permutation = true;
  std::string dispatcher = "alltoall";  // as given (flex is modelled as the all-to-all)
  bool overlap_moe_expert_parallel_comm = false;
  LayoutChoice layout;  // as given (the pipeline layout with its MTP cells)
  Cluster cluster;
  int64_t num_gpus = 0;
  int64_t vocab_size = 32000;  // before padding
  bool search = false;
  int64_t top = 10;
  bool json = false;
  bool help_requested = false;
  // The flags handed to train's parser, without the layout flags the search varies (to rebuild candidates).
  std::vector<std::string> model_flags;
  // Position of the MTP layers in --pipeline-model-parallel-layout ('m' cells), as (stage index, count); empty
  // without a layout: Megatron puts them on the last stage.
  std::vector<std::pair<int64_t, int64_t>> mtp_stages;
};

// Throws ConfigError (one line) on any problem.
PlanArgs parse_plan_args(const std::vector<std::string>& args);

// A training run's own arguments (finalised, the padded vocabulary in train.model.vocab_size) as a plan's: the input
// of the CPU engine's memory model (moecore_engine_memory.h) for train's start-up estimate.
PlanArgs plan_args_of_run(const TrainingArgs& train);

// `base` re-parsed with `layout`'s flags instead of its own; throws ConfigError with train's message when the
// layout is invalid for the model (a size that does not divide, Megatron's constraints).
PlanArgs with_layout(const PlanArgs& base, const LayoutChoice& layout);

// A parsed layout's sizes as the models use them: the pipeline split's PP and virtual stages, Megatron's groups
// (the distributed optimizer's dense dp x cp group, expert-DP) and the micro-batches per step of each DP rank.
struct LayoutSizes {
  ParallelSizes parallel;  // train's sizes: world, TP, CP, EP, expert-TP
  int pp = 1, vpp = 1;     // the pipeline split's stages and virtual stages per rank
  int64_t data_parallel = 1;
  int64_t microbatches = 1;
  // The sizes as the cost formulas take them.
  double tp() const { return parallel.tensor_model_parallel_size; }
  double cp() const { return parallel.context_parallel_size; }
  double ep() const { return parallel.expert_model_parallel_size; }
  double etp() const { return parallel.expert_tensor_parallel(); }
  double world() const { return parallel.world_size; }
  double dp() const { return static_cast<double>(data_parallel); }
  double dp_cp() const { return world() / (tp() * pp); }
  double edp() const { return world() / (etp() * ep() * pp); }
};
LayoutSizes layout_sizes(const PlanArgs& args);

// MTP layers per virtual stage (index v * PP + r): the layout's 'm' cells, else Megatron's default, the last stage.
std::map<int64_t, int64_t> mtp_layers_by_stage(const PlanArgs& args, int pp, int vpp);

std::string plan_flags_help();

}  // namespace moecore::plan
