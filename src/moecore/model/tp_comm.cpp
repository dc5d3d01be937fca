#include "moecore/model/tp_comm.h"

#include <span>

#include "moecore/parallel/comm_stats.h"

namespace moecore::tp {

void all_reduce(float* x, const int64_t n, const parallel::ProcessGroup& group) {
  if (group.size() == 1) return;
  const parallel::CommTimer timer(parallel::CommKind::kTensorParallel);
  group.all_reduce(std::span<float>(x, static_cast<size_t>(n)), parallel::ReduceOp::kSum);
}

void all_gather_rows(float* full, const float* shard, const int64_t rows_local, const int64_t width,
                     const parallel::ProcessGroup& group) {
  const auto n = static_cast<size_t>(rows_local * width);
  const parallel::CommTimer timer(parallel::CommKind::kTensorParallel);
  group.all_gather(std::span<const float>(shard, n), std::span<float>(full, n * static_cast<size_t>(group.size())));
}

void reduce_scatter_rows(float* shard, const float* full, const int64_t rows_local, const int64_t width,
                         const parallel::ProcessGroup& group) {
  const auto n = static_cast<size_t>(rows_local * width);
  const parallel::CommTimer timer(parallel::CommKind::kTensorParallel);
  group.reduce_scatter(std::span<const float>(full, n * static_cast<size_t>(group.size())), std::span<float>(shard, n),
                       parallel::ReduceOp::kSum);
}

}  // namespace moecore::tp
