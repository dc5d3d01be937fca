#include "moecore/util/json_string.h"

#include <nlohmann/json.hpp>

namespace moecore {

std::string json_string(const std::string_view text) {
  return nlohmann::json(std::string(text))
      .dump(-1, ' ', /*ensure_ascii=*/true, nlohmann::json::error_handler_t::replace);
}

}  // namespace moecore
