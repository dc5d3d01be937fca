// The GPT dataset whose cached indices the .npy harness corrupts (fuzz_npy.cpp), shared with the corpus generator
// (make_corpus.cpp) so the seeds are exactly the cache files this dataset writes.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "moecore/data/gpt_dataset.h"
#include "moecore/data/low_level_dataset.h"

namespace moecore::fuzz {

// Eight short documents of token ids below 50, in memory.
class FixtureSequences final : public TokenSequences {
 public:
  const std::string& name() const override { return name_; }
  const std::vector<int32_t>& sequence_lengths() const override { return lengths_; }
  void read(int64_t i, int64_t offset, std::span<int32_t> out) const override {
    if (i < 0 || i >= static_cast<int64_t>(lengths_.size()) || offset < 0 ||
        offset + static_cast<int64_t>(out.size()) > lengths_[static_cast<size_t>(i)]) {
      throw DataError("fixture: read out of range");
    }
    for (size_t k = 0; k < out.size(); ++k)
      out[k] = static_cast<int32_t>((i * 7 + offset + static_cast<int64_t>(k)) % 50);
  }

 private:
  std::string name_ = "fuzz-fixture";
  std::vector<int32_t> lengths_{5, 3, 8, 2, 7, 1, 4, 6};
};

inline GPTDataset fixture_dataset(const std::string& cache_dir) {
  GPTDatasetConfig config;
  config.sequence_length = 4;
  config.random_seed = 1234;
  config.path_to_cache = cache_dir;
  config.vocab_size = 50;
  return GPTDataset(std::make_shared<const FixtureSequences>(), DatasetSplit::kTrain, 0, 8, std::nullopt, config);
}

// The cache's three index files, in the order of the harness's selector byte (1, 2, 3).
inline const char* const kFixtureCacheFiles[] = {"document_index.npy", "sample_index.npy", "shuffle_index.npy"};

}  // namespace moecore::fuzz
