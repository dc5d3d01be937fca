// Training on whole variable-length samples (--sample-data-path), Megatron-RL's way (megatron/rl/rl_utils.py
// prepare_data_for_update, sequence_packing_utils.py): each step takes the next --global-batch-size samples, packs them
// into bins of --seq-length tokens (--rl-use-sequence-packing; without it every sample is a bin of its own, padded, in
// the order the samples come),
// deals the bins to the data-parallel ranks (--rl-sequence-packing-algo) and pads every rank to the same number of
// bins with empty ones: the number of micro-batches follows the packing (Megatron's packing-aware batch size, with
// its ratio 1: one optimizer step per global batch of samples). Optionally each rank runs its bins in the serpentine
// attention-cost order (--rl-attention-cost-order serpentine, moecore's; sequence_packing.h).
//
// A bin is one micro-batch row of --seq-length tokens: each sample in its slot with positions 0, 1, ... and its own
// document (attention stays inside the sample, as packed sequences do), labels the sample's next tokens, the loss mask
// the sample's own for those targets (its last token predicts nothing); slot and tail padding predict nothing. The
// samples are visited in a per-epoch shuffle of the dataset (seeded by --seed), the same on every rank.
#pragma once

#include <cstdint>
#include <vector>

#include "moecore/config/arguments.h"
#include "moecore/data/data_loader.h"
#include "moecore/data/sample_dataset.h"
#include "moecore/data/sequence_packing.h"
#include "moecore/moe/routing_replay.h"

namespace moecore {

struct PackedSamplesOptions {
  int64_t seq_length = 0;                                 // the bin size
  bool pack = false;                                      // --rl-use-sequence-packing (else one sample per bin)
  int64_t max_sequences_per_bin = 50;                     // --rl-sequence-packing-max-sequences-per-bin
  BinDistribution distribution = BinDistribution::kFifo;  // --rl-sequence-packing-algo
  int64_t context_parallel_size = 1;                      // slots align to 2 x CP
  bool serpentine = false;                                // --rl-attention-cost-order serpentine
  uint64_t seed = 0;                                      // --seed: the per-epoch sample order
};

// One optimizer step's bins.
struct PackedStep {
  std::vector<PackedBin> bins;      // the real bins; their sample_ids index `samples`
  std::vector<int64_t> samples;     // the step's dataset indices, in the order visited
  std::vector<int64_t> local_bins;  // this rank's micro-batches in run order: an index into `bins`, -1 = empty
  int64_t bins_per_rank = 0;        // every rank's micro-batches (padding included)
  int64_t padding_bins = 0;         // empty bins over every rank
  int64_t real_tokens = 0;          // the samples' tokens
  int64_t padding_tokens = 0;       // the bins' (padding bins included) tokens that are not a sample's
  int64_t squared_lengths = 0;      // sum of the samples' squared lengths (attention FLOPs)
};

// The options the run's flags give (context_parallel_size: the run's CP size).
PackedSamplesOptions packed_samples_options(const TrainingArgs& args, int64_t context_parallel_size);

class PackedSamples {
 public:
  // DataError when a sample is longer than --seq-length (Megatron-RL: "Rollout too long").
  PackedSamples(const SampleDataset& data, PackedSamplesOptions options);

  // Training samples [consumed, consumed + global_batch) packed and dealt to `dp_size` ranks; this is rank `dp_rank`'s
  // share. The same on every rank but for local_bins.
  PackedStep step(int64_t consumed, int64_t global_batch, int dp_size, int dp_rank) const;
  // The micro-batch (B = 1, S = seq_length) of local bin `local` of `step`.
  Batch batch(const PackedStep& step, int64_t local) const;

  // Router replay (moe/routing_replay.h): "" when every sample of `step` has a record, else the one-line reason; and
  // the table of local bin `local`: each sample's recorded experts at its positions, -1 (the router's own choice)
  // wherever the record has none: a sample's last token, slot and tail padding, an empty bin.
  std::string replay_missing(const PackedStep& step, const RoutingReplaySource& replay) const;
  RoutingReplayBatch replay_batch(const PackedStep& step, int64_t local, const RoutingReplaySource& replay) const;

  // The dataset indices of training samples [consumed, consumed + global_batch).
  std::vector<int64_t> step_samples(int64_t consumed, int64_t global_batch) const;
  // Dynamic context parallelism (--hybrid-context-parallel): one sample as a micro-batch of its own (B = 1) padded to
  // `length` tokens (its positions 0..n-1, the padding a second document that predicts nothing).
  Batch sample_batch(int64_t index, int64_t length) const;
  int64_t sample_length(int64_t index) const { return data_.length(index); }

  // The dataset index of training sample k (the epoch's shuffle).
  int64_t sample_index(int64_t k) const;

 private:
  const SampleDataset& data_;
  PackedSamplesOptions options_;
  // The epoch order last built: one shuffle of the whole dataset per epoch, not per step.
  mutable int64_t cached_epoch_ = -1;
  mutable std::vector<int64_t> cached_order_;
};

}  // namespace moecore
