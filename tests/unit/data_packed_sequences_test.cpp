// Packed sequences: per-token position ids, document ids and loss mask of a sample (Megatron's gpt_dataset.py
// _get_ltor_masks_and_position_ids under --reset-position-ids / --reset-attention-mask / --eod-mask-loss), the THD
// cu_seqlens derived from the document ids, and the batches GPTDataProvider serves with them (files and mock data).
//
// Independent references used below:
//  - hand-worked examples: Megatron's loop run by hand on each token list (worked next to each case);
//  - a literal transcription of Megatron's rules in this file (the dense [S, S] mask built as a tril of ones with
//    mask[i+1:, :i+1] = 0 for every EOD i, and position_ids[i+1:] -= i + 1 - prev), compared on random samples.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "moecore/data/data_loader.h"
#include "moecore/data/indexed_dataset.h"
#include "moecore/data/packed_sequences.h"
#include "test_temp_dir.h"

namespace moecore {
namespace {

constexpr int32_t kEod = 0;

struct SampleIds {
  std::vector<int64_t> positions;
  std::vector<int32_t> documents;
  std::vector<float> loss_mask;
};

SampleIds run(const std::vector<int32_t>& tokens, const SampleMaskOptions& options) {
  SampleIds ids{std::vector<int64_t>(tokens.size()), std::vector<int32_t>(tokens.size()),
                std::vector<float>(tokens.size())};
  ltor_masks_and_position_ids(tokens, options, ids.positions, ids.documents, ids.loss_mask);
  return ids;
}

SampleMaskOptions all_flags() {
  SampleMaskOptions options;
  options.eod_id = kEod;
  options.reset_position_ids = true;
  options.reset_attention_mask = true;
  options.eod_mask_loss = true;
  return options;
}

// --- hand-worked examples -----------------------------------------------------------------------------------------

struct WorkedExample {
  const char* what;
  std::vector<int32_t> tokens;
  std::vector<int64_t> positions;  // with --reset-position-ids
  std::vector<int32_t> documents;  // with --reset-attention-mask
  std::vector<int32_t> cu_seqlens;
};

// EOD = 0. Positions by Megatron's loop (prev = 0; for each EOD i: pos[i+1:] -= i + 1 - prev; prev = i + 1);
// documents by its mask (for each EOD i: mask[i+1:, :i+1] = 0), i.e. the first token after each EOD opens a document.
const std::vector<WorkedExample>& worked_examples() {
  static const std::vector<WorkedExample> examples = {
      // EODs at 0 (start), 3 (middle), 5 and 6 (two in a row). Positions: i=0: pos[1:] -= 1 -> 0 0 1 2 3 4 5 6;
      // i=3: pos[4:] -= 3 -> 0 0 1 2 0 1 2 3; i=5: pos[6:] -= 2 -> .. 0 1; i=6: pos[7:] -= 1 -> .. 0 0.
      {"start, middle, two in a row",
       {0, 5, 6, 0, 7, 0, 0, 8},
       {0, 0, 1, 2, 0, 1, 0, 0},
       {0, 1, 1, 1, 2, 2, 3, 4},
       {0, 1, 4, 6, 7, 8}},
      // EOD only at the last index: pos[8:] and mask[8:, :8] are empty, nothing changes.
      {"end only", {3, 4, 5, 6, 7, 8, 9, 0}, {0, 1, 2, 3, 4, 5, 6, 7}, {0, 0, 0, 0, 0, 0, 0, 0}, {0, 8}},
      // i=2: pos[3:] -= 3 -> 0 1 2 0 1 2 3 4; i=3: pos[4:] -= 1 -> 0 1 2 0 0 1 2 3. The second EOD is a
      // one-token document of its own.
      {"two in a row in the middle",
       {1, 2, 0, 0, 3, 4, 5, 6},
       {0, 1, 2, 0, 0, 1, 2, 3},
       {0, 0, 0, 1, 2, 2, 2, 2},
       {0, 3, 4, 8}},
      // Middle and last: i=1: pos[2:] -= 2 -> 0 1 0 1 2; i=4 changes nothing.
      {"middle and end", {2, 0, 3, 4, 0}, {0, 1, 0, 1, 2}, {0, 0, 1, 1, 1}, {0, 2, 5}},
      {"no EOD", {1, 2, 3, 4}, {0, 1, 2, 3}, {0, 0, 0, 0}, {0, 4}},
      {"only EODs", {0, 0, 0}, {0, 0, 0}, {0, 1, 2}, {0, 1, 2, 3}},
  };
  return examples;
}

TEST(DataPackedSequences, HandWorkedMegatronExamples) {
  for (const WorkedExample& example : worked_examples()) {
    const SampleIds ids = run(example.tokens, all_flags());
    EXPECT_EQ(ids.positions, example.positions) << example.what;
    EXPECT_EQ(ids.documents, example.documents) << example.what;
    for (size_t t = 0; t < example.tokens.size(); ++t) {
      EXPECT_EQ(ids.loss_mask[t], example.tokens[t] == kEod ? 0.0f : 1.0f) << example.what << " token " << t;
    }
    EXPECT_EQ(cu_seqlens_from_document_ids(ids.documents), example.cu_seqlens) << example.what;
  }
}

TEST(DataPackedSequences, FlagsAreIndependent) {
  const std::vector<int32_t> tokens = {0, 5, 6, 0, 7, 0, 0, 8};
  const std::vector<int64_t> identity = {0, 1, 2, 3, 4, 5, 6, 7};
  const std::vector<int32_t> one_document(8, 0);
  const std::vector<float> ones(8, 1.0f);

  SampleMaskOptions none;
  none.eod_id = kEod;
  SampleIds ids = run(tokens, none);
  EXPECT_EQ(ids.positions, identity);
  EXPECT_EQ(ids.documents, one_document);
  EXPECT_EQ(ids.loss_mask, ones);

  SampleMaskOptions positions_only = none;
  positions_only.reset_position_ids = true;
  ids = run(tokens, positions_only);
  EXPECT_EQ(ids.positions, (std::vector<int64_t>{0, 0, 1, 2, 0, 1, 0, 0}));
  EXPECT_EQ(ids.documents, one_document);
  EXPECT_EQ(ids.loss_mask, ones);

  SampleMaskOptions documents_only = none;
  documents_only.reset_attention_mask = true;
  ids = run(tokens, documents_only);
  EXPECT_EQ(ids.positions, identity);
  EXPECT_EQ(ids.documents, (std::vector<int32_t>{0, 1, 1, 1, 2, 2, 3, 4}));
  EXPECT_EQ(ids.loss_mask, ones);

  SampleMaskOptions loss_only = none;
  loss_only.eod_mask_loss = true;
  ids = run(tokens, loss_only);
  EXPECT_EQ(ids.positions, identity);
  EXPECT_EQ(ids.documents, one_document);
  EXPECT_EQ(ids.loss_mask, (std::vector<float>{0, 1, 1, 0, 1, 0, 0, 1}));

  // Another EOD id: 0 is then an ordinary token.
  SampleMaskOptions other_eod = all_flags();
  other_eod.eod_id = 7;
  ids = run(tokens, other_eod);
  EXPECT_EQ(ids.positions, (std::vector<int64_t>{0, 1, 2, 3, 4, 0, 1, 2}));
  EXPECT_EQ(ids.documents, (std::vector<int32_t>{0, 0, 0, 0, 0, 1, 1, 1}));
  EXPECT_EQ(ids.loss_mask, (std::vector<float>{1, 1, 1, 1, 0, 1, 1, 1}));
}

// Megatron's rules transcribed literally: dense mask (true = may attend) and the position loop.
struct DenseMegatron {
  std::vector<std::vector<bool>> attend;  // [q][k]
  std::vector<int64_t> positions;
};

DenseMegatron dense_megatron(const std::vector<int32_t>& tokens, const int32_t eod = kEod) {
  const size_t S = tokens.size();
  DenseMegatron out{std::vector<std::vector<bool>>(S, std::vector<bool>(S, false)), std::vector<int64_t>(S)};
  for (size_t q = 0; q < S; ++q) {
    for (size_t k = 0; k <= q; ++k) out.attend[q][k] = true;  // tril
  }
  std::iota(out.positions.begin(), out.positions.end(), int64_t{0});
  int64_t prev = 0;
  for (size_t i = 0; i < S; ++i) {
    if (tokens[i] != eod) continue;
    for (size_t q = i + 1; q < S; ++q) {
      for (size_t k = 0; k <= i; ++k) out.attend[q][k] = false;
    }
    const auto shift = static_cast<int64_t>(i) + 1 - prev;
    for (size_t t = i + 1; t < S; ++t) out.positions[t] -= shift;
    prev = static_cast<int64_t>(i) + 1;
  }
  return out;
}

TEST(DataPackedSequences, DocumentIdsEqualMegatronsDenseMaskOnRandomSamples) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 200; ++trial) {
    const size_t S = 1 + rng() % 40;
    const unsigned eod_percent = 5 + rng() % 50;
    std::vector<int32_t> tokens(S);
    for (int32_t& token : tokens) token = rng() % 100 < eod_percent ? kEod : 1 + static_cast<int32_t>(rng() % 9);
    const SampleIds ids = run(tokens, all_flags());
    const DenseMegatron reference = dense_megatron(tokens);
    EXPECT_EQ(ids.positions, reference.positions) << "trial " << trial;
    for (size_t q = 0; q < S; ++q) {
      for (size_t k = 0; k < S; ++k) {
        const bool attends = k <= q && ids.documents[q] == ids.documents[k];
        ASSERT_EQ(attends, reference.attend[q][k]) << "trial " << trial << " q " << q << " k " << k;
      }
    }
    // cu_seqlens cut exactly where the document id changes, and each document's positions restart at 0.
    const std::vector<int32_t> cu = cu_seqlens_from_document_ids(ids.documents);
    ASSERT_EQ(cu.front(), 0);
    ASSERT_EQ(cu.back(), static_cast<int32_t>(S));
    ASSERT_EQ(cu.size(), static_cast<size_t>(ids.documents.back()) + 2);
    for (size_t d = 0; d + 1 < cu.size(); ++d) {
      for (int32_t t = cu[d]; t < cu[d + 1]; ++t) {
        EXPECT_EQ(ids.documents[static_cast<size_t>(t)], static_cast<int32_t>(d));
        EXPECT_EQ(ids.positions[static_cast<size_t>(t)], t - cu[d]);
      }
    }
  }
}

