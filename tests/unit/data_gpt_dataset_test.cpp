// Megatron's GPTDataset: the document/sample/shuffle indices, sample windows, the index cache, splits, .npy
// files and the trainer-facing GPTDataProvider.
//
// Independent references used below:
//  - hand-worked examples (documented next to each);
//  - values printed by numpy 1.24 (/usr/bin/python3) when the tests were written: a Python transcription of
//    Megatron's gpt_dataset.py/_build_document_index/_build_shuffle_index and helpers.cpp build_sample_idx,
//    driven by numpy.random.RandomState(seed) exactly as Megatron drives it; numpy.save output; Megatron's
//    split arithmetic (re.findall, numpy normalize, cumulative book-ends, int(round(x * n))).
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "moecore/data/data_loader.h"
#include "moecore/data/gpt_dataset.h"
#include "moecore/data/mock_dataset.h"
#include "moecore/data/npy.h"
#include "moecore/data/split.h"
#include "test_temp_dir.h"

namespace moecore {
namespace {

namespace fs = std::filesystem;

template <typename F>
void expect_data_error(F&& action, const std::string& needle) {
  test::expect_error_containing<DataError>(std::forward<F>(action), needle);
}

// In-memory token sequences for index tests.
class VectorSequences final : public TokenSequences {
 public:
  explicit VectorSequences(std::vector<std::vector<int32_t>> sequences) : sequences_(std::move(sequences)) {
    for (const auto& sequence : sequences_) lengths_.push_back(static_cast<int32_t>(sequence.size()));
  }
  const std::string& name() const override { return name_; }
  const std::vector<int32_t>& sequence_lengths() const override { return lengths_; }
  void read(int64_t i, int64_t offset, std::span<int32_t> out) const override {
    const auto& sequence = sequences_.at(static_cast<size_t>(i));
    ASSERT_LE(offset + static_cast<int64_t>(out.size()), static_cast<int64_t>(sequence.size()));
    std::copy_n(sequence.begin() + offset, out.size(), out.begin());
  }

