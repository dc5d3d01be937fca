#include "moecore/model/tensor_parallel.h"

#include <span>
#include <stdexcept>
#include <string>
#include <utility>

#include "moecore/ops/convert.h"
#include "moecore/ops/precision.h"
#include "moecore/parallel/comm_stats.h"

namespace moecore {
namespace {

Tensor activation_like(const Tensor& t, const int64_t rows) {
  std::vector<int64_t> shape = t.shape();
  shape.at(0) = rows;
  return Tensor(std::move(shape), t.dtype(), MemCategory::kActivations, t.device());
}

void require_fp32(const Tensor& t, const char* what) {
  if (t.dtype() != DType::kF32 && t.dtype() != ops::activation_dtype())
    throw std::invalid_argument(std::string(what) +
                                ": tensor-parallel collectives take fp32 or the 16-bit activations");
}

// Under --bf16 / --fp16 activations hold 16-bit values (ops/precision.h), so the tensor-parallel collectives move
// them in 16 bits, as Megatron's 16-bit activations travel through NCCL: gathers are exact, sums round every partial
// sum (ProcessGroup::all_reduce_16bit_async). kF32 outside a 16-bit scope.
DType wire_dtype() { return ops::activation_dtype(); }

// x itself when it is stored in the wire dtype (16-bit activations, ops/precision.h), else a converted copy.
Tensor to_wire(const Tensor& x, const DType wire) {
  if (x.dtype() == wire) return x;
  Tensor bits(x.shape(), wire, MemCategory::kActivations, x.device());
  ops::convert(bits, x);
  return bits;
}

// Copies the wire tensor back into `x` unless they are one tensor.
void from_wire(Tensor& x, const Tensor& bits) {
  if (!x.shares_storage(bits)) ops::convert(x, bits);
}

void add_bytes(const int64_t elements, const DType wire) {
  parallel::CommStats::instance().add_bytes(parallel::CommKind::kTensorParallel,
                                            static_cast<double>(elements) * static_cast<double>(dtype_size(wire)));
}

}  // namespace

TensorParallel::TensorParallel(parallel::ProcessGroup group, const bool sequence_sharded)
    : group_(std::move(group)), sequence_sharded_(sequence_sharded && group_.size() > 1) {}

TensorParallel TensorParallel::attention(const parallel::ParallelState& state) {
  return TensorParallel(state.tp, state.sequence_parallel);
}

TensorParallel TensorParallel::sequence_sharded_always() const { return TensorParallel(group_, true); }

Tensor TensorParallel::all_gather_rows(const Tensor& shard_RW) const {
  if (size() == 1) return shard_RW;
  require_fp32(shard_RW, "all_gather_rows");
  Tensor full = activation_like(shard_RW, shard_RW.dim(0) * size());
  const DType wire = wire_dtype();
  add_bytes(shard_RW.numel(), wire);
  if (wire == DType::kF32) {
    const parallel::CommTimer timer(parallel::CommKind::kTensorParallel);
    group_.all_gather(shard_RW, full);
    return full;
  }
  const Tensor shard_bits = to_wire(shard_RW, wire);
  Tensor full_bits = to_wire(full, wire);
  {
    const parallel::CommTimer timer(parallel::CommKind::kTensorParallel);
    group_.all_gather(shard_bits, full_bits);
  }
  from_wire(full, full_bits);
  return full;
}

Tensor TensorParallel::reduce_scatter_rows(const Tensor& full_RW) const {
  if (size() == 1) return full_RW;
  require_fp32(full_RW, "reduce_scatter_rows");
  if (full_RW.dim(0) % size() != 0) {
    throw std::invalid_argument("reduce_scatter_rows: " + std::to_string(full_RW.dim(0)) +
                                " rows are not divisible by the tensor-parallel size " + std::to_string(size()));
  }
  Tensor shard = activation_like(full_RW, full_RW.dim(0) / size());
  const DType wire = wire_dtype();
  add_bytes(full_RW.numel(), wire);
  if (wire == DType::kF32) {
    const parallel::CommTimer timer(parallel::CommKind::kTensorParallel);
    group_.reduce_scatter(full_RW, shard, parallel::ReduceOp::kSum);
    return shard;
  }
  const Tensor full_bits = to_wire(full_RW, wire);
  Tensor shard_bits = to_wire(shard, wire);
  {
    const parallel::CommTimer timer(parallel::CommKind::kTensorParallel);
    group_.reduce_scatter_16bit_async(full_bits, shard_bits).wait();
  }
  from_wire(shard, shard_bits);
  return shard;
}

void TensorParallel::all_reduce_(Tensor& x, const parallel::ReduceOp op) const {
  if (size() == 1) return;
  require_fp32(x, "all_reduce_");
  const parallel::CommTimer timer(parallel::CommKind::kTensorParallel);
  group_.all_reduce(x, op);
}

void TensorParallel::all_reduce_activations_(Tensor& x) const {
  if (size() == 1) return;
  require_fp32(x, "all_reduce_activations_");
  const DType wire = wire_dtype();
  add_bytes(x.numel(), wire);
  if (wire == DType::kF32) {
    const parallel::CommTimer timer(parallel::CommKind::kTensorParallel);
    group_.all_reduce(x, parallel::ReduceOp::kSum);
    return;
  }
  Tensor bits = to_wire(x, wire);
  {
    const parallel::CommTimer timer(parallel::CommKind::kTensorParallel);
    group_.all_reduce_16bit_async(bits).wait();
  }
  from_wire(x, bits);
}

Tensor TensorParallel::split_rows(const Tensor& full_RW) const {
  if (size() == 1) return full_RW;
  const int64_t rows = full_RW.dim(0) / size();
  return full_RW.slice_rows(rank() * rows, (rank() + 1) * rows).clone(MemCategory::kActivations);
}

Tensor TensorParallel::to_sequence_shard(const Tensor& x_TW) const {
  return sequence_sharded_ ? x_TW : split_rows(x_TW);
}

Tensor TensorParallel::to_sequence_shard_backward(const Tensor& dshard_TW) const {
  return sequence_sharded_ ? dshard_TW : all_gather_rows(dshard_TW);
}

Tensor TensorParallel::from_sequence_shard(const Tensor& shard_TW) const {
  return sequence_sharded_ ? shard_TW : all_gather_rows(shard_TW);
}

Tensor TensorParallel::from_sequence_shard_backward(const Tensor& dx_TW) const {
  return sequence_sharded_ ? dx_TW : split_rows(dx_TW);
}

}  // namespace moecore
