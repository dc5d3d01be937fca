#include "moecore/data/gpt_dataset.h"

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <numeric>
#include <system_error>
#include <utility>

#include "moecore/data/file_bytes.h"
#include "moecore/data/npy.h"
#include "moecore/tensor/rng.h"
#include "moecore/util/json_string.h"

namespace moecore {

namespace {

constexpr int64_t kExtraToken = 1;                 // Megatron's add_extra_token_to_sequence (always on)
constexpr double kSeparateFinalEpochRatio = 0.80;  // Megatron's threshold for a separately shuffled last epoch

std::string hex64(uint64_t value) {
  char text[17];
  std::snprintf(text, sizeof(text), "%016" PRIx64, value);
  return text;
}

std::vector<int64_t> widen(const std::vector<int32_t>& values) { return {values.begin(), values.end()}; }

}  // namespace

// ---------------------------------------------------------------------------------------------------------------
// Index builders

int64_t gpt_num_epochs(int64_t tokens_per_epoch, int64_t sequence_length, std::optional<int64_t> num_samples) {
  if (!num_samples) return 1;
  const int64_t tokens_requested = *num_samples * sequence_length + kExtraToken;
  int64_t num_epochs = 1;
  for (int64_t tokens = tokens_per_epoch; tokens < tokens_requested; tokens += tokens_per_epoch) ++num_epochs;
  return num_epochs;
}

std::vector<int32_t> build_document_index(std::span<const int32_t> documents, int64_t num_epochs,
                                          NumpyRandomState& random, bool separate_final_epoch) {
  if (!separate_final_epoch || num_epochs == 1) {
    std::vector<int32_t> index;
    index.reserve(documents.size() * static_cast<size_t>(num_epochs));
    for (int64_t epoch = 0; epoch < num_epochs; ++epoch) index.insert(index.end(), documents.begin(), documents.end());
    random.shuffle(std::span<int32_t>(index));
    return index;
  }
  std::vector<int32_t> index = build_document_index(documents, num_epochs - 1, random, false);
  const std::vector<int32_t> last = build_document_index(documents, 1, random, false);
  index.insert(index.end(), last.begin(), last.end());
  return index;
}

std::vector<int64_t> build_sample_index(std::span<const int32_t> sizes, std::span<const int32_t> document_index,
                                        int64_t sequence_length, int64_t num_epochs, int64_t tokens_per_epoch) {
  // Samples whose sequence_length + 1 tokens are all present; the last partial one is dropped.
  const int64_t num_samples = (num_epochs * tokens_per_epoch - kExtraToken) / sequence_length;
  std::vector<int64_t> index(static_cast<size_t>(2 * (num_samples + 1)), 0);
  const auto last_position = static_cast<int64_t>(document_index.size()) - 1;
  int64_t position = 0;  // into document_index
  int64_t offset = 0;    // token offset within that document
  for (int64_t sample = 1; sample <= num_samples; ++sample) {
    int64_t remaining = sequence_length + kExtraToken;
    while (remaining != 0) {
      const int64_t document_length =
          sizes[static_cast<size_t>(document_index[static_cast<size_t>(position)])] - offset;
      remaining -= document_length;
      if (remaining <= 0) {
        // The sample ends inside this document; the next one starts on its last token (shared with the label).
        offset += remaining + document_length - kExtraToken;
        remaining = 0;
      } else if (position == last_position) {
        if (sample != num_samples) throw DataError("build_sample_index: ran out of documents before the last sample");
        offset = sizes[static_cast<size_t>(document_index[static_cast<size_t>(position)])] - kExtraToken;
        break;
      } else {
        ++position;
        offset = 0;
      }
    }
    index[static_cast<size_t>(2 * sample)] = position;
    index[static_cast<size_t>(2 * sample + 1)] = offset;
  }
  return index;
}

std::vector<int64_t> build_shuffle_index(int64_t num_samples, int64_t total_size, NumpyRandomState& random) {
  std::vector<int64_t> index(static_cast<size_t>(total_size));
  std::iota(index.begin(), index.end(), int64_t{0});
  random.shuffle(std::span<int64_t>(index.data(), static_cast<size_t>(num_samples)));
  if (num_samples < total_size) {
    random.shuffle(std::span<int64_t>(index.data() + num_samples, static_cast<size_t>(total_size - num_samples)));
  }
  return index;
}

GPTIndices build_gpt_indices(std::span<const int32_t> sizes, int64_t begin, int64_t end, int64_t sequence_length,
                             uint32_t seed, std::optional<int64_t> num_samples) {
  if (sequence_length < 1) throw DataError("sequence length must be positive, got " + std::to_string(sequence_length));
  if (begin < 0 || end > static_cast<int64_t>(sizes.size()) || begin >= end) {
    throw DataError("sequence range [" + std::to_string(begin) + ", " + std::to_string(end) + ") is empty");
  }
  if (end > std::numeric_limits<int32_t>::max()) throw DataError("more than 2^31 sequences are not supported");
  int64_t tokens_per_epoch = 0;
  for (int64_t i = begin; i < end; ++i) tokens_per_epoch += sizes[static_cast<size_t>(i)];
  if (tokens_per_epoch <= kExtraToken) {
    throw DataError("sequences [" + std::to_string(begin) + ", " + std::to_string(end) + ") hold " +
                    std::to_string(tokens_per_epoch) + " tokens, too few for one sample");
  }
  const int64_t num_epochs = gpt_num_epochs(tokens_per_epoch, sequence_length, num_samples);

  bool separate_final_epoch = false;
  int64_t num_samples_sans_final_epoch = 0;
  if (num_epochs > 1) {
    num_samples_sans_final_epoch = ((num_epochs - 1) * tokens_per_epoch - kExtraToken) / sequence_length;
    const int64_t num_samples_from_final_epoch = *num_samples - num_samples_sans_final_epoch;
    const int64_t num_samples_per_epoch = (tokens_per_epoch - kExtraToken) / sequence_length;
    if (num_samples_from_final_epoch < 0 || num_samples_from_final_epoch > num_samples_per_epoch + 1) {
      throw DataError("build_gpt_indices: inconsistent epoch arithmetic");
    }
    separate_final_epoch = num_samples_from_final_epoch <
                           static_cast<int64_t>(kSeparateFinalEpochRatio * static_cast<double>(num_samples_per_epoch));
  }

  NumpyRandomState random(seed);
  std::vector<int32_t> documents(static_cast<size_t>(end - begin));
  std::iota(documents.begin(), documents.end(), static_cast<int32_t>(begin));
  GPTIndices indices;
  indices.document_index = build_document_index(documents, num_epochs, random, separate_final_epoch);
  indices.sample_index =
      build_sample_index(sizes, indices.document_index, sequence_length, num_epochs, tokens_per_epoch);
  const int64_t total = indices.num_samples();
  indices.shuffle_index =
      build_shuffle_index(separate_final_epoch ? num_samples_sans_final_epoch : total, total, random);
  return indices;
}

void read_sample_text(const TokenSequences& sequences, const GPTIndices& indices, int64_t sample,
                      std::span<int32_t> text_out) {
  const std::vector<int32_t>& sizes = sequences.sequence_lengths();
  const auto row = [&](int64_t r, int k) { return indices.sample_index[static_cast<size_t>(2 * r + k)]; };
  const int64_t first = row(sample, 0);
  const int64_t first_offset = row(sample, 1);
  const int64_t last = row(sample + 1, 0);
  const int64_t last_offset = row(sample + 1, 1);
  const auto document_count = static_cast<int64_t>(indices.document_index.size());
  if (first < 0 || last < first || last >= document_count) {
    throw DataError(sequences.name() + ": corrupt sample index at sample " + std::to_string(sample));
  }
  size_t written = 0;
  for (int64_t position = first; position <= last; ++position) {
    const int32_t sequence = indices.document_index[static_cast<size_t>(position)];
    if (sequence < 0 || static_cast<size_t>(sequence) >= sizes.size()) {
      throw DataError(sequences.name() + ": corrupt document index entry " + std::to_string(sequence));
    }
    const int64_t offset = position == first ? first_offset : 0;
    const int64_t length =
        position < last ? sizes[static_cast<size_t>(sequence)] - offset : last_offset + kExtraToken - offset;
    if (length < 0 || written + static_cast<size_t>(length) > text_out.size()) {
      throw DataError(sequences.name() + ": corrupt sample index at sample " + std::to_string(sample));
    }
    sequences.read(sequence, offset, text_out.subspan(written, static_cast<size_t>(length)));
    written += static_cast<size_t>(length);
  }
  if (written != text_out.size()) {
    throw DataError(sequences.name() + ": sample " + std::to_string(sample) + " has " + std::to_string(written) +
                    " tokens, expected " + std::to_string(text_out.size()));
  }
}

// ---------------------------------------------------------------------------------------------------------------
// GPTDataset

GPTDataset::GPTDataset(std::shared_ptr<const TokenSequences> sequences, DatasetSplit split, int64_t begin, int64_t end,
                       std::optional<int64_t> num_samples, const GPTDatasetConfig& config)
    : sequences_(std::move(sequences)), split_(split), config_(config) {
  const int64_t num_sequences = static_cast<int64_t>(sequences_->sequence_lengths().size());
  if (begin >= end) {
    throw DataError(sequences_->name() + ": the " + split_name(split_) + " split has no documents (sequences [" +
                    std::to_string(begin) + ", " + std::to_string(end) + ") of " + std::to_string(num_sequences) +
                    "); use more data or change --split");
  }
  description_ = "{\n    \"class\": \"GPTDataset\",\n    \"dataset_path\": " + json_string(sequences_->name()) +
                 ",\n    \"num_samples\": " + (num_samples ? std::to_string(*num_samples) : std::string("null")) +
                 ",\n    \"index_split\": \"" + split_name(split_) +
                 "\",\n    \"random_seed\": " + std::to_string(config_.random_seed) +
                 ",\n    \"sequence_length\": " + std::to_string(config_.sequence_length) +
                 ",\n    \"split\": " + json_string(config_.split) + ",\n    \"sequence_range\": [" +
                 std::to_string(begin) + ", " + std::to_string(end) +
                 "],\n    \"num_sequences\": " + std::to_string(num_sequences) + "\n}";
  try {
    load_or_build(begin, end, num_samples);
  } catch (const DataError& error) {
    const std::string what = error.what();
    if (what.rfind(sequences_->name(), 0) == 0) throw;
    throw DataError(sequences_->name() + " (" + split_name(split_) + " split): " + what);
  }
}

void GPTDataset::load_or_build(int64_t begin, int64_t end, std::optional<int64_t> num_samples) {
  const std::vector<int32_t>& sizes = sequences_->sequence_lengths();
  if (config_.path_to_cache.empty()) {
    indices_ = build_gpt_indices(sizes, begin, end, config_.sequence_length, config_.random_seed, num_samples);
    return;
  }
  namespace fs = std::filesystem;
  const std::string base =
      (fs::path(config_.path_to_cache) / (hex64(stream_key(description_)) + "-GPTDataset-" + split_name(split_) + "-"))
          .string();
  const std::string description_path = base + "description.txt";
  const std::string document_path = base + "document_index.npy";
  const std::string sample_path = base + "sample_index.npy";
  const std::string shuffle_path = base + "shuffle_index.npy";

  std::error_code error;
  const bool cache_hit = fs::is_regular_file(description_path, error) && fs::is_regular_file(document_path, error) &&
                         fs::is_regular_file(sample_path, error) && fs::is_regular_file(shuffle_path, error) &&
                         read_file_bytes(description_path) == description_;
  if (cache_hit) {
    const NpyArray document = load_npy(document_path);
    const NpyArray sample = load_npy(sample_path);
    const NpyArray shuffle = load_npy(shuffle_path);
    if (document.shape.size() != 1 || sample.shape.size() != 2 || sample.shape[1] != 2 || sample.shape[0] < 1 ||
        shuffle.shape.size() != 1 || shuffle.shape[0] != sample.shape[0] - 1) {
      throw DataError(base + "*.npy: cached index shapes do not fit together; delete the cache files to rebuild");
    }
    indices_.document_index.assign(document.values.size(), 0);
    for (size_t i = 0; i < document.values.size(); ++i) {
      const int64_t value = document.values[i];
      if (value < begin || value >= end) {
        throw DataError(document_path + ": entry " + std::to_string(value) + " is outside the split's sequences [" +
                        std::to_string(begin) + ", " + std::to_string(end) + "); delete it to rebuild");
      }
      indices_.document_index[i] = static_cast<int32_t>(value);
    }
    indices_.sample_index = sample.values;
    indices_.shuffle_index = shuffle.values;
    validate_loaded(num_samples, base);
    loaded_from_cache_ = true;
    return;
  }

  indices_ = build_gpt_indices(sizes, begin, end, config_.sequence_length, config_.random_seed, num_samples);
  fs::create_directories(config_.path_to_cache, error);
  if (error) {
    throw DataError(config_.path_to_cache + ": cannot create the index cache directory (" + error.message() +
                    "); choose another with --data-cache-path");
  }
  // Megatron's dtypes: int32 document index; int32 sample index unless its values may exceed int32; uint32
  // shuffle index unless the sample count nears 2^32. The description goes last: it marks a complete cache.
  const int32_t max_size = sizes.empty() ? 0 : *std::max_element(sizes.begin(), sizes.end());
  const int64_t sample_max = std::max<int64_t>(static_cast<int64_t>(indices_.document_index.size()), max_size);
  const NpyDType sample_dtype = sample_max <= std::numeric_limits<int32_t>::max() ? NpyDType::kI4 : NpyDType::kI8;
  const int64_t total = indices_.num_samples();
  const NpyDType shuffle_dtype =
      total >= static_cast<int64_t>(std::numeric_limits<uint32_t>::max()) - 1 ? NpyDType::kI8 : NpyDType::kU4;
  save_npy_atomic(document_path, NpyDType::kI4, {static_cast<int64_t>(indices_.document_index.size())},
                  widen(indices_.document_index));
  save_npy_atomic(sample_path, sample_dtype, {total + 1, 2}, indices_.sample_index);
  save_npy_atomic(shuffle_path, shuffle_dtype, {total}, indices_.shuffle_index);
  write_file_atomic(description_path, description_);
}

void GPTDataset::validate_loaded(std::optional<int64_t> num_samples, const std::string& where) const {
  const int64_t total = indices_.num_samples();
  const auto fail = [&](const std::string& problem) {
    throw DataError(where + "*.npy: " + problem + "; delete the cache files to rebuild");
  };
  if (num_samples && total < *num_samples) {
    fail("cached indices hold " + std::to_string(total) + " samples, " + std::to_string(*num_samples) + " needed");
  }
  const auto documents = static_cast<int64_t>(indices_.document_index.size());
  for (int64_t r = 0; r <= total; ++r) {
    const int64_t position = indices_.sample_index[static_cast<size_t>(2 * r)];
    const int64_t offset = indices_.sample_index[static_cast<size_t>(2 * r + 1)];
    if (position < 0 || position >= documents || offset < -kExtraToken ||
        (r > 0 && position < indices_.sample_index[static_cast<size_t>(2 * r - 2)])) {
      fail("sample index row " + std::to_string(r) + " is out of range");
    }
    // An offset lies within its sequence (Megatron's build_sample_idx), which also keeps the token arithmetic of
    // read_sample_text far from int64 overflow.
    const int32_t sequence = indices_.document_index[static_cast<size_t>(position)];
    if (offset > sequences_->sequence_lengths()[static_cast<size_t>(sequence)]) {
      fail("sample index row " + std::to_string(r) + " has offset " + std::to_string(offset) + " past its sequence");
    }
  }
  std::vector<bool> seen(static_cast<size_t>(total), false);
  for (const int64_t value : indices_.shuffle_index) {
    if (value < 0 || value >= total || seen[static_cast<size_t>(value)]) fail("shuffle index is not a permutation");
    seen[static_cast<size_t>(value)] = true;
  }
}

void GPTDataset::sample_text(int64_t idx, std::span<int32_t> text_out) const {
  if (idx < 0 || idx >= size()) {
    throw DataError(sequences_->name() + ": sample " + std::to_string(idx) + " is out of range for the " +
                    split_name(split_) + " split (" + std::to_string(size()) + " samples)");
  }
  if (static_cast<int64_t>(text_out.size()) != config_.sequence_length + kExtraToken) {
    throw DataError("GPTDataset::sample_text: output holds " + std::to_string(text_out.size()) + " tokens, expected " +
                    std::to_string(config_.sequence_length + kExtraToken));
  }
  read_sample_text(*sequences_, indices_, indices_.shuffle_index[static_cast<size_t>(idx)], text_out);
  if (config_.vocab_size > 0) {
    for (const int32_t token : text_out) {
      if (token < 0 || token >= config_.vocab_size) {
        throw DataError(sequences_->name() + ": token id " + std::to_string(token) + " (" + split_name(split_) +
                        " sample " + std::to_string(idx) + ") is outside the vocabulary [0, " +
                        std::to_string(config_.vocab_size) +
                        "); was the data tokenized with another tokenizer or --vocab-size?");
      }
    }
  }
}

}  // namespace moecore