 private:
  std::string name_ = "vector";
  std::vector<std::vector<int32_t>> sequences_;
  std::vector<int32_t> lengths_;
};

std::vector<int32_t> sample_of(const TokenSequences& sequences, const GPTIndices& indices, int64_t sample,
                               int64_t sequence_length) {
  std::vector<int32_t> text(static_cast<size_t>(sequence_length + 1));
  read_sample_text(sequences, indices, sample, text);
  return text;
}

// --- index builders -----------------------------------------------------------------------------------------

// Documents of lengths 3, 5, 2 (tokens 10.., 20.., 30..), seq_length 4, unshuffled document index [0, 1, 2]:
// the stream 10 11 12 | 20 21 22 23 24 | 30 31 (10 tokens) holds (10 - 1) // 4 = 2 samples of 5 tokens,
// starting at stream positions 0 and 4; position 4 is document 1 offset 1, position 8 is document 2 offset 0.
TEST(DataGptIndexBuilders, SampleIndexHandExampleOneEpoch) {
  const VectorSequences sequences({{10, 11, 12}, {20, 21, 22, 23, 24}, {30, 31}});
  GPTIndices indices;
  indices.document_index = {0, 1, 2};
  indices.sample_index = build_sample_index(sequences.sequence_lengths(), indices.document_index, 4, 1, 10);
  EXPECT_EQ(indices.sample_index, (std::vector<int64_t>{0, 0, 1, 1, 2, 0}));
  EXPECT_EQ(sample_of(sequences, indices, 0, 4), (std::vector<int32_t>{10, 11, 12, 20, 21}));
  EXPECT_EQ(sample_of(sequences, indices, 1, 4), (std::vector<int32_t>{21, 22, 23, 24, 30}));
}

// Two epochs of the same documents: 20 tokens, (20 - 1) // 4 = 4 samples starting at stream positions
// 0, 4, 8, 12, 16 -> (pos 0, off 0), (1, 1), (2, 0), (3, 2) [doc 0 again, offset 2], (4, 3) [doc 1, offset 3].
TEST(DataGptIndexBuilders, SampleIndexHandExampleTwoEpochs) {
  const VectorSequences sequences({{10, 11, 12}, {20, 21, 22, 23, 24}, {30, 31}});
  GPTIndices indices;
  indices.document_index = {0, 1, 2, 0, 1, 2};
  indices.sample_index = build_sample_index(sequences.sequence_lengths(), indices.document_index, 4, 2, 10);
  EXPECT_EQ(indices.sample_index, (std::vector<int64_t>{0, 0, 1, 1, 2, 0, 3, 2, 4, 3}));
  EXPECT_EQ(sample_of(sequences, indices, 2, 4), (std::vector<int32_t>{30, 31, 10, 11, 12}));
  EXPECT_EQ(sample_of(sequences, indices, 3, 4), (std::vector<int32_t>{12, 20, 21, 22, 23}));
}

TEST(DataGptIndexBuilders, NumEpochs) {
  EXPECT_EQ(gpt_num_epochs(10, 4, 2), 1);   // 2 * 4 + 1 = 9 <= 10
  EXPECT_EQ(gpt_num_epochs(10, 4, 3), 2);   // 13 tokens
  EXPECT_EQ(gpt_num_epochs(71, 7, 30), 3);  // 211 tokens
  EXPECT_EQ(gpt_num_epochs(71, 7, std::nullopt), 1);
}

// numpy: RandomState(1234) shuffling arange(20) gives this permutation (numpy 1.24).
TEST(DataGptIndexBuilders, NumpyShuffleParity) {
  NumpyRandomState random(1234);
  std::vector<int64_t> values(20);
  std::iota(values.begin(), values.end(), 0);
  random.shuffle(std::span<int64_t>(values));
  EXPECT_EQ(values, (std::vector<int64_t>{3, 13, 2, 16, 14, 5, 4, 0, 8, 18, 17, 11, 10, 9, 7, 1, 19, 12, 6, 15}));
  std::vector<int32_t> next(7);  // the same state continues: shuffle(arange(7)) right after
  std::iota(next.begin(), next.end(), 0);
  random.shuffle(std::span<int32_t>(next));
  EXPECT_EQ(next, (std::vector<int32_t>{6, 4, 1, 5, 3, 0, 2}));
}

// Sequence lengths = numpy.random.RandomState(0).randint(1, 20, size=12).
const std::vector<int32_t> kReferenceSizes = {13, 16, 1, 4, 4, 8, 10, 19, 5, 7, 13, 2};

struct ReferenceCase {
  int64_t begin, end, sequence_length;
  uint32_t seed;
  int64_t num_samples;
  std::vector<int32_t> document_index;
  std::vector<int64_t> sample_index;
  std::vector<int64_t> shuffle_index;
};

// Printed by the Python/numpy transcription of Megatron (see the file comment).
const ReferenceCase kReferenceCases[] = {
    // 3 epochs, final epoch not separate (10 samples from it >= int(0.8 * 10)).
    {2,
     11,
     7,
     1234,
     30,
     {2, 9, 6, 5, 9, 4, 6, 3, 7, 7, 2, 10, 7, 8, 3, 9, 6, 4, 2, 10, 10, 4, 5, 5, 8, 3, 8},
     {0, 0,  1, 6,  2,  6,  3, 3,  4, 2,  5, 2,  6, 5,  7, 2,  8, 5,  8, 12, 9, 0,  9, 7,  9, 14, 11, 1,  11, 8,  12,
      2, 12, 9, 12, 16, 13, 4, 15, 2, 16, 2, 16, 9, 19, 1, 19, 8, 20, 2, 20, 9, 21, 3, 22, 6, 23, 5,  24, 4,  26, 2},
     {17, 18, 8, 28, 23, 4, 5, 22, 13, 25, 14, 20, 10, 15, 19, 21, 1, 12, 29, 27, 16, 24, 9, 0, 11, 7, 3, 26, 6, 2}},
    // 2 epochs, final epoch separate (3 samples from it < int(0.8 * 10)).
    {2,
     11,
     7,
     1234,
     13,
     {10, 4, 3, 2, 9, 6, 7, 8, 5, 8, 6, 2, 7, 5, 4, 10, 9, 3},
     {0, 0,  0, 7,  1, 1,  3, 0,  4,  6,  5,  6,  6, 3,  6, 10, 6, 17, 8, 0,  8,
      7, 10, 1, 10, 8, 12, 4, 12, 11, 12, 18, 13, 6, 15, 1, 15, 8, 16, 2, 17, 2},
     {3, 9, 2, 1, 7, 5, 4, 0, 8, 6, 18, 11, 17, 16, 19, 15, 14, 13, 10, 12}},
    // 1 epoch, another seed.
    {0,
     12,
     5,
     7,
     5,
     {7, 10, 2, 5, 0, 1, 11, 8, 3, 6, 9, 4},
     {0, 0, 0, 5, 0, 10, 0,  15, 1, 1, 1, 6, 1, 11, 3, 2, 3, 7,  4, 4,  4,
      9, 5, 1, 5, 6, 5,  11, 6,  0, 7, 3, 8, 3, 9,  4, 9, 9, 10, 4, 11, 2},
     {2, 19, 1, 9, 13, 5, 10, 16, 3, 17, 14, 11, 15, 12, 18, 0, 4, 6, 7, 8}},
};

TEST(DataGptIndexBuilders, MatchMegatronReference) {
  for (const ReferenceCase& c : kReferenceCases) {
    SCOPED_TRACE("seed " + std::to_string(c.seed) + ", num_samples " + std::to_string(c.num_samples));
    const GPTIndices indices =
        build_gpt_indices(kReferenceSizes, c.begin, c.end, c.sequence_length, c.seed, c.num_samples);
    EXPECT_EQ(indices.document_index, c.document_index);
    EXPECT_EQ(indices.sample_index, c.sample_index);
    EXPECT_EQ(indices.shuffle_index, c.shuffle_index);
  }
}

// --- GPTDataset -------------------------------------------------------------------------------------------------

// Sequence i holds tokens 1000 * i + k: every stream position has its own token id.
std::shared_ptr<VectorSequences> unique_token_sequences(int num_sequences, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::vector<int32_t>> sequences(static_cast<size_t>(num_sequences));
  for (int i = 0; i < num_sequences; ++i) {
    sequences[static_cast<size_t>(i)].resize(1 + rng() % 30);
    for (size_t k = 0; k < sequences[static_cast<size_t>(i)].size(); ++k) {
      sequences[static_cast<size_t>(i)][k] = 1000 * i + static_cast<int32_t>(k);
    }
  }
  return std::make_shared<VectorSequences>(std::move(sequences));
}

// One epoch, shuffled: the input tokens of all samples cover the first num_samples * S stream positions once.
TEST(DataGptDataset, EverySampleOfAnEpochOnce) {
  const auto sequences = unique_token_sequences(40, 3);
  GPTDatasetConfig config;
  config.sequence_length = 8;
  const GPTDataset dataset(sequences, DatasetSplit::kTrain, 5, 35, std::nullopt, config);
  int64_t tokens = 0;
  for (int64_t i = 5; i < 35; ++i) tokens += sequences->sequence_lengths()[static_cast<size_t>(i)];
  const int64_t expected_samples = (tokens - 1) / 8;
  ASSERT_EQ(dataset.size(), expected_samples);

  std::vector<int64_t> shuffle = dataset.indices().shuffle_index;
  std::sort(shuffle.begin(), shuffle.end());
  std::vector<int64_t> identity(static_cast<size_t>(expected_samples));
  std::iota(identity.begin(), identity.end(), 0);
  EXPECT_EQ(shuffle, identity);
  EXPECT_NE(dataset.indices().shuffle_index, identity);

  std::set<int32_t> seen;
  std::vector<int32_t> text(9);
  for (int64_t i = 0; i < dataset.size(); ++i) {
    dataset.sample_text(i, text);
    for (int k = 0; k < 8; ++k) {
      EXPECT_TRUE(seen.insert(text[static_cast<size_t>(k)]).second) << "token seen twice";
      const int32_t sequence = text[static_cast<size_t>(k)] / 1000;
      EXPECT_GE(sequence, 5);
      EXPECT_LT(sequence, 35);
    }
  }
  EXPECT_EQ(static_cast<int64_t>(seen.size()), expected_samples * 8);
  // Each sequence of the split is used once in the document index.
  std::vector<int32_t> documents = dataset.indices().document_index;
  std::sort(documents.begin(), documents.end());
  std::vector<int32_t> split_sequences(30);
  std::iota(split_sequences.begin(), split_sequences.end(), 5);
  EXPECT_EQ(documents, split_sequences);
}

TEST(DataGptDataset, SampleOutOfRangeAndEmptySplit) {
  const auto sequences = unique_token_sequences(10, 4);
  GPTDatasetConfig config;
  config.sequence_length = 4;
  const GPTDataset dataset(sequences, DatasetSplit::kValid, 0, 10, 5, config);
  std::vector<int32_t> text(5);
  expect_data_error([&] { dataset.sample_text(dataset.size(), text); }, "out of range for the valid split");
  expect_data_error([&] { GPTDataset empty(sequences, DatasetSplit::kTest, 10, 10, 1, config); },
                    "the test split has no documents");
}

TEST(DataGptDataset, VocabularyCheck) {
  const auto sequences = std::make_shared<VectorSequences>(std::vector<std::vector<int32_t>>{{1, 2, 3, 99, 4, 5}});
  GPTDatasetConfig config;
  config.sequence_length = 4;
  config.vocab_size = 50;
  const GPTDataset dataset(sequences, DatasetSplit::kTrain, 0, 1, 1, config);
  std::vector<int32_t> text(5);
  expect_data_error([&] { dataset.sample_text(0, text); }, "vector: token id 99");
}

TEST(DataGptDataset, IndicesAreCachedAndReloaded) {
  test::TempDir dir("gpt");
  const auto sequences = unique_token_sequences(30, 5);
  GPTDatasetConfig config;
  config.sequence_length = 6;
  config.random_seed = 99;
  config.path_to_cache = dir.path("cache");
  const GPTDataset built(sequences, DatasetSplit::kTrain, 0, 30, 200, config);
  EXPECT_FALSE(built.loaded_from_cache());
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(config.path_to_cache)) names.push_back(entry.path().filename());
  std::sort(names.begin(), names.end());
  ASSERT_EQ(names.size(), 4u);
  const std::string hash = names[0].substr(0, names[0].find('-'));
  EXPECT_EQ(names[0], hash + "-GPTDataset-train-description.txt");
  EXPECT_EQ(names[1], hash + "-GPTDataset-train-document_index.npy");
  EXPECT_EQ(names[2], hash + "-GPTDataset-train-sample_index.npy");
  EXPECT_EQ(names[3], hash + "-GPTDataset-train-shuffle_index.npy");

