#include "moecore/pipeline/layout_command.h"

#include <algorithm>
#include <charconv>
#include <limits>
#include <optional>
#include <string_view>
#include <utility>

#include "moecore/util/flag_suggest.h"

namespace moecore {
namespace {

constexpr std::string_view kMappingFlag = "--use-tp-pp-dp-mapping";
constexpr std::string_view kHelpFlag = "--help";
constexpr std::string_view kNumLayersFlag = "--num-layers";
constexpr std::string_view kLayoutFlag = "--pipeline-model-parallel-layout";
constexpr std::string_view kEmbeddingFlag = "--account-for-embedding-in-pipeline-split";
constexpr std::string_view kLossFlag = "--account-for-loss-in-pipeline-split";
const std::vector<std::string_view> kIntFlags = {
    "--world-size",
    "--tensor-model-parallel-size",
    "--pipeline-model-parallel-size",
    "--context-parallel-size",
    "--expert-model-parallel-size",
    "--expert-tensor-parallel-size",
    kNumLayersFlag,
};
// Integers of the pipeline split; PipelineLayout checks their values with Megatron's messages.
const std::vector<std::string_view> kSplitIntFlags = {
    "--decoder-first-pipeline-num-layers",
    "--decoder-last-pipeline-num-layers",
    "--num-layers-per-virtual-pipeline-stage",
    "--num-virtual-stages-per-pipeline-rank",
    "--mtp-num-layers",
};

bool is_one_of(const std::vector<std::string_view>& flags, const std::string_view flag) {
  return std::find(flags.begin(), flags.end(), flag) != flags.end();
}

std::string unknown_flag_message(const std::string_view flag) {
  std::vector<std::string_view> known = kIntFlags;
  known.insert(known.end(), kSplitIntFlags.begin(), kSplitIntFlags.end());
  known.push_back(kLayoutFlag);
  known.push_back(kEmbeddingFlag);
  known.push_back(kLossFlag);
  known.push_back(kMappingFlag);
  known.push_back(kHelpFlag);
  const std::string closest = closest_flag(flag, known);
  std::string message = "moecore layout: unknown flag '" + std::string(flag) + "'";
  if (!closest.empty()) message += " (did you mean " + closest + "?)";
  return message;
}

int parse_positive(const std::string_view flag, const std::string_view text) {
  int value = 0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (text.empty() || error != std::errc() || end != text.data() + text.size() || value < 1) {
    throw LayoutError(std::string(flag) + " expects a positive integer, got '" + std::string(text) + "'");
  }
  return value;
}

int64_t parse_integer(const std::string_view flag, const std::string_view text) {
  int64_t value = 0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (text.empty() || error != std::errc() || end != text.data() + text.size()) {
    throw LayoutError(std::string(flag) + " expects an integer, got '" + std::string(text) + "'");
  }
  return value;
}

// "layers 4-5", "layer 3" or "no layers".
std::string layer_range(const parallel::PipelineStage& stage) {
  if (stage.num_layers == 0) return "no layers";
  if (stage.num_layers == 1) return "layer " + std::to_string(stage.first_layer);
  return "layers " + std::to_string(stage.first_layer) + "-" + std::to_string(stage.end_layer() - 1);
}

void print_kind(const NamedRankGroups& kind, std::ostream& out) {
  constexpr size_t kWidth = 100;
  constexpr std::string_view kIndent = "      ";
  const RankGroups& groups = *kind.groups;
  const size_t group_size = groups.empty() ? 0 : groups.front().size();
  out << "    " << kind.name << " (" << kind.description << "): " << groups.size()
      << (groups.size() == 1 ? " group" : " groups") << " of " << group_size << '\n';
  std::string line(kIndent);
  const auto append = [&](const std::string& text) {
    if (line.size() > kIndent.size() && line.size() + 1 + text.size() > kWidth) {
      out << line << '\n';
      line = kIndent;
    }
    if (line.size() > kIndent.size()) line += ' ';
    line += text;
  };
  for (const auto& group : groups) {
    // A group stays on one line when it fits on one; a longer one wraps between its ranks.
    std::vector<std::string> words;
    size_t group_width = 0;
    for (size_t i = 0; i < group.size(); ++i) {
      std::string word = i == 0 ? "[" : "";
      word += std::to_string(group[i]);
      word += i + 1 == group.size() ? ']' : ',';
      words.push_back(std::move(word));
      group_width += words.back().size() + (i ? 1 : 0);
    }
    if (kIndent.size() + group_width <= kWidth) {
      std::string text;
      for (const std::string& word : words) {
        if (!text.empty()) text += ' ';
        text += word;
      }
      append(text);
    } else {
      for (const std::string& word : words) append(word);
    }
  }
  out << line << '\n';
}

}  // namespace

std::string layout_usage() {
  return "usage: moecore layout --world-size N [flags]\n"
         "Prints every process group of Megatron's rank layout (attention grid and expert grid of Parallel\n"
         "Folding) without launching anything.\n\n"
         "  --world-size N                      number of processes (required)\n"
         "  --tensor-model-parallel-size N      TP (default 1)\n"
         "  --pipeline-model-parallel-size N    PP (default 1)\n"
         "  --context-parallel-size N           CP (default 1)\n"
         "  --expert-model-parallel-size N      EP (default 1)\n"
         "  --expert-tensor-parallel-size N     expert TP (default: TP)\n"
         "  --use-tp-pp-dp-mapping              order tp-cp-ep-pp-dp instead of tp-cp-ep-dp-pp\n\n"
         "With --num-layers it also prints the decoder layers of every pipeline rank and virtual stage (Megatron's\n"
         "split; the flags below need --num-layers):\n\n"
         "  --num-layers N                                decoder layers\n"
         "  --decoder-first-pipeline-num-layers N         layers of the first pipeline stage (uneven split)\n"
         "  --decoder-last-pipeline-num-layers N          layers of the last pipeline stage (uneven split)\n"
         "  --account-for-embedding-in-pipeline-split     count the embedding as a layer in the uniform split\n"
         "  --account-for-loss-in-pipeline-split          count the loss as a layer in the uniform split\n"
         "  --pipeline-model-parallel-layout TEXT         stages by hand, e.g. \"Et|(tt|)*2,tL\" (E embedding,\n"
         "                                                t decoder layer, L loss, m MTP layer, | between stages)\n"
         "  --mtp-num-layers N                            Multi-Token Prediction depths (on the loss stage)\n"
         "  --num-layers-per-virtual-pipeline-stage N     layers per virtual stage (interleaved schedule)\n"
         "  --num-virtual-stages-per-pipeline-rank N      virtual stages per pipeline rank (interleaved schedule)\n";
}

LayoutCommandArgs parse_layout_command_args(const std::vector<std::string>& args) {
  LayoutCommandArgs parsed;
  ParallelSizes& sizes = parsed.sizes;
  parallel::PipelineSplitFlags& split = parsed.pipeline_split;
  parallel::PipelineShape shape;
  std::optional<int> world_size;
  std::optional<int> num_layers;
  std::string first_split_flag;  // the first split flag given, to name when --num-layers is missing
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string_view arg = args[i];
    const size_t equals = arg.find('=');
    const std::string_view flag = arg.substr(0, equals);
    if (flag == kMappingFlag || flag == kEmbeddingFlag || flag == kLossFlag) {
      if (equals != std::string_view::npos) throw LayoutError(std::string(flag) + " takes no value");
      if (flag == kMappingFlag) sizes.order = kTpPpDpRankOrder;
      if (flag == kEmbeddingFlag) split.account_for_embedding_in_pipeline_split = true;
      if (flag == kLossFlag) split.account_for_loss_in_pipeline_split = true;
      if (flag != kMappingFlag && first_split_flag.empty()) first_split_flag = flag;
      continue;
    }
    if (!is_one_of(kIntFlags, flag) && !is_one_of(kSplitIntFlags, flag) && flag != kLayoutFlag) {
      throw LayoutError(unknown_flag_message(flag));
    }
    std::string_view text;
    if (equals != std::string_view::npos) {
      text = arg.substr(equals + 1);
    } else if (i + 1 < args.size()) {
      text = args[++i];
    } else {
      throw LayoutError(std::string(flag) + " expects a value");
    }
    if (flag == kLayoutFlag || is_one_of(kSplitIntFlags, flag)) {
      if (first_split_flag.empty()) first_split_flag = flag;
      if (flag == kLayoutFlag) split.pipeline_model_parallel_layout = std::string(text);
      if (flag == "--decoder-first-pipeline-num-layers")
        split.decoder_first_pipeline_num_layers = parse_integer(flag, text);
      if (flag == "--decoder-last-pipeline-num-layers")
        split.decoder_last_pipeline_num_layers = parse_integer(flag, text);
      if (flag == "--num-layers-per-virtual-pipeline-stage") {
        split.num_layers_per_virtual_pipeline_stage = parse_integer(flag, text);
      }
      if (flag == "--num-virtual-stages-per-pipeline-rank") {
        split.num_virtual_stages_per_pipeline_rank = parse_integer(flag, text);
      }
      if (flag == "--mtp-num-layers") shape.mtp_num_layers = parse_integer(flag, text);
      continue;
    }
    const int value = parse_positive(flag, text);
    // The layout lists every rank's groups: a million ranks is beyond any cluster and still prints in seconds.
    constexpr int kMaxWorldSize = 1 << 20;
    if (value > kMaxWorldSize) {
      throw LayoutError(std::string(flag) + " " + std::string(text) + " is above the limit of " +
                        std::to_string(kMaxWorldSize) + " ranks");
    }
    if (flag == "--world-size") world_size = value;
    if (flag == "--tensor-model-parallel-size") sizes.tensor_model_parallel_size = value;
    if (flag == "--pipeline-model-parallel-size") sizes.pipeline_model_parallel_size = value;
    if (flag == "--context-parallel-size") sizes.context_parallel_size = value;
    if (flag == "--expert-model-parallel-size") sizes.expert_model_parallel_size = value;
    if (flag == "--expert-tensor-parallel-size") sizes.expert_tensor_parallel_size = value;
    if (flag == kNumLayersFlag) num_layers = value;
  }
  if (!world_size) throw LayoutError("moecore layout: --world-size is required");
  sizes.world_size = *world_size;
  if (!num_layers && !first_split_flag.empty()) {
    throw LayoutError("moecore layout: " + first_split_flag + " needs --num-layers (the split counts decoder layers)");
  }
  if (num_layers) {
    shape.num_layers = *num_layers;
    shape.pipeline_model_parallel_size = sizes.pipeline_model_parallel_size;
    parsed.pipeline = shape;
  }
  return parsed;
}

