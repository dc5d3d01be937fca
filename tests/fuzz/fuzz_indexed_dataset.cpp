// Fuzz harness: Megatron's indexed dataset reader (IndexedDataset: PREFIX.idx + PREFIX.bin, memory-mapped) and the
// GPT dataset built over it (document, sample and shuffle indices, then every sample's tokens read).
//
// Input: the two files in one (fuzz_util.h split_two_files): uint32 length N, N bytes of .idx, the rest .bin.
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <optional>
#include <vector>

#include "fuzz_util.h"
#include "moecore/data/gpt_dataset.h"
#include "moecore/data/indexed_dataset.h"
#include "moecore/data/low_level_dataset.h"

namespace {

constexpr int64_t kMaxSamplesRead = 256;

void read_everything(const std::string& prefix) {
  const moecore::IndexedDataset dataset(prefix);
  int64_t tokens = 0;
  for (int64_t i = 0; i < dataset.num_sequences(); ++i) {
    const std::vector<int32_t> sequence = dataset.get(i);
    if (static_cast<int64_t>(sequence.size()) != dataset.sequence_lengths()[static_cast<size_t>(i)]) {
      moecore::fuzz::property_failed("IndexedDataset::get returned a sequence of another length");
    }
    tokens += static_cast<int64_t>(sequence.size());
    if (!sequence.empty()) (void)dataset.get(i, static_cast<int64_t>(sequence.size()) - 1, 1);
  }
  // Out-of-range reads are errors, never reads past the mapping.
  for (const int64_t i : {int64_t{-1}, dataset.num_sequences()}) {
    try {
      (void)dataset.get(i);
      moecore::fuzz::property_failed("IndexedDataset::get accepted sequence " + std::to_string(i));
    } catch (const moecore::DataError&) {
    }
  }
  (void)tokens;
}

void build_gpt_dataset(const std::string& prefix, const size_t size) {
  auto sequences = std::make_shared<const moecore::IndexedTokenSequences>(prefix);
  const int64_t count = static_cast<int64_t>(sequences->sequence_lengths().size());
  moecore::GPTDatasetConfig config;
  config.sequence_length = 1 + static_cast<int64_t>(size % 7);
  config.vocab_size = 1000;
  const moecore::GPTDataset dataset(sequences, moecore::DatasetSplit::kTrain, 0, count, std::nullopt, config);
  std::vector<int32_t> text(static_cast<size_t>(config.sequence_length + 1));
  for (int64_t s = 0; s < std::min(dataset.size(), kMaxSamplesRead); ++s) {
    try {
      dataset.sample_text(s, text);
    } catch (const moecore::DataError& error) {  // a token outside the vocabulary
      moecore::fuzz::expected_error(error);
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const moecore::fuzz::ScratchDir dir("indexed_dataset");
  const std::string prefix = dir.file("data");
  const moecore::fuzz::TwoFiles files = moecore::fuzz::split_two_files(data, size);
  moecore::fuzz::write_bytes(prefix + ".idx", files.first);
  moecore::fuzz::write_bytes(prefix + ".bin", files.second);
  try {
    read_everything(prefix);
    build_gpt_dataset(prefix, size);
  } catch (const std::exception& error) {
    moecore::fuzz::expected_error(error);
  }
  return 0;
}
