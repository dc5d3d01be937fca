#include "moecore/train/batch_schedule.h"

#include <numeric>
#include <stdexcept>

#include "moecore/parallel/comm_stats.h"

namespace moecore {

std::vector<int64_t> local_microbatches(const int64_t num_microbatches, const int64_t dp_size, const int64_t dp_rank) {
  if (dp_size < 1 || dp_rank < 0 || dp_rank >= dp_size || num_microbatches % dp_size != 0) {
    throw std::invalid_argument("local_microbatches: " + std::to_string(num_microbatches) +
                                " micro-batches cannot be dealt to DP rank " + std::to_string(dp_rank) + " of " +
                                std::to_string(dp_size));
  }
  std::vector<int64_t> indices;
  for (int64_t g = dp_rank; g < num_microbatches; g += dp_size) indices.push_back(g);
  return indices;
}

double loss_tokens(const Batch& batch) {
  return std::accumulate(batch.loss_mask_BS.begin(), batch.loss_mask_BS.end(), 0.0);
}

void TokenWeightedLoss::add(const double mean_loss, const double num_tokens) {
  if (num_tokens <= 0.0) return;
  loss_sum += mean_loss * num_tokens;
  tokens += num_tokens;
}

double reduce_over_dp_cp(const TokenWeightedLoss& local, const parallel::ParallelState& parallel) {
  if (parallel.dp_cp_size() == 1) return local.value();
  const parallel::CommTimer timer(parallel::CommKind::kOther);
  TokenWeightedLoss global;
  global.loss_sum = parallel::sum_double(parallel.dp_cp, local.loss_sum);
  global.tokens = parallel::sum_double(parallel.dp_cp, local.tokens);
  return global.value();
}

}  // namespace moecore
