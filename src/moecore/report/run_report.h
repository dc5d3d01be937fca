// What `moecore report` shows of a run, filled by the readers of its sources (the text log, TensorBoard event files,
// routing traces) and drawn by report_page.h: curves grouped into charts, per-layer heatmaps of tokens per expert,
// the alarms the log raised and a summary table.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace moecore::report {

struct Series {
  std::string name;
  std::vector<std::pair<double, double>> points;  // (iteration, value); NaN values are kept (drawn as gaps)
};

struct Chart {
  std::string id;
  std::string title;
  std::string y_label;
  bool log_y = false;
  std::vector<Series> series;  // in the order their first point came
};

// Tokens per expert of one MoE layer over iterations (the log's [MoE] lines, or a routing trace's steps).
struct ExpertLoad {
  std::string id;  // "moe-layer-<L>", "trace-decoder-layer-<L>", ...
  std::string title;
  std::vector<int64_t> iterations;
  std::vector<std::vector<int64_t>> tokens;  // [column][expert]
  // Under the heatmap, one value per column (e.g. the logged min / max load ratio).
  std::vector<Series> under;
  std::vector<std::pair<int64_t, int64_t>> alarms;  // (iteration, expert) cells to mark
};

struct Alarm {
  int64_t iteration = 0;  // the log line it followed
  std::string text;
};

class RunReport {
 public:
  // Adds a point to chart `chart_id`'s series `series` (the chart and series are made on first use; a known chart id
  // gets its title, axis label and scale from the table in run_report.cpp).
  void add_point(const std::string& chart_id, const std::string& series, double x, double y);
  // The heatmap `id` (made with `title` on first use).
  ExpertLoad& expert_load(const std::string& id, const std::string& title);
  void add_alarm(int64_t iteration, std::string text) { alarms_.push_back({iteration, std::move(text)}); }
  void add_summary(std::string label, std::string value) { summary_.emplace_back(std::move(label), std::move(value)); }
  // Rows shown before those added so far.
  void prepend_summary(std::vector<std::pair<std::string, std::string>> rows);
  // Drops chart `chart_id` when every point of it is zero (a count that never moved, such as skipped iterations).
  void drop_if_all_zero(const std::string& chart_id);
  void add_source(std::string source) { sources_.push_back(std::move(source)); }

  const std::vector<Chart>& charts() const { return charts_; }
  const std::vector<ExpertLoad>& expert_loads() const { return loads_; }
  const std::vector<Alarm>& alarms() const { return alarms_; }
  const std::vector<std::pair<std::string, std::string>>& summary() const { return summary_; }
  const std::vector<std::string>& sources() const { return sources_; }
  // Whether chart `chart_id` has a series `series` already.
  bool has_series(const std::string& chart_id, const std::string& series) const {
    return last_point(chart_id, series).has_value();
  }
  // Whether any curve, heatmap or alarm was read.
  bool empty() const;
  // The last point of a chart's series, if any.
  std::optional<std::pair<double, double>> last_point(const std::string& chart_id, const std::string& series) const;

 private:
  std::vector<Chart> charts_;
  std::map<std::string, size_t> chart_index_;
  std::vector<ExpertLoad> loads_;
  std::vector<Alarm> alarms_;
  std::vector<std::pair<std::string, std::string>> summary_;
  std::vector<std::string> sources_;
};

}  // namespace moecore::report
