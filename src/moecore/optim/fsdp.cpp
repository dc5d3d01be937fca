// Megatron-FSDP's unit lifecycle on DistributedDataParallel's buffers (optim/fsdp.h).
#include "moecore/optim/fsdp.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>

#include "moecore/ops/convert.h"
#include "moecore/ops/elementwise.h"
#include "moecore/ops/precision.h"
#include "moecore/optim/ddp.h"
#include "moecore/parallel/comm_stats.h"

namespace moecore {
namespace {

using parallel::CommKind;
using parallel::CommTimer;

constexpr std::array<std::pair<ShardingStrategy, std::string_view>, 4> kStrategyNames = {{
    {ShardingStrategy::kNoShard, "no_shard"},
    {ShardingStrategy::kOptim, "optim"},
    {ShardingStrategy::kOptimGrads, "optim_grads"},
    {ShardingStrategy::kOptimGradsParams, "optim_grads_params"},
}};

}  // namespace

std::string_view sharding_strategy_name(const ShardingStrategy strategy) {
  for (const auto& [s, name] : kStrategyNames) {
    if (s == strategy) return name;
  }
  throw std::logic_error("unknown sharding strategy");
}

std::optional<ShardingStrategy> parse_sharding_strategy(const std::string_view name) {
  for (const auto& [s, n] : kStrategyNames) {
    if (n == name) return s;
  }
  return std::nullopt;
}

FsdpUnshardedScope::FsdpUnshardedScope(DistributedDataParallel& ddp, const bool write_back)
    : ddp_(ddp), write_back_(write_back) {
  ddp_.unshard_all();
}

FsdpUnshardedScope::~FsdpUnshardedScope() { ddp_.reshard_all(write_back_); }

bool DistributedDataParallel::fsdp_zero3() const {
  return options_.fsdp && options_.fsdp->strategy == ShardingStrategy::kOptimGradsParams;
}

bool DistributedDataParallel::fsdp_sharded_grads() const {
  return options_.fsdp && (options_.fsdp->strategy == ShardingStrategy::kOptimGrads ||
                           options_.fsdp->strategy == ShardingStrategy::kOptimGradsParams);
}

const std::vector<int>& DistributedDataParallel::buckets_of(const int module) const {
  static const std::vector<int> kNone;
  const int m = module - min_module_;
  if (m < 0 || m >= static_cast<int>(module_buckets_.size())) return kNone;
  return module_buckets_[static_cast<size_t>(m)];
}

Tensor DistributedDataParallel::grad_view(const int bucket, const int64_t lo, const int64_t hi) const {
  const Bucket& b = buckets_[static_cast<size_t>(bucket)];
  const int64_t base = b.grads_sharded ? b.shard_begin : b.begin;
  const int64_t size = b.grads_sharded ? b.shard_size : b.end - b.begin;
  if (lo < base || hi > base + size || lo > hi) {
    throw std::logic_error("grad_view: elements outside what bucket " + std::to_string(bucket) + " stores");
  }
  return groups_[static_cast<size_t>(b.group)].grad_buffer.slice_rows(b.grad_store + lo - base,
                                                                      b.grad_store + hi - base);
}

Tensor DistributedDataParallel::param_view(const int bucket, const int64_t lo, const int64_t hi) const {
  const Bucket& b = buckets_[static_cast<size_t>(bucket)];
  const int64_t base = b.params_sharded ? b.shard_begin : b.begin;
  const int64_t size = b.params_sharded ? b.shard_size : b.end - b.begin;
  if (lo < base || hi > base + size || lo > hi) {
    throw std::logic_error("param_view: elements outside what bucket " + std::to_string(bucket) + " stores");
  }
  return groups_[static_cast<size_t>(b.group)].param_buffer.slice_rows(b.param_store + lo - base,
                                                                       b.param_store + hi - base);
}

void DistributedDataParallel::round_params_(const DType dtype) {
  for (Param& p : params_) {
    if (p.value.defined()) ops::round_to_dtype_(p.value, dtype);
  }
  for (size_t bi = 0; bi < buckets_.size(); ++bi) {
    const Bucket& b = buckets_[bi];
    if (!b.params_sharded) continue;
    Tensor shard = param_view(static_cast<int>(bi), b.shard_begin, b.shard_begin + b.shard_size);
    ops::round_to_dtype_(shard, dtype);
  }
}

bool DistributedDataParallel::shards_params() const {
  for (const Bucket& b : buckets_) {
    if (b.params_sharded) return true;
  }
  return false;
}

void DistributedDataParallel::start_unit_gather(const int module) {
  for (const int bi : buckets_of(module)) {
    Bucket& b = buckets_[static_cast<size_t>(bi)];
    if (!b.params_sharded || b.unit_params.defined()) continue;
    Group& g = groups_[static_cast<size_t>(b.group)];
    b.unit_params = Tensor({b.end - b.begin}, DType::kF32, MemCategory::kComm);
    const Tensor shard = param_view(bi, b.shard_begin, b.shard_begin + b.shard_size);
    const CommTimer timer(CommKind::kParamGather);
    parallel::CommStats::instance().add_bytes(CommKind::kParamGather,
                                              static_cast<double>(b.shard_size) * sizeof(float));
    b.unit_gather = g.pg.all_gather_async(shard, b.unit_params);
    b.unit_gather.trace_as(std::string(g.expert ? "expert " : "") + "FSDP param gather, unit " +
                           std::to_string(module));
    b.unit_gather_in_flight = true;
  }
}

void DistributedDataParallel::bind_unit_params(const int module) {
  start_unit_gather(module);
  for (const int bi : buckets_of(module)) {
    Bucket& b = buckets_[static_cast<size_t>(bi)];
    if (!b.params_sharded) continue;
    if (b.unit_gather_in_flight) {
      const CommTimer timer(CommKind::kParamGather);
      b.unit_gather.wait();
      b.unit_gather_in_flight = false;
    }
    for (const int i : b.params) bind_param_value(i, b.unit_params);
  }
}

void DistributedDataParallel::bind_param_value(const int param_index, const Tensor& whole) {
  const Slot& slot = slots_[static_cast<size_t>(param_index)];
  const Bucket& b = buckets_[static_cast<size_t>(slot.bucket)];
  params_[static_cast<size_t>(param_index)].value =
      whole.slice_rows(slot.offset - b.begin, slot.offset - b.begin + slot.numel)
          .view(shapes_[static_cast<size_t>(param_index)]);
}

void DistributedDataParallel::free_unit_params(const int module) {
  for (const int bi : buckets_of(module)) free_bucket_params(buckets_[static_cast<size_t>(bi)]);
}

void DistributedDataParallel::free_bucket_params(Bucket& b) {
  if (!b.params_sharded) return;
  if (b.unit_gather_in_flight) {  // never free a buffer MPI writes into
    b.unit_gather.wait();
    b.unit_gather_in_flight = false;
  }
  for (const int i : b.params) params_[static_cast<size_t>(i)].value = Tensor();
  b.unit_params = Tensor();
}

void DistributedDataParallel::bind_unit_grads(const int module) {
  for (const int bi : buckets_of(module)) {
    Bucket& b = buckets_[static_cast<size_t>(bi)];
    if (!b.grads_sharded) continue;
    if (b.unit_reduce_in_flight) complete_unit_reduces();  // the same unit again before its reduction finished
    b.unit_grads = Tensor({b.end - b.begin}, DType::kF32, MemCategory::kComm);
    b.unit_grads.zero_();
    for (const int i : b.params) {
      const Slot& slot = slots_[static_cast<size_t>(i)];
      params_[static_cast<size_t>(i)].grad =
          b.unit_grads.slice_rows(slot.offset - b.begin, slot.offset - b.begin + slot.numel)
              .view(shapes_[static_cast<size_t>(i)]);
    }
  }
}

void DistributedDataParallel::reduce_unit_grads(const int module) {
  // One unit's reduce-scatters in flight at a time: the previous unit's finish while this unit's backward ran.
  complete_unit_reduces();
  const int dp_cp = parallel_.dp_cp.size();
  for (const int bi : buckets_of(module)) {
    Bucket& b = buckets_[static_cast<size_t>(bi)];
    if (!b.grads_sharded || !b.unit_grads.defined()) continue;
    Group& g = groups_[static_cast<size_t>(b.group)];
    const CommTimer timer(CommKind::kGradReduce);
    // Replicated-over-TP params whose TP ranks each saw part of the tokens: summed over TP first (a linear map, so
    // per micro-batch equals the sum of the accumulated gradient).
    for (const int i : b.params) {
      Param& p = params_[static_cast<size_t>(i)];
      if (p.grad_sum_over_tp && !p.is_expert && parallel_.tp.size() > 1) all_reduce_grads(parallel_.tp, p.grad);
      p.grad = Tensor();
    }
    // Megatron's gradient_scaling_factor, in the gradients' dtype (a 16-bit product rounded to 16 bits).
    const DType dtype = options_.grad_dtype;
    if (dp_cp > 1) {
      ops::scale_(b.unit_grads, 1.0 / static_cast<double>(dp_cp));
      if (dtype != DType::kF32) ops::round_to_dtype_(b.unit_grads, dtype);
    }
    parallel::CommStats::instance().add_bytes(CommKind::kGradReduce,
                                              static_cast<double>(b.end - b.begin) * dtype_size(dtype));
    if (dtype != DType::kF32) {  // 16-bit gradients travel and sum in 16 bits
      b.wire = Tensor({b.end - b.begin}, dtype, MemCategory::kComm);
      ops::convert(b.wire, b.unit_grads);  // exact: the buffer holds 16-bit values
      b.unit_grads = Tensor();
      b.grad_work = g.pg.reduce_scatter_16bit_async(b.wire, b.wire_shard);
    } else {
      b.grad_work = g.pg.reduce_scatter_async(b.unit_grads, b.comm_shard, parallel::ReduceOp::kSum);
    }
    b.grad_work.trace_as(std::string(g.expert ? "expert " : "") + "FSDP grad reduce-scatter, unit " +
                         std::to_string(module));
    b.unit_reduce_in_flight = true;
  }
  parallel::drive_progress();
}

void DistributedDataParallel::complete_unit_reduces() {
  for (size_t bi = 0; bi < buckets_.size(); ++bi) {
    Bucket& b = buckets_[bi];
    if (!b.unit_reduce_in_flight) continue;
    {
      const CommTimer timer(CommKind::kGradReduce);
      b.grad_work.wait();
    }
    b.unit_reduce_in_flight = false;
    Tensor shard = grad_view(static_cast<int>(bi), b.shard_begin, b.shard_begin + b.shard_size);
    const DType dtype = options_.grad_dtype;
    if (dtype != DType::kF32) ops::convert(b.comm_shard, b.wire_shard);
    ops::add_(shard, b.comm_shard);
    // 16-bit gradients accumulate over micro-batches in their dtype (Megatron-FSDP's main gradient buffer).
    if (dtype != DType::kF32) ops::round_to_dtype_(shard, dtype);
    b.unit_grads = Tensor();
    b.wire = Tensor();
  }
}

void DistributedDataParallel::unshard_all() {
  for (size_t bi = 0; bi < buckets_.size(); ++bi) {
    Bucket& b = buckets_[bi];
    if (!b.params_sharded) continue;
    bind_unit_params(b.modules.front());
  }
}

void DistributedDataParallel::reshard_all(const bool write_back) {
  for (size_t bi = 0; bi < buckets_.size(); ++bi) {
    Bucket& b = buckets_[bi];
    if (!b.params_sharded || !b.unit_params.defined()) continue;
    if (write_back) {
      for (const int i : b.params) {
        const Slot& slot = slots_[static_cast<size_t>(i)];
        const int64_t lo = std::max(slot.offset, b.shard_begin);
        const int64_t hi = std::min(slot.offset + slot.numel, b.shard_begin + b.shard_size);
        if (lo >= hi) continue;
        const Tensor whole = params_[static_cast<size_t>(i)].value.view({slot.numel});
        param_view(static_cast<int>(bi), lo, hi).copy_from(whole.slice_rows(lo - slot.offset, hi - slot.offset));
      }
    }
    free_bucket_params(b);
  }
}

}  // namespace moecore
