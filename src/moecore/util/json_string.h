// A string as a JSON string literal, escaped by nlohmann::json with ensure_ascii (non-ASCII as \uXXXX escapes, as
// Python's json.dumps writes them; bytes that are not UTF-8 become U+FFFD instead of an exception).
#pragma once

#include <string>
#include <string_view>

namespace moecore {

std::string json_string(std::string_view text);

}  // namespace moecore
