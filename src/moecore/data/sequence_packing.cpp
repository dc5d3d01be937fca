#include "moecore/data/sequence_packing.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <string>

#include "moecore/data/indexed_dataset.h"
#include "moecore/util/checked_math.h"

namespace moecore {
namespace {

int64_t round_up(const int64_t value, const int64_t multiple) { return (value + multiple - 1) / multiple * multiple; }

void check_options(const SequencePackingOptions& options) {
  if (options.context_parallel_size < 1) {
    throw DataError("sequence packing: context_parallel_size " + std::to_string(options.context_parallel_size) +
                    " must be at least 1");
  }
  const int64_t alignment = packing_alignment(options.context_parallel_size);
  if (options.bin_size < 1 || options.bin_size % alignment != 0) {
    throw DataError("sequence packing: bin size (--seq-length) " + std::to_string(options.bin_size) +
                    " must be a positive multiple of the slot alignment " + std::to_string(alignment));
  }
  if (options.max_sequences_per_bin < 1) {
    throw DataError("sequence packing: --rl-sequence-packing-max-sequences-per-bin " +
                    std::to_string(options.max_sequences_per_bin) + " must be at least 1");
  }
}

}  // namespace

int64_t packing_alignment(const int64_t context_parallel_size) {
  return context_parallel_size > 1 ? 2 * context_parallel_size : 1;
}

int64_t PackedBin::padded_end() const { return empty() ? 0 : offsets.back() + slot_lengths.back(); }

std::vector<PackedBin> pack_sequences(std::span<const int64_t> lengths, const SequencePackingOptions& options) {
  check_options(options);
  const int64_t alignment = packing_alignment(options.context_parallel_size);
  for (size_t i = 0; i < lengths.size(); ++i) {
    if (lengths[i] < 0 || lengths[i] > options.bin_size) {
      throw DataError(
          "sequence packing: sample " + std::to_string(i) + " has length " + std::to_string(lengths[i]) +
          (lengths[i] < 0 ? "" : ", longer than the bin size (--seq-length) " + std::to_string(options.bin_size)));
    }
  }
  std::vector<int64_t> order(lengths.size());
  std::iota(order.begin(), order.end(), int64_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](const int64_t a, const int64_t b) { return lengths[a] > lengths[b]; });

  std::vector<PackedBin> bins;
  for (const int64_t id : order) {
    const int64_t slot = round_up(lengths[id], alignment);
    const bool fits = !bins.empty() && bins.back().padded_end() + slot <= options.bin_size &&
                      static_cast<int64_t>(bins.back().sample_ids.size()) < options.max_sequences_per_bin;
    if (!fits) bins.emplace_back();
    PackedBin& bin = bins.back();
    bin.offsets.push_back(bin.padded_end());
    bin.sample_ids.push_back(id);
    bin.slot_lengths.push_back(slot);
    bin.lengths.push_back(lengths[id]);
  }
  return bins;
}

std::vector<int64_t> bin_position_ids(const PackedBin& bin, const int64_t bin_size) {
  if (bin.padded_end() > bin_size) {
    throw DataError("bin_position_ids: the bin's slots end at " + std::to_string(bin.padded_end()) +
                    ", past the bin size " + std::to_string(bin_size));
  }
  std::vector<int64_t> positions(static_cast<size_t>(bin_size), 0);
  for (size_t s = 0; s < bin.sample_ids.size(); ++s) {
    std::iota(positions.begin() + bin.offsets[s], positions.begin() + bin.offsets[s] + bin.lengths[s], int64_t{0});
  }
  return positions;
}

BinCuSeqlens bin_cu_seqlens(const PackedBin& bin, const int64_t bin_size, const int64_t fixed_entries) {
  if (bin_size > std::numeric_limits<int32_t>::max() || bin.padded_end() > bin_size) {
    throw DataError("bin_cu_seqlens: a bin of " + std::to_string(bin_size) + " tokens with slots ending at " +
                    std::to_string(bin.padded_end()) + " (the slots must fit the bin, the bin int32)");
  }
  BinCuSeqlens cu;
  cu.actual.push_back(0);
  for (const int64_t length : bin.lengths) cu.actual.push_back(cu.actual.back() + static_cast<int32_t>(length));
  cu.actual.push_back(cu.actual.back() + static_cast<int32_t>(bin_size - bin.padded_end()));
  for (const int64_t offset : bin.offsets) cu.padded.push_back(static_cast<int32_t>(offset));
  cu.padded.push_back(static_cast<int32_t>(bin.padded_end()));
  cu.padded.push_back(static_cast<int32_t>(bin_size));

  if (fixed_entries > 0) {
    if (static_cast<int64_t>(cu.actual.size()) > fixed_entries) {
      throw DataError("bin_cu_seqlens: " + std::to_string(cu.actual.size()) + " boundaries do not fit " +
                      std::to_string(fixed_entries) + " entries");
    }
    cu.actual.resize(static_cast<size_t>(fixed_entries), cu.actual.back());
    cu.padded.resize(static_cast<size_t>(fixed_entries), cu.padded.back());
  }
  return cu;
}

