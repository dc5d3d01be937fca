// Megatron-RL sequence packing (data/sequence_packing.h): next-fit-decreasing bins, their position ids and THD
// boundaries, the fifo / round-robin dealing of bins to data-parallel ranks, the packing-aware micro-batch count,
// and moecore's serpentine attention-cost order.
//
// Two independent references:
//  - hand derivations, worked in the comments next to each case;
//  - Megatron's own code, run on the same inputs by
//      /usr/bin/python3 tests/oracle/megatron_rl_packing_reference.py
//    (Megatron-LM commit d98e8a64ddf34856e74b24714e3bedb2f5a39553); the values marked "Megatron:" are its output,
//    pasted. Megatron's seq_starts are a bin's offsets followed by its padded end.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <stdexcept>
#include <vector>

#include "moecore/data/indexed_dataset.h"
#include "moecore/data/sequence_packing.h"

namespace moecore {
namespace {

using Lists = std::vector<std::vector<int64_t>>;

Lists sample_ids_of(const std::vector<PackedBin>& bins) {
  Lists ids;
  for (const PackedBin& bin : bins) ids.push_back(bin.sample_ids);
  return ids;
}

// Megatron's PackingInfo.seq_starts: every offset, then the padded end.
Lists seq_starts_of(const std::vector<PackedBin>& bins) {
  Lists starts;
  for (const PackedBin& bin : bins) {
    starts.push_back(bin.offsets);
    starts.back().push_back(bin.padded_end());
  }
  return starts;
}

Lists position_ids_of(const std::vector<PackedBin>& bins, const int64_t bin_size) {
  Lists positions;
  for (const PackedBin& bin : bins) positions.push_back(bin_position_ids(bin, bin_size));
  return positions;
}

std::vector<std::vector<int32_t>> cu_of(const std::vector<PackedBin>& bins, const int64_t bin_size,
                                        const int64_t fixed_entries, const bool padded) {
  std::vector<std::vector<int32_t>> cu;
  for (const PackedBin& bin : bins) {
    const BinCuSeqlens both = bin_cu_seqlens(bin, bin_size, fixed_entries);
    cu.push_back(padded ? both.padded : both.actual);
  }
  return cu;
}

// Per rank, the global bin index of each local bin, -1 for an empty padding bin (the oracle's format).
Lists local_bins(const std::vector<RankBins>& ranks) {
  Lists out;
  for (const RankBins& rank : ranks) {
    out.push_back(rank.bin_indices);
    out.back().insert(out.back().end(), static_cast<size_t>(rank.num_padding_bins), -1);
  }
  return out;
}

TEST(SequencePacking, NextFitDecreasingMatchesMegatron) {
  // Lengths by id: 5 9 3 7 2 9 4 1; bin 16. Sorted longest first, equal lengths in id order:
  // 9(1) 9(5) 7(3) 5(0) 4(6) 3(2) 2(4) 1(7).
  //   bin 0: 9(1); 9 + 9(5) = 18 > 16 closes it.
  //   bin 1: 9(5) + 7(3) = 16 fits exactly; + 5(0) = 21 closes it.
  //   bin 2: 5(0) + 4(6) + 3(2) + 2(4) + 1(7) = 15.
  // First-fit would have put 5(0) into bin 0 (9 + 5 = 14): Megatron keeps only the open bin (next-fit).
  const std::vector<int64_t> lengths = {5, 9, 3, 7, 2, 9, 4, 1};
  const auto bins = pack_sequences(lengths, {.bin_size = 16, .max_sequences_per_bin = 6});
  // Megatron:
  EXPECT_EQ(sample_ids_of(bins), (Lists{{1}, {5, 3}, {0, 6, 2, 4, 7}}));
  EXPECT_EQ(seq_starts_of(bins), (Lists{{0, 9}, {0, 9, 16}, {0, 5, 9, 12, 14, 15}}));
  EXPECT_EQ(position_ids_of(bins, 16), (Lists{{0, 1, 2, 3, 4, 5, 6, 7, 8, 0, 0, 0, 0, 0, 0, 0},
                                              {0, 1, 2, 3, 4, 5, 6, 7, 8, 0, 1, 2, 3, 4, 5, 6},
                                              {0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1, 2, 0, 1, 0, 0}}));
  // cu_seqlens padded to max_sequences_per_bin + 2 = 8 entries; with alignment 1 the padded layout equals them.
  const std::vector<std::vector<int32_t>> cu = {
      {0, 9, 16, 16, 16, 16, 16, 16}, {0, 9, 16, 16, 16, 16, 16, 16}, {0, 5, 9, 12, 14, 15, 16, 16}};
  EXPECT_EQ(cu_of(bins, 16, 8, false), cu);
  EXPECT_EQ(cu_of(bins, 16, 8, true), cu);

  EXPECT_EQ(bins[1].lengths, (std::vector<int64_t>{9, 7}));
  EXPECT_EQ(bins[1].slot_lengths, (std::vector<int64_t>{9, 7}));
  // Unpadded: the samples' boundaries, then the pad tail as one more sequence (16 - 15 = 1 token in bin 2).
  EXPECT_EQ(bin_cu_seqlens(bins[2], 16).actual, (std::vector<int32_t>{0, 5, 9, 12, 14, 15, 16}));
  EXPECT_EQ(bin_cu_seqlens(bins[1], 16).actual, (std::vector<int32_t>{0, 9, 16, 16}));
}

TEST(SequencePacking, ContextParallelSlotsMatchMegatron) {
  // CP 2: slots align to 2 * 2 = 4. Lengths by id 5 3 6 2 7 1 -> slots 8 4 8 4 8 4; bin 16, at most 4 per bin.
  // Sorted: 7(4) 6(2) 5(0) 3(1) 2(3) 1(5).
  //   bin 0: 8 + 8 = 16: 7(4) at 0, 6(2) at 8; 5(0) (slot 8) closes it.
  //   bin 1: 5(0) at 0, 3(1) at 8, 2(3) at 12: 16; 1(5) closes it.
  //   bin 2: 1(5) at 0, padded end 4, a pad tail of 12.
  const std::vector<int64_t> lengths = {5, 3, 6, 2, 7, 1};
  const auto bins = pack_sequences(lengths, {.bin_size = 16, .max_sequences_per_bin = 4, .context_parallel_size = 2});
  EXPECT_EQ(packing_alignment(2), 4);
  // Megatron:
  EXPECT_EQ(sample_ids_of(bins), (Lists{{4, 2}, {0, 1, 3}, {5}}));
  EXPECT_EQ(seq_starts_of(bins), (Lists{{0, 8, 16}, {0, 8, 12, 16}, {0, 4}}));
  EXPECT_EQ(position_ids_of(bins, 16), (Lists{{0, 1, 2, 3, 4, 5, 6, 0, 0, 1, 2, 3, 4, 5, 0, 0},
                                              {0, 1, 2, 3, 4, 0, 0, 0, 0, 1, 2, 0, 0, 1, 0, 0},
                                              {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}}));
  // cu_seqlens count real tokens (bin 2: 1, then the tail 16 - 4 = 12); the padded ones mark the slots.
  EXPECT_EQ(cu_of(bins, 16, 6, false),
            (std::vector<std::vector<int32_t>>{{0, 7, 13, 13, 13, 13}, {0, 5, 8, 10, 10, 10}, {0, 1, 13, 13, 13, 13}}));
  EXPECT_EQ(cu_of(bins, 16, 6, true), (std::vector<std::vector<int32_t>>{
                                          {0, 8, 16, 16, 16, 16}, {0, 8, 12, 16, 16, 16}, {0, 4, 16, 16, 16, 16}}));
  EXPECT_EQ(bins[1].slot_lengths, (std::vector<int64_t>{8, 4, 4}));
  EXPECT_EQ(bins[1].lengths, (std::vector<int64_t>{5, 3, 2}));
  for (const PackedBin& bin : bins) {
    for (size_t s = 0; s < bin.sample_ids.size(); ++s) EXPECT_EQ(bin.offsets[s] % 4, 0);
  }
}

TEST(SequencePacking, MaxSequencesPerBinAndEmptySamplesMatchMegatron) {
  // Eight samples of 10 tokens but sample 2 has none (Megatron: an all-pad row); bin 100 would hold all of them,
  // but at most 3 per bin. Sorted: the 10s in id order 0 1 3 4 5 6 7, then 0(2).
  //   bin 0: 0 1 3; bin 1: 4 5 6; bin 2: 7 and the empty 2 (slot 0, at offset 10).
  const std::vector<int64_t> lengths = {10, 10, 0, 10, 10, 10, 10, 10};
  const auto bins = pack_sequences(lengths, {.bin_size = 100, .max_sequences_per_bin = 3});
  // Megatron:
  EXPECT_EQ(sample_ids_of(bins), (Lists{{0, 1, 3}, {4, 5, 6}, {7, 2}}));
  EXPECT_EQ(seq_starts_of(bins), (Lists{{0, 10, 20, 30}, {0, 10, 20, 30}, {0, 10, 10}}));
  const std::vector<std::vector<int32_t>> cu = {{0, 10, 20, 30, 100}, {0, 10, 20, 30, 100}, {0, 10, 10, 100, 100}};
  EXPECT_EQ(cu_of(bins, 100, 5, false), cu);
  EXPECT_EQ(cu_of(bins, 100, 5, true), cu);
}

TEST(SequencePacking, SamplesFillingTheBinMatchMegatron) {
  // Bin 8, lengths 8 1 8 7: 8(0) and 8(2) fill a bin each; 7(3) + 1(1) = 8.
  const std::vector<int64_t> lengths = {8, 1, 8, 7};
  const auto bins = pack_sequences(lengths, {.bin_size = 8});
  // Megatron:
  EXPECT_EQ(sample_ids_of(bins), (Lists{{0}, {2}, {3, 1}}));
  EXPECT_EQ(seq_starts_of(bins), (Lists{{0, 8}, {0, 8}, {0, 7, 8}}));
  EXPECT_EQ(position_ids_of(bins, 8),
            (Lists{{0, 1, 2, 3, 4, 5, 6, 7}, {0, 1, 2, 3, 4, 5, 6, 7}, {0, 1, 2, 3, 4, 5, 6, 0}}));
  // A full bin has a ghost tail of length 0 (its last boundary repeats).
  EXPECT_EQ(bin_cu_seqlens(bins[0], 8).actual, (std::vector<int32_t>{0, 8, 8}));
}

// Lengths by id 9 8 7 6 6 5 5 4 3 2, bin 10: 9 | 8 | 7 | 6(3) | 6(4) | 5(5) + 5(6) = 10 | 4 + 3 + 2 = 9.
const std::vector<int64_t> kSevenBinLengths = {9, 8, 7, 6, 6, 5, 5, 4, 3, 2};

TEST(SequencePacking, SevenBinsMatchMegatron) {
  const auto bins = pack_sequences(kSevenBinLengths, {.bin_size = 10});
  // Megatron:
  EXPECT_EQ(sample_ids_of(bins), (Lists{{0}, {1}, {2}, {3}, {4}, {5, 6}, {7, 8, 9}}));
  EXPECT_EQ(seq_starts_of(bins), (Lists{{0, 9}, {0, 8}, {0, 7}, {0, 6}, {0, 6}, {0, 5, 10}, {0, 4, 7, 9}}));
  EXPECT_EQ(position_ids_of(bins, 10), (Lists{{0, 1, 2, 3, 4, 5, 6, 7, 8, 0},
                                              {0, 1, 2, 3, 4, 5, 6, 7, 0, 0},
                                              {0, 1, 2, 3, 4, 5, 6, 0, 0, 0},
                                              {0, 1, 2, 3, 4, 5, 0, 0, 0, 0},
                                              {0, 1, 2, 3, 4, 5, 0, 0, 0, 0},
                                              {0, 1, 2, 3, 4, 0, 1, 2, 3, 4},
                                              {0, 1, 2, 3, 0, 1, 2, 0, 1, 0}}));
}

TEST(SequencePacking, EmptyBinIsOneSequenceOfPadding) {
  // Megatron gives an empty (padding) bin no PackedSeqParams; the forward pass then uses
  // get_default_packed_seq_params(seq_length 16, max_sequences_per_bin 4) = {0, 16, 16, 16, 16, 16}.
  const PackedBin empty;
  EXPECT_EQ(empty.padded_end(), 0);
  EXPECT_EQ(bin_cu_seqlens(empty, 16, 6).actual, (std::vector<int32_t>{0, 16, 16, 16, 16, 16}));
  EXPECT_EQ(bin_cu_seqlens(empty, 16).padded, (std::vector<int32_t>{0, 16}));
  EXPECT_EQ(bin_position_ids(empty, 4), (std::vector<int64_t>{0, 0, 0, 0}));
}

TEST(SequencePacking, NoSamplesGiveNoBins) { EXPECT_TRUE(pack_sequences({}, {.bin_size = 8}).empty()); }

TEST(SequencePacking, DistributionMatchesMegatron) {
  // 7 bins over DP 3. fifo: 7 = 3 * 2 + 1, so rank 0 takes 3 contiguous bins, ranks 1 and 2 take 2 and one
  // padding bin each. round-robin: rank r takes r, r + 3, r + 6. Every rank runs ceil(7 / 3) = 3 bins.
  // Megatron (per rank, global bin per local bin, -1 an empty padding bin):
  EXPECT_EQ(local_bins(distribute_packed_bins(7, 3, BinDistribution::kFifo)),
            (Lists{{0, 1, 2}, {3, 4, -1}, {5, 6, -1}}));
  EXPECT_EQ(local_bins(distribute_packed_bins(7, 3, BinDistribution::kRoundRobin)),
            (Lists{{0, 3, 6}, {1, 4, -1}, {2, 5, -1}}));
  EXPECT_EQ(local_bins(distribute_packed_bins(7, 4, BinDistribution::kFifo)), (Lists{{0, 1}, {2, 3}, {4, 5}, {6, -1}}));
  EXPECT_EQ(local_bins(distribute_packed_bins(7, 4, BinDistribution::kRoundRobin)),
            (Lists{{0, 4}, {1, 5}, {2, 6}, {3, -1}}));
  EXPECT_EQ(local_bins(distribute_packed_bins(7, 8, BinDistribution::kFifo)),
            (Lists{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {-1}}));
  EXPECT_EQ(local_bins(distribute_packed_bins(7, 8, BinDistribution::kRoundRobin)),
            (Lists{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {-1}}));
  EXPECT_EQ(local_bins(distribute_packed_bins(7, 1, BinDistribution::kFifo)), (Lists{{0, 1, 2, 3, 4, 5, 6}}));

  const auto fifo = distribute_packed_bins(7, 3, BinDistribution::kFifo);
  EXPECT_EQ(fifo[0].num_padding_bins, 0);
  EXPECT_EQ(fifo[1].num_padding_bins, 1);
  EXPECT_EQ(fifo[2].num_padding_bins, 1);
  for (const RankBins& rank : fifo) EXPECT_EQ(rank.num_bins(), 3);
  // No bins: nothing to run, no padding.
  for (const RankBins& rank : distribute_packed_bins(0, 2, BinDistribution::kRoundRobin)) EXPECT_EQ(rank.num_bins(), 0);
  // Bins divisible by DP: no padding.
  for (const RankBins& rank : distribute_packed_bins(6, 3, BinDistribution::kFifo)) {
    EXPECT_EQ(rank.num_padding_bins, 0);
    EXPECT_EQ(rank.num_bins(), 2);
  }
}

TEST(SequencePacking, DistributionCoversEveryBinOnce) {
  for (const auto algo : {BinDistribution::kFifo, BinDistribution::kRoundRobin}) {
    for (int64_t num_bins = 0; num_bins <= 20; ++num_bins) {
      for (int64_t dp = 1; dp <= 9; ++dp) {
        std::vector<int> seen(static_cast<size_t>(num_bins), 0);
        for (const RankBins& rank : distribute_packed_bins(num_bins, dp, algo)) {
          EXPECT_EQ(rank.num_bins(), (num_bins + dp - 1) / dp);
          for (const int64_t bin : rank.bin_indices) ++seen[static_cast<size_t>(bin)];
        }
        EXPECT_TRUE(std::all_of(seen.begin(), seen.end(), [](const int n) { return n == 1; }));
      }
    }
  }
}

TEST(SequencePacking, ParsesTheAlgorithmFlag) {
  EXPECT_EQ(parse_bin_distribution("fifo"), BinDistribution::kFifo);
  EXPECT_EQ(parse_bin_distribution("round-robin"), BinDistribution::kRoundRobin);
  EXPECT_THROW(parse_bin_distribution("round_robin"), DataError);
}

TEST(SequencePacking, MicroBatchCountMatchesMegatron) {
  struct Case {
    int64_t gbs, prompts, group, bins, dp, microbatches, global_bins;
  };
  // Megatron (update_microbatch_calculator, then get_num_microbatches / get_current_running_global_batch_size):
  const std::vector<Case> cases = {
      {16, 4, 8, 5, 2, 3, 6},    // ratio 1/2: ceil(2.5) = 3 bins per rank per step
      {32, 4, 8, 7, 4, 7, 28},   // ratio 1: all 7 bins
      {8, 3, 8, 9, 2, 3, 6},     // ratio 1/3: 9/3 = 3
      {9, 3, 9, 7, 3, 3, 9},     // ratio 1/3: ceil(2.33) = 3
      {6, 7, 3, 10, 1, 3, 3},    // ratio 2/7: ceil(2.86) = 3
      {4, 5, 8, 30, 2, 3, 6},    // ratio 0.1: 0.1 * 30 rounds to exactly 3.0
      {9, 2, 7, 42, 3, 28, 84},  // ratio 9/14: (9/14) * 42 = 27.000000000000004 in doubles, so ceil gives 28
  };
  for (const Case& c : cases) {
    const PackedStepBatch batch = packing_aware_batch(c.gbs, c.prompts, c.group, c.bins, c.dp);
    EXPECT_EQ(batch.num_microbatches, c.microbatches) << c.gbs << " " << c.bins;
    EXPECT_EQ(batch.global_batch_bins, c.global_bins) << c.gbs << " " << c.bins;
    EXPECT_EQ(batch.bins_per_rank_per_step, c.microbatches);
  }
}

TEST(SequencePacking, WholeSampleStepTrainsEveryBin) {
  // A non-RL step of 10 samples (ratio 1) packed into 7 bins over DP 3: every rank runs ceil(7 / 3) = 3 micro-batches,
  // padding included, and the step trains all 7 bins.
  const auto bins = pack_sequences(kSevenBinLengths, {.bin_size = 10});
  const auto ranks = distribute_packed_bins(static_cast<int64_t>(bins.size()), 3, BinDistribution::kFifo);
  for (const RankBins& rank : ranks) {
    const PackedStepBatch batch = packing_aware_batch(10, 10, 1, rank.num_bins(), 3);
    EXPECT_EQ(batch.num_microbatches, 3);
    EXPECT_EQ(batch.global_batch_bins, 9);
  }
}

TEST(SequencePacking, SerpentineOrderOnAKnownBatch) {
  // Costs (sum of L^2): m0 = 16 + 9 = 25, m1 = 100, m2 = 4, m3 = 36 + 64 = 100, m4 = 49, m5 = 1.
  // Ascending (ties in input order): c0 = m5 (1), c1 = m2 (4), c2 = m0 (25), c3 = m4 (49), c4 = m1 (100),
  // c5 = m3 (100). Serpentine c0 c2 c4 c5 c3 c1 = m5 m0 m1 m3 m4 m2.
  const std::vector<std::vector<int64_t>> batch = {{4, 3}, {10}, {2}, {6, 8}, {7}, {1}};
  EXPECT_EQ(attention_cost(batch[3]), 100);
  EXPECT_EQ(serpentine_order(batch), (std::vector<int64_t>{5, 0, 1, 3, 4, 2}));
  // Five micro-batches: c0 c2 c4 c3 c1 (drop m3 = c5).
  const std::vector<std::vector<int64_t>> five = {{4, 3}, {10}, {2}, {7}, {1}};
  EXPECT_EQ(serpentine_order(five), (std::vector<int64_t>{4, 0, 1, 3, 2}));
  EXPECT_TRUE(serpentine_order({}).empty());
  EXPECT_EQ(serpentine_order({{5}}), (std::vector<int64_t>{0}));
  EXPECT_EQ(serpentine_order({{5}, {3}}), (std::vector<int64_t>{1, 0}));
  // Equal costs keep their input order on the rising side and come back reversed: 0 2 3 1.
  EXPECT_EQ(serpentine_order({{3}, {3}, {3}, {3}}), (std::vector<int64_t>{0, 2, 3, 1}));
  // An empty micro-batch (a padding bin) costs nothing and runs first.
  EXPECT_EQ(serpentine_order({{3}, {}, {2}}), (std::vector<int64_t>{1, 0, 2}));
}

TEST(SequencePacking, SerpentineRisesThenFalls) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 50; ++trial) {
    std::vector<std::vector<int64_t>> batch(rng() % 12 + 1);
    for (auto& lengths : batch) {
      lengths.resize(rng() % 4);
      for (int64_t& length : lengths) length = static_cast<int64_t>(rng() % 1000);
    }
    const auto order = serpentine_order(batch);
    std::vector<int64_t> sorted = order;
    std::sort(sorted.begin(), sorted.end());
    std::vector<int64_t> all(batch.size());
    std::iota(all.begin(), all.end(), int64_t{0});
    ASSERT_EQ(sorted, all);  // a permutation
    const auto peak = std::max_element(order.begin(), order.end(), [&](const int64_t a, const int64_t b) {
      return attention_cost(batch[static_cast<size_t>(a)]) < attention_cost(batch[static_cast<size_t>(b)]);
    });
    for (auto it = order.begin(); it + 1 <= peak; ++it) {
      EXPECT_LE(attention_cost(batch[static_cast<size_t>(*it)]), attention_cost(batch[static_cast<size_t>(*(it + 1))]));
    }
    for (auto it = peak; it + 1 < order.end(); ++it) {
      EXPECT_GE(attention_cost(batch[static_cast<size_t>(*it)]), attention_cost(batch[static_cast<size_t>(*(it + 1))]));
    }
  }
}

