// Routing traces (Megatron's router_trace.py format, moe/router_trace.h) read into a RunReport: per router (decoder
// layer, or MTP depth) a heatmap of the tokens each expert received at each traced step, summed over the ranks' files
// and the step's micro-batches. A step s is drawn at iteration s + 1 (Megatron stamps a record with the iteration
// before its step).
#pragma once

#include <string>
#include <vector>

#include "moecore/report/run_report.h"

namespace moecore::report {

// Reads every router_trace_rank<r>.jsonl in `dir`. Throws std::runtime_error naming the file and line of a record
// that is not a routing-trace record, and when the folder holds no trace file.
void read_routing_trace_dir(const std::string& dir, RunReport& out);

// The same for the trace files given (each rank's, or some of them).
void read_routing_trace_files(const std::vector<std::string>& files, RunReport& out);

// Whether `dir` holds a router_trace_rank<r>.jsonl.
bool is_routing_trace_dir(const std::string& dir);

}  // namespace moecore::report