  // Megatron's dtypes, and the arrays as built.
  const std::string base = config.path_to_cache + "/" + hash + "-GPTDataset-train-";
  const NpyArray shuffle = load_npy(base + "shuffle_index.npy");
  EXPECT_EQ(shuffle.dtype, NpyDType::kU4);
  EXPECT_EQ(shuffle.values, built.indices().shuffle_index);
  const NpyArray sample = load_npy(base + "sample_index.npy");
  EXPECT_EQ(sample.dtype, NpyDType::kI4);
  EXPECT_EQ(sample.shape, (std::vector<int64_t>{built.size() + 1, 2}));
  EXPECT_EQ(load_npy(base + "document_index.npy").dtype, NpyDType::kI4);

  const GPTDataset loaded(sequences, DatasetSplit::kTrain, 0, 30, 200, config);
  EXPECT_TRUE(loaded.loaded_from_cache());
  EXPECT_EQ(loaded.indices().document_index, built.indices().document_index);
  EXPECT_EQ(loaded.indices().sample_index, built.indices().sample_index);
  EXPECT_EQ(loaded.indices().shuffle_index, built.indices().shuffle_index);

  // Another seed is another description: built anew beside the first.
  GPTDatasetConfig other = config;
  other.random_seed = 100;
  const GPTDataset reseeded(sequences, DatasetSplit::kTrain, 0, 30, 200, other);
  EXPECT_FALSE(reseeded.loaded_from_cache());
  EXPECT_NE(reseeded.indices().shuffle_index, built.indices().shuffle_index);

