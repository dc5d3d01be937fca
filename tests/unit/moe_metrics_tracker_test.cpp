// MoEMetricsTracker: per-layer sums over the recorded micro-batches, forwards counted only once a layer recorded,
// and take() starting again from zero (what the training log averages over its interval).
#include "moecore/moe/moe_metrics_tracker.h"

#include <gtest/gtest.h>

namespace moecore {
namespace {

RouterOutput routing(const double aux, const double z, const std::vector<int64_t>& tokens) {
  RouterOutput out;
  out.load_balancing_losses = {aux};
  out.z_loss = z;
  out.tokens_per_expert_E = tokens;
  return out;
}

TEST(MoEMetricsTracker, SumsPerLayerAndStartsAgainAfterTake) {
  MoEMetricsTracker tracker;
  tracker.count_forward();  // no MoE layer recorded yet: not counted
  for (int micro_batch = 0; micro_batch < 2; ++micro_batch) {
    tracker.record(3, routing(1.5, 0.25, {4, 0, 2}));
    tracker.record(1, routing(0.5, 1.0, {1, 5, 0}));
    tracker.count_forward();
  }
  const MoEStats stats = tracker.take();
  EXPECT_EQ(stats.num_forwards, 2);
  ASSERT_EQ(stats.moe_layers, (std::vector<int64_t>{3, 1}));  // in the order the layers first recorded
  EXPECT_EQ(stats.load_balancing_losses, (std::vector<std::vector<double>>{{3.0}, {1.0}}));
  EXPECT_EQ(stats.z_losses, (std::vector<double>{0.5, 2.0}));
  EXPECT_EQ(stats.tokens_per_expert, (std::vector<std::vector<int64_t>>{{8, 0, 4}, {2, 10, 0}}));
  const MoEStats next = tracker.take();
  EXPECT_EQ(next.num_forwards, 0);
  EXPECT_TRUE(next.moe_layers.empty());
}

}  // namespace
}  // namespace moecore
