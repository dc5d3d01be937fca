#include "moecore/tokenizer/utf8.h"

namespace moecore::utf8 {
namespace {

constexpr DecodedChar kInvalidByte{0xFFFD, 1, false};

bool is_continuation(uint8_t byte) { return (byte & 0xC0) == 0x80; }

}  // namespace

DecodedChar decode(std::string_view text, size_t pos) {
  const auto byte_at = [&](size_t i) { return static_cast<uint8_t>(text[i]); };
  const uint8_t lead = byte_at(pos);
  if (lead < 0x80) return {lead, 1, true};
  uint32_t length = 0;
  char32_t code_point = 0;
  // The allowed range of the second byte narrows for E0, ED, F0, F4 (no overlongs, surrogates, > U+10FFFF).
  uint8_t second_min = 0x80;
  uint8_t second_max = 0xBF;
  if (lead >= 0xC2 && lead <= 0xDF) {
    length = 2;
    code_point = lead & 0x1F;
  } else if (lead >= 0xE0 && lead <= 0xEF) {
    length = 3;
    code_point = lead & 0x0F;
    if (lead == 0xE0) second_min = 0xA0;
    if (lead == 0xED) second_max = 0x9F;
  } else if (lead >= 0xF0 && lead <= 0xF4) {
    length = 4;
    code_point = lead & 0x07;
    if (lead == 0xF0) second_min = 0x90;
    if (lead == 0xF4) second_max = 0x8F;
  } else {
    return kInvalidByte;
  }
  for (uint32_t k = 1; k < length; ++k) {
    if (pos + k >= text.size()) return {0xFFFD, k, false};
    const uint8_t byte = byte_at(pos + k);
    const bool ok = k == 1 ? (byte >= second_min && byte <= second_max) : is_continuation(byte);
    if (!ok) return {0xFFFD, k, false};
    code_point = (code_point << 6) | (byte & 0x3F);
  }
  return {code_point, length, true};
}

void append(std::string& out, char32_t code_point) {
  if (code_point < 0x80) {
    out += static_cast<char>(code_point);
  } else if (code_point < 0x800) {
    out += static_cast<char>(0xC0 | (code_point >> 6));
    out += static_cast<char>(0x80 | (code_point & 0x3F));
  } else if (code_point < 0x10000) {
    out += static_cast<char>(0xE0 | (code_point >> 12));
    out += static_cast<char>(0x80 | ((code_point >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (code_point & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (code_point >> 18));
    out += static_cast<char>(0x80 | ((code_point >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((code_point >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (code_point & 0x3F));
  }
}

std::string replace_invalid(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  size_t pos = 0;
  while (pos < bytes.size()) {
    const DecodedChar c = decode(bytes, pos);
    if (c.valid) {
      out.append(bytes.substr(pos, c.length));
    } else {
      append(out, 0xFFFD);
    }
    pos += c.length;
  }
  return out;
}

}  // namespace moecore::utf8