  // A damaged cache file is an error naming it, not a crash.
  std::vector<int64_t> bad = built.indices().shuffle_index;
  bad[0] = bad[1];
  save_npy_atomic(base + "shuffle_index.npy", NpyDType::kU4, {static_cast<int64_t>(bad.size())}, bad);
  expect_data_error([&] { GPTDataset damaged(sequences, DatasetSplit::kTrain, 0, 30, 200, config); },
                    "not a permutation");
  save_npy_atomic(base + "shuffle_index.npy", NpyDType::kU4, {static_cast<int64_t>(shuffle.values.size())},
                  shuffle.values);
  // A sample offset past its sequence (these hold at most 30 tokens); 2^63 - 1 overflowed the token arithmetic.
  for (const int64_t offset : {int64_t{31}, std::numeric_limits<int64_t>::max()}) {
    std::vector<int64_t> rows = sample.values;
    rows.back() = offset;
    save_npy_atomic(base + "sample_index.npy", NpyDType::kI8, sample.shape, rows);
    expect_data_error([&] { GPTDataset damaged(sequences, DatasetSplit::kTrain, 0, 30, 200, config); },
                      "has offset " + std::to_string(offset) + " past its sequence");
  }
  std::ofstream(base + "sample_index.npy", std::ios::trunc) << "garbage";
  expect_data_error([&] { GPTDataset damaged(sequences, DatasetSplit::kTrain, 0, 30, 200, config); },
                    "sample_index.npy: not a .npy file");
}

// --- .npy -------------------------------------------------------------------------------------------------------

std::string from_hex(const std::string& hex) {
  std::string bytes;
  for (size_t i = 0; i < hex.size(); i += 2) bytes += static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16));
  return bytes;
}

