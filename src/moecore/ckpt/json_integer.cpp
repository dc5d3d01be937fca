#include "moecore/ckpt/json_integer.h"

#include <cmath>
#include <limits>

#include "moecore/model/config.h"

namespace moecore {

int64_t json_integer(const nlohmann::json& value, const std::string& where) {
  if (value.is_number_integer() && !value.is_number_unsigned()) return value.get<int64_t>();
  if (value.is_number_unsigned()) {
    const uint64_t u = value.get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      throw ConfigError(where + " is out of range (got " + value.dump() + ")");
    }
    return static_cast<int64_t>(u);
  }
  if (value.is_number_float()) {
    // nlohmann stores integers beyond 64 bits as doubles: 2^70 is a whole number out of range, 2.5 is not an integer.
    const double d = value.get<double>();
    if (std::isfinite(d) && d == std::floor(d) && std::abs(d) >= 9.2233720368547758e18) {
      throw ConfigError(where + " is out of range (got " + value.dump() + ")");
    }
  }
  throw ConfigError(where + " must be an integer (got " + value.dump() + ")");
}

std::vector<int64_t> json_integer_list(const nlohmann::json& value, const std::string& where) {
  if (!value.is_array()) throw ConfigError(where + " must be a list of integers (got " + value.dump() + ")");
  std::vector<int64_t> out;
  out.reserve(value.size());
  for (size_t i = 0; i < value.size(); ++i)
    out.push_back(json_integer(value[i], where + "[" + std::to_string(i) + "]"));
  return out;
}

}  // namespace moecore
