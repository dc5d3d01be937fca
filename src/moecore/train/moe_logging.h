// MoE metrics in the training log, as Megatron's track_moe_metrics names them: the auxiliary losses
// averaged over MoE layers and micro-batches ("load_balancing_loss", "seq_load_balancing_loss",
// "global_load_balancing_loss", "z_loss"; per layer with --moe-per-layer-logging), and expert usage per layer
// (tokens per expert, min/max load ratio to the mean) so collapse or imbalance shows as it happens.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "moecore/model/gpt_model.h"
#include "moecore/moe/moe_config.h"
#include "moecore/train/log_format.h"

namespace moecore {

// The balancing losses the training log prints, in Megatron's order (load_balancing_loss, seq_load_balancing_loss,
// global_load_balancing_loss), by Megatron's training_log rule; a tracked type whose coefficient is 0 (or that is not
// configured, e.g. load_balancing_loss under "seq_aux_loss" alone) prints 0.
std::vector<std::pair<std::string, LoadBalancingType>> tracked_balancing_losses(const MoEConfig& config);

// Sums MoEStats over the iterations of one logging interval.
class MoEMetrics {
 public:
  explicit MoEMetrics(const MoEConfig& config) : config_(config) {}
  void add(const MoEStats& stats);
  bool empty() const { return total_.num_forwards == 0; }
  // The averaged auxiliary losses to print after "lm loss" (empty for a dense model).
  NamedValues losses() const;
  // One line per MoE layer: tokens per expert over the interval and the min/max load ratio.
  std::vector<std::string> usage_lines() const;
  void reset() { total_ = MoEStats(); }
  const MoEStats& totals() const { return total_; }

 private:
  MoEConfig config_;
  MoEStats total_;
};

}  // namespace moecore