// numpy.save(numpy.array([[0, 7], [1, 2], [3, -1]], dtype=numpy.int32)) and
// numpy.save(numpy.array([4, 0, 3], dtype=numpy.uint32)), numpy 1.24, as hex.
TEST(DataGptNpy, BytesMatchNumpySave) {
  const std::string numpy_2d =
      "934e554d5059010076007b276465736372273a20273c6934272c2027666f727472616e5f6f72646572273a2046616c73652c20277368"
      "617065273a2028332c2032292c207d202020202020202020202020202020202020202020202020202020202020202020202020202020"
      "202020202020202020202020202020202020200a0000000007000000010000000200000003000000ffffffff";
  EXPECT_EQ(npy_encode(NpyDType::kI4, {3, 2}, {0, 7, 1, 2, 3, -1}), from_hex(numpy_2d));
  const std::string numpy_1d =
      "934e554d5059010076007b276465736372273a20273c7534272c2027666f727472616e5f6f72646572273a2046616c73652c20277368"
      "617065273a2028332c292c207d2020202020202020202020202020202020202020202020202020202020202020202020202020202020"
      "202020202020202020202020202020202020200a040000000000000003000000";
  EXPECT_EQ(npy_encode(NpyDType::kU4, {3}, {4, 0, 3}), from_hex(numpy_1d));

  const NpyArray decoded = npy_decode(from_hex(numpy_2d), "x.npy");
  EXPECT_EQ(decoded.dtype, NpyDType::kI4);
  EXPECT_EQ(decoded.shape, (std::vector<int64_t>{3, 2}));
  EXPECT_EQ(decoded.values, (std::vector<int64_t>{0, 7, 1, 2, 3, -1}));
}

TEST(DataGptNpy, RoundTripAndErrors) {
  const std::vector<int64_t> values = {-5, int64_t{1} << 40, 0, 17};
  const NpyArray array = npy_decode(npy_encode(NpyDType::kI8, {4}, values), "y.npy");
  EXPECT_EQ(array.values, values);
  const std::string good = npy_encode(NpyDType::kI2, {2}, {-3, 300});
  EXPECT_EQ(npy_decode(good, "z.npy").values, (std::vector<int64_t>{-3, 300}));
  expect_data_error([&] { npy_decode(good.substr(0, good.size() - 1), "z.npy"); }, "z.npy: .npy size mismatch");
  expect_data_error([&] { npy_decode("hello world", "w.npy"); }, "w.npy: not a .npy file");
  expect_data_error([&] { npy_encode(NpyDType::kU4, {1}, {-1}); }, "does not fit <u4");
  // 2^14 x 2^50 elements in a 16 KiB file: the element count wrapped to 0 ("expected 128 bytes").
  const std::string header = "{'descr': '<i2', 'fortran_order': False, 'shape': (16384, 1125899906842624), }";
  std::string wrapping = std::string("\x93NUMPY\x01\x00", 8) + static_cast<char>(header.size()) + '\0' + header;
  wrapping.append(16384, '\0');
  expect_data_error([&] { npy_decode(wrapping, "big.npy"); }, "big.npy: .npy shape (16384, 1125899906842624) exceeds");
}

// --- splits -----------------------------------------------------------------------------------------------------

struct SplitCase {
  std::string split;
  int64_t n;
  std::vector<std::pair<int64_t, int64_t>> ranges;  // (-1, -1): the split does not exist
};

