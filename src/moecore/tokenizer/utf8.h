// UTF-8 decoding that never fails: ill-formed input is reported per "maximal subpart" (Unicode 3.9,
// Table 3-7), the unit Python's decode(errors='replace') turns into one U+FFFD.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace moecore::utf8 {

struct DecodedChar {
  char32_t code_point;  // U+FFFD when !valid
  uint32_t length;      // bytes consumed, >= 1
  bool valid;
};

// Decodes the character starting at text[pos]; requires pos < text.size().
DecodedChar decode(std::string_view text, size_t pos);

// Python's bytes.decode('utf-8', errors='replace') re-encoded: each ill-formed subpart becomes U+FFFD.
std::string replace_invalid(std::string_view bytes);

void append(std::string& out, char32_t code_point);  // encodes one valid code point

}  // namespace moecore::utf8
