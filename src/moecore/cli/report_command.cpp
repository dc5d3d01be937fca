// `moecore report SOURCE... -o report.html`: a run's sources read into one self-contained HTML page (report/): a
// training log (a file), a TensorBoard folder (events.out.tfevents.* in it) and a routing-trace folder
// (router_trace_rank<r>.jsonl in it), in any number and order.
#include <algorithm>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "moecore/cli/commands.h"
#include "moecore/report/log_reader.h"
#include "moecore/report/report_page.h"
#include "moecore/report/routing_trace_reader.h"
#include "moecore/report/tensorboard_source.h"
#include "moecore/util/atomic_file.h"
#include "moecore/util/flag_parser.h"
#include "moecore/util/tensorboard_reader.h"

namespace moecore {
namespace {

constexpr std::string_view kReportUsage =
    "usage: moecore report SOURCE... -o REPORT.html [--title TEXT]\n"
    "  SOURCE: a training log (moecore train's output), a --tensorboard-dir folder or one of its event files, a\n"
    "          --moe-routing-trace-path folder or one of its router_trace_rank<r>.jsonl files\n";

struct ReportFlags {
  std::string output;
  std::string title = "moecore run report";
};

const std::vector<FlagSpec<ReportFlags>>& report_flag_table() {
  static const std::vector<FlagSpec<ReportFlags>> table = {
      {"--output", Arity::kOne, "FILE", "the HTML file to write (required; also -o)",
       [](ReportFlags& f, const FlagValue& v) { f.output = v.non_empty_text(); }},
      {"-o", Arity::kOne, "FILE", "the same as --output",
       [](ReportFlags& f, const FlagValue& v) { f.output = v.non_empty_text(); }},
      {"--title", Arity::kOne, "TEXT", "the page's title (default \"moecore run report\")",
       [](ReportFlags& f, const FlagValue& v) { f.title = v.non_empty_text(); }},
  };
  return table;
}

// Reads one source into `report`, by what it is.
void read_source(const std::string& source, report::RunReport& report) {
  namespace fs = std::filesystem;
  std::error_code error;
  if (fs::is_directory(source, error)) {
    const bool events = !tensorboard_event_files(source).empty();
    const bool trace = report::is_routing_trace_dir(source);
    if (!events && !trace) {
      throw std::runtime_error(source +
                               " holds neither TensorBoard event files (events.out.tfevents.*) nor a routing trace "
                               "(router_trace_rank<r>.jsonl)");
    }
    if (events) report::read_tensorboard_dir(source, report);
    if (trace) report::read_routing_trace_dir(source, report);
    return;
  }
  std::ifstream log(source);
  if (!fs::is_regular_file(source, error) || !log) throw std::runtime_error("cannot read " + source + ": no such file");
  // One event file or one rank's trace on its own, by their names; any other file is a training log.
  const std::string name = fs::path(source).filename().string();
  if (name.starts_with("events.out.tfevents.")) {
    report::read_tensorboard_files({source}, report);
  } else if (name.starts_with("router_trace_rank") && name.ends_with(".jsonl")) {
    report::read_routing_trace_files({source}, report);
  } else {
    report::read_training_log(log, source, report);
  }
}

// The summary table: what a reader looks for first.
void summarize(report::RunReport& report) {
  int64_t last_iteration = 0;
  for (const report::Chart& chart : report.charts()) {
    for (const report::Series& series : chart.series) {
      if (!series.points.empty())
        last_iteration = std::max(last_iteration, static_cast<int64_t>(series.points.back().first));
    }
  }
  std::vector<std::pair<std::string, std::string>> rows;
  rows.emplace_back("last iteration", std::to_string(last_iteration));
  const auto shown = [](const double value) {
    std::ostringstream text;
    text << value;
    return text.str();
  };
  if (const auto loss = report.last_point("loss", "lm loss")) rows.emplace_back("final lm loss", shown(loss->second));
  if (const auto valid = report.last_point("loss", "lm loss validation")) {
    rows.emplace_back("last validation lm loss", shown(valid->second));
  }
  for (const report::Chart& chart : report.charts()) {
    if (chart.id != "iteration-time") continue;
    for (const report::Series& series : chart.series) {
      double sum = 0.0;
      size_t count = 0;
      for (size_t i = 1; i < series.points.size(); ++i) {  // the first line holds start-up work
        sum += series.points[i].second;
        ++count;
      }
      if (count > 0) rows.emplace_back("mean time per iteration (ms)", shown(sum / static_cast<double>(count)));
    }
  }
  size_t moe_layers = 0, experts = 0;
  for (const report::ExpertLoad& load : report.expert_loads()) {
    if (!load.id.starts_with("moe-layer-")) continue;
    ++moe_layers;
    for (const auto& column : load.tokens) experts = std::max(experts, column.size());
  }
  if (moe_layers > 0) {
    rows.emplace_back("MoE layers logged", std::to_string(moe_layers));
    rows.emplace_back("experts", std::to_string(experts));
  }
  rows.emplace_back("expert-collapse alarms", std::to_string(report.alarms().size()));
  report.prepend_summary(std::move(rows));
  report.drop_if_all_zero("skipped");
}

int report_main(const std::vector<std::string>& args, std::ostream& out) {
  ReportFlags flags;
  FlagParserOptions options;
  options.positionals = true;
  ParsedFlags parsed;
  try {
    parsed = parse_flags(report_flag_table(), args, flags, options);
  } catch (const FlagError& error) {
    throw std::runtime_error(error.what());
  }
  if (parsed.help_requested) {
    out << kReportUsage << flags_help(report_flag_table());
    return 0;
  }
  if (parsed.positional.empty())
    throw std::runtime_error("moecore report needs a SOURCE (a log file, a TensorBoard or trace folder)");
  if (flags.output.empty()) throw std::runtime_error("moecore report needs -o REPORT.html");
  report::RunReport report;
  for (const std::string& source : parsed.positional) read_source(source, report);
  if (report.empty()) {
    throw std::runtime_error("no training figures found in " + parsed.positional.front() +
                             (parsed.positional.size() > 1 ? " and the other sources" : "") +
                             " (no iteration line, TensorBoard scalar or routing record)");
  }
  // The figures the log gave (training throughput, losses after training) first, then the computed ones.
  summarize(report);
  AtomicFile file(flags.output);
  file.write(report::report_html(report, flags.title));
  file.commit();
  out << "> report: " << flags.output << " (" << report.charts().size() << " charts, " << report.expert_loads().size()
      << " heatmaps, " << report.alarms().size() << " alarms)\n";
  return 0;
}

}  // namespace
}  // namespace moecore

int run_report(int argc, char** argv) {
  try {
    return moecore::report_main(std::vector<std::string>(argv + 1, argv + argc), std::cout);
  } catch (const std::exception& e) {
    std::cout.flush();
    std::cerr << "error: " << e.what() << '\n';
    return 1;
  }
}