TEST(DataPackedSequences, OutputSizesMustMatch) {
  const std::vector<int32_t> tokens = {1, 2, 3};
  std::vector<int64_t> positions(3);
  std::vector<int32_t> documents(2);
  std::vector<float> loss_mask(3);
  test::expect_error_containing<DataError>(
      [&] { ltor_masks_and_position_ids(tokens, all_flags(), positions, documents, loss_mask); }, "hold 3 tokens");
}

// --- cu_seqlens ---------------------------------------------------------------------------------------------------

TEST(DataPackedSequences, CuSeqlensOfOneSample) {
  EXPECT_EQ(cu_seqlens_from_document_ids(std::vector<int32_t>{0, 0, 0}), (std::vector<int32_t>{0, 3}));
  EXPECT_EQ(cu_seqlens_from_document_ids(std::vector<int32_t>{0, 1, 1, 2}), (std::vector<int32_t>{0, 1, 3, 4}));
  EXPECT_EQ(cu_seqlens_from_document_ids(std::vector<int32_t>{}), (std::vector<int32_t>{0}));
  for (const std::vector<int32_t>& bad : {std::vector<int32_t>{1, 1}, std::vector<int32_t>{0, 2},
                                          std::vector<int32_t>{0, 1, 0}, std::vector<int32_t>{0, -1}}) {
    test::expect_error_containing<DataError>([&] { cu_seqlens_from_document_ids(bad); },
                                             "ids must count documents from 0 in order");
  }
}

