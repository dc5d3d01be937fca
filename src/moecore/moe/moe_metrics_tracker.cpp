#include "moecore/moe/moe_metrics_tracker.h"

#include <utility>

namespace moecore {

void MoEMetricsTracker::record(const int64_t layer, const RouterOutput& routing) {
  size_t slot = 0;
  while (slot < stats_.moe_layers.size() && stats_.moe_layers[slot] != layer) ++slot;
  if (slot == stats_.moe_layers.size()) {
    stats_.moe_layers.push_back(layer);
    stats_.load_balancing_losses.emplace_back(routing.load_balancing_losses.size(), 0.0);
    stats_.z_losses.push_back(0.0);
    stats_.tokens_per_expert.emplace_back(routing.tokens_per_expert_E.size(), 0);
  }
  for (size_t j = 0; j < routing.load_balancing_losses.size(); ++j) {
    stats_.load_balancing_losses[slot][j] += routing.load_balancing_losses[j];
  }
  stats_.z_losses[slot] += routing.z_loss;
  for (size_t e = 0; e < routing.tokens_per_expert_E.size(); ++e) {
    stats_.tokens_per_expert[slot][e] += routing.tokens_per_expert_E[e];
  }
}

void MoEMetricsTracker::count_forward() {
  if (!stats_.moe_layers.empty()) ++stats_.num_forwards;
}

MoEStats MoEMetricsTracker::take() { return std::exchange(stats_, MoEStats()); }

}  // namespace moecore
