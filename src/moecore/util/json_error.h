// The text of a JSON library error for a user's message: nlohmann's what() without its
// "[json.exception.<kind>.<id>] " tag ("parse error at line 1, column 5: syntax error ...").
#pragma once

#include <exception>
#include <string>

namespace moecore {

inline std::string json_error_text(const std::exception& error) {
  const std::string what = error.what();
  const size_t tag_end = what.starts_with("[json.exception") ? what.find("] ") : std::string::npos;
  return tag_end == std::string::npos ? what : what.substr(tag_end + 2);
}

}  // namespace moecore