TEST(DataPackedSequences, PackedCuSeqlensFlattenTheMicroBatch) {
  // Two samples of S = 4: documents [0 0 1 1] -> 0 2 4; [0 1 2 2] -> 0 1 2 4, shifted by 4 -> 5 6 8.
  const std::vector<int32_t> documents_BS = {0, 0, 1, 1, 0, 1, 2, 2};
  const std::vector<int32_t> cu = packed_cu_seqlens(documents_BS, 2, 4);
  EXPECT_EQ(cu, (std::vector<int32_t>{0, 2, 4, 5, 6, 8}));
  EXPECT_EQ(max_seqlen(cu), 2);
  // Without document resets every sample is one sequence.
  EXPECT_EQ(packed_cu_seqlens(std::vector<int32_t>(12, 0), 3, 4), (std::vector<int32_t>{0, 4, 8, 12}));
  EXPECT_EQ(max_seqlen(std::vector<int32_t>{0, 3, 4, 9}), 5);
  EXPECT_EQ(max_seqlen(std::vector<int32_t>{0}), 0);
  test::expect_error_containing<DataError>([&] { packed_cu_seqlens(documents_BS, 3, 4); },
                                           "8 document ids for a [3, 4] batch");
}

TEST(DataPackedSequences, SeqlenStatsCountDocumentsOfEverySample) {
  // Documents of lengths 2, 2 | 1, 1, 2: 8 tokens, sum of squares 4 + 4 + 1 + 1 + 4 = 14.
  const SeqlenStats packed = seqlen_stats(std::vector<int32_t>{0, 0, 1, 1, 0, 1, 2, 2}, 2, 4);
  EXPECT_EQ(packed.tokens, 8);
  EXPECT_EQ(packed.squared_sum, 14);
  // One document per sample: B * S tokens, B * S^2.
  const SeqlenStats whole = seqlen_stats(std::vector<int32_t>(12, 0), 3, 4);
  EXPECT_EQ(whole.tokens, 12);
  EXPECT_EQ(whole.squared_sum, 48);
  SeqlenStats sum = packed;
  sum += whole;
  EXPECT_EQ(sum.tokens, 20);
  EXPECT_EQ(sum.squared_sum, 62);
}

