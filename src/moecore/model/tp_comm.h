// Tensor- and sequence-parallel communication on activations [T, H] (token rows t = s * B + b; a sequence shard
// is a contiguous block of rows). Each function is timed as CommKind::kTensorParallel; on a TP group of one they
// are copies. Forward/backward pairs (Megatron's mappings):
//   copy-to-TP (fwd identity)        <-> all-reduce (bwd)
//   all-reduce (fwd)                 <-> identity (bwd)
//   SP all-gather (fwd)              <-> SP reduce-scatter (bwd)
//   SP reduce-scatter (fwd)          <-> SP all-gather (bwd)
#pragma once

#include <cstdint>

#include "moecore/parallel/process_group.h"

namespace moecore::tp {

// x (n elements) = sum over the group, in place.
void all_reduce(float* x, int64_t n, const parallel::ProcessGroup& group);
// full [rows_local * size, width] = concatenation of every rank's shard [rows_local, width] in group order.
void all_gather_rows(float* full, const float* shard, int64_t rows_local, int64_t width,
                     const parallel::ProcessGroup& group);
// shard [rows_local, width] = rows [rank * rows_local, (rank + 1) * rows_local) of the sum of every rank's full.
void reduce_scatter_rows(float* shard, const float* full, int64_t rows_local, int64_t width,
                         const parallel::ProcessGroup& group);

}  // namespace moecore::tp
