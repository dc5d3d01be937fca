// Which micro-batches of a global batch a rank computes, and the lm loss of several micro-batches weighted by
// their tokens.
#pragma once

#include <cstdint>
#include <vector>

#include "moecore/data/data_loader.h"
#include "moecore/parallel/parallel_state.h"

namespace moecore {

// The global micro-batch indices a data-parallel rank reads, in order, as Megatron's MegatronPretrainingSampler
// deals them: step m of the global batch gives micro-batch m * dp_size + dp_rank to DP rank dp_rank. dp_size and
// dp_rank are the data-parallel group's (without context parallelism: every CP rank of a replica reads the same
// samples).
std::vector<int64_t> local_microbatches(int64_t num_microbatches, int64_t dp_size, int64_t dp_rank);

// Unmasked tokens of a micro-batch: the sum of its loss mask (Megatron's loss_func num_tokens).
double loss_tokens(const Batch& batch);

// Sum of per-token losses and the number of tokens they cover. Megatron reports the lm loss of a global batch as
// (sum over every micro-batch and DP rank of the per-token losses) / (their unmasked tokens) (training.py:
// train_step and evaluate reduce [loss sum, num_tokens] over dp-cp), not as the mean of per-micro-batch means.
struct TokenWeightedLoss {
  double loss_sum = 0.0;
  double tokens = 0.0;
  // A micro-batch whose mean loss over `num_tokens` unmasked tokens is `mean_loss` (no tokens: nothing added).
  void add(double mean_loss, double num_tokens);
  double value() const { return loss_sum / tokens; }  // NaN without tokens
};

// The loss over every rank's micro-batches: [loss sum, tokens] summed over dp-cp (collective over dp-cp; every TP
// rank of a replica holds the same values).
double reduce_over_dp_cp(const TokenWeightedLoss& local, const parallel::ParallelState& parallel);

}  // namespace moecore
