// Integer fields of the JSON files moecore reads (HF config.json): nlohmann's get<int64_t>() truncates 2.5 to 2 and
// turns 2^70 (stored as a double) into an arbitrary value; these checks refuse both.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace moecore {

// `value` as an int64: a JSON integer (not 2.5, 2.0 or 1e3) within [-2^63, 2^63). Throws ConfigError
// "<where> must be an integer (got 2.5)" or "<where> is out of range (got 1180591620717411303424)".
int64_t json_integer(const nlohmann::json& value, const std::string& where);

// A JSON array of such integers; ConfigError "<where> must be a list of integers" otherwise.
std::vector<int64_t> json_integer_list(const nlohmann::json& value, const std::string& where);

}  // namespace moecore
