#include "moecore/report/run_report.h"

#include <algorithm>
#include <array>
#include <cstddef>

namespace moecore::report {

namespace {

struct ChartStyle {
  const char* id;
  const char* title;
  const char* y_label;
  bool log_y;
};

// The charts in the order the page shows them; charts not listed follow in the order they were made.
constexpr std::array<ChartStyle, 13> kCharts = {{
    {"loss", "lm loss", "loss", false},
    {"learning-rate", "learning rate", "learning rate", false},
    {"grad-norm", "grad norm", "grad norm", true},
    {"params-norm", "params norm", "L2 norm", false},
    {"num-zeros", "zero gradient elements", "count", false},
    {"loss-scale", "loss scale", "loss scale", true},
    {"throughput", "throughput per device", "TFLOP/s", false},
    {"iteration-time", "elapsed time per iteration", "ms", false},
    {"memory", "memory (MB)", "MB", false},
    {"comm", "communication per iteration (max over ranks)", "ms", false},
    {"load-balancing", "MoE auxiliary losses", "loss / coefficient", false},
    {"expert-load", "MoE min / max load ratio", "load ratio", true},
    {"skipped", "skipped and nan iterations", "count", false},
}};

}  // namespace

void RunReport::add_point(const std::string& chart_id, const std::string& series, const double x, const double y) {
  auto at = chart_index_.find(chart_id);
  if (at == chart_index_.end()) {
    Chart chart{.id = chart_id, .title = chart_id, .y_label = "", .log_y = false, .series = {}};
    for (const ChartStyle& style : kCharts) {
      if (chart_id == style.id) {
        chart.title = style.title;
        chart.y_label = style.y_label;
        chart.log_y = style.log_y;
      }
    }
    // Known charts in the table's order, before any other.
    const auto rank = [](const std::string& id) {
      for (size_t i = 0; i < kCharts.size(); ++i) {
        if (id == kCharts[i].id) return i;
      }
      return kCharts.size();
    };
    const auto position = std::find_if(charts_.begin(), charts_.end(),
                                       [&](const Chart& other) { return rank(other.id) > rank(chart_id); });
    charts_.insert(position, std::move(chart));
    chart_index_.clear();
    for (size_t i = 0; i < charts_.size(); ++i) chart_index_[charts_[i].id] = i;
    at = chart_index_.find(chart_id);
  }
  Chart& chart = charts_[at->second];
  auto named =
      std::find_if(chart.series.begin(), chart.series.end(), [&](const Series& s) { return s.name == series; });
  if (named == chart.series.end()) {
    // The series the chart is named after leads its legend (the validation loss may come first in a log).
    named = chart.series.insert(series == chart.title ? chart.series.begin() : chart.series.end(), {series, {}});
  }
  named->points.emplace_back(x, y);
}

ExpertLoad& RunReport::expert_load(const std::string& id, const std::string& title) {
  for (ExpertLoad& load : loads_) {
    if (load.id == id) return load;
  }
  loads_.push_back(ExpertLoad{.id = id, .title = title, .iterations = {}, .tokens = {}, .under = {}, .alarms = {}});
  return loads_.back();
}

void RunReport::prepend_summary(std::vector<std::pair<std::string, std::string>> rows) {
  rows.insert(rows.end(), summary_.begin(), summary_.end());
  summary_ = std::move(rows);
}

void RunReport::drop_if_all_zero(const std::string& chart_id) {
  const auto at = chart_index_.find(chart_id);
  if (at == chart_index_.end()) return;
  for (const Series& series : charts_[at->second].series) {
    for (const auto& point : series.points) {
      if (point.second != 0.0) return;
    }
  }
  charts_.erase(charts_.begin() + static_cast<std::ptrdiff_t>(at->second));
  chart_index_.clear();
  for (size_t i = 0; i < charts_.size(); ++i) chart_index_[charts_[i].id] = i;
}

bool RunReport::empty() const { return charts_.empty() && loads_.empty() && alarms_.empty(); }

std::optional<std::pair<double, double>> RunReport::last_point(const std::string& chart_id,
                                                               const std::string& series) const {
  const auto at = chart_index_.find(chart_id);
  if (at == chart_index_.end()) return std::nullopt;
  for (const Series& s : charts_[at->second].series) {
    if (s.name == series && !s.points.empty()) return s.points.back();
  }
  return std::nullopt;
}

}  // namespace moecore::report