// --- GPTDataProvider ----------------------------------------------------------------------------------------------

// Documents of random length 1..6 (ids 1..9), each ending with EOD, so samples of 8 tokens hold several.
std::string write_short_documents(const test::TempDir& dir) {
  const std::string prefix = dir.path("packed_text_document");
  IndexedDatasetWriter writer(prefix, IndexedDType::kU16);
  std::mt19937 rng(5);
  for (int d = 0; d < 60; ++d) {
    std::vector<int32_t> tokens(rng() % 6);  // may be empty: the document is a lone EOD
    for (int32_t& token : tokens) token = 1 + static_cast<int32_t>(rng() % 9);
    tokens.push_back(kEod);
    writer.add_document(tokens);
  }
  writer.finalize();
  return prefix;
}

DataOptions file_options(const std::string& prefix) {
  DataOptions options;
  options.data_path = {prefix};
  options.split = "1,0,0";
  options.seq_length = 8;
  options.vocab_size = 16;
  options.eod_id = kEod;
  return options;
}

// Every sample's ids equal the function's on its tokens, and the reference rules of this file.
void expect_batch_follows_megatron(const Batch& batch, const SampleMaskOptions& options, const char* what) {
  const size_t S = static_cast<size_t>(batch.S);
  ASSERT_EQ(batch.position_ids_BS.size(), static_cast<size_t>(batch.B) * S) << what;
  ASSERT_EQ(batch.document_ids_BS.size(), static_cast<size_t>(batch.B) * S) << what;
  for (int64_t b = 0; b < batch.B; ++b) {
    const auto first = batch.tokens_BS.begin() + b * batch.S;
    const std::vector<int32_t> tokens(first, first + batch.S);
    const DenseMegatron reference = dense_megatron(tokens, options.eod_id);
    for (size_t t = 0; t < S; ++t) {
      const size_t at = static_cast<size_t>(b) * S + t;
      const bool eod = tokens[t] == options.eod_id;
      EXPECT_EQ(batch.position_ids_BS[at], options.reset_position_ids ? reference.positions[t] : int64_t(t)) << what;
      EXPECT_EQ(batch.loss_mask_BS[at], options.eod_mask_loss && eod ? 0.0f : 1.0f) << what;
      if (!options.reset_attention_mask) {
        EXPECT_EQ(batch.document_ids_BS[at], 0) << what;
      } else {
        for (size_t k = 0; k < S; ++k) {
          const bool attends =
              k <= t && batch.document_ids_BS[at] == batch.document_ids_BS[static_cast<size_t>(b) * S + k];
          EXPECT_EQ(attends, reference.attend[t][k]) << what << " sample " << b << " q " << t << " k " << k;
        }
      }
    }
  }
}

