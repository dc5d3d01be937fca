#include "moecore/data/blended_dataset.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <sstream>

namespace moecore {

namespace {

std::optional<double> parse_number(const std::string& text) {
  if (text.empty()) return std::nullopt;
  char* end = nullptr;
  const double value = std::strtod(text.c_str(), &end);
  if (end != text.c_str() + text.size()) return std::nullopt;
  return value;
}

}  // namespace

Blend parse_blend(const std::vector<std::string>& data_path) {
  std::vector<std::string> entries;
  for (const std::string& item : data_path) {
    std::istringstream words(item);
    for (std::string word; words >> word;) entries.push_back(word);
  }
  if (entries.empty()) throw DataError("--data-path: no dataset prefix given");
  Blend blend;
  if (entries.size() % 2 == 1) {
    blend.prefixes = entries;
    return blend;
  }
  std::vector<double> weights;
  size_t numeric = 0;
  for (size_t i = 0; i < entries.size(); i += 2) {
    if (const auto value = parse_number(entries[i])) {
      weights.push_back(*value);
      ++numeric;
    }
  }
  if (numeric == 0) {
    blend.prefixes = entries;
    return blend;
  }
  if (numeric != entries.size() / 2) {
    throw DataError("--data-path: expected \"weight prefix weight prefix ...\" but some weights are not numbers");
  }
  for (size_t i = 1; i < entries.size(); i += 2) blend.prefixes.push_back(entries[i]);
  for (size_t i = 0; i < weights.size(); ++i) {
    if (!(weights[i] >= 0.0) || !std::isfinite(weights[i])) {
      throw DataError("--data-path: weight " + entries[2 * i] + " of " + blend.prefixes[i] + " is not >= 0");
    }
  }
  blend.weights = weights;
  return blend;
}

void build_blending_indices(const std::vector<double>& weights, int64_t size, std::vector<int16_t>& dataset_index,
                            std::vector<int64_t>& dataset_sample_index) {
  const auto num_datasets = static_cast<int64_t>(weights.size());
  dataset_index.assign(static_cast<size_t>(size), 0);
  dataset_sample_index.assign(static_cast<size_t>(size), 0);
  std::vector<int64_t> current_samples(weights.size(), 0);
  for (int64_t sample = 0; sample < size; ++sample) {
    const double target = std::max(static_cast<double>(sample), 1.0);
    int64_t best = 0;
    double best_error = weights[0] * target - static_cast<double>(current_samples[0]);
    for (int64_t d = 1; d < num_datasets; ++d) {
      const double error =
          weights[static_cast<size_t>(d)] * target - static_cast<double>(current_samples[static_cast<size_t>(d)]);
      if (error > best_error) {
        best_error = error;
        best = d;
      }
    }
    dataset_index[static_cast<size_t>(sample)] = static_cast<int16_t>(best);
    dataset_sample_index[static_cast<size_t>(sample)] = current_samples[static_cast<size_t>(best)]++;
  }
}

std::vector<int64_t> blend_sizes_per_dataset(const std::vector<double>& normalized_weights, int64_t target,
                                             double surplus) {
  std::vector<int64_t> sizes;
  sizes.reserve(normalized_weights.size());
  for (const double weight : normalized_weights) {
    const double share = std::ceil(static_cast<double>(target) * weight);
    sizes.push_back(static_cast<int64_t>(std::ceil(share * (1.0 + surplus))));
  }
  return sizes;
}

BlendedDataset::BlendedDataset(std::vector<std::shared_ptr<const GPTDataset>> datasets,
                               const std::vector<double>& weights, int64_t size)
    : datasets_(std::move(datasets)) {
  if (datasets_.empty() || datasets_.size() != weights.size() || datasets_.size() >= 32767) {
    throw DataError("BlendedDataset: need 1 to 32766 datasets with one weight each");
  }
  build_blending_indices(normalize_weights(weights), size, dataset_index_, dataset_sample_index_);
  std::vector<int64_t> drawn(datasets_.size(), 0);
  for (const int16_t d : dataset_index_) ++drawn[static_cast<size_t>(d)];
  for (size_t d = 0; d < datasets_.size(); ++d) {
    if (drawn[d] > datasets_[d]->size()) {
      throw DataError(datasets_[d]->sequences().name() + ": the blend draws " + std::to_string(drawn[d]) + " " +
                      split_name(datasets_[d]->split()) + " samples from it but it holds " +
                      std::to_string(datasets_[d]->size()));
    }
  }
}

void BlendedDataset::sample_text(int64_t idx, std::span<int32_t> text_out) const {
  if (idx < 0 || idx >= size()) {
    throw DataError("blended dataset: sample " + std::to_string(idx) + " is out of range (" + std::to_string(size()) +
                    " samples)");
  }
  const auto i = static_cast<size_t>(idx);
  datasets_[static_cast<size_t>(dataset_index_[i])]->sample_text(dataset_sample_index_[i], text_out);
}

}  // namespace moecore
