// Whole variable-length samples (data/sample_dataset.h) and their per-step packing into micro-batches
// (train/packed_samples.h): the JSONL and indexed forms and their refusals, a bin's rows by hand (tokens, labels, loss
// mask, positions restarting per sample, one document per sample, CP-aligned slots, the padding tail), the step's
// bins dealt over DP with padding bins, the serpentine order, and the per-epoch sample order.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <set>
#include <string>
#include <vector>

#include "moecore/data/indexed_dataset.h"
#include "moecore/data/sample_dataset.h"
#include "moecore/train/packed_samples.h"

namespace moecore {
namespace {

namespace fs = std::filesystem;

std::string temp_path(const std::string& name) {
  const fs::path dir = fs::temp_directory_path() / ("moecore_packed_samples_test_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  return (dir / name).string();
}

std::string write_jsonl(const std::string& name, const std::string& text) {
  const std::string path = temp_path(name);
  std::ofstream(path) << text;
  return path;
}

std::string data_error(const std::function<void()>& f) {
  try {
    f();
  } catch (const DataError& e) {
    return e.what();
  }
  return "";
}

// Samples of 5, 3, 2 and 4 tokens (ids 10.., 20.., 30.., 40..); the first with its 2 prompt tokens masked.
std::string four_samples() {
  return write_jsonl("four.jsonl",
                     "{\"tokens\": [10, 11, 12, 13, 14], \"loss_mask\": [0, 0, 1, 1, 1]}\n"
                     "{\"tokens\": [20, 21, 22]}\n"
                     "\n"
                     "{\"tokens\": [30, 31], \"loss_mask\": [1, 1]}\n"
                     "{\"tokens\": [40, 41, 42, 43], \"loss_mask\": [1, 0, 1, 0]}\n");
}

TEST(SampleDataset, ReadsJsonlAndIndexedForms) {
  const SampleDataset jsonl(four_samples(), 100);
  ASSERT_EQ(jsonl.size(), 4);
  EXPECT_EQ(jsonl.length(0), 5);
  EXPECT_EQ(jsonl.sample(1).loss_mask, (std::vector<uint8_t>{1, 1, 1}));  // no loss_mask: every token
  EXPECT_EQ(jsonl.sample(3).tokens, (std::vector<int32_t>{40, 41, 42, 43}));
  // The indexed form: PREFIX_tokens_document and PREFIX_loss_mask_document, one document per sample.
  const std::string prefix = temp_path("indexed");
  IndexedDatasetWriter tokens(prefix + "_tokens_document", IndexedDType::kU16);
  IndexedDatasetWriter masks(prefix + "_loss_mask_document", IndexedDType::kU16);
  for (int64_t i = 0; i < jsonl.size(); ++i) {
    const Sample s = jsonl.sample(i);
    tokens.add_document(s.tokens);
    masks.add_document(std::vector<int32_t>(s.loss_mask.begin(), s.loss_mask.end()));
  }
  tokens.finalize();
  masks.finalize();
  const SampleDataset indexed(prefix, 100);
  ASSERT_EQ(indexed.size(), 4);
  for (int64_t i = 0; i < 4; ++i) {
    EXPECT_EQ(indexed.sample(i).tokens, jsonl.sample(i).tokens);
    EXPECT_EQ(indexed.sample(i).loss_mask, jsonl.sample(i).loss_mask);
  }
}

TEST(SampleDataset, BadSamplesAreOneLineErrors) {
  const auto error_for = [](const std::string& text) {
    const std::string path = write_jsonl("bad.jsonl", text);
    return data_error([&] { SampleDataset(path, 100); }).substr(path.size());
  };
  EXPECT_EQ(error_for("{\"tokens\": [1]}\n"), ":1: the sample has 1 tokens (at least 2)");
  EXPECT_EQ(error_for("{\"tokens\": [1, 2]}\n{\"tokens\": [1, 100]}\n"),
            ":2: the sample token 1 is id 100, outside the vocabulary of 100");
  EXPECT_EQ(error_for("{\"tokens\": [1, 2], \"loss_mask\": [1]}\n"),
            ":1: the sample has 2 tokens but 1 loss-mask values");
  EXPECT_EQ(error_for("{\"tokens\": [1, 2], \"loss_mask\": [1, 2]}\n"),
            ":1: \"loss_mask\" must hold integers in [0, 1], got 2");
  EXPECT_EQ(error_for("{\"tokens\": [1, -2]}\n"), ":1: \"tokens\" must hold integers in [0, 2147483647], got -2");
  EXPECT_EQ(error_for("{\"text\": \"a\"}\n"), ":1: no \"tokens\"");
  EXPECT_EQ(error_for("{\"tokens\": 3}\n"), ":1: \"tokens\" must be a list of integers");
  EXPECT_NE(error_for("{\"tokens\": [1, 2]\n").find(":1: malformed JSON"), std::string::npos);
  EXPECT_EQ(error_for("\n"), ": no samples");
  EXPECT_EQ(data_error([] { SampleDataset(temp_path("missing.jsonl"), 100); }),
            temp_path("missing.jsonl") + ": no such file");
}

PackedSamplesOptions options(const bool pack, const int64_t cp = 1) {
  PackedSamplesOptions o;
  o.seq_length = 8;
  o.pack = pack;
  o.context_parallel_size = cp;
  return o;
}

// The step's samples in visiting order, whatever the shuffle: (k-th sample -> dataset index) from sample_index.
std::vector<int64_t> visited(const PackedSamples& packed, const int64_t first, const int64_t count) {
  std::vector<int64_t> out;
  for (int64_t k = first; k < first + count; ++k) out.push_back(packed.sample_index(k));
  return out;
}

TEST(PackedSamples, BinsHoldWholeSamplesAsTheirOwnDocuments) {
  const SampleDataset data(four_samples(), 100);
  const PackedSamples packed(data, options(true));
  const PackedStep step = packed.step(0, 4, 1, 0);
  EXPECT_EQ(step.samples, visited(packed, 0, 4));
  EXPECT_EQ(step.real_tokens, 14);
  EXPECT_EQ(step.squared_lengths, 25 + 9 + 4 + 16);
  // Next-fit decreasing into bins of 8 (5, 4, 3, 2): [5] (5 + 4 > 8 closes it), [4, 3] (7 + 2 > 8), [2].
  ASSERT_EQ(step.bins.size(), 3u);
  EXPECT_EQ(step.bins_per_rank, 3);
  EXPECT_EQ(step.padding_tokens, 3 * 8 - 14);
  // The bin holding the 4- and 3-token samples, by hand.
  int64_t local = -1;
  for (int64_t i = 0; i < 3; ++i) {
    if (step.bins[static_cast<size_t>(step.local_bins[static_cast<size_t>(i)])].lengths[0] == 4) local = i;
  }
  ASSERT_GE(local, 0);
  const Batch batch = packed.batch(step, local);
  EXPECT_EQ(batch.B, 1);
  EXPECT_EQ(batch.S, 8);
  EXPECT_EQ(batch.tokens_BS, (std::vector<int32_t>{40, 41, 42, 43, 20, 21, 22, 0}));
  EXPECT_EQ(batch.labels_BS, (std::vector<int32_t>{41, 42, 43, 0, 21, 22, 0, 0}));
  // Target j + 1's mask at position j; a sample's last token predicts nothing.
  EXPECT_EQ(batch.loss_mask_BS, (std::vector<float>{0, 1, 0, 0, 1, 1, 0, 0}));
  EXPECT_EQ(batch.position_ids_BS, (std::vector<int64_t>{0, 1, 2, 3, 0, 1, 2, 0}));
  EXPECT_EQ(batch.document_ids_BS, (std::vector<int32_t>{0, 0, 0, 0, 1, 1, 1, 2}));
}

TEST(PackedSamples, WithoutPackingEachSampleIsABinAndCpAlignsSlots) {
  const SampleDataset data(four_samples(), 100);
  const PackedStep alone = PackedSamples(data, options(false)).step(0, 4, 1, 0);
  EXPECT_EQ(alone.bins.size(), 4u);
  EXPECT_EQ(alone.padding_tokens, 4 * 8 - 14);
  // CP 2: slots of 4 (2 x CP): the 5-token sample takes 8 and fills a bin; 4 -> 4 and 3 -> 4 share one, 2 -> 4.
  const PackedSamples cp(data, options(true, 2));
  const PackedStep step = cp.step(0, 4, 1, 0);
  ASSERT_EQ(step.bins.size(), 3u);
  int64_t checked = 0;
  for (int64_t i = 0; i < 3; ++i) {
    const PackedBin& bin = step.bins[static_cast<size_t>(step.local_bins[static_cast<size_t>(i)])];
    if (bin.lengths.size() != 2 || bin.lengths[0] != 4) continue;
    const Batch batch = cp.batch(step, i);
    // [4-token sample | 3-token sample + 1 alignment token], the alignment token in its sample's document.
    EXPECT_EQ(bin.slot_lengths, (std::vector<int64_t>{4, 4}));
    EXPECT_EQ(batch.document_ids_BS, (std::vector<int32_t>{0, 0, 0, 0, 1, 1, 1, 1}));
    EXPECT_EQ(batch.loss_mask_BS[7], 0.0f);
    EXPECT_EQ(batch.labels_BS[7], 0);
    ++checked;
  }
  EXPECT_EQ(checked, 1);
}

TEST(PackedSamples, StepsDealBinsOverRanksWithPaddingBins) {
  const SampleDataset data(four_samples(), 100);
  PackedSamplesOptions o = options(true);
  o.max_sequences_per_bin = 1;  // four bins over three ranks: two ranks get a padding bin
  const PackedSamples packed(data, o);
  std::multiset<int64_t> seen;
  for (int rank = 0; rank < 3; ++rank) {
    const PackedStep step = packed.step(0, 4, 3, rank);
    EXPECT_EQ(step.bins_per_rank, 2);
    EXPECT_EQ(step.padding_bins, 2);
    EXPECT_EQ(step.padding_tokens, 6 * 8 - 14);
    for (const int64_t b : step.local_bins) seen.insert(b);
    for (int64_t i = 0; i < 2; ++i) {
      if (step.local_bins[static_cast<size_t>(i)] >= 0) continue;
      const Batch empty = packed.batch(step, i);
      EXPECT_EQ(empty.loss_mask_BS, std::vector<float>(8, 0.0f));  // a padding bin trains nothing
    }
  }
  EXPECT_EQ(seen, (std::multiset<int64_t>{-1, -1, 0, 1, 2, 3}));  // fifo: 0 1 | 2 3 | pad pad
}

TEST(PackedSamples, SerpentineOrdersEachRanksBinsByAttentionCost) {
  // Bins of one sample each (lengths 5, 3, 2, 4: costs 25, 9, 4, 16): small-large-small = 4, 16, 25, 9.
  const SampleDataset data(four_samples(), 100);
  PackedSamplesOptions o = options(false);
  o.serpentine = true;
  const PackedSamples packed(data, o);
  const PackedStep step = packed.step(0, 4, 1, 0);
  std::vector<int64_t> lengths;
  for (const int64_t b : step.local_bins) lengths.push_back(step.bins[static_cast<size_t>(b)].lengths[0]);
  EXPECT_EQ(lengths, (std::vector<int64_t>{2, 4, 5, 3}));
}

TEST(PackedSamples, EpochsVisitEverySampleOnceInASeededOrder) {
  const SampleDataset data(four_samples(), 100);
  const PackedSamples packed(data, options(true));
  for (int64_t epoch = 0; epoch < 3; ++epoch) {
    std::vector<int64_t> order = visited(packed, epoch * 4, 4);
    std::sort(order.begin(), order.end());
    EXPECT_EQ(order, (std::vector<int64_t>{0, 1, 2, 3}));
  }
  EXPECT_NE(visited(packed, 0, 12), visited(PackedSamples(data,
                                                          [] {
                                                            PackedSamplesOptions o = options(true);
                                                            o.seed = 99;
                                                            return o;
                                                          }()),
                                            0, 12));
  // A step across an epoch boundary continues into the next epoch's order.
  EXPECT_EQ(packed.step(2, 4, 1, 0).samples, visited(packed, 2, 4));
  PackedSamplesOptions short_bins = options(true);
  short_bins.seq_length = 4;
  EXPECT_NE(
      data_error([&] { PackedSamples(data, short_bins); }).find("sample 0 has 5 tokens, more than --seq-length 4"),
      std::string::npos);
}

}  // namespace
}  // namespace moecore
