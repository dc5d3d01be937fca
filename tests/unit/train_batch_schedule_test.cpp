// Which micro-batches each rank computes under data x context parallelism (the layout built without MPI, as
// ParallelState splits its communicators from it), and the token-weighted lm loss of several micro-batches.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <set>
#include <vector>

#include "moecore/parallel/parallel_layout.h"
#include "moecore/train/batch_schedule.h"

namespace moecore {
namespace {

// (size, index of `rank`) of the group of `groups` holding `rank`: what ParallelState's communicator split by these
// lists reports as size() and rank().
std::pair<int, int> position(const RankGroups& groups, const int rank) {
  const std::vector<int>& members = groups[static_cast<size_t>(group_index_of(groups, rank))];
  return {static_cast<int>(members.size()),
          static_cast<int>(std::find(members.begin(), members.end(), rank) - members.begin())};
}

TEST(BatchSchedule, DataParallelRanksShareMicroBatchesAcrossContextParallelism) {
  ParallelSizes sizes;
  sizes.world_size = 8;
  sizes.tensor_model_parallel_size = 2;
  sizes.context_parallel_size = 2;  // DP = 8 / (2 x 2) = 2
  const ParallelLayout layout(sizes);
  ASSERT_EQ(layout.data_parallel_size(), 2);
  const int64_t num_microbatches = 6;
  std::map<int, std::vector<int64_t>> by_dp_rank;  // DP rank -> the micro-batches every rank of that DP index reads
  for (int rank = 0; rank < sizes.world_size; ++rank) {
    const auto [dp_size, dp_rank] = position(layout.dense().dp, rank);
    const auto [dp_cp_size, dp_cp_rank] = position(layout.dense().dp_cp, rank);
    EXPECT_EQ(dp_size, 2) << rank;     // dp_size(): the DP group, without CP
    EXPECT_EQ(dp_cp_size, 4) << rank;  // dp_cp_size(): DP x CP, the gradient / lm loss group
    EXPECT_LT(dp_rank, dp_size);
    EXPECT_LT(dp_cp_rank, dp_cp_size);
    const std::vector<int64_t> mine = local_microbatches(num_microbatches, dp_size, dp_rank);
    EXPECT_EQ(mine.size(), 3u);
    // Both CP ranks (and both TP ranks) of a replica read the same samples.
    const auto [it, inserted] = by_dp_rank.emplace(dp_rank, mine);
    if (!inserted) {
      EXPECT_EQ(it->second, mine) << "rank " << rank;
    }
  }
  // The DP ranks together read every micro-batch of the global batch exactly once, in Megatron's sampler order.
  ASSERT_EQ(by_dp_rank.size(), 2u);
  EXPECT_EQ(by_dp_rank[0], (std::vector<int64_t>{0, 2, 4}));
  EXPECT_EQ(by_dp_rank[1], (std::vector<int64_t>{1, 3, 5}));
}

TEST(BatchSchedule, RejectsABatchThatDoesNotDivide) {
  EXPECT_THROW(local_microbatches(5, 2, 0), std::invalid_argument);
  EXPECT_THROW(local_microbatches(4, 2, 2), std::invalid_argument);
  EXPECT_EQ(local_microbatches(3, 1, 0), (std::vector<int64_t>{0, 1, 2}));
}

TEST(BatchSchedule, LossIsWeightedByTokens) {
  // Micro-batch means 2.0 over 1 token and 4.0 over 3 tokens: Megatron's (2 + 12) / 4 = 3.5, not (2 + 4) / 2 = 3.
  TokenWeightedLoss loss;
  loss.add(2.0, 1.0);
  loss.add(4.0, 3.0);
  loss.add(123.0, 0.0);  // a fully masked micro-batch adds nothing
  EXPECT_DOUBLE_EQ(loss.value(), 3.5);
  EXPECT_TRUE(std::isnan(TokenWeightedLoss{}.value()));
  Batch batch;
  batch.loss_mask_BS = {1.0f, 0.0f, 1.0f, 1.0f};
  EXPECT_EQ(loss_tokens(batch), 3.0);
}

}  // namespace
}  // namespace moecore
