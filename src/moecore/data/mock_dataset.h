// Synthetic token sequences for tests and benchmarks (the idea of Megatron's MockGPTLowLevelDataset: a fixed
// number of sequences of pseudo-random lengths in [1, max_sequence_length), each ending with EOD). Contents
// are computed on demand, never stored. Unlike Megatron's (1, 2, ..., n-1, eod), which overflows small
// vocabularies, sequence i counts up from a pseudo-random start modulo the vocabulary, skipping EOD:
// a learnable next-token pattern whose ids are always < vocab_size. As in Megatron, every sequence ends with the EOD
// token and a sequence may be a lone EOD (length 1), so GPT samples cut across sequences hold EODs at any position,
// also two in a row, and --eod-mask-loss / --reset-position-ids / --reset-attention-mask act on mock data (about one
// EOD per max_sequence_length / 2 tokens: lower mock_max_sequence_length for denser packing).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "moecore/data/low_level_dataset.h"

namespace moecore {

struct MockDataOptions {
  int64_t vocab_size = 0;  // > 1
  int32_t eod_id = 0;      // in [0, vocab_size)
  // Megatron's mock has 100000 sequences; a tenth keeps a mock run's index build well under a second on a
  // small machine (one epoch of every split is indexed up front) while still giving ~20M tokens.
  int64_t num_sequences = 10000;
  int32_t max_sequence_length = 4096;  // Megatron's MockGPTLowLevelDataset.max_sequence_length
  uint32_t seed = 0;                   // Megatron's MockGPTLowLevelDataset.seed
};

class MockTokenSequences final : public TokenSequences {
 public:
  explicit MockTokenSequences(const MockDataOptions& options);  // throws DataError on bad options
  const std::string& name() const override { return name_; }
  const std::vector<int32_t>& sequence_lengths() const override { return sequence_lengths_; }
  void read(int64_t i, int64_t offset, std::span<int32_t> out) const override;

 private:
  MockDataOptions options_;
  std::string name_ = "mock";
  std::vector<int32_t> sequence_lengths_;
};

}  // namespace moecore