TEST(SequencePacking, RandomPackingsKeepTheRules) {
  std::mt19937 rng(11);
  for (int trial = 0; trial < 200; ++trial) {
    const int64_t cp = std::vector<int64_t>{1, 2, 4}[rng() % 3];
    const int64_t alignment = packing_alignment(cp);
    const SequencePackingOptions options{.bin_size = alignment * static_cast<int64_t>(rng() % 32 + 1),
                                         .max_sequences_per_bin = static_cast<int64_t>(rng() % 6 + 1),
                                         .context_parallel_size = cp};
    std::vector<int64_t> lengths(rng() % 40);
    for (int64_t& length : lengths) length = static_cast<int64_t>(rng() % static_cast<uint32_t>(options.bin_size + 1));
    const auto bins = pack_sequences(lengths, options);

    std::vector<int> seen(lengths.size(), 0);
    std::vector<int64_t> packing_order;
    for (size_t b = 0; b < bins.size(); ++b) {
      const PackedBin& bin = bins[b];
      ASSERT_FALSE(bin.empty());
      EXPECT_LE(static_cast<int64_t>(bin.sample_ids.size()), options.max_sequences_per_bin);
      EXPECT_LE(bin.padded_end(), options.bin_size);
      int64_t offset = 0;
      for (size_t s = 0; s < bin.sample_ids.size(); ++s) {
        const int64_t id = bin.sample_ids[s];
        ++seen[static_cast<size_t>(id)];
        packing_order.push_back(id);
        EXPECT_EQ(bin.offsets[s], offset);
        EXPECT_EQ(bin.lengths[s], lengths[static_cast<size_t>(id)]);
        EXPECT_EQ(bin.slot_lengths[s] % alignment, 0);
        EXPECT_GE(bin.slot_lengths[s], bin.lengths[s]);
        EXPECT_LT(bin.slot_lengths[s] - bin.lengths[s], alignment);
        offset += bin.slot_lengths[s];
      }
      // Next-fit: the next bin's first sample did not fit this one.
      if (b + 1 < bins.size()) {
        const bool full = static_cast<int64_t>(bin.sample_ids.size()) == options.max_sequences_per_bin;
        EXPECT_TRUE(full || bin.padded_end() + bins[b + 1].slot_lengths[0] > options.bin_size);
      }
      const BinCuSeqlens cu = bin_cu_seqlens(bin, options.bin_size);
      EXPECT_EQ(cu.actual.size(), bin.sample_ids.size() + 2);
      EXPECT_EQ(cu.padded.back(), options.bin_size);
    }
    EXPECT_TRUE(std::all_of(seen.begin(), seen.end(), [](const int n) { return n == 1; }));
    // Longest first, equal lengths in id order.
    for (size_t k = 1; k < packing_order.size(); ++k) {
      const int64_t a = lengths[static_cast<size_t>(packing_order[k - 1])];
      const int64_t b = lengths[static_cast<size_t>(packing_order[k])];
      EXPECT_TRUE(a > b || (a == b && packing_order[k - 1] < packing_order[k]));
    }
  }
}

