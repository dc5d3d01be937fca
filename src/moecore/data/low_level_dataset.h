// What a GPT dataset reads from: a list of token sequences (Megatron's "low level dataset"). Implemented by an
// indexed dataset on disk (IndexedTokenSequences) and by the synthetic mock data (mock_dataset.h).
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "moecore/data/indexed_dataset.h"

namespace moecore {

class TokenSequences {
 public:
  virtual ~TokenSequences() = default;
  // Names the data in messages and cache descriptions (the path prefix, or "mock").
  virtual const std::string& name() const = 0;
  virtual const std::vector<int32_t>& sequence_lengths() const = 0;
  // Writes tokens [offset, offset + out.size()) of sequence i to out; throws DataError when out of range.
  virtual void read(int64_t i, int64_t offset, std::span<int32_t> out) const = 0;
};

class IndexedTokenSequences final : public TokenSequences {
 public:
  explicit IndexedTokenSequences(const std::string& prefix) : dataset_(prefix) {}
  const std::string& name() const override { return dataset_.prefix(); }
  const std::vector<int32_t>& sequence_lengths() const override { return dataset_.sequence_lengths(); }
  void read(int64_t i, int64_t offset, std::span<int32_t> out) const override {
    const std::vector<int32_t> tokens = dataset_.get(i, offset, static_cast<int64_t>(out.size()));
    std::copy(tokens.begin(), tokens.end(), out.begin());
  }

 private:
  IndexedDataset dataset_;
};

}  // namespace moecore
