#include "moecore/parallel/layout_command.h"

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
const std::vector<std::string_view> kIntFlags = {
    "--world-size",
    "--tensor-model-parallel-size",
    "--pipeline-model-parallel-size",
    "--context-parallel-size",
    "--expert-model-parallel-size",
    "--expert-tensor-parallel-size",
};

std::string unknown_flag_message(const std::string_view flag) {
  std::vector<std::string_view> known = kIntFlags;
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
         "  --use-tp-pp-dp-mapping              order tp-cp-ep-pp-dp instead of tp-cp-ep-dp-pp\n";
}

ParallelSizes parse_layout_args(const std::vector<std::string>& args) {
  ParallelSizes sizes;
  std::optional<int> world_size;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string_view arg = args[i];
    const size_t equals = arg.find('=');
    const std::string_view flag = arg.substr(0, equals);
    if (flag == kMappingFlag) {
      if (equals != std::string_view::npos) throw LayoutError(std::string(kMappingFlag) + " takes no value");
      sizes.order = kTpPpDpRankOrder;
      continue;
    }
    if (std::find(kIntFlags.begin(), kIntFlags.end(), flag) == kIntFlags.end()) {
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
    const int value = parse_positive(flag, text);
    if (flag == "--world-size") world_size = value;
    if (flag == "--tensor-model-parallel-size") sizes.tensor_model_parallel_size = value;
    if (flag == "--pipeline-model-parallel-size") sizes.pipeline_model_parallel_size = value;
    if (flag == "--context-parallel-size") sizes.context_parallel_size = value;
    if (flag == "--expert-model-parallel-size") sizes.expert_model_parallel_size = value;
    if (flag == "--expert-tensor-parallel-size") sizes.expert_tensor_parallel_size = value;
  }
  if (!world_size) throw LayoutError("moecore layout: --world-size is required");
  sizes.world_size = *world_size;
  return sizes;
}

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
  print_layout(ParallelLayout(parse_layout_args(args)), out);
  return 0;
}

}  // namespace moecore
