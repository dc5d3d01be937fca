#include "moecore/cli/layout_command.h"

#include <algorithm>
#include <exception>
#include <iostream>
#include <string_view>

#include "moecore/cli/commands.h"
#include "moecore/pipeline/layout_print.h"
#include "moecore/util/flag_parser.h"

namespace moecore {
namespace {

// The layout lists every rank's groups: a million ranks is beyond any cluster and still prints in seconds.
constexpr int64_t kMaxWorldSize = int64_t{1} << 20;

struct LayoutFlags {
  ParallelSizes sizes;
  PipelineSplitFlags split;
  int64_t mtp_num_layers = 0;
  std::optional<int> world_size;
  std::optional<int> num_layers;
  std::string first_split_flag;  // the first split flag given, to name when --num-layers is missing

  void saw_split_flag(const std::string_view flag) {
    if (first_split_flag.empty()) first_split_flag = flag;
  }
};

int rank_count(const FlagValue& v) {
  const int64_t value = v.integer();
  if (value < 1) throw FlagError(std::string(v.flag) + " must be positive (got " + v.text() + ")");
  if (value > kMaxWorldSize) v.too_large(std::to_string(kMaxWorldSize) + " ranks", {});
  return static_cast<int>(value);
}

// clang-format off
const std::vector<FlagSpec<LayoutFlags>>& layout_flag_table() {
  static const std::vector<FlagSpec<LayoutFlags>> table = {
    {"--world-size", Arity::kOne, "N", "number of processes (required)",
     [](LayoutFlags& f, const FlagValue& v) { f.world_size = rank_count(v); }},
    {"--tensor-model-parallel-size", Arity::kOne, "N", "TP (default 1)",
     [](LayoutFlags& f, const FlagValue& v) { f.sizes.tensor_model_parallel_size = rank_count(v); }},
    {"--pipeline-model-parallel-size", Arity::kOne, "N", "PP (default 1)",
     [](LayoutFlags& f, const FlagValue& v) { f.sizes.pipeline_model_parallel_size = rank_count(v); }},
    {"--context-parallel-size", Arity::kOne, "N", "CP (default 1)",
     [](LayoutFlags& f, const FlagValue& v) { f.sizes.context_parallel_size = rank_count(v); }},
    {"--expert-model-parallel-size", Arity::kOne, "N", "EP (default 1)",
     [](LayoutFlags& f, const FlagValue& v) { f.sizes.expert_model_parallel_size = rank_count(v); }},
    {"--expert-tensor-parallel-size", Arity::kOne, "N", "expert TP (default: TP)",
     [](LayoutFlags& f, const FlagValue& v) { f.sizes.expert_tensor_parallel_size = rank_count(v); }},
    {"--use-tp-pp-dp-mapping", Arity::kSwitch, "", "order tp-cp-ep-pp-dp instead of tp-cp-ep-dp-pp",
     [](LayoutFlags& f, const FlagValue&) { f.sizes.order = kTpPpDpRankOrder; }},
    // The pipeline split (its values are checked by PipelineLayout with Megatron's messages).
    {"--num-layers", Arity::kOne, "N", "decoder layers: also print every pipeline stage's layers",
     [](LayoutFlags& f, const FlagValue& v) { f.num_layers = rank_count(v); }},
    {"--decoder-first-pipeline-num-layers", Arity::kOne, "N", "layers of the first pipeline stage (uneven split)",
     [](LayoutFlags& f, const FlagValue& v) {
       f.saw_split_flag(v.flag);
       f.split.decoder_first_pipeline_num_layers = v.integer();
     }},
    {"--decoder-last-pipeline-num-layers", Arity::kOne, "N", "layers of the last pipeline stage (uneven split)",
     [](LayoutFlags& f, const FlagValue& v) {
       f.saw_split_flag(v.flag);
       f.split.decoder_last_pipeline_num_layers = v.integer();
     }},
    {"--account-for-embedding-in-pipeline-split", Arity::kSwitch, "",
     "count the embedding as a layer in the uniform split",
     [](LayoutFlags& f, const FlagValue& v) {
       f.saw_split_flag(v.flag);
       f.split.account_for_embedding_in_pipeline_split = true;
     }},
    {"--account-for-loss-in-pipeline-split", Arity::kSwitch, "", "count the loss as a layer in the uniform split",
     [](LayoutFlags& f, const FlagValue& v) {
       f.saw_split_flag(v.flag);
       f.split.account_for_loss_in_pipeline_split = true;
     }},
    {"--pipeline-model-parallel-layout", Arity::kOne, "TEXT",
     "stages by hand, e.g. \"Et|(tt|)*2,tL\" (E embedding, t decoder layer, L loss, m MTP layer, | between stages)",
     [](LayoutFlags& f, const FlagValue& v) {
       f.saw_split_flag(v.flag);
       f.split.pipeline_model_parallel_layout = v.text();
     }},
    {"--mtp-num-layers", Arity::kOne, "N", "Multi-Token Prediction depths (on the loss stage)",
     [](LayoutFlags& f, const FlagValue& v) {
       f.saw_split_flag(v.flag);
       f.mtp_num_layers = v.integer();
     }},
    {"--num-layers-per-virtual-pipeline-stage", Arity::kOne, "N", "layers per virtual stage (interleaved schedule)",
     [](LayoutFlags& f, const FlagValue& v) {
       f.saw_split_flag(v.flag);
       f.split.num_layers_per_virtual_pipeline_stage = v.integer();
     }},
    {"--num-virtual-stages-per-pipeline-rank", Arity::kOne, "N",
     "virtual stages per pipeline rank (interleaved schedule)",
     [](LayoutFlags& f, const FlagValue& v) {
       f.saw_split_flag(v.flag);
       f.split.num_virtual_stages_per_pipeline_rank = v.integer();
     }},
  };
  return table;
}
// clang-format on

}  // namespace

std::string layout_usage() {
  return "usage: moecore layout --world-size N [flags]\n"
         "Prints every process group of Megatron's rank layout (attention grid and expert grid of Parallel\n"
         "Folding) without launching anything. With --num-layers it also prints the decoder layers of every\n"
         "pipeline rank and virtual stage (Megatron's split; the split flags need --num-layers).\n\n" +
         flags_help(layout_flag_table());
}

LayoutCommandArgs parse_layout_command_args(const std::vector<std::string>& args) {
  LayoutFlags flags;
  try {
    parse_flags(layout_flag_table(), args, flags);
  } catch (const FlagError& error) {
    throw LayoutError(error.what());
  }
  LayoutCommandArgs parsed;
  parsed.sizes = flags.sizes;
  if (!flags.world_size) throw LayoutError("moecore layout: --world-size is required");
  parsed.sizes.world_size = *flags.world_size;
  if (!flags.num_layers && !flags.first_split_flag.empty()) {
    throw LayoutError("moecore layout: " + flags.first_split_flag +
                      " needs --num-layers (the split counts decoder layers)");
  }
  parsed.pipeline_split = flags.split;
  if (flags.num_layers) {
    PipelineShape shape;
    shape.num_layers = *flags.num_layers;
    shape.pipeline_model_parallel_size = parsed.sizes.pipeline_model_parallel_size;
    shape.mtp_num_layers = flags.mtp_num_layers;
    parsed.pipeline = shape;
  }
  return parsed;
}

ParallelSizes parse_layout_args(const std::vector<std::string>& args) { return parse_layout_command_args(args).sizes; }

int layout_main(const std::vector<std::string>& args, std::ostream& out) {
  if (std::find(args.begin(), args.end(), "--help") != args.end() ||
      std::find(args.begin(), args.end(), "-h") != args.end()) {
    out << layout_usage();
    return 0;
  }
  const LayoutCommandArgs parsed = parse_layout_command_args(args);
  const ParallelLayout layout(parsed.sizes);
  // Both are validated before anything is printed.
  const std::optional<PipelineLayout> pipeline =
      parsed.pipeline ? std::optional<PipelineLayout>(std::in_place, *parsed.pipeline, parsed.pipeline_split)
                      : std::nullopt;
  print_layout(layout, out);
  if (pipeline) print_pipeline_stages(*pipeline, out);
  return 0;
}

}  // namespace moecore

int run_layout(int argc, char** argv) {
  try {
    return moecore::layout_main(std::vector<std::string>(argv + 1, argv + argc), std::cout);
  } catch (const std::exception& e) {
    std::cout.flush();
    std::cerr << "error: " << e.what() << '\n';
    return 1;
  }
}