TEST(DataGptSplit, RangesMatchMegatron) {
  // Printed by Megatron's split arithmetic in Python (see the file comment).
  const SplitCase cases[] = {
      {"969,30,1", 1000, {{0, 969}, {969, 999}, {999, 1000}}},
      {"969,30,1", 10, {{0, 10}, {10, 10}, {10, 10}}},
      {"98,2,0", 7, {{0, 7}, {7, 7}, {-1, -1}}},
      {"1,1", 5, {{0, 2}, {2, 5}, {-1, -1}}},  // 2.5 rounds half to even
      {"1,1,1", 100000, {{0, 33333}, {33333, 66667}, {66667, 100000}}},
      {"969, 30, 1", 12345, {{0, 11962}, {11962, 12333}, {12333, 12345}}},
      {"0.7 0.2 0.1", 9, {{0, 6}, {6, 8}, {8, 9}}},
  };
  for (const SplitCase& c : cases) {
    SCOPED_TRACE(c.split + " over " + std::to_string(c.n));
    const SplitMatrix matrix = split_matrix_from_vector(parse_and_normalize_split(c.split));
    for (size_t s = 0; s < 3; ++s) {
      if (c.ranges[s].first < 0) {
        EXPECT_FALSE(matrix[s].has_value());
      } else {
        ASSERT_TRUE(matrix[s].has_value());
        EXPECT_EQ(split_range(*matrix[s], c.n), c.ranges[s]);
      }
    }
  }
}

TEST(DataGptSplit, BadSplitStrings) {
  expect_data_error([] { parse_and_normalize_split("1,2,3,4"); }, "--split \"1,2,3,4\": has 4 weights");
  expect_data_error([] { parse_and_normalize_split("0,0,0"); }, "positive sum");
  expect_data_error([] { parse_and_normalize_split("train"); }, "positive sum");
  expect_data_error([] { parse_and_normalize_split("1.2.3,1"); }, "\"1.2.3\" is not a number");
}

// Weights w_i = ((i * 7919) % 1000 + 1) / 7; numpy's normalize results printed as float.hex(). At 200 and
// 1000 elements numpy's pairwise sum differs from a left-to-right sum in the last bits.
TEST(DataGptSplit, NormalizeMatchesNumpyBitwise) {
  const std::map<int, std::pair<double, double>> expected = {
      {3, {0x1.29e4129e4129ep-11, 0x1.e8253c8253c83p-2}},
      {10, {0x1.86e522b0a5ac1p-13, 0x1.9f5374dbb006dp-5}},
      {200, {0x1.51e8e14cf5b7fp-17, 0x1.230d160ec9a50p-7}},
      {1000, {0x1.0c2ad36ed7f99p-19, 0x1.5796dee604b7cp-13}},
  };
  for (const auto& [n, first_last] : expected) {
    std::vector<double> weights;
    for (int i = 0; i < n; ++i) weights.push_back(static_cast<double>((i * 7919) % 1000 + 1) / 7.0);
    const std::vector<double> normalized = normalize_weights(weights);
    EXPECT_EQ(normalized.front(), first_last.first) << n;
    EXPECT_EQ(normalized.back(), first_last.second) << n;
  }
}

// --- GPTDataProvider over files --------------------------------------------------------------------------------

constexpr int32_t kEod = 0;

// 20 documents of random length 1..12 with ids in [1, 50), each ending with EOD.
std::string write_corpus(const test::TempDir& dir, const std::string& name, uint32_t seed, int32_t bad_token = -1) {
  const std::string prefix = dir.path(name);
  IndexedDatasetWriter writer(prefix, IndexedDType::kU16);
  std::mt19937 rng(seed);
  for (int d = 0; d < 20; ++d) {
    std::vector<int32_t> tokens(1 + rng() % 12);
    for (int32_t& token : tokens) token = 1 + static_cast<int32_t>(rng() % 49);
    if (d == 7 && bad_token >= 0) tokens[0] = bad_token;
    tokens.push_back(kEod);
    writer.add_document(tokens);
  }
  writer.finalize();
  return prefix;
}

DataOptions corpus_options(const std::vector<std::string>& data_path) {
  DataOptions options;
  options.data_path = data_path;
  options.split = "8,1,1";
  options.seq_length = 5;
  options.vocab_size = 50;
  options.eod_id = kEod;
  return options;
}

