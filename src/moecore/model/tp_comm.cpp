#include "moecore/model/tp_comm.h"

#include <span>

#include "moecore/dist/comm_stats.h"

namespace moecore::tp {

void all_reduce(float* x, const int64_t n, const dist::ProcessGroup& group) {
  if (group.size() == 1) return;
  const dist::CommTimer timer(dist::CommKind::kTensorParallel);
  group.all_reduce(std::span<float>(x, static_cast<size_t>(n)), dist::ReduceOp::kSum);
}

void all_gather_rows(float* full, const float* shard, const int64_t rows_local, const int64_t width,
                     const dist::ProcessGroup& group) {
  const auto n = static_cast<size_t>(rows_local * width);
  const dist::CommTimer timer(dist::CommKind::kTensorParallel);
  group.all_gather(std::span<const float>(shard, n), std::span<float>(full, n * static_cast<size_t>(group.size())));
}

void reduce_scatter_rows(float* shard, const float* full, const int64_t rows_local, const int64_t width,
                         const dist::ProcessGroup& group) {
  const auto n = static_cast<size_t>(rows_local * width);
  const dist::CommTimer timer(dist::CommKind::kTensorParallel);
  group.reduce_scatter(std::span<const float>(full, n * static_cast<size_t>(group.size())), std::span<float>(shard, n),
                       dist::ReduceOp::kSum);
}

}  // namespace moecore::tp
