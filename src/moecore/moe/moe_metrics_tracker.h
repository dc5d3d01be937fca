// The MoE layers' routing statistics over the training forwards of a step, as Megatron's MoEMetricsTracker
// (megatron/core/transformer/moe/moe_logging.py): every MoE layer records its values during forward, the training
// loop takes them at the step's end, reduces them over the ranks and reports them (train/training_log.h,
// train/moe_logging.h), and the tracker starts again from zero. A model owns its tracker.
#pragma once

#include <cstdint>
#include <vector>

#include "moecore/moe/router.h"

namespace moecore {

// MoE routing statistics summed over the training forwards since the last take().
struct MoEStats {
  int64_t num_forwards = 0;
  std::vector<int64_t> moe_layers;                         // model index of each MoE layer
  std::vector<std::vector<double>> load_balancing_losses;  // [MoE layer][balancing type], logged values (loss / coeff)
  std::vector<double> z_losses;                            // [MoE layer], z-loss / coeff
  std::vector<std::vector<int64_t>> tokens_per_expert;     // [MoE layer][expert]
};

class MoEMetricsTracker {
 public:
  // Adds MoE layer `layer`'s balancing losses, z-loss and tokens per expert of one micro-batch.
  void record(int64_t layer, const RouterOutput& routing);
  // Counts one training forward, once it has recorded its MoE layers (the divisor of the interval averages).
  void count_forward();
  // The statistics since the last take(); the tracker starts again from zero.
  MoEStats take();

 private:
  MoEStats stats_;
};

}  // namespace moecore
