// Megatron's data blending (megatron/core/datasets/blended_dataset.py, helpers.cpp and utils.py):
// "--data-path w1 prefix1 w2 prefix2 ..." draws sample i of the blend from the dataset whose count so far is
// furthest below weight * max(i, 1), so every prefix of the blend follows the weights as closely as it can.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "moecore/data/gpt_dataset.h"

namespace moecore {

// Megatron's get_blend_from_list: an odd number of entries (or entries that are not numbers) are prefixes
// without weights; an even number alternating number, prefix are weighted. Entries holding spaces are split.
struct Blend {
  std::vector<std::string> prefixes;
  std::optional<std::vector<double>> weights;  // as given, not normalized
};
Blend parse_blend(const std::vector<std::string>& data_path);

// Megatron's build_blending_indices: dataset_index[i] (int16) and dataset_sample_index[i] for i < size.
void build_blending_indices(const std::vector<double>& weights, int64_t size, std::vector<int16_t>& dataset_index,
                            std::vector<int64_t>& dataset_sample_index);

// Megatron's _get_size_per_split_per_dataset for one split: ceil(ceil(target * w) * (1 + surplus)) per dataset.
std::vector<int64_t> blend_sizes_per_dataset(const std::vector<double>& normalized_weights, int64_t target,
                                             double surplus);
constexpr double kMidLevelDatasetSurplus = 0.005;  // Megatron's mid_level_dataset_surplus default

class BlendedDataset {
 public:
  // `weights` are normalized here (again, as Megatron does, for bitwise identical indices). Throws DataError
  // when the blend would draw more samples from a dataset than it holds.
  BlendedDataset(std::vector<std::shared_ptr<const GPTDataset>> datasets, const std::vector<double>& weights,
                 int64_t size);

  int64_t size() const { return static_cast<int64_t>(dataset_index_.size()); }
  void sample_text(int64_t idx, std::span<int32_t> text_out) const;
  const std::vector<int16_t>& dataset_index() const { return dataset_index_; }
  const std::vector<int64_t>& dataset_sample_index() const { return dataset_sample_index_; }
  const std::vector<std::shared_ptr<const GPTDataset>>& datasets() const { return datasets_; }

 private:
  std::vector<std::shared_ptr<const GPTDataset>> datasets_;
  std::vector<int16_t> dataset_index_;
  std::vector<int64_t> dataset_sample_index_;
};

}  // namespace moecore
