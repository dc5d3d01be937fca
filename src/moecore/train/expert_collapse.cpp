#include "moecore/train/expert_collapse.h"

#include <algorithm>
#include <cstdio>
#include <numeric>
#include <sstream>

namespace moecore {
namespace {

// At most this many experts are named in one warning; the rest are counted.
constexpr size_t kNamedExperts = 16;

std::string ratio_text(const double ratio) {
  char text[32];
  std::snprintf(text, sizeof text, "%.3f", ratio);
  return text;
}

}  // namespace

std::vector<std::string> ExpertCollapseAlarm::observe(const int64_t first_iteration, const int64_t last_iteration,
                                                      const MoEStats& interval, std::vector<LayerLoad>* loads) {
  if (loads != nullptr) loads->clear();
  std::vector<std::string> warnings;
  for (size_t l = 0; l < interval.moe_layers.size() && l < interval.tokens_per_expert.size(); ++l) {
    const std::vector<int64_t>& counts = interval.tokens_per_expert[l];
    if (counts.empty()) continue;
    if (layers_.size() <= l) layers_.resize(l + 1);
    LayerState& state = layers_[l];
    state.layer = interval.moe_layers[l];
    state.low.resize(counts.size());
    state.high.resize(counts.size());
    const double mean = static_cast<double>(std::accumulate(counts.begin(), counts.end(), int64_t{0})) /
                        static_cast<double>(counts.size());
    if (mean <= 0.0) continue;  // no tokens routed in the interval: nothing to judge
    LayerLoad load;
    load.layer = state.layer;
    load.min_load_ratio = 1e300;
    std::vector<std::pair<size_t, double>> newly_low, newly_high;
    int64_t low_since = last_iteration, high_since = last_iteration;
    const auto track = [&](Streak& streak, const bool now, const size_t expert, const double ratio,
                           std::vector<std::pair<size_t, double>>& newly, int64_t& since, int64_t& counted) {
      if (!now) {
        streak = Streak();
        return;
      }
      if (streak.intervals++ == 0) streak.since = first_iteration;
      if (streak.intervals < thresholds_.intervals) return;
      ++counted;
      if (streak.warned) return;
      streak.warned = true;
      newly.emplace_back(expert, ratio);
      since = std::min(since, streak.since);
    };
    for (size_t e = 0; e < counts.size(); ++e) {
      const double ratio = static_cast<double>(counts[e]) / mean;
      load.min_load_ratio = std::min(load.min_load_ratio, ratio);
      load.max_load_ratio = std::max(load.max_load_ratio, ratio);
      track(state.low[e], thresholds_.min_load_ratio > 0.0 && ratio < thresholds_.min_load_ratio, e, ratio, newly_low,
            low_since, load.collapsed);
      track(state.high[e], thresholds_.max_load_ratio > 0.0 && ratio > thresholds_.max_load_ratio, e, ratio, newly_high,
            high_since, load.overloaded);
    }
    if (loads != nullptr) loads->push_back(load);
    const auto warn = [&](const std::vector<std::pair<size_t, double>>& experts, const char* what, const double bound,
                          const int64_t since) {
      if (experts.empty()) return;
      std::ostringstream line;
      line << "WARNING: [MoE] layer " << state.layer << ": " << (experts.size() == 1 ? "expert " : "experts ");
      for (size_t i = 0; i < experts.size() && i < kNamedExperts; ++i) {
        line << (i ? ", " : "") << experts[i].first << " (load ratio " << ratio_text(experts[i].second) << ")";
      }
      if (experts.size() > kNamedExperts) line << " and " << experts.size() - kNamedExperts << " more";
      line << " " << (experts.size() == 1 ? "has" : "have") << " had " << what << " " << ratio_text(bound)
           << " of the layer's mean tokens per expert since iteration " << since << " (" << thresholds_.intervals
           << (thresholds_.intervals == 1 ? " log interval" : " log intervals") << " or more)";
      warnings.push_back(line.str());
    };
    warn(newly_low, "under", thresholds_.min_load_ratio, low_since);
    warn(newly_high, "over", thresholds_.max_load_ratio, high_since);
  }
  return warnings;
}

}  // namespace moecore
