// Sequence packing of whole samples into fixed-size bins, as Megatron-RL does it
// (megatron/rl/sequence_packing_utils.py: SequencePacker.pack_sequences, create_packed_seq_params_for_bin,
// distribute_packed_bins, update_microbatch_calculator; called from megatron/rl/rl_utils.py:prepare_data_for_update),
// plus moecore's attention-cost (serpentine) ordering of micro-batches. Pure functions over sample lengths: no tensors,
// no MPI.
//
// Packing (flags --seq-length = bin size, --rl-sequence-packing-max-sequences-per-bin, default 50):
//   order    the samples sorted by length, longest first; equal lengths keep their input order (Megatron sorts the
//            indices with Python's sorted(..., reverse=True), which is stable, also in reverse);
//   slot     a sample occupies its length rounded up to the alignment 2*cp when cp > 1 (TE's THD context
//            parallelism splits every slot into 2*cp equal chunks), else exactly its length; bin_size must be a
//            multiple of the alignment;
//   bins     next-fit decreasing (Megatron's docstring says first-fit; the code keeps one open bin): a sample joins
//            the open bin if the bin's used slots plus its slot fit bin_size and the bin holds fewer than
//            max_sequences_per_bin samples, otherwise the open bin is closed and the sample opens the next one.
//            Bins keep the order they were opened in (not re-sorted). A sample of length 0 (Megatron: an all-pad
//            row) takes a slot of 0 and still counts towards max_sequences_per_bin.
//   offsets  a bin's samples sit back to back at their slot offsets; the gap between a sample's end and its slot's
//            end, and the bin's tail after the last slot, hold pad tokens with loss mask 0 and position id 0.
// A sample longer than bin_size is a DataError (Megatron asserts "Rollout too long" when it builds the rows).
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

namespace moecore {

struct SequencePackingOptions {
  int64_t bin_size = 0;                // --seq-length
  int64_t max_sequences_per_bin = 50;  // --rl-sequence-packing-max-sequences-per-bin
  int64_t context_parallel_size = 1;   // slots align to 2 * cp when cp > 1
};

// The slot alignment: 2 * context_parallel_size when it is > 1, else 1.
int64_t packing_alignment(int64_t context_parallel_size);

// One bin: its samples in packing order (Megatron's PackingInfo.bin_seq_indices and seq_starts).
struct PackedBin {
  std::vector<int64_t> sample_ids;    // indices into the packed lengths
  std::vector<int64_t> offsets;       // where each sample starts in the bin
  std::vector<int64_t> slot_lengths;  // each sample's length rounded up to the alignment
  std::vector<int64_t> lengths;       // each sample's real length

