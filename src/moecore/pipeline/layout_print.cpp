#include "moecore/pipeline/layout_print.h"

#include <string>
#include <utility>

namespace moecore {
namespace {

// "layers 4-5", "layer 3" or "no layers".
std::string layer_range(const PipelineStage& stage) {
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

void print_pipeline_stages(const PipelineLayout& pipeline, std::ostream& out) {
  out << "pipeline stages: " << pipeline.num_layers() << " decoder layers, PP " << pipeline.pipeline_size();
  if (pipeline.interleaved()) out << ", " << pipeline.virtual_pipeline_size() << " virtual stages per rank";
  out << '\n';
  for (const PipelineStage& stage : pipeline.stages()) {
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
