#include "moecore/tokenizer/null_tokenizer.h"

#include <cstdint>
#include <limits>
#include <optional>

namespace moecore {
namespace {

// ASCII characters Python's int() strips around a number (C's isspace; not U+001C..U+001F).
bool is_python_ascii_space(char c) { return c == ' ' || (c >= '\t' && c <= '\r'); }

// Python's int(piece) for base 10, limited to int64; nullopt when Python would raise (or on overflow).
std::optional<int64_t> parse_python_int(std::string_view piece) {
  while (!piece.empty() && is_python_ascii_space(piece.front())) piece.remove_prefix(1);
  while (!piece.empty() && is_python_ascii_space(piece.back())) piece.remove_suffix(1);
  bool negative = false;
  if (!piece.empty() && (piece.front() == '+' || piece.front() == '-')) {
    negative = piece.front() == '-';
    piece.remove_prefix(1);
  }
  if (piece.empty() || piece.front() == '_' || piece.back() == '_') return std::nullopt;
  int64_t magnitude = 0;
  char previous = '\0';
  for (const char c : piece) {
    if (c == '_') {
      if (previous == '_') return std::nullopt;
    } else if (c >= '0' && c <= '9') {
      if (magnitude > (std::numeric_limits<int64_t>::max() - (c - '0')) / 10) return std::nullopt;
      magnitude = magnitude * 10 + (c - '0');
    } else {
      return std::nullopt;
    }
    previous = c;
  }
  return negative ? -magnitude : magnitude;
}

}  // namespace

NullTokenizer::NullTokenizer(int64_t vocab_size_without_eod) : vocab_size_without_eod_(vocab_size_without_eod) {
  if (vocab_size_without_eod < 1 || vocab_size_without_eod >= std::numeric_limits<int32_t>::max()) {
    throw TokenizerError("NullTokenizer: --vocab-size must be in [1, 2^31 - 2], got " +
                         std::to_string(vocab_size_without_eod));
  }
}

std::vector<int32_t> NullTokenizer::tokenize(std::string_view text) const {
  std::vector<int32_t> ids;
  size_t start = 0;
  while (true) {
    const size_t end = text.find(' ', start);
    const std::string_view piece =
        text.substr(start, end == std::string_view::npos ? std::string_view::npos : end - start);
    const std::optional<int64_t> id = parse_python_int(piece);
    if (!id) {
      throw TokenizerError("NullTokenizer: '" + std::string(piece.substr(0, 40)) +
                           "' is not an integer (the text must be token ids separated by single spaces)");
    }
    if (*id < 0 || *id >= vocab_size()) {
      throw TokenizerError("NullTokenizer: token id " + std::to_string(*id) + " is outside [0, " +
                           std::to_string(vocab_size()) + ")");
    }
    ids.push_back(static_cast<int32_t>(*id));
    if (end == std::string_view::npos) break;
    start = end + 1;
  }
  return ids;
}

std::string NullTokenizer::detokenize(const std::vector<int32_t>& ids) const {
  std::string text;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (i > 0) text += ' ';
    text += std::to_string(ids[i]);
  }
  return text;
}

}  // namespace moecore