  // The end of the last slot (Megatron's padded_end, the last entry of seq_starts); 0 for an empty bin.
  int64_t padded_end() const;
  bool empty() const { return sample_ids.empty(); }
};

// Packs samples of the given lengths (sample i has lengths[i] tokens) into bins. No samples: no bins.
// DataError for a negative length, a length over bin_size, bin_size not a positive multiple of the alignment, or
// max_sequences_per_bin < 1.
std::vector<PackedBin> pack_sequences(std::span<const int64_t> lengths, const SequencePackingOptions& options);

// A bin's bin_size position ids: 0, 1, ..., L-1 over each sample's tokens, 0 in the padding (Megatron's
// packed_position_ids). An empty (padding) bin is all zeros.
std::vector<int64_t> bin_position_ids(const PackedBin& bin, int64_t bin_size);

// A bin's THD boundaries (create_packed_seq_params_for_bin):
//   actual  [0, L0, L0+L1, ..., sum L, sum L + (bin_size - padded_end)]: the real token count of each sample,
//           then the bin's pad tail as one last "ghost" sequence (its pad tokens attend among themselves);
//   padded  [offset0, offset1, ..., padded_end, bin_size]: where each slot begins, then the tail.
// With alignment 1 both are equal. An empty bin gives [0, bin_size] for both (the single-sequence default
// get_default_packed_seq_params uses for it). fixed_entries > 0 pads both to that many entries by repeating the
// last one (Megatron pads to max_sequences_per_bin + 2 so CUDA graphs see one shape); DataError if they are longer.
struct BinCuSeqlens {
  std::vector<int32_t> actual;  // cu_seqlens_q / cu_seqlens_kv
  std::vector<int32_t> padded;  // cu_seqlens_q_padded / cu_seqlens_kv_padded (Megatron passes them when cp > 1)
};
BinCuSeqlens bin_cu_seqlens(const PackedBin& bin, int64_t bin_size, int64_t fixed_entries = 0);

// --rl-sequence-packing-algo: how bins are dealt to the data-parallel ranks.
enum class BinDistribution {
  kFifo,        // "fifo": rank r gets a contiguous block; the first num_bins % DP ranks get one bin more
  kRoundRobin,  // "round-robin": rank r gets bins r, r + DP, r + 2 DP, ...
};
BinDistribution parse_bin_distribution(std::string_view algo);  // "fifo" or "round-robin"; DataError otherwise

// One data-parallel rank's bins: the global bin indices it trains, in order, followed by num_padding_bins empty bins
// so that every rank runs ceil(num_bins / DP) bins (Megatron's create_empty_bins: pad tokens, position ids 0, loss
// mask 0, no samples).
struct RankBins {
  std::vector<int64_t> bin_indices;
  int64_t num_padding_bins = 0;
  int64_t num_bins() const { return static_cast<int64_t>(bin_indices.size()) + num_padding_bins; }
};
// Per data-parallel rank (DataError for data_parallel_size < 1 or num_bins < 0).
std::vector<RankBins> distribute_packed_bins(int64_t num_bins, int64_t data_parallel_size, BinDistribution algo);

// The packing-aware batch size of update_microbatch_calculator. Megatron-RL samples
// prompts_per_step * group_size sequences per collection (--grpo-prompts-per-step, --grpo-group-size) and trains
// global_batch_size of them per optimizer step, so ratio = global_batch_size / (prompts_per_step * group_size) <= 1
// and one collection lasts 1 / ratio steps. Counted in bins:
//   bins_per_rank_per_step = ceil(ratio * num_bins_this_rank)   (num_bins_this_rank includes the padding bins)
//   global_batch_bins      = bins_per_rank_per_step * DP
//   num_microbatches       = global_batch_bins / (micro_batch_size * DP) = bins_per_rank_per_step (mbs is 1)
// The ratio and the product are taken in double precision, as Python does.
//
// A trainer of whole samples (not RL) that packs the N samples of each step's global batch has ratio 1
// (global_batch_size = the N samples collected for the step): every bin packed from the step is trained in that
// step, and the number of micro-batches per rank is ceil(num_bins / DP), the bins per rank after padding; it varies
// from step to step with the samples' lengths, and every rank runs the same count.
struct PackedStepBatch {
  int64_t bins_per_rank_per_step = 0;
  int64_t global_batch_bins = 0;
  int64_t num_microbatches = 0;
};
// DataError when a count is not positive (no bins: Megatron's "number of microbatches should be at least 1"), when
// the ratio exceeds 1 ("You cannot use more data than you sampled") or when micro_batch_size is not 1 (arguments.py:
// sequence packing requires --micro-batch-size 1).
PackedStepBatch packing_aware_batch(int64_t global_batch_size, int64_t prompts_per_step, int64_t group_size,
                                    int64_t num_bins_this_rank, int64_t data_parallel_size,
                                    int64_t micro_batch_size = 1);

// moecore's attention-cost ordering of a step's micro-batches (the Megatron-Core MoE report: micro-batches run in a
// small-to-large-to-small serpentine of their attention cost, the sum of squared sequence lengths, to reduce
// pipeline synchronization bubbles; Megatron has no code for it). The cost of micro-batch m is
// sum over its samples of L^2. With the micro-batches sorted by cost ascending, ties in input order, c0 <= c1 <= ...
// <= c(n-1), the order is c0, c2, c4, ... (the even ranks rising) followed by ..., c5, c3, c1 (the odd ranks
// falling): n = 5 gives c0 c2 c4 c3 c1, n = 6 gives c0 c2 c4 c5 c3 c1. Returns the micro-batch indices in run
// order. DataError for a negative length; std::overflow_error if a cost overflows 64 bits.
int64_t attention_cost(std::span<const int64_t> sample_lengths);
std::vector<int64_t> serpentine_order(const std::vector<std::vector<int64_t>>& micro_batch_lengths);

}  // namespace moecore
