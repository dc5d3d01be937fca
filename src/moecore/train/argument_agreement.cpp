#include "moecore/train/argument_agreement.h"

#include <algorithm>
#include <map>
#include <string_view>

#include "moecore/config/arguments.h"
#include "moecore/model/config.h"
#include "moecore/parallel/agreement.h"

namespace moecore {
namespace {

// Flag name -> the values of its last occurrence. Tokens before the first flag are kept under the name "".
using EffectiveFlags = std::map<std::string, std::vector<std::string>>;

EffectiveFlags effective_flags(const std::vector<std::string>& args) {
  EffectiveFlags flags;
  std::vector<std::string>* current = nullptr;
  for (const std::string& token : args) {
    if (!looks_like_train_flag(token)) {
      if (current == nullptr) current = &flags[""];
      current->push_back(token);
      continue;
    }
    const size_t equals = token.find('=');
    current = &flags[token.substr(0, equals)];
    current->clear();  // the last occurrence wins
    if (equals != std::string::npos) current->push_back(token.substr(equals + 1));
  }
  return flags;
}

std::string describe(const EffectiveFlags& flags, const std::string& name, const int rank) {
  const std::string who = "rank " + std::to_string(rank);
  const auto it = flags.find(name);
  if (it == flags.end()) return who + " does not give it";
  if (it->second.empty()) return who + " gives it";
  std::string values;
  for (const std::string& value : it->second) {
    const bool quote = value.empty() || value.find_first_of(" \t\n") != std::string::npos;
    values += (values.empty() ? "" : " ") + (quote ? "'" + value + "'" : value);
  }
  return who + " has " + values;
}

}  // namespace

const std::vector<std::string>& per_rank_train_flags() {
  static const std::vector<std::string> flags = {"--threads"};
  return flags;
}

std::optional<std::string> first_argument_disagreement(const std::vector<std::string>& rank0_args,
                                                       const std::vector<std::string>& args, const int rank) {
  const EffectiveFlags root = effective_flags(rank0_args);
  const EffectiveFlags mine = effective_flags(args);
  std::vector<std::string> names;
  for (const auto& [name, values] : root) names.push_back(name);
  for (const auto& [name, values] : mine) {
    if (!root.contains(name)) names.push_back(name);
  }
  // The flag table's order (model shape first), then names it does not know alphabetically.
  const std::vector<std::string> table = implemented_train_flags();
  const auto position = [&](const std::string& name) {
    return std::find(table.begin(), table.end(), name) - table.begin();
  };
  std::sort(names.begin(), names.end(), [&](const std::string& a, const std::string& b) {
    const auto pa = position(a);
    const auto pb = position(b);
    return pa != pb ? pa < pb : a < b;
  });
  const std::vector<std::string>& per_rank = per_rank_train_flags();
  for (const std::string& name : names) {
    if (std::find(per_rank.begin(), per_rank.end(), name) != per_rank.end()) continue;
    const auto a = root.find(name);
    const auto b = mine.find(name);
    if (a != root.end() && b != mine.end() && a->second == b->second) continue;
    const std::string what = name.empty() ? "the arguments before the first flag" : name;
    return "ranks disagree on " + what + ": " + describe(root, name, 0) + ", " + describe(mine, name, rank);
  }
  return std::nullopt;
}

void check_ranks_agree_on_arguments(const parallel::ProcessGroup& world, const std::vector<std::string>& args) {
  // argv strings hold no NUL byte, so NUL separates them.
  std::string mine;
  for (const std::string& arg : args) mine.append(arg).push_back('\0');
  const std::string text = parallel::broadcast_text(world, mine, 0);
  std::vector<std::string> rank0_args;
  for (size_t begin = 0; begin < text.size();) {
    const size_t end = text.find('\0', begin);
    rank0_args.push_back(text.substr(begin, end - begin));
    begin = end + 1;
  }
  parallel::run_on_all_ranks(world, [&] {
    if (const std::optional<std::string> message = first_argument_disagreement(rank0_args, args, world.rank())) {
      throw ConfigError(*message);
    }
  });
}

}  // namespace moecore
