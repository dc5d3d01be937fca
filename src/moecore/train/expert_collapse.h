// The expert-collapse alarm, moecore's addition to Megatron's MoE logging: at each text log line it reads every MoE
// layer's tokens per expert over the interval (the [MoE] line's figures) as load ratios, an expert's tokens over the
// layer's mean. An expert whose ratio stays below `min_load_ratio` (or above `max_load_ratio`, when that is set) for
// `intervals` consecutive log intervals is collapsed (or overloaded): the log gets one warning per layer naming those
// experts, their ratios and the iteration since which they have been so. A warned expert is not named again while it
// stays so; once it recovers it is watched afresh.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "moecore/moe/moe_metrics_tracker.h"

namespace moecore {

struct CollapseThresholds {
  double min_load_ratio = 0.1;  // --moe-collapse-min-load-ratio (0: off)
  double max_load_ratio = 0.0;  // --moe-collapse-max-load-ratio (0: off)
  int64_t intervals = 3;        // --moe-collapse-intervals
};

// A layer's load ratios over one interval and how many of its experts are collapsed now.
struct LayerLoad {
  int64_t layer = 0;  // the model's layer number
  double min_load_ratio = 0.0, max_load_ratio = 0.0;
  int64_t collapsed = 0;   // experts below min_load_ratio for `intervals` intervals or more
  int64_t overloaded = 0;  // experts above max_load_ratio for `intervals` intervals or more
};

class ExpertCollapseAlarm {
 public:
  explicit ExpertCollapseAlarm(const CollapseThresholds& thresholds) : thresholds_(thresholds) {}

  // The log interval of iterations [first_iteration, last_iteration], with its MoE statistics summed over them.
  // Returns the warnings to print (one line each, "WARNING: [MoE] layer ..."), and fills `loads` (if given) with every
  // layer's figures.
  std::vector<std::string> observe(int64_t first_iteration, int64_t last_iteration, const MoEStats& interval,
                                   std::vector<LayerLoad>* loads = nullptr);

 private:
  struct Streak {
    int64_t intervals = 0;  // consecutive intervals so far
    int64_t since = 0;      // the first iteration of the first of them
    bool warned = false;
  };
  struct LayerState {
    int64_t layer = 0;
    std::vector<Streak> low, high;  // per expert
  };

  CollapseThresholds thresholds_;
  std::vector<LayerState> layers_;
};

}  // namespace moecore
