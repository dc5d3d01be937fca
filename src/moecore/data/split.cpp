#include "moecore/data/split.h"

#include <cmath>
#include <cstdlib>

#include "moecore/data/indexed_dataset.h"

namespace moecore {

namespace {

// numpy's pairwise summation (npy_pairwise_sum): plain loop under 8 elements, 8 accumulators up to 128,
// recursive halves (at multiples of 8) above.
double pairwise_sum(const double* values, int64_t n) {
  if (n < 8) {
    double sum = -0.0;
    for (int64_t i = 0; i < n; ++i) sum += values[i];
    return sum;
  }
  if (n <= 128) {
    double r[8];
    for (int j = 0; j < 8; ++j) r[j] = values[j];
    int64_t i = 8;
    for (; i < n - (n % 8); i += 8) {
      for (int j = 0; j < 8; ++j) r[j] += values[i + j];
    }
    double sum = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
    for (; i < n; ++i) sum += values[i];
    return sum;
  }
  int64_t half = n / 2;
  half -= half % 8;
  return pairwise_sum(values, half) + pairwise_sum(values + half, n - half);
}

}  // namespace

const char* split_name(DatasetSplit split) {
  switch (split) {
    case DatasetSplit::kTrain: return "train";
    case DatasetSplit::kValid: return "valid";
    case DatasetSplit::kTest: return "test";
  }
  return "unknown";
}

std::vector<double> normalize_weights(const std::vector<double>& weights) {
  // numpy.sum reduces from the identity 0.0.
  const double sum = 0.0 + pairwise_sum(weights.data(), static_cast<int64_t>(weights.size()));
  if (!(sum > 0.0) || !std::isfinite(sum)) {
    throw DataError("weights must be non-negative with a positive sum, got sum " + std::to_string(sum));
  }
  std::vector<double> normalized;
  normalized.reserve(weights.size());
  for (const double weight : weights) {
    if (weight < 0.0 || !std::isfinite(weight)) throw DataError("weight " + std::to_string(weight) + " is invalid");
    normalized.push_back(weight / sum);
  }
  return normalized;
}

std::array<double, kNumDatasetSplits> parse_and_normalize_split(const std::string& split) {
  std::vector<double> weights;
  size_t i = 0;
  while (i < split.size()) {
    const auto is_number_char = [](char c) { return c == '.' || (c >= '0' && c <= '9'); };
    if (!is_number_char(split[i])) {
      ++i;
      continue;
    }
    size_t end = i;
    while (end < split.size() && is_number_char(split[end])) ++end;
    const std::string token = split.substr(i, end - i);
    char* parsed_end = nullptr;
    const double value = std::strtod(token.c_str(), &parsed_end);
    if (parsed_end != token.c_str() + token.size()) {
      throw DataError("--split \"" + split + "\": \"" + token + "\" is not a number");
    }
    weights.push_back(value);
    i = end;
  }
  if (weights.size() > kNumDatasetSplits) {
    throw DataError("--split \"" + split + "\": has " + std::to_string(weights.size()) +
                    " weights, at most 3 (train,valid,test)");
  }
  weights.resize(kNumDatasetSplits, 0.0);
  std::vector<double> normalized;
  try {
    normalized = normalize_weights(weights);
  } catch (const DataError&) {
    throw DataError("--split \"" + split + "\": weights must have a positive sum");
  }
  return {normalized[0], normalized[1], normalized[2]};
}

SplitMatrix split_matrix_from_vector(const std::array<double, kNumDatasetSplits>& weights) {
  SplitMatrix matrix;
  double cumulative = 0.0;
  for (int i = 0; i < kNumDatasetSplits; ++i) {
    const double begin = cumulative;
    cumulative = cumulative + weights[static_cast<size_t>(i)];
    if (cumulative > begin) matrix[static_cast<size_t>(i)] = std::make_pair(begin, cumulative);
  }
  return matrix;
}

std::pair<int64_t, int64_t> split_range(const std::pair<double, double>& bookends, int64_t num_elements) {
  // Python's round() rounds half to even, as nearbyint does in the default rounding mode.
  const double n = static_cast<double>(num_elements);
  return {static_cast<int64_t>(std::nearbyint(bookends.first * n)),
          static_cast<int64_t>(std::nearbyint(bookends.second * n))};
}

}  // namespace moecore
