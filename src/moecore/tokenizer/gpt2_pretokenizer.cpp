#include "moecore/tokenizer/gpt2_pretokenizer.h"

#include <array>
#include <cstdint>

#include "moecore/tokenizer/unicode_tables.h"
#include "moecore/tokenizer/utf8.h"

namespace moecore {
namespace {

enum class CharClass : uint8_t { kLetter, kNumber, kWhitespace, kOther };

struct CharInfo {
  CharClass cls;
  uint32_t length;  // bytes
};

constexpr std::array<CharClass, 128> make_ascii_classes() {
  std::array<CharClass, 128> classes{};
  for (int c = 0; c < 128; ++c) {
    if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) {
      classes[c] = CharClass::kLetter;
    } else if (c >= '0' && c <= '9') {
      classes[c] = CharClass::kNumber;
    } else if (unicode::is_whitespace(static_cast<char32_t>(c))) {
      classes[c] = CharClass::kWhitespace;
    } else {
      classes[c] = CharClass::kOther;
    }
  }
  return classes;
}
constexpr std::array<CharClass, 128> kAsciiClasses = make_ascii_classes();

CharInfo char_at(std::string_view text, size_t pos) {
  const auto byte = static_cast<uint8_t>(text[pos]);
  if (byte < 0x80) return {kAsciiClasses[byte], 1};
  const utf8::DecodedChar c = utf8::decode(text, pos);
  if (!c.valid) return {CharClass::kOther, c.length};
  if (unicode::is_letter(c.code_point)) return {CharClass::kLetter, c.length};
  if (unicode::is_number(c.code_point)) return {CharClass::kNumber, c.length};
  if (unicode::is_whitespace(c.code_point)) return {CharClass::kWhitespace, c.length};
  return {CharClass::kOther, c.length};
}

// Length in bytes of the contraction ('s 't 're 've 'm 'll 'd) starting at text[pos], or 0.
size_t contraction_length(std::string_view text, size_t pos) {
  if (text[pos] != '\'' || pos + 1 >= text.size()) return 0;
  const char a = text[pos + 1];
  if (a == 's' || a == 't' || a == 'm' || a == 'd') return 2;
  if (pos + 2 >= text.size()) return 0;
  const char b = text[pos + 2];
  if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return 3;
  return 0;
}

// End of the run of characters of class `cls` that starts at pos.
size_t run_end(std::string_view text, size_t pos, CharClass cls) {
  while (pos < text.size()) {
    const CharInfo c = char_at(text, pos);
    if (c.cls != cls) break;
    pos += c.length;
  }
  return pos;
}

}  // namespace

void gpt2_pretokenize(std::string_view text, std::vector<std::string_view>& pieces) {
  size_t pos = 0;
  while (pos < text.size()) {
    if (const size_t n = contraction_length(text, pos); n > 0) {
      pieces.push_back(text.substr(pos, n));
      pos += n;
      continue;
    }
    const CharInfo first = char_at(text, pos);
    // ` ?X+` for X in letters, numbers, other: an optional U+0020 then a run of one class.
    size_t run_start = pos;
    CharClass run_class = first.cls;
    if (text[pos] == ' ' && pos + 1 < text.size()) {
      const CharClass next = char_at(text, pos + 1).cls;
      if (next != CharClass::kWhitespace) {
        run_start = pos + 1;
        run_class = next;
      }
    }
    if (run_class != CharClass::kWhitespace) {
      const size_t end = run_end(text, run_start, run_class);
      pieces.push_back(text.substr(pos, end - pos));
      pos = end;
      continue;
    }
    // `\s+(?!\S)|\s+`: a whitespace run; when a non-space follows, its last character is left to start
    // the next piece, unless the run is a single character.
    size_t end = pos;
    size_t last_start = pos;
    while (end < text.size()) {
      const CharInfo c = char_at(text, end);
      if (c.cls != CharClass::kWhitespace) break;
      last_start = end;
      end += c.length;
    }
    if (end < text.size() && last_start > pos) end = last_start;
    pieces.push_back(text.substr(pos, end - pos));
    pos = end;
  }
}

}  // namespace moecore
