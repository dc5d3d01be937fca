// The listing `moecore layout` prints: every process group of a parallel layout and the decoder layers of every
// pipeline stage.
#pragma once

#include <ostream>

#include "moecore/parallel/parallel_layout.h"
#include "moecore/pipeline/pipeline_layout.h"

namespace moecore {

// The layout's sizes and each group kind with its rank lists.
void print_layout(const ParallelLayout& layout, std::ostream& out);

// One line per pipeline rank and virtual stage, e.g. "    pp rank 0, virtual stage 1: layers 4-5" with
// " + embedding" / " + loss" on the chunks that hold them, after a header line.
void print_pipeline_stages(const PipelineLayout& pipeline, std::ostream& out);

}  // namespace moecore
