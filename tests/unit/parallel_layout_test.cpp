#include "moecore/parallel/parallel_layout.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace moecore {
namespace {

RankGroups singletons(const int world) {
  RankGroups groups;
  for (int r = 0; r < world; ++r) groups.push_back({r});
  return groups;
}

ParallelSizes make_sizes(const int world, const int tp, const int pp, const int cp, const int ep,
                         const std::optional<int> etp = std::nullopt) {
  ParallelSizes sizes;
  sizes.world_size = world;
  sizes.tensor_model_parallel_size = tp;
  sizes.pipeline_model_parallel_size = pp;
  sizes.context_parallel_size = cp;
  sizes.expert_model_parallel_size = ep;
  sizes.expert_tensor_parallel_size = etp;
  return sizes;
}

// The message of the LayoutError that building `sizes` throws ("" if none); it must be a single line.
std::string layout_error(const ParallelSizes& sizes) {
  try {
    const ParallelLayout layout(sizes);
  } catch (const LayoutError& e) {
    const std::string message = e.what();
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
    return message;
  }
  return "";
}

// Semantics reference, section 3: world 16, TP2 CP2 PP2 (DP2), ETP1 EP4 (EDP2), order tp-cp-ep-dp-pp.
// Expected lists derived by hand. Dense grid: rank = t + 2c + 4d + 8p. Expert grid: rank = e + 4d + 8p.
TEST(ParallelLayout, MegatronWorkedExampleWorld16) {
  const ParallelLayout layout(make_sizes(16, /*tp=*/2, /*pp=*/2, /*cp=*/2, /*ep=*/4, /*etp=*/1));
  EXPECT_EQ(layout.data_parallel_size(), 2);
  EXPECT_EQ(layout.expert_data_parallel_size(), 2);
  EXPECT_EQ(layout.expert_tensor_parallel_size(), 1);
  EXPECT_EQ(layout.order(), "tp-cp-ep-dp-pp");

  const DenseGroups& dense = layout.dense();
  EXPECT_EQ(dense.tp, (RankGroups{{0, 1}, {2, 3}, {4, 5}, {6, 7}, {8, 9}, {10, 11}, {12, 13}, {14, 15}}));
  EXPECT_EQ(dense.cp, (RankGroups{{0, 2}, {1, 3}, {4, 6}, {5, 7}, {8, 10}, {9, 11}, {12, 14}, {13, 15}}));
  EXPECT_EQ(dense.dp, (RankGroups{{0, 4}, {1, 5}, {2, 6}, {3, 7}, {8, 12}, {9, 13}, {10, 14}, {11, 15}}));
  EXPECT_EQ(dense.dp_cp, (RankGroups{{0, 2, 4, 6}, {1, 3, 5, 7}, {8, 10, 12, 14}, {9, 11, 13, 15}}));
  EXPECT_EQ(dense.pp, (RankGroups{{0, 8}, {1, 9}, {2, 10}, {3, 11}, {4, 12}, {5, 13}, {6, 14}, {7, 15}}));
  EXPECT_EQ(dense.tp_pp, (RankGroups{{0, 1, 8, 9}, {2, 3, 10, 11}, {4, 5, 12, 13}, {6, 7, 14, 15}}));
  EXPECT_EQ(dense.tp_dp_cp, (RankGroups{{0, 1, 2, 3, 4, 5, 6, 7}, {8, 9, 10, 11, 12, 13, 14, 15}}));
  EXPECT_EQ(dense.tp_cp, (RankGroups{{0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9, 10, 11}, {12, 13, 14, 15}}));

  const ExpertGroups& expert = layout.expert();
  EXPECT_EQ(expert.ep, (RankGroups{{0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9, 10, 11}, {12, 13, 14, 15}}));
  EXPECT_EQ(expert.tp, singletons(16));
  EXPECT_EQ(expert.tp_ep, (RankGroups{{0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9, 10, 11}, {12, 13, 14, 15}}));
  EXPECT_EQ(expert.dp, (RankGroups{{0, 4}, {1, 5}, {2, 6}, {3, 7}, {8, 12}, {9, 13}, {10, 14}, {11, 15}}));
  EXPECT_EQ(expert.pp, dense.pp);
}

// Parallel Folding: EP4 spans the TP2 x CP2 ranks of one DP replica, so EP (4) exceeds DP (2).
// Dense: rank = t + 2c + 4d. Expert (ETP1, EP4, EDP2): rank = e + 4d.
TEST(ParallelLayout, ExpertParallelFoldsOverTensorAndContextParallel) {
  const ParallelLayout layout(make_sizes(8, /*tp=*/2, /*pp=*/1, /*cp=*/2, /*ep=*/4, /*etp=*/1));
  EXPECT_EQ(layout.data_parallel_size(), 2);
  EXPECT_EQ(layout.expert_data_parallel_size(), 2);
  EXPECT_EQ(layout.dense().tp, (RankGroups{{0, 1}, {2, 3}, {4, 5}, {6, 7}}));
  EXPECT_EQ(layout.dense().cp, (RankGroups{{0, 2}, {1, 3}, {4, 6}, {5, 7}}));
  EXPECT_EQ(layout.dense().dp, (RankGroups{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
  EXPECT_EQ(layout.dense().dp_cp, (RankGroups{{0, 2, 4, 6}, {1, 3, 5, 7}}));
  EXPECT_EQ(layout.dense().tp_cp, (RankGroups{{0, 1, 2, 3}, {4, 5, 6, 7}}));
  EXPECT_EQ(layout.dense().pp, singletons(8));
  EXPECT_EQ(layout.expert().ep, (RankGroups{{0, 1, 2, 3}, {4, 5, 6, 7}}));
  EXPECT_EQ(layout.expert().ep, layout.dense().tp_cp);
  EXPECT_EQ(layout.expert().tp, singletons(8));
  EXPECT_EQ(layout.expert().dp, (RankGroups{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
  EXPECT_EQ(layout.expert().pp, singletons(8));
}

// TP2 with DP4 on 8 ranks, experts folded over all of them: EP8 > DP4, expert-DP 1.
TEST(ParallelLayout, ExpertParallelSpansTheWholeWorld) {
  const ParallelLayout layout(make_sizes(8, /*tp=*/2, /*pp=*/1, /*cp=*/1, /*ep=*/8, /*etp=*/1));
  EXPECT_EQ(layout.data_parallel_size(), 4);
  EXPECT_EQ(layout.expert_data_parallel_size(), 1);
  EXPECT_EQ(layout.dense().dp, (RankGroups{{0, 2, 4, 6}, {1, 3, 5, 7}}));
  EXPECT_EQ(layout.expert().ep, (RankGroups{{0, 1, 2, 3, 4, 5, 6, 7}}));
  EXPECT_EQ(layout.expert().dp, singletons(8));
}

// ETP2 with attention TP1: expert grid rank = t + 2e + 4d (ETP2, EP2, EDP2).
TEST(ParallelLayout, ExpertTensorParallelDiffersFromAttentionTensorParallel) {
  const ParallelLayout layout(make_sizes(8, /*tp=*/1, /*pp=*/1, /*cp=*/1, /*ep=*/2, /*etp=*/2));
  EXPECT_EQ(layout.data_parallel_size(), 8);
  EXPECT_EQ(layout.expert_data_parallel_size(), 2);
  EXPECT_EQ(layout.dense().tp, singletons(8));
  EXPECT_EQ(layout.dense().dp, (RankGroups{{0, 1, 2, 3, 4, 5, 6, 7}}));
  EXPECT_EQ(layout.expert().tp, (RankGroups{{0, 1}, {2, 3}, {4, 5}, {6, 7}}));
  EXPECT_EQ(layout.expert().ep, (RankGroups{{0, 2}, {1, 3}, {4, 6}, {5, 7}}));
  EXPECT_EQ(layout.expert().tp_ep, (RankGroups{{0, 1, 2, 3}, {4, 5, 6, 7}}));
  EXPECT_EQ(layout.expert().dp, (RankGroups{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
}

TEST(ParallelLayout, ExpertTensorParallelDefaultsToTensorParallel) {
  const ParallelLayout layout(make_sizes(8, /*tp=*/4, /*pp=*/1, /*cp=*/1, /*ep=*/2));
  EXPECT_EQ(layout.expert_tensor_parallel_size(), 4);
  EXPECT_EQ(layout.expert_data_parallel_size(), 1);
  EXPECT_EQ(layout.expert().tp, (RankGroups{{0, 1, 2, 3}, {4, 5, 6, 7}}));
  EXPECT_EQ(layout.expert().ep, (RankGroups{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
  EXPECT_EQ(layout.expert().tp_ep, (RankGroups{{0, 1, 2, 3, 4, 5, 6, 7}}));
}

// --use-tp-pp-dp-mapping: order tp-cp-ep-pp-dp, so rank = t + 2p + 4d for TP2 PP2 DP2.
TEST(ParallelLayout, TpPpDpMapping) {
  ParallelSizes sizes = make_sizes(8, /*tp=*/2, /*pp=*/2, /*cp=*/1, /*ep=*/1);
  sizes.order = kTpPpDpRankOrder;
  const ParallelLayout layout(sizes);
  EXPECT_EQ(layout.dense().tp, (RankGroups{{0, 1}, {2, 3}, {4, 5}, {6, 7}}));
  EXPECT_EQ(layout.dense().pp, (RankGroups{{0, 2}, {1, 3}, {4, 6}, {5, 7}}));
  EXPECT_EQ(layout.dense().dp, (RankGroups{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
  EXPECT_EQ(layout.dense().tp_pp, (RankGroups{{0, 1, 2, 3}, {4, 5, 6, 7}}));
  EXPECT_EQ(layout.expert().pp, layout.dense().pp);
  EXPECT_EQ(layout.expert().dp, layout.dense().dp);
}

TEST(ParallelLayout, EveryKindPartitionsTheWorld) {
  const ParallelLayout layout(make_sizes(48, /*tp=*/2, /*pp=*/2, /*cp=*/3, /*ep=*/6, /*etp=*/1));
  auto kinds = layout.dense_kinds();
  for (const auto& kind : layout.expert_kinds()) kinds.push_back(kind);
  for (const auto& kind : kinds) {
    std::vector<int> seen(48, 0);
    for (const auto& group : *kind.groups) {
      EXPECT_EQ(group.size(), kind.groups->front().size()) << kind.name;
      for (const int rank : group) ++seen[static_cast<size_t>(rank)];
    }
    EXPECT_EQ(seen, std::vector<int>(48, 1)) << kind.name;
  }
  EXPECT_EQ(group_index_of(layout.dense().dp, 5), 5);  // dp groups: base t + 2c + 12p, here t=1, c=2
  EXPECT_THROW(group_index_of(layout.dense().dp, 48), LayoutError);
}

TEST(ParallelLayout, RejectsWorldNotDivisibleByDenseModelSize) {
  const std::string message = layout_error(make_sizes(12, /*tp=*/2, /*pp=*/2, /*cp=*/2, /*ep=*/1));
  EXPECT_NE(message.find("world size 12 is not divisible"), std::string::npos) << message;
  EXPECT_NE(message.find("tensor-model-parallel-size (2)"), std::string::npos) << message;
}

TEST(ParallelLayout, RejectsWorldNotDivisibleByExpertModelSize) {
  const std::string message = layout_error(make_sizes(12, /*tp=*/2, /*pp=*/1, /*cp=*/1, /*ep=*/4, /*etp=*/2));
  EXPECT_NE(message.find("world size 12 is not divisible"), std::string::npos) << message;
  EXPECT_NE(message.find("expert-model-parallel-size (4)"), std::string::npos) << message;
}

TEST(ParallelLayout, RejectsUnequalDataParallelWhenPipelineIsNotLast) {
  ParallelSizes sizes = make_sizes(8, /*tp=*/2, /*pp=*/2, /*cp=*/1, /*ep=*/2, /*etp=*/2);  // DP2, EDP1
  sizes.order = kTpPpDpRankOrder;
  const std::string message = layout_error(sizes);
  EXPECT_NE(message.find("must be equal"), std::string::npos) << message;
}

// An order putting pp before ep gives the two grids different pp strides (dense: 2, expert: 1).
TEST(ParallelLayout, RejectsMismatchedPipelineGroups) {
  ParallelSizes sizes = make_sizes(8, /*tp=*/2, /*pp=*/2, /*cp=*/1, /*ep=*/2, /*etp=*/1);  // DP2, EDP2
  sizes.order = "tp-pp-ep-dp";
  const std::string message = layout_error(sizes);
  EXPECT_NE(message.find("different pipeline groups"), std::string::npos) << message;
  EXPECT_NE(message.find("[0,2][1,3][4,6][5,7]"), std::string::npos) << message;
  EXPECT_NE(message.find("[0,1][2,3][4,5][6,7]"), std::string::npos) << message;
}

TEST(ParallelLayout, RejectsNonPositiveSizes) {
  EXPECT_NE(layout_error(make_sizes(0, 1, 1, 1, 1)).find("--world-size"), std::string::npos);
  EXPECT_NE(layout_error(make_sizes(8, 1, 1, 1, 0)).find("--expert-model-parallel-size"), std::string::npos);
  EXPECT_NE(layout_error(make_sizes(8, 1, 1, 1, 1, 0)).find("--expert-tensor-parallel-size"), std::string::npos);
  EXPECT_NE(layout_error(make_sizes(1 << 30, 1 << 20, 1 << 20, 1 << 20, 1)).find("not divisible"), std::string::npos);
}

}  // namespace
}  // namespace moecore