BinDistribution parse_bin_distribution(const std::string_view algo) {
  if (algo == "fifo") return BinDistribution::kFifo;
  if (algo == "round-robin") return BinDistribution::kRoundRobin;
  throw DataError("--rl-sequence-packing-algo: '" + std::string(algo) + "' is not one of fifo, round-robin");
}

std::vector<RankBins> distribute_packed_bins(const int64_t num_bins, const int64_t data_parallel_size,
                                             const BinDistribution algo) {
  if (num_bins < 0 || data_parallel_size < 1) {
    throw DataError("distribute_packed_bins: " + std::to_string(num_bins) + " bins over " +
                    std::to_string(data_parallel_size) + " data-parallel ranks");
  }
  const int64_t bins_per_rank = (num_bins + data_parallel_size - 1) / data_parallel_size;
  std::vector<RankBins> ranks(static_cast<size_t>(data_parallel_size));
  for (int64_t rank = 0; rank < data_parallel_size; ++rank) {
    std::vector<int64_t>& mine = ranks[static_cast<size_t>(rank)].bin_indices;
    if (algo == BinDistribution::kRoundRobin) {
      for (int64_t bin = rank; bin < num_bins; bin += data_parallel_size) mine.push_back(bin);
    } else {
      const int64_t base = num_bins / data_parallel_size;
      const int64_t extra = num_bins % data_parallel_size;
      const int64_t begin = rank < extra ? rank * (base + 1) : rank * base + extra;
      const int64_t count = rank < extra ? base + 1 : base;
      for (int64_t bin = begin; bin < begin + count; ++bin) mine.push_back(bin);
    }
    ranks[static_cast<size_t>(rank)].num_padding_bins = bins_per_rank - static_cast<int64_t>(mine.size());
  }
  return ranks;
}

PackedStepBatch packing_aware_batch(const int64_t global_batch_size, const int64_t prompts_per_step,
                                    const int64_t group_size, const int64_t num_bins_this_rank,
                                    const int64_t data_parallel_size, const int64_t micro_batch_size) {
  if (global_batch_size < 1 || prompts_per_step < 1 || group_size < 1 || num_bins_this_rank < 0 ||
      data_parallel_size < 1) {
    throw DataError("packing_aware_batch: global batch " + std::to_string(global_batch_size) + ", " +
                    std::to_string(prompts_per_step) + " prompts x " + std::to_string(group_size) +
                    " samples per step, " + std::to_string(num_bins_this_rank) + " bins per rank, DP " +
                    std::to_string(data_parallel_size) + ": the counts must be positive");
  }
  if (micro_batch_size != 1) {
    throw DataError("sequence packing requires --micro-batch-size 1, got " + std::to_string(micro_batch_size));
  }
  const int64_t sampled = checked_mul(prompts_per_step, group_size, "samples per step");
  const double ratio = static_cast<double>(global_batch_size) / static_cast<double>(sampled);
  if (ratio > 1.0) {
    throw DataError("packing_aware_batch: global batch size " + std::to_string(global_batch_size) + " exceeds the " +
                    std::to_string(sampled) + " samples collected per step");
  }
  PackedStepBatch batch;
  batch.bins_per_rank_per_step = static_cast<int64_t>(std::ceil(ratio * static_cast<double>(num_bins_this_rank)));
  batch.global_batch_bins = checked_mul(batch.bins_per_rank_per_step, data_parallel_size, "global batch in bins");
  batch.num_microbatches = batch.global_batch_bins / (micro_batch_size * data_parallel_size);
  if (batch.num_microbatches < 1) {
    throw DataError("packing_aware_batch: " + std::to_string(num_bins_this_rank) +
                    " bins per rank give no micro-batch (at least 1 is needed)");
  }
  return batch;
}

int64_t attention_cost(std::span<const int64_t> sample_lengths) {
  int64_t cost = 0;
  for (const int64_t length : sample_lengths) {
    if (length < 0) throw DataError("attention_cost: negative sample length " + std::to_string(length));
    if (__builtin_add_overflow(cost, checked_mul(length, length, "attention cost"), &cost)) {
      throw std::overflow_error("attention cost overflows 64-bit integers");
    }
  }
  return cost;
}

std::vector<int64_t> serpentine_order(const std::vector<std::vector<int64_t>>& micro_batch_lengths) {
  const size_t n = micro_batch_lengths.size();
  std::vector<int64_t> costs(n);
  for (size_t m = 0; m < n; ++m) costs[m] = attention_cost(micro_batch_lengths[m]);
  std::vector<int64_t> by_cost(n);
  std::iota(by_cost.begin(), by_cost.end(), int64_t{0});
  std::stable_sort(by_cost.begin(), by_cost.end(),
                   [&](const int64_t a, const int64_t b) { return costs[a] < costs[b]; });

  std::vector<int64_t> order;
  order.reserve(n);
  const auto count = static_cast<int64_t>(n);
  for (int64_t k = 0; k < count; k += 2) order.push_back(by_cost[static_cast<size_t>(k)]);  // c0, c2, c4, ...
  const int64_t last_odd = count % 2 == 0 ? count - 1 : count - 2;
  for (int64_t k = last_odd; k >= 1; k -= 2) order.push_back(by_cost[static_cast<size_t>(k)]);  // ..., c3, c1
  return order;
}

}  // namespace moecore
