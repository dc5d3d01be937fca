// Megatron's process-group layout (initialize_model_parallel in parallel_state.py) as plain rank lists: the
// attention (dense) grid over TP, CP, DP, PP and the expert grid of Parallel Folding over expert-TP, EP,
// expert-DP, PP, both laid out by the same order string. No MPI: ParallelState turns these lists into
// communicators.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "moecore/parallel/rank_generator.h"

namespace moecore {

inline constexpr const char* kDefaultRankOrder = "tp-cp-ep-dp-pp";
// Megatron's order under --use-tp-pp-dp-mapping.
inline constexpr const char* kTpPpDpRankOrder = "tp-cp-ep-pp-dp";

struct ParallelSizes {
  int world_size = 1;
  int tensor_model_parallel_size = 1;
  int pipeline_model_parallel_size = 1;
  int context_parallel_size = 1;
  int expert_model_parallel_size = 1;
  std::optional<int> expert_tensor_parallel_size;  // unset: the tensor-parallel size, as in Megatron
  std::string order = kDefaultRankOrder;

  // The expert tensor-parallel size in effect.
  int expert_tensor_parallel() const { return expert_tensor_parallel_size.value_or(tensor_model_parallel_size); }
};

// Groups of the attention grid (ep = 1 there). dp_cp reduces dense gradients; tp_cp reduces router statistics
// (aux and z losses); tp_dp_cp reduces the global aux loss and the expert bias.
struct DenseGroups {
  RankGroups tp, cp, dp, dp_cp, pp, tp_pp, tp_dp_cp, tp_cp;
};

// Groups of the expert grid (cp = 1 there). dp is expert-DP, which reduces expert gradients.
struct ExpertGroups {
  RankGroups ep, tp, tp_ep, dp, pp;
};

// One group kind for listing: its short name ("dp-cp"), what it is for, and its groups.
struct NamedRankGroups {
  std::string name;
  std::string description;
  const RankGroups* groups;
};

class ParallelLayout {
 public:
  // Validates as Megatron does (sizes >= 1; world divisible by TP*PP*CP and by ETP*EP*PP; equal DP sizes in both
  // grids unless pp is the last axis or PP = 1; identical pp groups) and throws LayoutError with one line otherwise.
  explicit ParallelLayout(const ParallelSizes& sizes);

  const ParallelSizes& sizes() const { return sizes_; }
  int world_size() const { return sizes_.world_size; }
  int data_parallel_size() const { return data_parallel_size_; }
  int expert_tensor_parallel_size() const { return expert_tensor_parallel_size_; }
  int expert_data_parallel_size() const { return expert_data_parallel_size_; }
  // The order string with its omitted size-1 axes appended.
  const std::string& order() const { return order_; }

  const DenseGroups& dense() const { return dense_; }
  const ExpertGroups& expert() const { return expert_; }

  // Every group kind of each grid, in a fixed order, for printing.
  std::vector<NamedRankGroups> dense_kinds() const;
  std::vector<NamedRankGroups> expert_kinds() const;

 private:
  ParallelSizes sizes_;
  int data_parallel_size_ = 1;
  int expert_tensor_parallel_size_ = 1;
  int expert_data_parallel_size_ = 1;
  std::string order_;
  DenseGroups dense_;
  ExpertGroups expert_;
};

// ParallelLayout(sizes).data_parallel_size() with the same checks and messages, without listing every group (O(1)
// for Megatron's orders ending in pp, whatever the world size): for parsers and planners that need no groups.
int checked_data_parallel_size(const ParallelSizes& sizes);

// Index of the group that holds `rank` (the colour of a communicator split); throws LayoutError if none does.
int group_index_of(const RankGroups& groups, int rank);

}  // namespace moecore