TEST(DataGptProvider, BatchesShiftLabelsAndMaskEod) {
  test::TempDir dir("gpt");
  const std::string prefix = write_corpus(dir, "corpus_text_document", 11);
  DataOptions options = corpus_options({prefix});
  const GPTDataProvider provider = GPTDataProvider::build(options, 12, 4, 2);
  ASSERT_TRUE(provider.has_split(DatasetSplit::kTrain));
  ASSERT_NE(provider.gpt_dataset(DatasetSplit::kTrain), nullptr);
  // Default cache location: <data dir>/cache/GPTDataset_indices.
  EXPECT_TRUE(fs::is_directory(dir.path("cache/GPTDataset_indices")));

  const Batch batch = provider.get_batch(DatasetSplit::kTrain, 3, 4);
  ASSERT_EQ(batch.B, 4);
  ASSERT_EQ(batch.S, 5);
  std::vector<int32_t> text(6);
  for (int64_t b = 0; b < 4; ++b) {
    provider.gpt_dataset(DatasetSplit::kTrain)->sample_text(3 + b, text);
    for (int64_t s = 0; s < 5; ++s) {
      EXPECT_EQ(batch.tokens_BS[static_cast<size_t>(b * 5 + s)], text[static_cast<size_t>(s)]);
      EXPECT_EQ(batch.labels_BS[static_cast<size_t>(b * 5 + s)], text[static_cast<size_t>(s + 1)]);
      EXPECT_EQ(batch.loss_mask_BS[static_cast<size_t>(b * 5 + s)], 1.0f);
    }
  }

  options.eod_mask_loss = true;
  const GPTDataProvider masked = GPTDataProvider::build(options, 12, 4, 2);
  int eods = 0;
  for (int64_t begin = 0; begin + 4 <= 12; begin += 4) {
    const Batch eod_batch = masked.get_batch(DatasetSplit::kTrain, begin, 4);
    for (size_t i = 0; i < eod_batch.tokens_BS.size(); ++i) {
      const bool is_eod = eod_batch.tokens_BS[i] == kEod;
      eods += is_eod;
      EXPECT_EQ(eod_batch.loss_mask_BS[i], is_eod ? 0.0f : 1.0f);
    }
  }
  EXPECT_GT(eods, 0);

  expect_data_error([&] { provider.get_batch(DatasetSplit::kTrain, provider.num_samples(DatasetSplit::kTrain), 1); },
                    "out of range for the train split");
}

TEST(DataGptProvider, DeterministicAndCached) {
  test::TempDir dir("gpt");
  const std::string prefix = write_corpus(dir, "c", 12);
  DataOptions options = corpus_options({prefix});
  options.data_cache_path = dir.path("my_cache");
  const GPTDataProvider first = GPTDataProvider::build(options, 40, 4, 2);
  EXPECT_FALSE(first.gpt_dataset(DatasetSplit::kTrain)->loaded_from_cache());
  const GPTDataProvider second = GPTDataProvider::build(options, 40, 4, 2);
  EXPECT_TRUE(second.gpt_dataset(DatasetSplit::kTrain)->loaded_from_cache());
  EXPECT_TRUE(second.gpt_dataset(DatasetSplit::kValid)->loaded_from_cache());
  EXPECT_EQ(first.get_batch(DatasetSplit::kTrain, 0, 40).tokens_BS,
            second.get_batch(DatasetSplit::kTrain, 0, 40).tokens_BS);
  EXPECT_FALSE(fs::exists(dir.path("cache")));
}

TEST(DataGptProvider, TokenOutsideVocabularyIsAnError) {
  test::TempDir dir("gpt");
  const std::string prefix = write_corpus(dir, "bad_vocab", 13, 700);
  const GPTDataProvider provider = GPTDataProvider::build(corpus_options({prefix}), 30, 0, 0);
  expect_data_error(
      [&] {
        for (int64_t i = 0; i < provider.num_samples(DatasetSplit::kTrain); ++i) {
          provider.get_batch(DatasetSplit::kTrain, i, 1);
        }
      },
      "bad_vocab: token id 700");
}

