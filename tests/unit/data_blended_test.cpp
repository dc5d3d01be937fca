// Megatron's data blending: --data-path parsing, build_blending_indices, per-dataset sample counts, and
// blended GPTDataProvider batches.
//
// Independent references: hand-worked examples (documented next to each) and values printed by a Python
// transcription of Megatron's helpers.cpp build_blending_indices and _get_size_per_split_per_dataset
// (numpy 1.24, /usr/bin/python3) when the tests were written.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "moecore/data/blended_dataset.h"
#include "moecore/data/data_loader.h"
#include "test_temp_dir.h"

namespace moecore {
namespace {

namespace fs = std::filesystem;

template <typename F>
void expect_data_error(F&& action, const std::string& needle) {
  test::expect_error_containing<DataError>(std::forward<F>(action), needle);
}

TEST(DataBlendParse, Forms) {
  const Blend single = parse_blend({"data/a_text_document"});
  EXPECT_EQ(single.prefixes, (std::vector<std::string>{"data/a_text_document"}));
  EXPECT_FALSE(single.weights.has_value());

  const Blend weighted = parse_blend({"30", "data/a", "70", "data/b"});
  EXPECT_EQ(weighted.prefixes, (std::vector<std::string>{"data/a", "data/b"}));
  ASSERT_TRUE(weighted.weights.has_value());
  EXPECT_EQ(*weighted.weights, (std::vector<double>{30.0, 70.0}));

  // One string holding the whole list (as a config file might give it) means the same.
  const Blend joined = parse_blend({"0.3 data/a 0.7 data/b"});
  EXPECT_EQ(joined.prefixes, weighted.prefixes);
  EXPECT_EQ(*joined.weights, (std::vector<double>{0.3, 0.7}));

  const Blend unweighted = parse_blend({"data/a", "data/b"});
  EXPECT_EQ(unweighted.prefixes, (std::vector<std::string>{"data/a", "data/b"}));
  EXPECT_FALSE(unweighted.weights.has_value());

  expect_data_error([] { parse_blend({"30", "data/a", "data/b", "data/c"}); }, "some weights are not numbers");
  expect_data_error([] { parse_blend({"-1", "data/a", "2", "data/b"}); }, "weight -1 of data/a");
  expect_data_error([] { parse_blend({}); }, "--data-path: no dataset prefix");
}

// Weights (0.3, 0.7): sample i goes to the dataset maximizing w * max(i, 1) - count.
//   i=0: 0.3 vs 0.7 -> 1;  i=1: 0.3 vs -0.3 -> 0;  i=2: -0.4 vs 0.4 -> 1;  i=3: -0.1 vs 0.1 -> 1;
//   i=4: 0.2 vs -0.2 -> 0.
TEST(DataBlendIndices, HandExample) {
  std::vector<int16_t> dataset_index;
  std::vector<int64_t> dataset_sample_index;
  build_blending_indices({0.3, 0.7}, 5, dataset_index, dataset_sample_index);
  EXPECT_EQ(dataset_index, (std::vector<int16_t>{1, 0, 1, 1, 0}));
  EXPECT_EQ(dataset_sample_index, (std::vector<int64_t>{0, 0, 1, 2, 1}));
}

TEST(DataBlendIndices, MatchMegatronReference) {
  std::vector<int16_t> dataset_index;
  std::vector<int64_t> dataset_sample_index;
  build_blending_indices({0.2, 0.5, 0.3}, 20, dataset_index, dataset_sample_index);
  EXPECT_EQ(dataset_index, (std::vector<int16_t>{1, 2, 0, 1, 2, 1, 0, 1, 2, 1, 0, 1, 2, 1, 2, 1, 0, 1, 2, 1}));
  EXPECT_EQ(dataset_sample_index, (std::vector<int64_t>{0, 0, 0, 1, 1, 2, 1, 3, 2, 4, 2, 5, 3, 6, 4, 7, 3, 8, 5, 9}));
}

// Every prefix of the blend follows the weights within one sample, and the total is exact.
TEST(DataBlendIndices, ProportionsHoldAtEveryPrefix) {
  const std::vector<double> weights = {0.125, 0.5, 0.0625, 0.3125};
  std::vector<int16_t> dataset_index;
  std::vector<int64_t> dataset_sample_index;
  build_blending_indices(weights, 4000, dataset_index, dataset_sample_index);
  std::vector<int64_t> counts(weights.size(), 0);
  for (size_t i = 0; i < dataset_index.size(); ++i) {
    const auto d = static_cast<size_t>(dataset_index[i]);
    EXPECT_EQ(dataset_sample_index[i], counts[d]);  // each dataset is read in order
    ++counts[d];
    for (size_t k = 0; k < weights.size(); ++k) {
      ASSERT_LE(std::abs(static_cast<double>(counts[k]) - weights[k] * static_cast<double>(i + 1)), 1.0)
          << "dataset " << k << " after " << i + 1 << " samples";
    }
  }
  EXPECT_EQ(counts, (std::vector<int64_t>{500, 2000, 250, 1250}));
}

TEST(DataBlendSizes, MatchMegatronReference) {
  struct Case {
    std::vector<double> weights;
    int64_t target;
    std::vector<int64_t> exact, buffered;
  };
  const Case cases[] = {
      {{30, 70}, 1000, {300, 700}, {302, 704}},
      {{1, 3}, 640, {160, 480}, {161, 483}},
      {{0.2, 0.5, 0.3}, 77, {16, 39, 24}, {17, 40, 25}},
      {{1, 1, 1}, 100, {34, 34, 34}, {35, 35, 35}},
  };
  for (const Case& c : cases) {
    const std::vector<double> normalized = normalize_weights(c.weights);
    EXPECT_EQ(blend_sizes_per_dataset(normalized, c.target, 0.0), c.exact);
    EXPECT_EQ(blend_sizes_per_dataset(normalized, c.target, kMidLevelDatasetSurplus), c.buffered);
  }
}

// --- blended provider over files ---------------------------------------------------------------------------------

// 30 documents; corpus `tag` uses token ids in [tag * 100, tag * 100 + 50) so a sample's source is visible.
std::string write_corpus(const test::TempDir& dir, const std::string& name, int tag, uint32_t seed) {
  const std::string prefix = dir.path(name);
  IndexedDatasetWriter writer(prefix, IndexedDType::kU16);
  std::mt19937 rng(seed);
  for (int d = 0; d < 30; ++d) {
    std::vector<int32_t> tokens(2 + rng() % 10);
    for (int32_t& token : tokens) token = tag * 100 + static_cast<int32_t>(rng() % 50);
    writer.add_document(tokens);
  }
  writer.finalize();
  return prefix;
}

DataOptions blend_options(const std::vector<std::string>& data_path, const std::string& cache) {
  DataOptions options;
  options.data_path = data_path;
  options.split = "90,5,5";
  options.seq_length = 4;
  options.vocab_size = 400;
  options.data_cache_path = cache;
  return options;
}

TEST(DataBlendProvider, WeightedBlendFollowsWeightsAndIsDeterministic) {
  test::TempDir dir("blend");
  const std::string a = write_corpus(dir, "a", 1, 21);
  const std::string b = write_corpus(dir, "b", 3, 22);
  const DataOptions options = blend_options({"1", a, "3", b}, dir.path("cache"));
  const GPTDataProvider first = GPTDataProvider::build(options, 40, 8, 8);
  const BlendedDataset* blend = first.blended_dataset(DatasetSplit::kTrain);
  ASSERT_NE(blend, nullptr);
  EXPECT_EQ(first.gpt_dataset(DatasetSplit::kTrain), nullptr);
  // Size = ceil(40 * 0.25) + ceil(40 * 0.75); datasets built with Megatron's 0.5% surplus.
  ASSERT_EQ(first.num_samples(DatasetSplit::kTrain), 40);
  EXPECT_GE(blend->datasets()[0]->size(), 11);
  EXPECT_GE(blend->datasets()[1]->size(), 31);

  const Batch batch = first.get_batch(DatasetSplit::kTrain, 0, 40);
  int from_b = 0;
  std::vector<int32_t> text(5);
  for (int64_t i = 0; i < 40; ++i) {
    const int16_t d = blend->dataset_index()[static_cast<size_t>(i)];
    blend->datasets()[static_cast<size_t>(d)]->sample_text(blend->dataset_sample_index()[static_cast<size_t>(i)], text);
    for (int s = 0; s < 4; ++s) {
      const int32_t token = batch.tokens_BS[static_cast<size_t>(i * 4 + s)];
      EXPECT_EQ(token, text[static_cast<size_t>(s)]);
      EXPECT_EQ(token / 100, d == 0 ? 1 : 3);
    }
    from_b += d;
  }
  EXPECT_EQ(from_b, 30);

  const GPTDataProvider second = GPTDataProvider::build(options, 40, 8, 8);
  EXPECT_TRUE(second.blended_dataset(DatasetSplit::kTrain)->datasets()[0]->loaded_from_cache());
  EXPECT_EQ(second.get_batch(DatasetSplit::kTrain, 0, 40).tokens_BS, batch.tokens_BS);
  EXPECT_EQ(second.get_batch(DatasetSplit::kValid, 0, 8).tokens_BS,
            first.get_batch(DatasetSplit::kValid, 0, 8).tokens_BS);
}

TEST(DataBlendProvider, UnweightedBlendUsesDatasetSizes) {
  test::TempDir dir("blend");
  const std::string a = write_corpus(dir, "a", 1, 31);
  const std::string b = write_corpus(dir, "b", 2, 32);
  const GPTDataProvider provider = GPTDataProvider::build(blend_options({a, b}, dir.path("cache")), 25, 0, 0);
  const BlendedDataset* blend = provider.blended_dataset(DatasetSplit::kTrain);
  ASSERT_NE(blend, nullptr);
  EXPECT_EQ(provider.num_samples(DatasetSplit::kTrain), 25);
  const double size_a = static_cast<double>(blend->datasets()[0]->size());
  const double size_b = static_cast<double>(blend->datasets()[1]->size());
  int64_t from_a = 0;
  for (const int16_t d : blend->dataset_index()) from_a += d == 0;
  EXPECT_LE(std::abs(static_cast<double>(from_a) - 25.0 * size_a / (size_a + size_b)), 1.0);
}

TEST(DataBlendProvider, OverdrawnDatasetIsAnError) {
  test::TempDir dir("blend");
  const std::string a = write_corpus(dir, "a", 1, 41);
  const auto sequences = std::make_shared<const IndexedTokenSequences>(a);
  GPTDatasetConfig config;
  config.sequence_length = 4;
  const auto dataset = std::make_shared<const GPTDataset>(sequences, DatasetSplit::kTrain, 0, 30, std::nullopt, config);
  const int64_t available = dataset->size();
  expect_data_error([&] { BlendedDataset blend({dataset}, {1.0}, available + 1); }, "the blend draws");
  const BlendedDataset blend({dataset}, {1.0}, available);
  std::vector<int32_t> text(5);
  expect_data_error([&] { blend.sample_text(available, text); }, "out of range");
}

}  // namespace
}  // namespace moecore
