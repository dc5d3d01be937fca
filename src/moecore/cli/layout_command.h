// `moecore layout`: prints every process group of a parallel layout, and with --num-layers the decoder layers of
// every pipeline stage, without launching anything.
#pragma once

#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "moecore/parallel/parallel_layout.h"
#include "moecore/pipeline/pipeline_layout.h"

namespace moecore {

struct LayoutCommandArgs {
  ParallelSizes sizes;
  // Set when --num-layers is given: the layers to split (its PP is sizes.pipeline_model_parallel_size), split by
  // pipeline_split.
  std::optional<PipelineShape> pipeline;
  PipelineSplitFlags pipeline_split;
};

// Parses the flags of `moecore layout` (args exclude the command name) through the common flag parser:
// --world-size N (required), --tensor-model-parallel-size, --pipeline-model-parallel-size, --context-parallel-size,
// --expert-model-parallel-size, --expert-tensor-parallel-size (positive integers), --use-tp-pp-dp-mapping; the
// pipeline split: --num-layers N, --decoder-first-pipeline-num-layers, --decoder-last-pipeline-num-layers,
// --num-layers-per-virtual-pipeline-stage, --num-virtual-stages-per-pipeline-rank, --mtp-num-layers (integers,
// checked by PipelineLayout), --pipeline-model-parallel-layout TEXT, --account-for-embedding-in-pipeline-split,
// --account-for-loss-in-pipeline-split (the split flags need --num-layers). Throws LayoutError naming the bad flag
// or value.
LayoutCommandArgs parse_layout_command_args(const std::vector<std::string>& args);

// The sizes of parse_layout_command_args.
ParallelSizes parse_layout_args(const std::vector<std::string>& args);

std::string layout_usage();

// Writes the layout's sizes and each group kind with its rank lists to `out`, then with --num-layers each pipeline
// stage's layers; returns 0. `--help` prints the usage. Throws LayoutError (one line) on a bad flag, an invalid
// layout or an invalid pipeline split, before printing anything.
int layout_main(const std::vector<std::string>& args, std::ostream& out);

}  // namespace moecore
