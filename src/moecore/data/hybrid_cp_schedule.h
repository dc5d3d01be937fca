// Dynamic ("hybrid") context parallelism: Megatron's BalancedCPScheduler (megatron/core/pipeline_parallel/
// hybrid_cp_schedule.py) deals the variable-length samples of a global batch to the N = DP x CP ranks so that each
// sample runs on a power-of-two block of ranks that together hold it (its local CP size) and the ranks' attention work
// is balanced. Flags: --hybrid-context-parallel, --max-seqlen-per-dp-cp-rank. Pure function of the lengths: every rank
// computes the same schedule.
//
// The rules, as the Python has them:
//   ranks_needed(L) = max(1, 2^ceil(log2(L / max_seqlen_per_rank))), computed exactly in integers (the smallest power
//                     of two p with p * max_seqlen_per_rank >= L; Python's float log2 gives the same for any length
//                     below 2^50);
//   work(L, cp)     = L^2 / cp in double; a sample's own work is work(L, ranks_needed(L)).
//   The samples are sorted by length, longest first (stable: equal lengths keep their input order), and rounds are
//   formed until none is left (get_groups_and_subsamples). A round (next_hdp_group):
//   1. buckets (make_buckets_equal): k = the number of distinct ranks_needed; target = (sum of work, added left to
//      right as Python 3.11's sum does) / k; walking the samples, the open bucket is closed before a sample when the
//      bucket is not empty and either its work plus the sample's exceeds 1.1 * target or (samples left, this one
//      included) <= k - 2 * (buckets closed so far) (Megatron subtracts the closed count twice: it decrements
//      remaining_k and also subtracts len(buckets));
//   2. placement: take the head of the first bucket that can be placed: there is a group of exactly ranks_needed
//      ranks, or at least that many free ranks (ranks in no group yet). It joins the existing group of that size
//      whose busiest rank has the least work (ties: the group opened first), unless a new group on the free ranks
//      would be less loaded: the free ranks are taken lowest first (they all have work 0), so while enough ranks are
//      free every sample opens a new group. Its work is added to every rank of the group;
//   3. once a sample needs fewer ranks than the round's first sample, the round stops as soon as
//      max(work) - min(work) <= 0.05 * max(work) with samples still waiting;
//   4. trim_overload: while the spread exceeds 5% of the maximum and no rank is idle, the last sample of the
//      busiest rank's group (lowest rank among equals) goes back to the waiting list if that reduces the spread and
//      the rank has more than one sample;
//   5. fill_empty_gpus: while a rank is idle, the first group of the smallest size s doubles to 2s ranks (its start
//      stays; the groups after it shift up by s ranks);
//   the waiting samples (bucket order, then the trimmed ones in the order trimmed) are the next round's input,
//   without re-sorting.
// Groups are opened at the lowest free ranks, so every sample's ranks are contiguous. A group of size s starts at a
// multiple of s (is one of the sub-groups parallel_state.create_hybrid_dp_cp_groups builds: ranks [i*s, (i+1)*s) of
// the DP x CP group, or the whole group) when the round opens its groups largest first, which the sorted input of
// the first round guarantees. Later rounds take the waiting samples unsorted (the trimmed ones last), so a larger
// sample can open its group after smaller ones on a block that is not aligned; moecore reproduces that schedule as
// is (Megatron's ranks would then look up aligned sub-groups that differ from the block).
//
// What a trainer does with a schedule (data_schedule.py: HybridCPDataLoaderWrapper, hybrid_context_parallel_forward_
// backward): every DP rank gathers the lengths of all the sub-samples of the global batch (ids = position in the
// gather, DP rank by DP rank), all ranks compute the same schedule, and each sample is sent (all-to-all over the
// DP x CP group) from the DP rank that loaded it to every rank of its placement; rank r receives the ids of all
// rounds sorted ascending. Then rank r runs, round by round, its samples in sample_ids_per_rank order, each with
// local_cp_size = cp_size of its placement: local_cp_size 1 runs the sample alone, otherwise the sample's tokens are
// split over the sub-group of local_cp_size ranks that contains r with per-sequence zigzag balancing
// (core/utils.py:get_batch_on_this_cp_rank). A barrier over DP x CP ends each round (ranks change CP groups
// between rounds); gradients are reduced after the last sample of the last round. Ranks run different numbers of
// samples and tokens, so Megatron requires --calculate-per-token-loss (and PP 1, the single data loader).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace moecore {

struct CpSample {
  int64_t id = 0;      // any label, unique within one call
  int64_t length = 0;  // tokens, >= 1
};

// One sample of a round: it runs on ranks [first_rank, first_rank + cp_size).
struct CpPlacement {
  int64_t sample_id = 0;
  int64_t length = 0;
  int64_t first_rank = 0;
  int64_t cp_size = 0;  // Megatron's local_cp_size: the number of ranks that hold the sample
};

// One round (Megatron: one entry of sample_id_groups).
struct HybridCpRound {
  std::vector<std::vector<int64_t>> sample_ids_per_rank;  // N lists: the samples each rank runs, in order
  std::vector<CpPlacement> placements;  // every sample of the round, by first rank, then in its run order
  // N sums of L^2 / cp_size over the rank's samples, in run order. (Megatron's exec_times, which nothing reads after
  // fill_empty_gpus, keep only the first sample's work on a widened group.)
  std::vector<double> work_per_rank;
};

// BalancedCPScheduler.gpus_needed (DataError for length < 1 or max_seqlen_per_rank < 1).
int64_t hybrid_cp_ranks_needed(int64_t length, int64_t max_seqlen_per_rank);
// BalancedCPScheduler.get_total_workload with an explicit cp size: length^2 / cp_size.
double hybrid_cp_work(int64_t length, int64_t cp_size);

// The rounds of one global batch over total_ranks = DP x CP ranks; no samples give no rounds. DataError when
// total_ranks is not a power of two (Megatron builds CP sub-groups only for powers of two), max_seqlen_per_rank < 1,
// a length is < 1 (Megatron drops empty sub-samples before scheduling), an id repeats, or a sample needs more ranks
// than total_ranks (length > total_ranks * max_seqlen_per_rank; Megatron fails with "There should be at least one
// group existing").
std::vector<HybridCpRound> schedule_hybrid_cp(std::span<const CpSample> samples, int64_t total_ranks,
                                              int64_t max_seqlen_per_rank);

}  // namespace moecore
