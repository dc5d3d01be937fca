// A training log read into a RunReport: moecore's log, which prints Megatron's lines (training.py: training_log's
// iteration line, evaluate_and_print_results' validation line) plus moecore's own: "[MoE] layer L tokens per
// expert", the expert-collapse "WARNING: [MoE] layer L: expert E ..." lines, "[Rank 0] (after N iterations) memory
// (MB)", "[comm] per iteration" and "> training throughput". Megatron's own log gives the curves of its lines. Lines
// it does not know are skipped.
#pragma once

#include <istream>
#include <string>

#include "moecore/report/run_report.h"

namespace moecore::report {

// Adds the log's curves, heatmaps, alarms and its summary figures (training throughput, final validation loss) to
// `out`. `name` names the log in the page.
void read_training_log(std::istream& log, const std::string& name, RunReport& out);

}  // namespace moecore::report
