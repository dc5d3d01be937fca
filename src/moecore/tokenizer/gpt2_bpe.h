// Megatron's GPT2BPETokenizer: GPT-2's byte-level BPE, giving exactly GPT-2's ids.
//   vocab file: encoder.json / vocab.json, a JSON object token -> id, tokens spelled with GPT-2's
//               bytes_to_unicode alphabet (one printable character per byte);
//   merge file: vocab.bpe / merges.txt, "#version" line then one "left right" pair per line, best first.
// "<|endoftext|>" is the eod id; the same text inside the input is encoded as ordinary characters, as
// Megatron's GPT2Tokenizer (no special tokens) does.
#pragma once

#include <array>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "moecore/tokenizer/tokenizer.h"

namespace moecore {

class Gpt2BpeTokenizer final : public Tokenizer {
 public:
  Gpt2BpeTokenizer(const std::string& vocab_file, const std::string& merge_file);
  ~Gpt2BpeTokenizer() override;

  std::vector<int32_t> tokenize(std::string_view text) const override;
  // Python's decode('utf-8', errors='replace') of the tokens' bytes, like Megatron.
  std::string detokenize(const std::vector<int32_t>& ids) const override;
  int64_t vocab_size() const override { return num_tokens_; }  // len(encoder): 50257 for GPT-2
  int32_t eod() const override { return eod_id_; }

  // The raw bytes of the tokens (no UTF-8 repair); throws TokenizerError for an id not in the vocabulary.
  std::string detokenize_bytes(const std::vector<int32_t>& ids) const;
  // Id of a token spelled in the vocab file's alphabet (e.g. "\u0120the" for " the"); -1 when absent.
  int32_t token_to_id(const std::string& token) const;

 private:
  struct Merge {
    int32_t rank;
    int32_t merged_id;
  };
  class WordCache;

  // Appends the BPE ids of one pre-tokenised piece.
  void encode_piece(std::string_view piece, std::vector<int32_t>& ids) const;
  void apply_merges(std::vector<int32_t>& symbols) const;
  const Merge* find_merge(int32_t left, int32_t right) const;

  int64_t num_tokens_ = 0;
  int32_t eod_id_ = -1;
  std::unordered_map<std::string, int32_t> encoder_;  // vocab-file spelling -> id
  std::vector<std::string> id_to_bytes_;
  std::vector<bool> id_present_;
  std::array<int32_t, 256> byte_to_id_{};
  std::unordered_map<uint64_t, Merge> merges_;  // (left id << 32 | right id) -> rank, merged id
  std::unique_ptr<WordCache> cache_;
};

}  // namespace moecore