TEST(DataPackedSequences, ProviderFillsIdsFromFiles) {
  test::TempDir dir("packed");
  const std::string prefix = write_short_documents(dir);
  DataOptions options = file_options(prefix);
  const GPTDataProvider plain = GPTDataProvider::build(options, 16, 0, 0);
  const Batch plain_batch = plain.get_batch(DatasetSplit::kTrain, 0, 16);
  SampleMaskOptions masks;
  masks.eod_id = kEod;
  expect_batch_follows_megatron(plain_batch, masks, "no flags");

  options.reset_position_ids = true;
  options.reset_attention_mask = true;
  options.eod_mask_loss = true;
  const GPTDataProvider packed = GPTDataProvider::build(options, 16, 0, 0);
  const Batch batch = packed.get_batch(DatasetSplit::kTrain, 0, 16);
  // The flags change the ids and the loss mask, never the tokens or labels.
  EXPECT_EQ(batch.tokens_BS, plain_batch.tokens_BS);
  EXPECT_EQ(batch.labels_BS, plain_batch.labels_BS);
  expect_batch_follows_megatron(batch, all_flags(), "all flags");
  EXPECT_GT(*std::max_element(batch.document_ids_BS.begin(), batch.document_ids_BS.end()), 1);
  const std::vector<int32_t> cu = packed_cu_seqlens(batch.document_ids_BS, batch.B, batch.S);
  EXPECT_GT(cu.size(), static_cast<size_t>(batch.B) + 1);  // more documents than samples
  EXPECT_EQ(cu.back(), 16 * 8);

  options.eod_mask_loss = false;
  options.reset_attention_mask = false;
  const Batch positions_only = GPTDataProvider::build(options, 16, 0, 0).get_batch(DatasetSplit::kTrain, 0, 16);
  SampleMaskOptions positions_masks = masks;
  positions_masks.reset_position_ids = true;
  expect_batch_follows_megatron(positions_only, positions_masks, "positions only");
}

TEST(DataPackedSequences, MockDataHoldsEodsAndPacks) {
  DataOptions options;
  options.mock_data = true;
  options.seq_length = 64;
  options.vocab_size = 128;
  options.eod_id = 127;
  options.mock_num_sequences = 300;
  options.mock_max_sequence_length = 24;  // ~1 EOD per 12 tokens
  options.reset_position_ids = true;
  options.reset_attention_mask = true;
  const GPTDataProvider provider = GPTDataProvider::build(options, 32, 8, 8);
  const Batch batch = provider.get_batch(DatasetSplit::kTrain, 0, 32);
  const auto eods = std::count(batch.tokens_BS.begin(), batch.tokens_BS.end(), 127);
  EXPECT_GT(eods, 32 * 64 / 24);
  SampleMaskOptions masks;
  masks.eod_id = 127;
  masks.reset_position_ids = true;
  masks.reset_attention_mask = true;
  expect_batch_follows_megatron(batch, masks, "mock");

  // Megatron's defaults for the mock sizes (sequences up to 4096 tokens): EODs still appear in the stream.
  DataOptions defaults = options;
  defaults.mock_max_sequence_length = DataOptions{}.mock_max_sequence_length;
  defaults.mock_num_sequences = DataOptions{}.mock_num_sequences;
  defaults.seq_length = 512;
  const Batch long_batch = GPTDataProvider::build(defaults, 32, 1, 1).get_batch(DatasetSplit::kTrain, 0, 32);
  EXPECT_GT(std::count(long_batch.tokens_BS.begin(), long_batch.tokens_BS.end(), 127), 0);
  EXPECT_GT(*std::max_element(long_batch.document_ids_BS.begin(), long_batch.document_ids_BS.end()), 0);
}

}  // namespace
}  // namespace moecore