ParallelSizes parse_layout_args(const std::vector<std::string>& args) { return parse_layout_command_args(args).sizes; }

void print_layout(const ParallelLayout& layout, std::ostream& out) {
  const ParallelSizes& sizes = layout.sizes();
  out << "world size " << layout.world_size() << ", rank order " << layout.order() << " (leftmost varies fastest)\n";
  out << "attention grid: TP " << sizes.tensor_model_parallel_size << ", CP " << sizes.context_parallel_size << ", DP "
      << layout.data_parallel_size() << ", PP " << sizes.pipeline_model_parallel_size << '\n';
  for (const NamedRankGroups& kind : layout.dense_kinds()) print_kind(kind, out);
  out << "expert grid (Parallel Folding): ETP " << layout.expert_tensor_parallel_size() << ", EP "
      << sizes.expert_model_parallel_size << ", EDP " << layout.expert_data_parallel_size() << ", PP "
      << sizes.pipeline_model_parallel_size << '\n';
  for (const NamedRankGroups& kind : layout.expert_kinds()) print_kind(kind, out);
}

int layout_main(const std::vector<std::string>& args, std::ostream& out) {
  if (std::find(args.begin(), args.end(), kHelpFlag) != args.end() ||
      std::find(args.begin(), args.end(), "-h") != args.end()) {
    out << layout_usage();
    return 0;
  }
  const LayoutCommandArgs parsed = parse_layout_command_args(args);
  const ParallelLayout layout(parsed.sizes);
  // Both are validated before anything is printed.
  const std::optional<parallel::PipelineLayout> pipeline =
      parsed.pipeline ? std::optional<parallel::PipelineLayout>(std::in_place, *parsed.pipeline, parsed.pipeline_split)
                      : std::nullopt;
  print_layout(layout, out);
  if (pipeline) print_pipeline_stages(*pipeline, out);
  return 0;
}

void print_pipeline_stages(const parallel::PipelineLayout& pipeline, std::ostream& out) {
  out << "pipeline stages: " << pipeline.num_layers() << " decoder layers, PP " << pipeline.pipeline_size();
  if (pipeline.interleaved()) out << ", " << pipeline.virtual_pipeline_size() << " virtual stages per rank";
  out << '\n';
  for (const parallel::PipelineStage& stage : pipeline.stages()) {
    out << "    pp rank " << stage.pp_rank;
    if (pipeline.interleaved()) out << ", virtual stage " << stage.virtual_stage;
    out << ": " << layer_range(stage);
    if (stage.has_embedding) out << " + embedding";
    if (stage.has_loss) out << " + loss";
    if (stage.mtp_layers > 0) out << " + " << stage.mtp_layers << " MTP layers";
    out << '\n';
  }
}

}  // namespace moecore
