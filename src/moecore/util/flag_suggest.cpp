#include "moecore/util/flag_suggest.h"

#include <algorithm>
#include <numeric>

namespace moecore {

size_t edit_distance(const std::string_view a, const std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  std::iota(row.begin(), row.end(), size_t{0});
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t substitute = diagonal + (a[i - 1] == b[j - 1] ? 0 : 1);
      diagonal = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, substitute});
    }
  }
  return row[b.size()];
}

std::string closest_flag(const std::string_view name, const std::vector<std::string>& candidates) {
  return closest_flag(name, std::vector<std::string_view>(candidates.begin(), candidates.end()));
}

std::string closest_flag(const std::string_view name, const std::vector<std::string_view>& candidates) {
  size_t best_distance = std::max<size_t>(2, name.size() / 4) + 1;  // suggest only close names
  std::string best;
  for (const std::string_view candidate : candidates) {
    const size_t distance = edit_distance(name, candidate);
    if (distance < best_distance) {
      best_distance = distance;
      best = candidate;
    }
  }
  return best;
}

std::string unknown_flag_message(const std::string_view name, const std::vector<std::string>& candidates) {
  std::string message = "unknown flag " + std::string(name);
  const std::string suggestion = closest_flag(name, candidates);
  if (!suggestion.empty()) message += " (did you mean " + suggestion + "?)";
  return message;
}

}  // namespace moecore
