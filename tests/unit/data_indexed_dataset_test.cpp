// Megatron's indexed dataset (.bin/.idx): round trips, the exact bytes of the format, and corrupt files.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "moecore/data/indexed_dataset.h"
#include "test_temp_dir.h"

namespace moecore {
namespace {

namespace fs = std::filesystem;

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

template <typename T>
void put(std::string& out, T value) {
  char bytes[sizeof(T)];
  std::memcpy(bytes, &value, sizeof(T));
  out.append(bytes, sizeof(T));
}

// Expects a DataError whose message contains `needle`.
template <typename F>
void expect_data_error(F&& action, const std::string& needle) {
  test::expect_error_containing<DataError>(std::forward<F>(action), needle);
}

// Random documents of 1..3 sequences each, token ids below `max_token`.
std::vector<std::vector<std::vector<int32_t>>> random_documents(uint32_t seed, int32_t max_token) {
  std::mt19937 rng(seed);
  std::vector<std::vector<std::vector<int32_t>>> documents(7);
  for (auto& document : documents) {
    document.resize(1 + rng() % 3);
    for (auto& sequence : document) {
      sequence.resize(rng() % 40);  // zero-length sequences happen too
      for (int32_t& token : sequence) token = static_cast<int32_t>(rng() % static_cast<uint32_t>(max_token));
    }
  }
  return documents;
}

void round_trip(IndexedDType dtype, int32_t max_token) {
  test::TempDir dir("idx");
  const std::string prefix = dir.path("corpus_text_document");
  const auto documents = random_documents(42, max_token);
  {
    IndexedDatasetWriter writer(prefix, dtype);
    for (const auto& document : documents) {
      for (const auto& sequence : document) writer.add_sequence(sequence);
      writer.end_document();
    }
    writer.finalize();
  }
  const IndexedDataset dataset(prefix);
  EXPECT_EQ(dataset.dtype(), dtype);
  std::vector<int64_t> expected_boundaries = {0};
  int64_t i = 0;
  for (const auto& document : documents) {
    for (const auto& sequence : document) {
      ASSERT_EQ(dataset.sequence_lengths()[static_cast<size_t>(i)], static_cast<int32_t>(sequence.size()));
      EXPECT_EQ(dataset.get(i), sequence);
      if (sequence.size() >= 5) {
        EXPECT_EQ(dataset.get(i, 2, 3), std::vector<int32_t>(sequence.begin() + 2, sequence.begin() + 5));
        EXPECT_EQ(dataset.get(i, 3), std::vector<int32_t>(sequence.begin() + 3, sequence.end()));
      }
      ++i;
    }
    expected_boundaries.push_back(i);
  }
  EXPECT_EQ(dataset.num_sequences(), i);
  EXPECT_EQ(dataset.document_indices(), expected_boundaries);
}

TEST(DataIndexedDataset, RoundTripUint16) { round_trip(IndexedDType::kU16, 65535); }
TEST(DataIndexedDataset, RoundTripInt32) { round_trip(IndexedDType::kI32, 2000000000); }

TEST(DataIndexedDataset, OptimalDtypeFollowsMegatron) {
  EXPECT_EQ(optimal_token_dtype(50257), IndexedDType::kU16);
  EXPECT_EQ(optimal_token_dtype(65499), IndexedDType::kU16);
  EXPECT_EQ(optimal_token_dtype(65500), IndexedDType::kI32);
  EXPECT_EQ(optimal_token_dtype(151936), IndexedDType::kI32);
}

// Two documents: {[5, 6, 7], [8]} and {[9, 1000]}, uint16. Bytes assembled from the format's spec.
TEST(DataIndexedDataset, BytesMatchTheFormatSpec) {
  test::TempDir dir("idx");
  const std::string prefix = dir.path("tiny");
  IndexedDatasetWriter writer(prefix, IndexedDType::kU16);
  writer.add_sequence({5, 6, 7});
  writer.add_sequence({8});
  writer.end_document();
  writer.add_document({9, 1000});
  writer.finalize();

  std::string idx("MMIDIDX\0\0", 9);
  put<uint64_t>(idx, 1);  // version
  put<uint8_t>(idx, 8);   // uint16
  put<uint64_t>(idx, 3);  // sequences
  put<uint64_t>(idx, 3);  // document index entries (2 documents + 1)
  for (const int32_t length : {3, 1, 2}) put<int32_t>(idx, length);
  for (const int64_t pointer : {0, 6, 8}) put<int64_t>(idx, pointer);
  for (const int64_t boundary : {0, 2, 3}) put<int64_t>(idx, boundary);
  EXPECT_EQ(read_bytes(prefix + ".idx"), idx);

  std::string bin;
  for (const uint16_t token : {5, 6, 7, 8, 9, 1000}) put<uint16_t>(bin, token);
  EXPECT_EQ(read_bytes(prefix + ".bin"), bin);
}

// The reader accepts files assembled by hand (as Megatron writes them), int32 tokens.
TEST(DataIndexedDataset, ReadsHandAssembledFiles) {
  test::TempDir dir("idx");
  const std::string prefix = dir.path("hand");
  std::string idx("MMIDIDX\0\0", 9);
  put<uint64_t>(idx, 1);
  put<uint8_t>(idx, 4);  // int32
  put<uint64_t>(idx, 2);
  put<uint64_t>(idx, 2);
  put<int32_t>(idx, 2);
  put<int32_t>(idx, 1);
  put<int64_t>(idx, 0);
  put<int64_t>(idx, 8);
  put<int64_t>(idx, 0);
  put<int64_t>(idx, 2);
  write_bytes(prefix + ".idx", idx);
  std::string bin;
  for (const int32_t token : {70000, 3, 123456}) put<int32_t>(bin, token);
  write_bytes(prefix + ".bin", bin);
  const IndexedDataset dataset(prefix);
  EXPECT_EQ(dataset.get(0), (std::vector<int32_t>{70000, 3}));
  EXPECT_EQ(dataset.get(1), (std::vector<int32_t>{123456}));
  EXPECT_EQ(dataset.document_indices(), (std::vector<int64_t>{0, 2}));
}

class DataIndexedCorruptFiles : public ::testing::Test {
 protected:
  void SetUp() override {
    prefix_ = dir_.path("corpus_text_document");
    IndexedDatasetWriter writer(prefix_, IndexedDType::kU16);
    writer.add_document({11, 12, 13, 14});
    writer.add_document({15, 16});
    writer.finalize();
    idx_ = read_bytes(prefix_ + ".idx");
    bin_ = read_bytes(prefix_ + ".bin");
  }
  test::TempDir dir_{"idx"};
  std::string prefix_;
  std::string idx_;
  std::string bin_;
};

TEST_F(DataIndexedCorruptFiles, BadMagic) {
  idx_[0] = 'X';
  write_bytes(prefix_ + ".idx", idx_);
  expect_data_error([&] { IndexedDataset dataset(prefix_); }, "corpus_text_document.idx: bad magic");
}

TEST_F(DataIndexedCorruptFiles, WrongVersion) {
  idx_[9] = 2;
  write_bytes(prefix_ + ".idx", idx_);
  expect_data_error([&] { IndexedDataset dataset(prefix_); }, "unsupported version 2");
}

TEST_F(DataIndexedCorruptFiles, UnknownDtypeCode) {
  idx_[17] = 9;
  write_bytes(prefix_ + ".idx", idx_);
  expect_data_error([&] { IndexedDataset dataset(prefix_); }, "unknown dtype code 9");
}

TEST_F(DataIndexedCorruptFiles, TruncatedIdx) {
  write_bytes(prefix_ + ".idx", idx_.substr(0, idx_.size() - 5));
  expect_data_error([&] { IndexedDataset dataset(prefix_); }, ".idx is truncated");
  write_bytes(prefix_ + ".idx", idx_.substr(0, 20));
  expect_data_error([&] { IndexedDataset dataset(prefix_); }, ".idx is truncated");
}

TEST_F(DataIndexedCorruptFiles, TruncatedBin) {
  write_bytes(prefix_ + ".bin", bin_.substr(0, bin_.size() - 2));
  expect_data_error([&] { IndexedDataset dataset(prefix_); }, ".bin is truncated: expected 12 bytes, found 10");
}

TEST_F(DataIndexedCorruptFiles, BinLongerThanIndexSays) {
  write_bytes(prefix_ + ".bin", bin_ + "xy");
  expect_data_error([&] { IndexedDataset dataset(prefix_); }, "do not belong together");
}

TEST_F(DataIndexedCorruptFiles, HugeSequenceCount) {
  std::string idx = idx_;
  const uint64_t huge = uint64_t{1} << 62;
  std::memcpy(idx.data() + 18, &huge, 8);
  write_bytes(prefix_ + ".idx", idx);
  expect_data_error([&] { IndexedDataset dataset(prefix_); }, "corrupt header");
}

TEST_F(DataIndexedCorruptFiles, BadPointer) {
  const int64_t pointer = 7;  // second sequence pointer (first is at 34 + 2*4)
  std::memcpy(idx_.data() + 34 + 8 + 8, &pointer, 8);
  write_bytes(prefix_ + ".idx", idx_);
  expect_data_error([&] { IndexedDataset dataset(prefix_); }, "sequence 1 pointer is 7, expected 8");
}

TEST_F(DataIndexedCorruptFiles, DocumentIndicesMustEndAtSequenceCount) {
  const int64_t last = 1;
  std::memcpy(idx_.data() + idx_.size() - 8, &last, 8);
  write_bytes(prefix_ + ".idx", idx_);
  expect_data_error([&] { IndexedDataset dataset(prefix_); }, "expected the sequence count 2");
}

TEST_F(DataIndexedCorruptFiles, MissingFiles) {
  fs::remove(prefix_ + ".bin");
  expect_data_error([&] { IndexedDataset dataset(prefix_); }, ".bin: cannot open");
  expect_data_error([&] { IndexedDataset dataset(dir_.path("absent")); }, "absent.idx: cannot open");
}

TEST_F(DataIndexedCorruptFiles, FolderInPlaceOfAFile) {
  fs::remove(prefix_ + ".bin");
  fs::create_directory(prefix_ + ".bin");  // its st_size (4096 on ext4) once read as "truncated ... found 4096"
  expect_data_error([&] { IndexedDataset dataset(prefix_); }, ".bin is a folder, not the dataset's token file");
  fs::remove(prefix_ + ".idx");
  fs::create_directory(prefix_ + ".idx");
  expect_data_error([&] { IndexedDataset dataset(prefix_); }, ".idx is a folder, not the dataset's index file");
}

TEST_F(DataIndexedCorruptFiles, GetOutOfRange) {
  const IndexedDataset dataset(prefix_);
  EXPECT_EQ(dataset.get(1, 1, 1), (std::vector<int32_t>{16}));
  expect_data_error([&] { dataset.get(2); }, "sequence 2 out of range [0, 2)");
  expect_data_error([&] { dataset.get(-1); }, "out of range");
  expect_data_error([&] { dataset.get(0, 3, 2); }, "tokens [3, 5) out of range for sequence 0 of length 4");
  expect_data_error([&] { dataset.get(0, 5); }, "out of range");
}

TEST(DataIndexedWriter, TokenMustFitDtype) {
  test::TempDir dir("idx");
  IndexedDatasetWriter writer(dir.path("small"), IndexedDType::kU16);
  expect_data_error([&] { writer.add_sequence({1, 65536}); }, "token id 65536 does not fit dtype uint16");
  expect_data_error([&] { writer.add_sequence({-1}); }, "does not fit dtype uint16");
}

TEST(DataIndexedWriter, NothingAppearsBeforeFinalize) {
  test::TempDir dir("idx");
  const std::string prefix = dir.path("atomic");
  {
    IndexedDatasetWriter writer(prefix, IndexedDType::kI32);
    writer.add_document({1, 2, 3});
    EXPECT_FALSE(fs::exists(prefix + ".bin"));
    EXPECT_FALSE(fs::exists(prefix + ".idx"));
  }
  // Abandoned without finalize: no file, not even a temporary, is left behind.
  EXPECT_TRUE(fs::is_empty(dir.path()));

  // A finished dataset survives an abandoned rewrite of the same prefix.
  {
    IndexedDatasetWriter writer(prefix, IndexedDType::kI32);
    writer.add_document({4, 5});
    writer.finalize();
  }
  {
    IndexedDatasetWriter writer(prefix, IndexedDType::kI32);
    writer.add_document({6, 7, 8, 9});
  }
  const IndexedDataset dataset(prefix);
  EXPECT_EQ(dataset.get(0), (std::vector<int32_t>{4, 5}));
}

TEST(DataIndexedDataset, EmptyDatasetOpens) {
  test::TempDir dir("idx");
  const std::string prefix = dir.path("empty");
  IndexedDatasetWriter writer(prefix, IndexedDType::kU16);
  writer.finalize();
  const IndexedDataset dataset(prefix);
  EXPECT_EQ(dataset.num_sequences(), 0);
  EXPECT_EQ(dataset.document_indices(), (std::vector<int64_t>{0}));
}

}  // namespace
}  // namespace moecore
