#include "moecore/data/data_loader.h"

#include <algorithm>
#include <cstddef>
#include <filesystem>
#include <limits>
#include <numeric>
#include <optional>
#include <span>

#include "moecore/data/mock_dataset.h"

namespace moecore {

namespace {

std::string default_cache_path(const std::string& prefix) {
  std::filesystem::path directory = std::filesystem::path(prefix).parent_path();
  if (directory.empty()) directory = ".";
  return (directory / "cache" / "GPTDataset_indices").string();
}

GPTDatasetConfig dataset_config(const DataOptions& options, const std::string& prefix) {
  GPTDatasetConfig config;
  config.sequence_length = options.seq_length;
  config.random_seed = static_cast<uint32_t>(options.seed);
  config.split = options.split;
  config.path_to_cache = prefix.empty()                    ? std::string()
                         : options.data_cache_path.empty() ? default_cache_path(prefix)
                                                           : options.data_cache_path;
  config.vocab_size = options.vocab_size;
  return config;
}

}  // namespace

GPTDataProvider GPTDataProvider::build(const DataOptions& options, int64_t num_samples_train, int64_t num_samples_valid,
                                       int64_t num_samples_test) {
  if (options.seq_length < 1)
    throw DataError("--seq-length must be positive, got " + std::to_string(options.seq_length));
  if (options.seed > std::numeric_limits<uint32_t>::max()) {
    throw DataError("--seed " + std::to_string(options.seed) + " must be below 2^32 (numpy RandomState seed)");
  }
  if (options.vocab_size < 1) throw DataError("data: vocabulary size must be positive to check token ids");
  if (options.mock_data == !options.data_path.empty()) {
    throw DataError(options.mock_data ? "--mock-data and --data-path are mutually exclusive"
                                      : "no data: give --data-path or --mock-data");
  }
  const int64_t requested[kNumDatasetSplits] = {num_samples_train, num_samples_valid, num_samples_test};
  for (int s = 0; s < kNumDatasetSplits; ++s) {
    if (requested[s] < 0)
      throw DataError(std::string("negative sample count for the ") + split_name(DatasetSplit(s)) + " split");
  }

  GPTDataProvider provider;
  provider.options_ = options;
  const SplitMatrix matrix =
      split_matrix_from_vector(parse_and_normalize_split(options.mock_data ? "1,1,1" : options.split));
  const auto wanted = [&](int s) { return matrix[static_cast<size_t>(s)].has_value() && requested[s] > 0; };
  const auto range = [&](int s, const TokenSequences& sequences) {
    return split_range(*matrix[static_cast<size_t>(s)], static_cast<int64_t>(sequences.sequence_lengths().size()));
  };

  if (options.mock_data) {
    MockDataOptions mock;
    mock.vocab_size = options.vocab_size;
    mock.eod_id = options.eod_id;
    mock.num_sequences = options.mock_num_sequences;
    mock.max_sequence_length = options.mock_max_sequence_length;
    const auto sequences = std::make_shared<const MockTokenSequences>(mock);
    for (int s = 0; s < kNumDatasetSplits; ++s) {
      if (!wanted(s)) continue;
      const auto [begin, end] = range(s, *sequences);
      provider.splits_[s].single = std::make_shared<const GPTDataset>(sequences, DatasetSplit(s), begin, end,
                                                                      requested[s], dataset_config(options, ""));
    }
    return provider;
  }

  const Blend blend = parse_blend(options.data_path);
  std::vector<std::shared_ptr<const TokenSequences>> sources;
  for (const std::string& prefix : blend.prefixes)
    sources.push_back(std::make_shared<const IndexedTokenSequences>(prefix));

  const auto build_one = [&](size_t d, int s, std::optional<int64_t> num_samples) {
    const auto [begin, end] = range(s, *sources[d]);
    return std::make_shared<const GPTDataset>(sources[d], DatasetSplit(s), begin, end, num_samples,
                                              dataset_config(options, blend.prefixes[d]));
  };

  if (sources.size() == 1 && !blend.weights) {
    for (int s = 0; s < kNumDatasetSplits; ++s) {
      if (wanted(s)) provider.splits_[s].single = build_one(0, s, requested[s]);
    }
    return provider;
  }

  for (int s = 0; s < kNumDatasetSplits; ++s) {
    if (!wanted(s)) continue;
    std::vector<std::shared_ptr<const GPTDataset>> datasets;
    std::vector<double> weights;
    int64_t size = 0;
    if (blend.weights) {
      // Each dataset is built with a small surplus; the blend draws the un-surplused shares.
      weights = normalize_weights(*blend.weights);
      const std::vector<int64_t> target = blend_sizes_per_dataset(weights, requested[s], 0.0);
      const std::vector<int64_t> buffered = blend_sizes_per_dataset(weights, requested[s], kMidLevelDatasetSurplus);
      for (size_t d = 0; d < sources.size(); ++d) datasets.push_back(build_one(d, s, buffered[d]));
      size = std::accumulate(target.begin(), target.end(), int64_t{0});
    } else {
      // Unweighted: one epoch of each dataset, blended in proportion to their sizes.
      for (size_t d = 0; d < sources.size(); ++d) {
        datasets.push_back(build_one(d, s, std::nullopt));
        weights.push_back(static_cast<double>(datasets.back()->size()));
      }
      size =
          std::min<int64_t>(requested[s], static_cast<int64_t>(std::accumulate(weights.begin(), weights.end(), 0.0)));
    }
    provider.splits_[s].blended = std::make_shared<const BlendedDataset>(std::move(datasets), weights, size);
  }
  return provider;
}

bool GPTDataProvider::has_split(DatasetSplit split) const {
  const SplitData& data = splits_[static_cast<int>(split)];
  return data.single != nullptr || data.blended != nullptr;
}

int64_t GPTDataProvider::num_samples(DatasetSplit split) const {
  const SplitData& data = splits_[static_cast<int>(split)];
  if (data.single) return data.single->size();
  if (data.blended) return data.blended->size();
  return 0;
}

const GPTDataset* GPTDataProvider::gpt_dataset(DatasetSplit split) const {
  return splits_[static_cast<int>(split)].single.get();
}

const BlendedDataset* GPTDataProvider::blended_dataset(DatasetSplit split) const {
  return splits_[static_cast<int>(split)].blended.get();
}

Batch GPTDataProvider::get_batch(DatasetSplit split, int64_t sample_begin, int64_t batch_size) const {
  if (!has_split(split)) {
    throw DataError(std::string("data: the ") + split_name(split) +
                    " split was not built (its --split weight is 0 or no samples were requested)");
  }
  const int64_t available = num_samples(split);
  if (sample_begin < 0 || batch_size < 0 || sample_begin + batch_size > available) {
    throw DataError(std::string("data: samples [") + std::to_string(sample_begin) + ", " +
                    std::to_string(sample_begin + batch_size) + ") are out of range for the " + split_name(split) +
                    " split (" + std::to_string(available) + " samples)");
  }
  const SplitData& data = splits_[static_cast<int>(split)];
  const int64_t S = options_.seq_length;
  Batch batch;
  batch.B = batch_size;
  batch.S = S;
  batch.tokens_BS.resize(static_cast<size_t>(batch_size * S));
  batch.labels_BS.resize(static_cast<size_t>(batch_size * S));
  batch.loss_mask_BS.resize(static_cast<size_t>(batch_size * S));
  batch.position_ids_BS.resize(static_cast<size_t>(batch_size * S));
  batch.document_ids_BS.resize(static_cast<size_t>(batch_size * S));
  SampleMaskOptions masks;
  masks.eod_id = options_.eod_id;
  masks.reset_position_ids = options_.reset_position_ids;
  masks.reset_attention_mask = options_.reset_attention_mask;
  masks.eod_mask_loss = options_.eod_mask_loss;
  std::vector<int32_t> text(static_cast<size_t>(S + 1));
  for (int64_t b = 0; b < batch_size; ++b) {
    if (data.single) {
      data.single->sample_text(sample_begin + b, text);
    } else {
      data.blended->sample_text(sample_begin + b, text);
    }
    const auto row = static_cast<size_t>(b * S);
    const auto count = static_cast<size_t>(S);
    std::copy_n(text.begin(), S, batch.tokens_BS.begin() + static_cast<std::ptrdiff_t>(row));
    std::copy_n(text.begin() + 1, S, batch.labels_BS.begin() + static_cast<std::ptrdiff_t>(row));
    // Masks and positions come from the input tokens (text[:-1]), as in Megatron's GPTDataset.__getitem__.
    ltor_masks_and_position_ids(std::span<const int32_t>(batch.tokens_BS).subspan(row, count), masks,
                                std::span<int64_t>(batch.position_ids_BS).subspan(row, count),
                                std::span<int32_t>(batch.document_ids_BS).subspan(row, count),
                                std::span<float>(batch.loss_mask_BS).subspan(row, count));
  }
  return batch;
}

}  // namespace moecore
