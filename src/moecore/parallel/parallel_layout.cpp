#include "moecore/parallel/parallel_layout.h"

#include <algorithm>
#include <cstdint>
#include <sstream>

namespace moecore {
namespace {

void require_positive(const char* flag, const int value) {
  if (value < 1) throw LayoutError(std::string(flag) + " must be >= 1, got " + std::to_string(value));
}

// a*b*c, saturated above `cap` so that large sizes cannot overflow.
int64_t product_capped(const int a, const int b, const int c, const int64_t cap) {
  const int64_t ab = std::min<int64_t>(int64_t{a} * b, cap + 1);
  return std::min<int64_t>(ab * c, cap + 1);
}

bool pp_is_last(const std::string& order) { return order.size() >= 2 && order.compare(order.size() - 2, 2, "pp") == 0; }

std::string format_groups(const RankGroups& groups) {
  std::ostringstream text;
  for (const auto& group : groups) {
    text << '[';
    for (size_t i = 0; i < group.size(); ++i) text << (i ? "," : "") << group[i];
    text << ']';
  }
  return text.str();
}

}  // namespace

namespace {

// Everything ParallelLayout checks before it lists the groups: the sizes, the divisions, the order string and the
// data-parallel sizes of the two grids.
struct CheckedGrids {
  int data_parallel_size = 1;
  int expert_tensor_parallel_size = 1;
  int expert_data_parallel_size = 1;
  RankGenerator dense;
  RankGenerator expert;
};

CheckedGrids check_grids(const ParallelSizes& sizes) {
  require_positive("--world-size", sizes.world_size);
  require_positive("--tensor-model-parallel-size", sizes.tensor_model_parallel_size);
  require_positive("--pipeline-model-parallel-size", sizes.pipeline_model_parallel_size);
  require_positive("--context-parallel-size", sizes.context_parallel_size);
  require_positive("--expert-model-parallel-size", sizes.expert_model_parallel_size);
  const int etp = sizes.expert_tensor_parallel();
  require_positive("--expert-tensor-parallel-size", etp);

  const int world = sizes.world_size;
  const int tp = sizes.tensor_model_parallel_size;
  const int pp = sizes.pipeline_model_parallel_size;
  const int cp = sizes.context_parallel_size;
  const int ep = sizes.expert_model_parallel_size;

  const int64_t dense_model_size = product_capped(tp, pp, cp, world);
  if (world % dense_model_size != 0) {
    throw LayoutError("world size " + std::to_string(world) + " is not divisible by tensor-model-parallel-size (" +
                      std::to_string(tp) + ") x pipeline-model-parallel-size (" + std::to_string(pp) +
                      ") x context-parallel-size (" + std::to_string(cp) + ")");
  }
  const int dp = static_cast<int>(world / dense_model_size);
  const int64_t expert_model_size = product_capped(etp, ep, pp, world);
  if (world % expert_model_size != 0) {
    throw LayoutError("world size " + std::to_string(world) + " is not divisible by expert-tensor-parallel-size (" +
                      std::to_string(etp) + ") x expert-model-parallel-size (" + std::to_string(ep) +
                      ") x pipeline-model-parallel-size (" + std::to_string(pp) + ")");
  }
  const int edp = static_cast<int>(world / expert_model_size);

  CheckedGrids grids{dp, etp, edp, RankGenerator(tp, /*ep=*/1, dp, pp, cp, sizes.order),
                     RankGenerator(etp, ep, edp, pp, /*cp=*/1, sizes.order)};
  if (!pp_is_last(sizes.order) && pp > 1 && edp != dp) {
    throw LayoutError("rank order '" + sizes.order + "' does not end in pp, so with pipeline-model-parallel-size " +
                      std::to_string(pp) + " the data-parallel size of the attention grid (" + std::to_string(dp) +
                      ") and of the expert grid (" + std::to_string(edp) + ") must be equal");
  }
  return grids;
}

void check_same_pp_groups(const RankGroups& dense, const RankGroups& expert, const std::string& order) {
  if (dense != expert) {
    throw LayoutError("rank order '" + order + "' gives different pipeline groups to the attention grid " +
                      format_groups(dense) + " and the expert grid " + format_groups(expert));
  }
}

}  // namespace

ParallelLayout::ParallelLayout(const ParallelSizes& sizes) : sizes_(sizes) {
  const CheckedGrids grids = check_grids(sizes);
  data_parallel_size_ = grids.data_parallel_size;
  expert_tensor_parallel_size_ = grids.expert_tensor_parallel_size;
  expert_data_parallel_size_ = grids.expert_data_parallel_size;
  const RankGenerator& dense_grid = grids.dense;
  const RankGenerator& expert_grid = grids.expert;
  order_ = dense_grid.order();

  dense_.tp = dense_grid.get_ranks("tp");
  dense_.cp = dense_grid.get_ranks("cp");
  dense_.dp = dense_grid.get_ranks("dp");
  dense_.dp_cp = dense_grid.get_ranks("dp-cp");
  dense_.pp = dense_grid.get_ranks("pp");
  dense_.tp_pp = dense_grid.get_ranks("tp-pp");
  dense_.tp_dp_cp = dense_grid.get_ranks("tp-dp-cp");
  dense_.tp_cp = dense_grid.get_ranks("tp-cp");

  expert_.ep = expert_grid.get_ranks("ep");
  expert_.tp = expert_grid.get_ranks("tp");
  expert_.tp_ep = expert_grid.get_ranks("tp-ep");
  expert_.dp = expert_grid.get_ranks("dp");
  expert_.pp = expert_grid.get_ranks("pp");

  check_same_pp_groups(dense_.pp, expert_.pp, sizes.order);
}

int checked_data_parallel_size(const ParallelSizes& sizes) {
  const CheckedGrids grids = check_grids(sizes);
  // pp last (slowest) in both grids, or PP 1: pp group r is {r + k x world / PP} in each, the same groups.
  if (!pp_is_last(sizes.order) && sizes.pipeline_model_parallel_size > 1) {
    check_same_pp_groups(grids.dense.get_ranks("pp"), grids.expert.get_ranks("pp"), sizes.order);
  }
  return grids.data_parallel_size;
}

std::vector<NamedRankGroups> ParallelLayout::dense_kinds() const {
  return {
      {"tp", "tensor parallel", &dense_.tp},
      {"cp", "context parallel", &dense_.cp},
      {"dp", "data parallel", &dense_.dp},
      {"dp-cp", "data x context parallel: dense gradient reduction", &dense_.dp_cp},
      {"pp", "pipeline parallel", &dense_.pp},
      {"tp-pp", "model parallel", &dense_.tp_pp},
      {"tp-dp-cp", "global aux loss and expert bias", &dense_.tp_dp_cp},
      {"tp-cp", "router aux and z loss statistics", &dense_.tp_cp},
  };
}

std::vector<NamedRankGroups> ParallelLayout::expert_kinds() const {
  return {
      {"ep", "expert model parallel", &expert_.ep},
      {"tp", "expert tensor parallel", &expert_.tp},
      {"tp-ep", "expert tensor x expert model parallel", &expert_.tp_ep},
      {"dp", "expert data parallel: expert gradient reduction", &expert_.dp},
      {"pp", "pipeline parallel", &expert_.pp},
  };
}

int group_index_of(const RankGroups& groups, const int rank) {
  for (size_t i = 0; i < groups.size(); ++i) {
    if (std::find(groups[i].begin(), groups[i].end(), rank) != groups[i].end()) return static_cast<int>(i);
  }
  throw LayoutError("rank " + std::to_string(rank) + " is in none of the groups");
}

}  // namespace moecore
