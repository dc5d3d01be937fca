// `moecore layout`: prints every process group of a parallel layout without launching anything.
#pragma once

#include <ostream>
#include <string>
#include <vector>

#include "moecore/parallel/parallel_layout.h"

namespace moecore {

// Parses the flags of `moecore layout` (args exclude the command name): --world-size N (required),
// --tensor-model-parallel-size, --pipeline-model-parallel-size, --context-parallel-size,
// --expert-model-parallel-size, --expert-tensor-parallel-size (integers; "--flag N" or "--flag=N"),
// --use-tp-pp-dp-mapping. Throws LayoutError naming the bad flag or value.
ParallelSizes parse_layout_args(const std::vector<std::string>& args);

std::string layout_usage();

// Writes the layout's sizes and each group kind with its rank lists to `out`; returns 0. `--help` prints the
// usage. Throws LayoutError (one line) on a bad flag or an invalid layout.
int layout_main(const std::vector<std::string>& args, std::ostream& out);

// The listing layout_main prints for a valid layout.
void print_layout(const ParallelLayout& layout, std::ostream& out);

}  // namespace moecore
