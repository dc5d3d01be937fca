// Whole variable-length samples (RL rollouts, SFT conversations): each sample is its own sequence of token ids with a
// loss mask over its tokens, never cut across samples, and packed into fixed-size bins for training
// (sequence_packing.h, Megatron-RL's packer). Two forms, read by `--sample-data-path PATH`:
//   PATH ending in .jsonl  one JSON object per line, {"tokens": [ids...], "loss_mask": [0/1...]} (loss_mask optional:
//                          every token trained); the two lists of one line are equally long;
//   PATH a prefix          Megatron indexed datasets PATH_tokens_document.bin/.idx and, optionally,
//                          PATH_loss_mask_document.bin/.idx with equally long documents, one per sample, as
//                          `moecore preprocess --json-keys tokens loss_mask` writes them from the same JSONL.
// loss_mask[i] = 1 trains the prediction of token i (from tokens 0..i-1); the first token is never predicted. A sample
// needs at least 2 tokens. Ids must lie below the vocabulary size given.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace moecore {

struct Sample {
  std::vector<int32_t> tokens;
  std::vector<uint8_t> loss_mask;  // per token: 1 = a training target
};

class SampleDataset {
 public:
  // Reads (JSONL) or maps (indexed) the samples and checks each one. DataError (one line: the path, the sample or line,
  // the problem) when the data is missing or malformed.
  SampleDataset(const std::string& path, int64_t vocab_size);
  ~SampleDataset();
  SampleDataset(const SampleDataset&) = delete;
  SampleDataset& operator=(const SampleDataset&) = delete;

  int64_t size() const { return static_cast<int64_t>(lengths_.size()); }
  int64_t length(int64_t i) const { return lengths_.at(static_cast<size_t>(i)); }  // tokens of sample i
  Sample sample(int64_t i) const;
  const std::string& path() const { return path_; }

 private:
  struct Indexed;
  std::string path_;
  std::vector<int64_t> lengths_;
  std::vector<Sample> samples_;       // JSONL: every sample in memory
  std::unique_ptr<Indexed> indexed_;  // indexed: the mapped datasets
};

}  // namespace moecore
