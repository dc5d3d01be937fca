// The attention tensor-parallel group and how activations lie on it, with Megatron's mappings
// (megatron/core/tensor_parallel/mappings.py) on [T, W] token rows (row t = s * B + b; a sequence shard is a
// contiguous block of rows). Every collective is timed as CommKind::kTensorParallel; on a group of one they are
// copies or no-ops. Only the parallel layers (parallel_linear.h, vocab_parallel.h) and the sequence adapter of the
// MoE layer call these.
#pragma once

#include <cstdint>

#include "moecore/parallel/parallel_state.h"
#include "moecore/tensor/tensor.h"

namespace moecore {

class TensorParallel {
 public:
  TensorParallel() = default;  // one process
  // sequence_sharded: activations outside the tensor-parallel regions are sequence shards of T / size rows.
  TensorParallel(parallel::ProcessGroup group, bool sequence_sharded);
  // The attention TP group of `state`, sequence-sharded under --sequence-parallel with more than one rank.
  static TensorParallel attention(const parallel::ParallelState& state);
  // The same group with every activation sequence-sharded when it has more than one rank (the MoE layer).
  TensorParallel sequence_sharded_always() const;

  const parallel::ProcessGroup& group() const { return group_; }
  int size() const { return group_.size(); }
  int rank() const { return group_.rank(); }
  bool sequence_sharded() const { return sequence_sharded_; }
  // This rank's rows of T tokens and the one-process index of the first one (dropout / jitter counters).
  int64_t local_rows(int64_t T) const { return sequence_sharded_ ? T / size() : T; }
  int64_t row_offset(int64_t T) const { return sequence_sharded_ ? rank() * (T / size()) : 0; }

  // Forward of gather_from_sequence_parallel_region: every rank's rows, in rank order.
  Tensor all_gather_rows(const Tensor& shard_RW) const;
  // Forward of reduce_scatter_to_sequence_parallel_region: this rank's rows of the sum over the group.
  Tensor reduce_scatter_rows(const Tensor& full_RW) const;
  // Forward of reduce_from_tensor_model_parallel_region: x = sum (or max) over the group, in place.
  void all_reduce_(Tensor& x, parallel::ReduceOp op = parallel::ReduceOp::kSum) const;
  // The same sum for activations and activation gradients: in 16 bits under a bf16 / fp16 activation dtype, as
  // all_gather_rows and reduce_scatter_rows (statistics such as the vocabulary-parallel max use all_reduce_, fp32).
  void all_reduce_activations_(Tensor& x) const;
  // Forward of scatter_to_sequence_parallel_region: a copy of this rank's rows of a replicated tensor.
  Tensor split_rows(const Tensor& full_RW) const;

  // Entering and leaving a region that always works on sequence shards (the MoE layer) from this layout's
  // activations: a no-op when they are sequence shards already (or on one rank), else a split of the replicated
  // rows and an all-gather of the result; each backward is the other mapping.
  Tensor to_sequence_shard(const Tensor& x_TW) const;
  Tensor to_sequence_shard_backward(const Tensor& dshard_TW) const;
  Tensor from_sequence_shard(const Tensor& shard_TW) const;
  Tensor from_sequence_shard_backward(const Tensor& dx_TW) const;

 private:
  parallel::ProcessGroup group_ = parallel::ProcessGroup::self();
  bool sequence_sharded_ = false;
};

}  // namespace moecore
