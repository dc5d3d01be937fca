// "did you mean" for command-line flags.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace moecore {

// Levenshtein distance between two strings.
size_t edit_distance(std::string_view a, std::string_view b);

// The candidate closest to `name` when it is close enough to be a likely typo, else "".
std::string closest_flag(std::string_view name, const std::vector<std::string>& candidates);
std::string closest_flag(std::string_view name, const std::vector<std::string_view>& candidates);

// "unknown flag --x" plus " (did you mean --y?)" when a candidate is close.
std::string unknown_flag_message(std::string_view name, const std::vector<std::string>& candidates);

}  // namespace moecore
