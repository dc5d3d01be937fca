// Train/valid/test splits as Megatron's BlendedMegatronDatasetConfig computes them: "969,30,1" is parsed
// (every run of [.0-9] is a number, missing ones are 0), normalized, turned into cumulative book-ends
// [(0, .969), (.969, .999), (.999, 1.0)], and split i of n elements is [round(lo*n), round(hi*n)) with
// Python's round (half to even). A split of weight 0 does not exist (std::nullopt).
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace moecore {

enum class DatasetSplit { kTrain = 0, kValid = 1, kTest = 2 };
constexpr int kNumDatasetSplits = 3;
const char* split_name(DatasetSplit split);  // "train", "valid", "test" (Megatron's Split enum names)

using SplitMatrix = std::array<std::optional<std::pair<double, double>>, kNumDatasetSplits>;

// Weights divided by their sum, the sum taken as numpy.sum does (pairwise), so results are bitwise
// Megatron's utils.normalize. Throws DataError when the sum is not positive.
std::vector<double> normalize_weights(const std::vector<double>& weights);

// "--split" string -> normalized weights; throws DataError naming the flag and the bad text.
std::array<double, kNumDatasetSplits> parse_and_normalize_split(const std::string& split);
SplitMatrix split_matrix_from_vector(const std::array<double, kNumDatasetSplits>& weights);
// [begin, end) element range of one split's book-ends for a dataset of `num_elements` elements.
std::pair<int64_t, int64_t> split_range(const std::pair<double, double>& bookends, int64_t num_elements);

}  // namespace moecore
