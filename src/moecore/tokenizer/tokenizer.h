// Tokenizers with Megatron's names and behaviour (megatron/training/tokenizer/tokenizer.py).
//   GPT2BPETokenizer: GPT-2's byte-level BPE (encoder.json / vocab.json + vocab.bpe / merges.txt).
//   NullTokenizer:    text is space-separated integer ids; eod = the given vocab size.
#pragma once

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace moecore {

// Bad tokenizer options, unreadable vocabulary files, or text a tokenizer cannot encode: one line.
class TokenizerError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Thread safety: every method is const and may be called from several threads at once.
class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  virtual std::vector<int32_t> tokenize(std::string_view text) const = 0;
  virtual std::string detokenize(const std::vector<int32_t>& ids) const = 0;
  // Megatron's `tokenizer.vocab_size`: the unpadded size the embedding must cover (eod included).
  virtual int64_t vocab_size() const = 0;
  virtual int32_t eod() const = 0;
};

struct TokenizerOptions {
  std::string type;         // --tokenizer-type
  std::string vocab_file;   // --vocab-file
  std::string merge_file;   // --merge-file
  int64_t vocab_size = -1;  // --vocab-size (NullTokenizer); -1 when not given
};

// Throws TokenizerError: unknown type, a Megatron type moecore does not implement yet, missing files.
std::unique_ptr<Tokenizer> build_tokenizer(const TokenizerOptions& options);

// Megatron's _vocab_size_with_padding: round up to a multiple of divisible_by * tensor_parallel_size.
int64_t padded_vocab_size(int64_t vocab_size, int64_t make_vocab_size_divisible_by, int64_t tensor_parallel_size);

}  // namespace moecore
