#include "moecore/data/mock_dataset.h"

#include "moecore/data/numpy_random.h"

namespace moecore {

namespace {

// SplitMix64 finalizer: a well-mixed start token per sequence.
uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

}  // namespace

MockTokenSequences::MockTokenSequences(const MockDataOptions& options) : options_(options) {
  if (options_.vocab_size < 2) {
    throw DataError("--mock-data: vocabulary size must be at least 2, got " + std::to_string(options_.vocab_size));
  }
  if (options_.eod_id < 0 || options_.eod_id >= options_.vocab_size) {
    throw DataError("--mock-data: EOD id " + std::to_string(options_.eod_id) + " is outside the vocabulary [0, " +
                    std::to_string(options_.vocab_size) + ")");
  }
  if (options_.num_sequences < 1 || options_.max_sequence_length < 2) {
    throw DataError("--mock-data: need at least one sequence and a maximum length of at least 2");
  }
  NumpyRandomState random(options_.seed);
  sequence_lengths_.resize(static_cast<size_t>(options_.num_sequences));
  const auto span = static_cast<uint64_t>(options_.max_sequence_length - 2);  // lengths in [1, max)
  for (int32_t& length : sequence_lengths_) length = 1 + static_cast<int32_t>(random.interval(span));
}

void MockTokenSequences::read(int64_t i, int64_t offset, std::span<int32_t> out) const {
  if (i < 0 || i >= options_.num_sequences) {
    throw DataError("mock: sequence " + std::to_string(i) + " out of range [0, " +
                    std::to_string(options_.num_sequences) + ")");
  }
  const int64_t length = sequence_lengths_[static_cast<size_t>(i)];
  const auto count = static_cast<int64_t>(out.size());
  if (offset < 0 || offset + count > length) {
    throw DataError("mock: tokens [" + std::to_string(offset) + ", " + std::to_string(offset + count) +
                    ") out of range for sequence " + std::to_string(i) + " of length " + std::to_string(length));
  }
  const auto vocab = static_cast<uint64_t>(options_.vocab_size);
  const uint64_t start = mix((static_cast<uint64_t>(options_.seed) << 40) ^ static_cast<uint64_t>(i)) % vocab;
  for (int64_t k = 0; k < count; ++k) {
    const int64_t position = offset + k;
    if (position == length - 1) {
      out[static_cast<size_t>(k)] = options_.eod_id;
      continue;
    }
    auto token = static_cast<int64_t>((start + static_cast<uint64_t>(position)) % vocab);
    if (token == options_.eod_id) token = (token + 1) % options_.vocab_size;
    out[static_cast<size_t>(k)] = static_cast<int32_t>(token);
  }
}

}  // namespace moecore
