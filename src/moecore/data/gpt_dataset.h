// Megatron's GPTDataset (megatron/core/datasets/gpt_dataset.py): fixed-length samples of sequence_length + 1
// tokens cut from the split's sequences laid end to end, crossing sequence boundaries, over as many epochs as
// the requested number of samples needs. Three indices, built as Megatron builds them:
//   document index  the split's sequence ids tiled over the epochs and shuffled (numpy RandomState(seed));
//                   when the final epoch is needed for under 80% of its samples it is shuffled separately;
//   sample index    (num_samples + 1, 2) rows of (position in the document index, token offset): sample i
//                   spans row i to row i + 1 inclusive of one extra token (Megatron's build_sample_idx);
//   shuffle index   a permutation of the samples (the separate final epoch, if any, shuffled on its own).
// As in Megatron the split is over sequences (numel_low_level_dataset = number of sequences), which are the
// documents unless the data was preprocessed with --split-sentences, and the last partial sample is dropped.
// The indices are cached as .npy files named by a hash of a description of the dataset, split, number of
// samples, sequence length and seed; a later run with the same description loads them instead of rebuilding.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "moecore/data/low_level_dataset.h"
#include "moecore/data/numpy_random.h"
#include "moecore/data/split.h"

namespace moecore {

struct GPTDatasetConfig {
  int64_t sequence_length = 0;     // tokens per sample (each sample reads one more for the labels)
  uint32_t random_seed = 1234;     // --seed
  std::string split = "969,30,1";  // only recorded in the cache description
  std::string path_to_cache;       // directory for the cached indices; empty: build in memory every time
  int64_t vocab_size = 0;          // > 0: a token id outside [0, vocab_size) is a DataError
};

// --- Megatron's index builders, exposed for tests ---------------------------------------------------------------

// Epochs needed for `num_samples` samples (1 when num_samples is nullopt: exactly one epoch).
int64_t gpt_num_epochs(int64_t tokens_per_epoch, int64_t sequence_length, std::optional<int64_t> num_samples);
// `documents` tiled num_epochs times and shuffled; with separate_final_epoch the first num_epochs - 1 copies
// and the last copy are shuffled separately and concatenated.
std::vector<int32_t> build_document_index(std::span<const int32_t> documents, int64_t num_epochs,
                                          NumpyRandomState& random, bool separate_final_epoch);
// Flattened (num_samples + 1, 2) sample index; `sizes` are the lengths of all sequences of the dataset.
std::vector<int64_t> build_sample_index(std::span<const int32_t> sizes, std::span<const int32_t> document_index,
                                        int64_t sequence_length, int64_t num_epochs, int64_t tokens_per_epoch);
// [0, num_samples) shuffled, followed by [num_samples, total_size) shuffled.
std::vector<int64_t> build_shuffle_index(int64_t num_samples, int64_t total_size, NumpyRandomState& random);

struct GPTIndices {
  std::vector<int32_t> document_index;
  std::vector<int64_t> sample_index;  // flattened rows of (document index position, offset)
  std::vector<int64_t> shuffle_index;
  int64_t num_samples() const { return static_cast<int64_t>(sample_index.size() / 2) - 1; }
};

// The three indices for sequences [begin, end) of `sizes`, exactly as GPTDataset builds them.
GPTIndices build_gpt_indices(std::span<const int32_t> sizes, int64_t begin, int64_t end, int64_t sequence_length,
                             uint32_t seed, std::optional<int64_t> num_samples);

// Sample text (sequence_length + 1 tokens) of the unshuffled sample `sample` (row of the sample index).
void read_sample_text(const TokenSequences& sequences, const GPTIndices& indices, int64_t sample,
                      std::span<int32_t> text_out);

class GPTDataset {
 public:
  // Sequences [begin, end) of `sequences` form the split. num_samples: samples the caller will draw
  // (nullopt: one epoch). Throws DataError when the range holds no tokens or a cache file is corrupt.
  GPTDataset(std::shared_ptr<const TokenSequences> sequences, DatasetSplit split, int64_t begin, int64_t end,
             std::optional<int64_t> num_samples, const GPTDatasetConfig& config);

  int64_t size() const { return indices_.num_samples(); }
  // Writes the sequence_length + 1 tokens of sample idx (after the shuffle) to text_out.
  void sample_text(int64_t idx, std::span<int32_t> text_out) const;

  const GPTIndices& indices() const { return indices_; }
  const TokenSequences& sequences() const { return *sequences_; }
  DatasetSplit split() const { return split_; }
  int64_t sequence_length() const { return config_.sequence_length; }
  bool loaded_from_cache() const { return loaded_from_cache_; }
  // The JSON text whose hash names the cache files.
  const std::string& description() const { return description_; }

 private:
  void load_or_build(int64_t begin, int64_t end, std::optional<int64_t> num_samples);
  void validate_loaded(std::optional<int64_t> num_samples, const std::string& where) const;

  std::shared_ptr<const TokenSequences> sequences_;
  DatasetSplit split_;
  GPTDatasetConfig config_;
  std::string description_;
  GPTIndices indices_;
  bool loaded_from_cache_ = false;
};

}  // namespace moecore