TEST(SequencePacking, RejectsBadInput) {
  const std::vector<int64_t> too_long = {5, 20, 3};
  // Megatron asserts "Rollout too long" when building the rows (its packer alone fails copying 20 tokens into 16).
  EXPECT_THROW(pack_sequences(too_long, {.bin_size = 16}), DataError);
  const std::vector<int64_t> negative = {5, -1};
  EXPECT_THROW(pack_sequences(negative, {.bin_size = 16}), DataError);
  const std::vector<int64_t> fine = {5, 3};
  EXPECT_THROW(pack_sequences(fine, {.bin_size = 10, .context_parallel_size = 2}), DataError);  // 10 % 4 != 0
  EXPECT_THROW(pack_sequences(fine, {.bin_size = 0}), DataError);
  EXPECT_THROW(pack_sequences(fine, {.bin_size = 16, .max_sequences_per_bin = 0}), DataError);
  EXPECT_THROW(pack_sequences(fine, {.bin_size = 16, .context_parallel_size = 0}), DataError);

  const auto bins = pack_sequences(fine, {.bin_size = 16});
  EXPECT_THROW(bin_cu_seqlens(bins[0], 16, 3), DataError);  // 4 boundaries do not fit 3 entries
  EXPECT_THROW(bin_position_ids(bins[0], 4), DataError);    // slots end at 8

  EXPECT_THROW(distribute_packed_bins(7, 0, BinDistribution::kFifo), DataError);
  EXPECT_THROW(distribute_packed_bins(-1, 2, BinDistribution::kFifo), DataError);

  EXPECT_THROW(packing_aware_batch(64, 4, 8, 5, 2), DataError);     // ratio 2: more than was sampled
  EXPECT_THROW(packing_aware_batch(16, 4, 8, 5, 2, 2), DataError);  // --micro-batch-size 2
  EXPECT_THROW(packing_aware_batch(16, 4, 8, 0, 2), DataError);     // no bins: no micro-batch
  EXPECT_THROW(packing_aware_batch(0, 4, 8, 5, 2), DataError);

  EXPECT_THROW(serpentine_order({{3}, {-2}}), DataError);
  EXPECT_THROW(serpentine_order({{int64_t{1} << 32}}), std::overflow_error);
}

}  // namespace
}  // namespace moecore
