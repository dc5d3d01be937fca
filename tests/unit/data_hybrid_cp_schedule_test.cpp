// Dynamic ("hybrid") context parallelism schedule (data/hybrid_cp_schedule.h), Megatron's BalancedCPScheduler.
//
// The expected rounds come from Megatron's own scheduler, run on the same inputs by
//   /usr/bin/python3 tests/oracle/megatron_hybrid_cp_reference.py
// (Megatron-LM commit d98e8a64ddf34856e74b24714e3bedb2f5a39553): per round, per rank, the sample ids it runs
// (Megatron's sample_id_groups), pasted below; sample id i has length lengths[i]. Some cases are also worked by
// hand in the comments. Beside them: the invariants every schedule keeps, on those cases and on random batches.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>
#include <vector>

#include "moecore/data/hybrid_cp_schedule.h"
#include "moecore/data/indexed_dataset.h"

namespace moecore {
namespace {

using Round = std::vector<std::vector<int64_t>>;  // per rank, the sample ids it runs

std::vector<CpSample> samples_of(const std::vector<int64_t>& lengths) {
  std::vector<CpSample> samples;
  for (size_t i = 0; i < lengths.size(); ++i) samples.push_back({static_cast<int64_t>(i), lengths[i]});
  return samples;
}

std::vector<Round> ids_of(const std::vector<HybridCpRound>& rounds) {
  std::vector<Round> ids;
  for (const HybridCpRound& round : rounds) ids.push_back(round.sample_ids_per_rank);
  return ids;
}

bool is_power_of_two(const int64_t n) { return n > 0 && (n & (n - 1)) == 0; }

// What every schedule keeps: each sample runs in exactly one round, on a contiguous block of a power-of-two number
// of ranks (at least ranks_needed; Megatron's fill step only widens blocks), every rank of the block runs the same
// samples in the same order, no rank idles, and work_per_rank is the sum of L^2 / cp over the rank's samples.
void expect_invariants(const std::vector<CpSample>& samples, const std::vector<HybridCpRound>& rounds,
                       const int64_t ranks, const int64_t max_seqlen) {
  std::map<int64_t, int64_t> length_of;
  for (const CpSample& s : samples) length_of[s.id] = s.length;
  std::map<int64_t, int> times_placed;
  for (const HybridCpRound& round : rounds) {
    ASSERT_EQ(static_cast<int64_t>(round.sample_ids_per_rank.size()), ranks);
    ASSERT_EQ(static_cast<int64_t>(round.work_per_rank.size()), ranks);
    std::vector<double> work(static_cast<size_t>(ranks), 0.0);
    std::map<int64_t, int64_t> placements_holding;
    for (const CpPlacement& p : round.placements) {
      ++times_placed[p.sample_id];
      EXPECT_EQ(p.length, length_of.at(p.sample_id));
      EXPECT_TRUE(is_power_of_two(p.cp_size));
      EXPECT_GE(p.cp_size, hybrid_cp_ranks_needed(p.length, max_seqlen));
      ASSERT_LE(p.first_rank + p.cp_size, ranks);
      const auto& first = round.sample_ids_per_rank[static_cast<size_t>(p.first_rank)];
      for (int64_t r = 0; r < ranks; ++r) {
        const auto& ids = round.sample_ids_per_rank[static_cast<size_t>(r)];
        const bool inside = r >= p.first_rank && r < p.first_rank + p.cp_size;
        EXPECT_EQ(std::count(ids.begin(), ids.end(), p.sample_id), inside ? 1 : 0) << "sample " << p.sample_id;
        if (inside) {
          EXPECT_EQ(ids, first);
          work[static_cast<size_t>(r)] += hybrid_cp_work(p.length, p.cp_size);
        }
      }
      placements_holding[p.sample_id] += 1;
    }
    for (int64_t r = 0; r < ranks; ++r) {
      const auto& ids = round.sample_ids_per_rank[static_cast<size_t>(r)];
      EXPECT_FALSE(ids.empty()) << "rank " << r << " idles";
      for (const int64_t id : ids) EXPECT_EQ(placements_holding[id], 1);
      EXPECT_DOUBLE_EQ(round.work_per_rank[static_cast<size_t>(r)], work[static_cast<size_t>(r)]);
    }
  }
  EXPECT_EQ(times_placed.size(), samples.size());
  for (const auto& [id, times] : times_placed) EXPECT_EQ(times, 1) << "sample " << id;
}

// Whether every sample's block starts at a multiple of its size (is one of parallel_state's hybrid DP x CP groups).
bool aligned(const HybridCpRound& round) {
  return std::all_of(round.placements.begin(), round.placements.end(),
                     [](const CpPlacement& p) { return p.first_rank % p.cp_size == 0; });
}

struct Case {
  const char* name;
  int64_t ranks;
  int64_t max_seqlen;
  std::vector<int64_t> lengths;
  std::vector<Round> megatron;
};

// Megatron (tests/oracle/megatron_hybrid_cp_reference.py):
const std::vector<Case> kCases = {
    {"AllRanksSampleN4",
     4,
     1024,
     {1000, 4096, 900, 800, 700, 600, 500, 400, 300},
     {{{1}, {1}, {1}, {1}}, {{0}, {2, 7}, {3, 6}, {4, 5, 8}}}},
    {"MixedN8",
     8,
     1024,
     {512, 3000, 2000, 1800, 1024, 1000, 900, 512, 300, 200},
     {{{1}, {1}, {1}, {1}, {2}, {2}, {3}, {3}}, {{4}, {4}, {5}, {6}, {0}, {7}, {8}, {9}}}},
    {"ManyShortN8",
     8,
     4096,
     {1900, 350,  1210, 640,  1999, 720,  180, 1500, 980, 415,  1333, 260,
      870,  1760, 505,  1111, 199,  1450, 777, 1620, 333, 1024, 888,  1299},
     {{{4}, {0, 6}, {13, 18}, {19, 22, 9, 11}, {7, 8, 14, 1, 16}, {17, 21, 5}, {10, 15, 12}, {23, 2, 3, 20}}}},
    {"IdleRanksFilledN8", 8, 1024, {700, 500, 300}, {{{0}, {0}, {0}, {0}, {1}, {1}, {2}, {2}}}},
    {"OneSampleN8", 8, 1024, {2048}, {{{0}, {0}, {0}, {0}, {0}, {0}, {0}, {0}}}},
    {"LongTailN4",
     4,
     1000,
     {3900, 2100, 1900, 1000, 990, 980, 970, 960, 950, 500, 400, 100, 90, 80},
     {{{0, 1}, {0, 1}, {0, 1}, {0, 1}}, {{2}, {2}, {3, 6}, {4, 5}}, {{9}, {13, 10}, {12, 7}, {11, 8}}}},
    {"TrimmedRoundsN4",
     4,
     100,
     {190, 100, 84, 83, 82, 77, 64, 58, 43, 41, 33},
     {{{0}, {0}, {1, 4, 6}, {2, 3, 5}}, {{9}, {10}, {7}, {8}}}},
    {"BalancedStopN4",
     4,
     100,
     {200, 100, 100, 100, 100, 50, 50, 50},
     {{{0}, {0}, {1, 3}, {2, 4}}, {{5}, {5}, {6}, {7}}}},
    // Rank 0 runs 100 + 50 (work 10000 + 2500), rank 1 75 + 75 (11250): trimming the 50 would leave the spread at
    // 1250, not less, so it stays (a strict comparison).
    {"TrimTieN2", 2, 100, {75, 75, 50, 100}, {{{3, 2}, {0, 1}}}},
    {"SingleRank", 1, 512, {300, 500, 100}, {{{1, 0, 2}}}},
    {"MisalignedLaterRoundN16",
     16,
     64,
     {269, 124, 410, 231, 154, 288, 85, 119, 358, 367, 271, 97, 340, 7, 68, 203},
     {{{2, 12, 10},
       {2, 12, 10},
       {2, 12, 10},
       {2, 12, 10},
       {2, 12, 10},
       {2, 12, 10},
       {2, 12, 10},
       {2, 12, 10},
       {9, 8, 5},
       {9, 8, 5},
       {9, 8, 5},
       {9, 8, 5},
       {9, 8, 5},
       {9, 8, 5},
       {9, 8, 5},
       {9, 8, 5}},
      {{3}, {3}, {3}, {3}, {15}, {15}, {15}, {15}, {4}, {4}, {4}, {4}, {1, 6}, {1, 6}, {7, 11}, {7, 11}},
      {{13}, {13}, {13}, {13}, {0}, {0}, {0}, {0}, {0}, {0}, {0}, {0}, {14}, {14}, {14}, {14}}}},
};

TEST(HybridCpSchedule, MatchesMegatron) {
  for (const Case& c : kCases) {
    SCOPED_TRACE(c.name);
    const auto samples = samples_of(c.lengths);
    const auto rounds = schedule_hybrid_cp(samples, c.ranks, c.max_seqlen);
    EXPECT_EQ(ids_of(rounds), c.megatron);
    expect_invariants(samples, rounds, c.ranks, c.max_seqlen);
  }
}

TEST(HybridCpSchedule, RanksNeededAndWork) {
  // max(1, 2^ceil(log2(L / 1024))).
  EXPECT_EQ(hybrid_cp_ranks_needed(1, 1024), 1);
  EXPECT_EQ(hybrid_cp_ranks_needed(1024, 1024), 1);
  EXPECT_EQ(hybrid_cp_ranks_needed(1025, 1024), 2);
  EXPECT_EQ(hybrid_cp_ranks_needed(2048, 1024), 2);
  EXPECT_EQ(hybrid_cp_ranks_needed(2049, 1024), 4);
  EXPECT_EQ(hybrid_cp_ranks_needed(3000, 1024), 4);
  EXPECT_EQ(hybrid_cp_ranks_needed(4097, 1024), 8);
  EXPECT_EQ(hybrid_cp_ranks_needed(int64_t{1} << 40, 1), int64_t{1} << 40);
  EXPECT_DOUBLE_EQ(hybrid_cp_work(3000, 4), 2250000.0);
  EXPECT_DOUBLE_EQ(hybrid_cp_work(7, 2), 24.5);
}

TEST(HybridCpSchedule, OneSampleOnAllRanks) {
  // 4096 tokens at 1024 per rank need all 4 ranks; the 1-rank samples then find no group of their size and no free
  // rank, so round 1 is the big sample alone. Round 2: one group of 1 rank per sample, while ranks are free (a new
  // group has work 0, less than any busy group), then each joins the least-loaded rank.
  const auto rounds = schedule_hybrid_cp(samples_of(kCases[0].lengths), 4, 1024);
  ASSERT_EQ(rounds.size(), 2u);
  ASSERT_EQ(rounds[0].placements.size(), 1u);
  EXPECT_EQ(rounds[0].placements[0].sample_id, 1);
  EXPECT_EQ(rounds[0].placements[0].first_rank, 0);
  EXPECT_EQ(rounds[0].placements[0].cp_size, 4);
  for (const double work : rounds[0].work_per_rank) EXPECT_DOUBLE_EQ(work, 4096.0 * 4096.0 / 4.0);
  for (const CpPlacement& p : rounds[1].placements) EXPECT_EQ(p.cp_size, 1);
}

TEST(HybridCpSchedule, IdleRanksAreFilledByDoubling) {
  // Three 1-rank samples (700, 500, 300) on 8 ranks open groups at ranks 0, 1, 2; five ranks idle. fill_empty_gpus
  // doubles the first smallest group each time: 0 -> ranks 0-1 (the others shift up: 1 at 2, 2 at 3), 1 -> 2-3
  // (2 at 4), 2 -> 4-5, then the groups are all of 2: 0 -> 0-3 (1 at 4-5, 2 at 6-7). No rank idles.
  const auto rounds = schedule_hybrid_cp(samples_of({700, 500, 300}), 8, 1024);
  ASSERT_EQ(rounds.size(), 1u);
  const std::vector<CpPlacement> expected = {{0, 700, 0, 4}, {1, 500, 4, 2}, {2, 300, 6, 2}};
  ASSERT_EQ(rounds[0].placements.size(), expected.size());
  for (size_t k = 0; k < expected.size(); ++k) {
    EXPECT_EQ(rounds[0].placements[k].sample_id, expected[k].sample_id);
    EXPECT_EQ(rounds[0].placements[k].length, expected[k].length);
    EXPECT_EQ(rounds[0].placements[k].first_rank, expected[k].first_rank);
    EXPECT_EQ(rounds[0].placements[k].cp_size, expected[k].cp_size);
  }
  EXPECT_EQ(rounds[0].work_per_rank,
            (std::vector<double>{122500, 122500, 122500, 122500, 125000, 125000, 45000, 45000}));
}

TEST(HybridCpSchedule, BalancedRoundStopsEarly) {
  // 200 tokens need 2 ranks (ranks 0-1, work 200^2 / 2 = 20000 each); the 100s open ranks 2 and 3 (10000), then
  // join the least-loaded (rank 2, then rank 3: 20000 each). All ranks now carry 20000, within 5% of each other, and
  // smaller samples have started (1 rank < 2), so the round ends with the three 50s still waiting.
  const auto rounds = schedule_hybrid_cp(samples_of({200, 100, 100, 100, 100, 50, 50, 50}), 4, 100);
  ASSERT_EQ(rounds.size(), 2u);
  EXPECT_EQ(rounds[0].work_per_rank, (std::vector<double>{20000, 20000, 20000, 20000}));
  EXPECT_EQ(rounds[1].sample_ids_per_rank, (Round{{5}, {5}, {6}, {7}}));
}

TEST(HybridCpSchedule, BlocksAreAlignedInTheFirstRound) {
  for (const Case& c : kCases) {
    SCOPED_TRACE(c.name);
    const auto rounds = schedule_hybrid_cp(samples_of(c.lengths), c.ranks, c.max_seqlen);
    EXPECT_TRUE(aligned(rounds.front()));
  }
  // Later rounds take the waiting samples unsorted (trimmed ones last), so a larger sample can open its group
  // after smaller ones: Megatron puts sample 0 (269 tokens, 8 ranks of 64) on ranks 4-11 in round 3, a block that
  // is not one of parallel_state's aligned groups of 8.
  const Case& misaligned = kCases.back();
  const auto rounds = schedule_hybrid_cp(samples_of(misaligned.lengths), misaligned.ranks, misaligned.max_seqlen);
  ASSERT_EQ(rounds.size(), 3u);
  EXPECT_FALSE(aligned(rounds[2]));
  const auto sample0 = std::find_if(rounds[2].placements.begin(), rounds[2].placements.end(),
                                    [](const CpPlacement& p) { return p.sample_id == 0; });
  ASSERT_NE(sample0, rounds[2].placements.end());
  EXPECT_EQ(sample0->first_rank, 4);
  EXPECT_EQ(sample0->cp_size, 8);
}

TEST(HybridCpSchedule, EqualLengthsKeepTheirInputOrder) {
  // Sorting is stable: with equal lengths the ids run in input order (ids need not be 0..n-1).
  const std::vector<CpSample> samples = {{42, 100}, {7, 100}, {19, 100}};
  const auto rounds = schedule_hybrid_cp(samples, 1, 512);
  ASSERT_EQ(rounds.size(), 1u);
  EXPECT_EQ(rounds[0].sample_ids_per_rank, (Round{{42, 7, 19}}));
  EXPECT_TRUE(schedule_hybrid_cp({}, 4, 512).empty());
}

TEST(HybridCpSchedule, RandomBatchesKeepTheInvariants) {
  std::mt19937 rng(5);
  for (int trial = 0; trial < 300; ++trial) {
    const int64_t ranks = int64_t{1} << (rng() % 6);
    const int64_t max_seqlen = std::vector<int64_t>{64, 100, 1000}[rng() % 3];
    std::vector<int64_t> lengths(rng() % 40 + 1);
    for (int64_t& length : lengths) {
      const int64_t limit = rng() % 4 == 0 ? ranks * max_seqlen : max_seqlen;
      length = static_cast<int64_t>(rng() % static_cast<uint64_t>(limit)) + 1;
    }
    const auto samples = samples_of(lengths);
    const auto rounds = schedule_hybrid_cp(samples, ranks, max_seqlen);
    expect_invariants(samples, rounds, ranks, max_seqlen);
    ASSERT_FALSE(rounds.empty());
    EXPECT_TRUE(aligned(rounds.front()));
  }
}

TEST(HybridCpSchedule, RejectsBadInput) {
  // 4 ranks of 1024 tokens hold at most 4096: Megatron can place 4097 nowhere ("There should be at least one group
  // existing").
  EXPECT_THROW(schedule_hybrid_cp(samples_of({1000, 4097}), 4, 1024), DataError);
  EXPECT_NO_THROW(schedule_hybrid_cp(samples_of({1000, 4096}), 4, 1024));
  EXPECT_THROW(schedule_hybrid_cp(samples_of({100}), 6, 1024), DataError);  // not a power of two
  EXPECT_THROW(schedule_hybrid_cp(samples_of({100}), 0, 1024), DataError);
  EXPECT_THROW(schedule_hybrid_cp(samples_of({100}), 4, 0), DataError);
  EXPECT_THROW(schedule_hybrid_cp(samples_of({100, 0}), 4, 1024), DataError);  // empty sub-samples are dropped first
  const std::vector<CpSample> repeated = {{3, 100}, {3, 200}};
  EXPECT_THROW(schedule_hybrid_cp(repeated, 4, 1024), DataError);
  EXPECT_THROW(hybrid_cp_ranks_needed(0, 1024), DataError);
}

}  // namespace
}  // namespace moecore
