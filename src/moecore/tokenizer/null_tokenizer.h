// Megatron's _NullTokenizer (megatron/training/tokenizer/tokenizer.py): the text is already token ids,
// written as integers separated by single spaces (Python: [int(x) for x in text.split(' ')]).
// vocab_size() is V + 1 and eod() is V, where V is --vocab-size.
#pragma once

#include "moecore/tokenizer/tokenizer.h"

namespace moecore {

class NullTokenizer final : public Tokenizer {
 public:
  explicit NullTokenizer(int64_t vocab_size_without_eod);

  // Each piece between single spaces is parsed like Python's int(): surrounding ASCII whitespace, an
  // optional sign and single underscores between digits are accepted (non-ASCII digits and spaces are not).
  // Unlike Megatron, ids outside [0, vocab_size()) are an error instead of being written to the dataset.
  std::vector<int32_t> tokenize(std::string_view text) const override;
  std::string detokenize(const std::vector<int32_t>& ids) const override;  // ids joined by single spaces
  int64_t vocab_size() const override { return vocab_size_without_eod_ + 1; }
  int32_t eod() const override { return static_cast<int32_t>(vocab_size_without_eod_); }

 private:
  int64_t vocab_size_without_eod_;
};

}  // namespace moecore