TEST(DataGptProvider, SplitsWithoutDocumentsOrWeight) {
  test::TempDir dir("gpt");
  const std::string prefix = write_corpus(dir, "small", 14);
  DataOptions options = corpus_options({prefix});
  options.split = "969,30,1";  // 20 documents: valid gets round(0.999 * 20) - round(0.969 * 20) = 1, test 0
  expect_data_error([&] { GPTDataProvider::build(options, 10, 2, 2); }, "the test split has no documents");
  // Asking no test samples skips the split.
  const GPTDataProvider no_test = GPTDataProvider::build(options, 10, 2, 0);
  EXPECT_FALSE(no_test.has_split(DatasetSplit::kTest));
  expect_data_error([&] { no_test.get_batch(DatasetSplit::kTest, 0, 1); }, "test split was not built");

  options.split = "1,0,0";
  const GPTDataProvider train_only = GPTDataProvider::build(options, 10, 2, 2);
  EXPECT_TRUE(train_only.has_split(DatasetSplit::kTrain));
  EXPECT_FALSE(train_only.has_split(DatasetSplit::kValid));
  EXPECT_FALSE(train_only.has_split(DatasetSplit::kTest));
}

TEST(DataGptProvider, BadOptions) {
  test::TempDir dir("gpt");
  const std::string prefix = write_corpus(dir, "opts", 15);
  DataOptions options = corpus_options({prefix});
  options.seed = uint64_t{1} << 33;
  expect_data_error([&] { GPTDataProvider::build(options, 1, 0, 0); }, "--seed");
  options = corpus_options({});
  expect_data_error([&] { GPTDataProvider::build(options, 1, 0, 0); }, "no data");
  options = corpus_options({dir.path("missing")});
  expect_data_error([&] { GPTDataProvider::build(options, 1, 0, 0); }, "missing.idx: cannot open");
}

// --- mock data --------------------------------------------------------------------------------------------------

TEST(DataGptMockData, DeterministicInVocabularyEndsWithEod) {
  MockDataOptions mock;
  mock.vocab_size = 37;
  mock.eod_id = 5;
  mock.num_sequences = 200;
  mock.max_sequence_length = 64;
  const MockTokenSequences a(mock);
  const MockTokenSequences b(mock);
  EXPECT_EQ(a.sequence_lengths(), b.sequence_lengths());
  std::set<int32_t> lengths(a.sequence_lengths().begin(), a.sequence_lengths().end());
  EXPECT_GE(*lengths.begin(), 1);
  EXPECT_LE(*lengths.rbegin(), 63);
  EXPECT_GT(lengths.size(), 20u);
  for (int64_t i = 0; i < 200; ++i) {
    std::vector<int32_t> tokens(static_cast<size_t>(a.sequence_lengths()[static_cast<size_t>(i)]));
    std::vector<int32_t> again(tokens.size());
    a.read(i, 0, tokens);
    b.read(i, 0, again);
    EXPECT_EQ(tokens, again);
    EXPECT_EQ(tokens.back(), 5);
    for (size_t k = 0; k + 1 < tokens.size(); ++k) {
      EXPECT_GE(tokens[k], 0);
      EXPECT_LT(tokens[k], 37);
      EXPECT_NE(tokens[k], 5);
    }
    if (tokens.size() >= 4) {  // reading a slice gives the same tokens
      std::vector<int32_t> slice(2);
      a.read(i, 1, slice);
      EXPECT_EQ(slice[0], tokens[1]);
      EXPECT_EQ(slice[1], tokens[2]);
    }
  }
}

TEST(DataGptMockData, ProviderServesAllSplits) {
  DataOptions options;
  options.mock_data = true;
  options.seq_length = 16;
  options.vocab_size = 128;
  options.eod_id = 127;
  options.mock_num_sequences = 300;
  options.mock_max_sequence_length = 100;
  const GPTDataProvider a = GPTDataProvider::build(options, 64, 16, 8);
  const GPTDataProvider b = GPTDataProvider::build(options, 64, 16, 8);
  for (const DatasetSplit split : {DatasetSplit::kTrain, DatasetSplit::kValid, DatasetSplit::kTest}) {
    ASSERT_TRUE(a.has_split(split));
    const Batch batch = a.get_batch(split, 0, 8);
    EXPECT_EQ(batch.tokens_BS, b.get_batch(split, 0, 8).tokens_BS);
    for (const int32_t token : batch.tokens_BS) EXPECT_LT(token, 128);
  }
  // As in Megatron, mock data splits its sequences "1,1,1" whatever --split says.
  const std::vector<int32_t>& documents = a.gpt_dataset(DatasetSplit::kValid)->indices().document_index;
  EXPECT_EQ(*std::min_element(documents.begin(), documents.end()), 100);
  EXPECT_EQ(*std::max_element(documents.begin(), documents.end()), 199);
}

}  // namespace
}  // namespace moecore
