#include "moecore/optim/ddp.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <numeric>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>

#include "moecore/ops/convert.h"
#include "moecore/ops/elementwise.h"
#include "moecore/ops/precision.h"
#include "moecore/parallel/comm_stats.h"
#include "moecore/util/trace.h"

namespace moecore {
namespace {

// Zeroes a buffer in contiguous pieces, one run per OpenMP thread: a memset is bound by memory bandwidth, which one
// core does not saturate (the gradient buffer grows with the total parameters: the experts' weights).
void zero_in_parallel(Tensor& buffer) {
  constexpr int64_t kPiece = int64_t{4} << 20;  // bytes; below two pieces one thread does it
  auto* bytes = static_cast<std::byte*>(static_cast<void*>(buffer.data<float>()));
  const auto total = static_cast<int64_t>(buffer.nbytes());
  const int64_t pieces = (total + kPiece - 1) / kPiece;
#pragma omp parallel for schedule(static) if (pieces > 1)
  for (int64_t i = 0; i < pieces; ++i) {
    const int64_t begin = i * kPiece;
    std::memset(bytes + begin, 0, static_cast<size_t>(std::min(total, begin + kPiece) - begin));
  }
}

using parallel::CommKind;
using parallel::CommTimer;

// Every param starts on a 64-byte boundary, as its own storage would: kernels see the same alignment either way.
constexpr int64_t kParamAlign = 16;

int64_t align_up(const int64_t x, const int64_t a) { return (x + a - 1) / a * a; }

bool packs_two_codes(const ParamStore& params, const std::vector<int>& indices) {
  return std::any_of(indices.begin(), indices.end(), [&](const int i) {
    const auto& q = params[static_cast<size_t>(i)].weight_quantization;
    return q && q->element == quant::ElementFormat::kE2M1;
  });
}

// The elements [lo, hi) where a param's slot [offset, offset + numel) meets [begin, end); lo >= hi when disjoint.
struct Overlap {
  int64_t lo, hi;
};
Overlap overlap(const int64_t offset, const int64_t numel, const int64_t begin, const int64_t end) {
  return {std::max(offset, begin), std::min(offset + numel, end)};
}

}  // namespace

DistributedDataParallel::DistributedDataParallel(ParamStore& params, const parallel::ParallelState& parallel,
                                                 const DdpOptions& options)
    : params_(params), parallel_(parallel), options_(options) {
  if (options_.overlap_param_gather && !options_.use_distributed_optimizer) {
    throw std::invalid_argument("overlap_param_gather requires the distributed optimizer");
  }
  if (options_.quantized_param_gather && !options_.use_distributed_optimizer) {
    throw std::invalid_argument("quantized_param_gather requires the distributed optimizer");
  }
  if (options_.bucket_size < 0) throw std::invalid_argument("bucket_size must be >= 0");
  if (options_.fsdp) {
    const bool no_shard = options_.fsdp->strategy == ShardingStrategy::kNoShard;
    if (options_.use_distributed_optimizer == no_shard) {
      throw std::invalid_argument(
          "Megatron-FSDP: the distributed optimizer's shards exist for every strategy but "
          "no_shard");
    }
    if (options_.quantized_param_gather) {
      throw std::invalid_argument("Megatron-FSDP: no quantized parameter all-gather");
    }
  }
  if (options_.grad_dtype != DType::kF32 && options_.grad_dtype != DType::kBF16 && options_.grad_dtype != DType::kF16) {
    throw std::invalid_argument("grad_dtype must be fp32, bf16 or fp16");
  }
  if (options_.fsdp) {
    bucket_size_ = 0;  // one bucket per module and group kind
  } else if (options_.bucket_size > 0) {
    bucket_size_ = options_.bucket_size;
  } else if (options_.overlap_grad_reduce) {
    bucket_size_ = std::max<int64_t>(40000000, 1000000 * static_cast<int64_t>(parallel_.dp_cp.size()));
  }  // else one bucket per group, as Megatron without overlap

  int min_module = 0, max_module = -1;
  std::vector<int> dense, expert, dense_quantized, expert_quantized;
  for (int i = static_cast<int>(params_.size()) - 1; i >= 0; --i) {  // backward order
    const Param& p = params_[static_cast<size_t>(i)];
    if (!p.value.defined() || !p.grad.defined() || p.value.dtype() != DType::kF32 || p.grad.dtype() != DType::kF32 ||
        p.value.numel() != p.grad.numel()) {
      throw std::invalid_argument("DistributedDataParallel: parameter " + p.name +
                                  " needs fp32 value and gradient of equal size");
    }
    if (options_.quantized_param_gather && p.weight_quantization) {
      (p.is_expert ? expert_quantized : dense_quantized).push_back(i);
    } else {
      (p.is_expert ? expert : dense).push_back(i);
    }
    if (max_module < min_module) {
      min_module = max_module = p.module;
    } else {
      min_module = std::min(min_module, p.module);
      max_module = std::max(max_module, p.module);
    }
  }
  min_module_ = min_module;
  const size_t num_modules = max_module >= min_module ? static_cast<size_t>(max_module - min_module + 1) : 0;
  module_buckets_.resize(num_modules);
  module_params_.resize(num_modules);
  for (size_t i = 0; i < params_.size(); ++i) {
    module_params_[static_cast<size_t>(params_[i].module - min_module)].push_back(static_cast<int>(i));
  }
  module_done_.assign(num_modules, 0);
  tp_summed_.assign(params_.size(), 0);
  slots_.resize(params_.size());
  for (const Param& p : params_) shapes_.push_back(p.value.shape());

  if (!dense.empty()) build(false, false, dense);
  if (!expert.empty()) build(true, false, expert);
  if (!dense_quantized.empty()) build(false, true, dense_quantized);
  if (!expert_quantized.empty()) build(true, true, expert_quantized);
}

DistributedDataParallel::~DistributedDataParallel() = default;

void DistributedDataParallel::build(const bool expert, const bool quantized, const std::vector<int>& param_indices) {
  const int group_index = static_cast<int>(groups_.size());
  Group group;
  group.expert = expert;
  group.quantized = quantized;
  group.pg = group.expert ? parallel_.edp : parallel_.dp_cp;
  const int64_t group_size = group.pg.size();
  const bool dist_opt = options_.use_distributed_optimizer;
  // Packed FP4 codes: every shard an even number of elements (params start at even offsets, kParamAlign).
  const int64_t shard_multiple = quantized && packs_two_codes(params_, param_indices) ? 2 : 1;
  if (shard_multiple == 2) {
    for (const int i : param_indices) {
      if (params_[static_cast<size_t>(i)].weight_quantization->element != quant::ElementFormat::kE2M1) {
        throw std::invalid_argument("DistributedDataParallel: FP4 and FP8 weights in one quantized group");
      }
    }
  }
  const int64_t bucket_align = dist_opt ? std::lcm(group_size * shard_multiple, int64_t{128}) : kParamAlign;

  int64_t offset = 0;
  Bucket bucket;
  const auto close_bucket = [&] {
    bucket.group = group_index;
    bucket.end = align_up(offset, bucket_align);
    bucket.shard_size = (bucket.end - bucket.begin) / group_size;
    bucket.shard_begin = bucket.begin + group.pg.rank() * bucket.shard_size;
    std::sort(bucket.modules.begin(), bucket.modules.end());
    bucket.modules.erase(std::unique(bucket.modules.begin(), bucket.modules.end()), bucket.modules.end());
    offset = bucket.end;
    if (options_.fsdp) {
      const int module = bucket.modules.front();
      const ShardingStrategy strategy = options_.fsdp->strategy;
      bucket.unit = module >= 0 && module < options_.fsdp->num_units;
      bucket.grads_sharded =
          bucket.unit && (strategy == ShardingStrategy::kOptimGrads || strategy == ShardingStrategy::kOptimGradsParams);
      bucket.params_sharded = bucket.unit && strategy == ShardingStrategy::kOptimGradsParams;
    }
    group.buckets.push_back(static_cast<int>(buckets_.size()));
    buckets_.push_back(std::move(bucket));
    bucket = Bucket();
    bucket.begin = offset;
  };
  for (const int i : param_indices) {
    const Param& p = params_[static_cast<size_t>(i)];
    // A tied embedding shared over the pipeline gets a bucket of its own (Megatron's shared_embedding).
    if (p.sum_over_embedding_group && !bucket.params.empty()) close_bucket();
    // Megatron-FSDP: each unit (and each module outside them) in buckets of its own.
    if (options_.fsdp && !bucket.params.empty() &&
        params_[static_cast<size_t>(bucket.params.back())].module != p.module) {
      close_bucket();
    }
    offset = align_up(offset, kParamAlign);
    Slot& slot = slots_[static_cast<size_t>(i)];
    slot.group = group_index;
    slot.bucket = static_cast<int>(buckets_.size());
    slot.offset = offset;
    slot.numel = p.value.numel();
    offset += slot.numel;
    bucket.params.push_back(i);
    bucket.modules.push_back(p.module);
    if ((bucket_size_ > 0 && offset - bucket.begin >= bucket_size_) || p.sum_over_embedding_group) close_bucket();
  }
  if (!bucket.params.empty()) close_bucket();

  // Gradients that are all zero (a fresh model's) are released before the buffer exists, so the gradients' memory
  // never holds both copies; nonzero ones are copied into it.
  std::vector<std::vector<int64_t>> zero_grad_shapes(params_.size());
  std::vector<char> released(params_.size(), 0);
  for (const int i : param_indices) {
    Param& p = params_[static_cast<size_t>(i)];
    const std::span<const float> g = std::as_const(p.grad).span<float>();
    if (std::all_of(g.begin(), g.end(), [](const float v) { return v == 0.0f; })) {
      zero_grad_shapes[static_cast<size_t>(i)] = p.grad.shape();
      released[static_cast<size_t>(i)] = 1;
      p.grad = Tensor();
    }
  }
  // Where each bucket's elements are stored: in place without FSDP; with it, buckets one after another, a sharded
  // one taking its shard's elements only.
  int64_t grad_total = offset, param_total = offset;
  if (options_.fsdp) {
    grad_total = param_total = 0;
    for (const int b : group.buckets) {
      Bucket& bk = buckets_[static_cast<size_t>(b)];
      bk.grad_store = align_up(grad_total, kParamAlign);
      grad_total = bk.grad_store + (bk.grads_sharded ? bk.shard_size : bk.end - bk.begin);
      bk.param_store = align_up(param_total, kParamAlign);
      param_total = bk.param_store + (bk.params_sharded ? bk.shard_size : bk.end - bk.begin);
    }
  } else {
    for (const int b : group.buckets) {
      Bucket& bk = buckets_[static_cast<size_t>(b)];
      bk.grad_store = bk.param_store = bk.begin;
    }
  }
  group.grad_buffer = Tensor({std::max<int64_t>(grad_total, 1)}, DType::kF32, MemCategory::kGrads);
  if (dist_opt) group.param_buffer = Tensor({std::max<int64_t>(param_total, 1)}, DType::kF32, MemCategory::kParams);
  groups_.push_back(std::move(group));  // grad_view / param_view read it from here on
  Group& stored = groups_.back();
  for (const int i : param_indices) {
    Param& p = params_[static_cast<size_t>(i)];
    const Slot& slot = slots_[static_cast<size_t>(i)];
    const Bucket& bk = buckets_[static_cast<size_t>(slot.bucket)];
    const auto idx = static_cast<size_t>(i);
    // This rank's shard of the param: the elements [o.lo, o.hi) of the buffer.
    const Overlap o = overlap(slot.offset, slot.numel, bk.shard_begin, bk.shard_begin + bk.shard_size);
    if (bk.grads_sharded) {
      if (!released[idx] && o.lo < o.hi) {
        grad_view(slot.bucket, o.lo, o.hi)
            .copy_from(p.grad.view({slot.numel}).slice_rows(o.lo - slot.offset, o.hi - slot.offset));
      }
      p.grad = Tensor();
    } else {
      Tensor grad = grad_view(slot.bucket, slot.offset, slot.offset + slot.numel)
                        .view(released[idx] ? zero_grad_shapes[idx] : p.grad.shape());
      if (!released[idx]) grad.copy_from(p.grad);
      p.grad = std::move(grad);
    }
    if (!dist_opt) continue;
    if (bk.params_sharded) {
      if (o.lo < o.hi) {
        param_view(slot.bucket, o.lo, o.hi)
            .copy_from(p.value.view({slot.numel}).slice_rows(o.lo - slot.offset, o.hi - slot.offset));
      }
      p.value = Tensor();
    } else {
      Tensor value = param_view(slot.bucket, slot.offset, slot.offset + slot.numel).view(p.value.shape());
      value.copy_from(p.value);
      p.value = std::move(value);
    }
  }
  for (const int b : stored.buckets) {
    Bucket& bk = buckets_[static_cast<size_t>(b)];
    if (dist_opt) bk.comm_shard = Tensor({bk.shard_size}, DType::kF32, MemCategory::kComm);
    if (quantized) {
      for (const int i : bk.params) {
        const Param& p = params_[static_cast<size_t>(i)];
        if (p.value.ndim() != 2) {
          throw std::invalid_argument("DistributedDataParallel: quantized weight " + p.name + " is not 2-D");
        }
        bk.quantizers.emplace_back(p.value.dim(0), p.value.dim(1), *p.weight_quantization);
      }
      bk.codes = Tensor({(bk.end - bk.begin) / shard_multiple}, DType::kU8, MemCategory::kComm);
      bk.code_shard = Tensor({bk.shard_size / shard_multiple}, DType::kU8, MemCategory::kComm);
    }
    const bool wire16 = options_.grad_dtype != DType::kF32 ||
                        (dist_opt && !quantized && !bk.params_sharded && options_.param_gather_dtype != DType::kF32);
    if (wire16) {
      const DType wire_dtype = options_.grad_dtype != DType::kF32 ? options_.grad_dtype : options_.param_gather_dtype;
      // A unit with sharded gradients takes its whole 16-bit wire only while reducing (reduce_unit_grads) or, with
      // whole parameters, while gathering them after the step (start_bucket_gather).
      if (!bk.grads_sharded) bk.wire = Tensor({bk.end - bk.begin}, wire_dtype, MemCategory::kComm);
      if (dist_opt) bk.wire_shard = Tensor({bk.shard_size}, wire_dtype, MemCategory::kComm);
    }
    for (const int m : bk.modules) module_buckets_[static_cast<size_t>(m - min_module_)].push_back(b);
  }
}

void DistributedDataParallel::zero_grad() {
  const trace::Scope scope("zero grads", "step");
  complete_unit_reduces();
  for (Bucket& b : buckets_) {
    if (b.grad_launched) b.grad_work.wait();  // never let MPI write into a buffer being zeroed
  }
  if (!grads_zeroed_) {
    for (Group& g : groups_) zero_in_parallel(g.grad_buffer);
  }
  grads_zeroed_ = false;
  for (Param& p : params_) p.grad_zero = true;
  reset_round();
}

void DistributedDataParallel::reset_round() {
  std::fill(module_done_.begin(), module_done_.end(), 0);
  std::fill(tp_summed_.begin(), tp_summed_.end(), 0);
  for (Bucket& b : buckets_) b.grad_launched = false;
}

void DistributedDataParallel::tp_sum(const int param_index) {
  char& summed = tp_summed_[static_cast<size_t>(param_index)];
  if (summed) return;
  summed = 1;
  Param& p = params_[static_cast<size_t>(param_index)];
  if (!p.grad_sum_over_tp || p.is_expert || parallel_.tp.size() == 1) return;
  if (buckets_[static_cast<size_t>(slots_[static_cast<size_t>(param_index)].bucket)].grads_sharded) return;  // per unit
  const CommTimer timer(CommKind::kGradReduce);
  all_reduce_grads(parallel_.tp, p.grad);
}

void DistributedDataParallel::all_reduce_grads(const parallel::ProcessGroup& pg, Tensor& grads) {
  if (options_.grad_dtype == DType::kF32) return pg.all_reduce(grads, parallel::ReduceOp::kSum);
  Tensor wire({grads.numel()}, options_.grad_dtype, MemCategory::kComm);
  ops::convert(wire, grads);
  pg.all_reduce_16bit_async(wire).wait();
  ops::convert(grads, wire);
}

void DistributedDataParallel::launch(const int bucket_index) {
  Bucket& b = buckets_[static_cast<size_t>(bucket_index)];
  if (b.grad_launched || b.grads_sharded) return;  // sharded gradients are reduced per unit in after_backward
  wait_bucket_gather(b);                           // comm_shard is the all-gather's input
  Group& g = groups_[static_cast<size_t>(b.group)];
  const CommTimer timer(CommKind::kGradReduce);
  const auto n = static_cast<size_t>(b.end - b.begin);
  Tensor bucket = grad_view(bucket_index, b.begin, b.end);
  const DType wire = options_.grad_dtype;
  // Gradients written without after_backward (none in training) become buffer values first.
  if (wire != DType::kF32) ops::round_to_dtype_(bucket, wire);
  // Megatron's gradient_scaling_factor, applied to the buffer before the collective (in its dtype: a 16-bit buffer's
  // product is rounded to 16 bits); expert grads use the same 1 / dp-cp factor (they already hold the tokens of
  // every EP rank).
  const int dp_cp = parallel_.dp_cp.size();
  if (dp_cp > 1 && !options_.per_token_loss) {
    ops::scale_(bucket, 1.0 / static_cast<double>(dp_cp));
    if (wire != DType::kF32) ops::round_to_dtype_(bucket, wire);
  }
  parallel::CommStats::instance().add_bytes(CommKind::kGradReduce, static_cast<double>(n * dtype_size(wire)));
  if (wire != DType::kF32) {
    ops::convert(b.wire, bucket);  // exact: the bucket holds 16-bit values
    if (options_.use_distributed_optimizer) {
      b.grad_work = g.pg.reduce_scatter_16bit_async(b.wire, b.wire_shard);
    } else {
      b.grad_work = g.pg.all_reduce_16bit_async(b.wire);
    }
  } else if (options_.use_distributed_optimizer) {
    b.grad_work = g.pg.reduce_scatter_async(bucket, b.comm_shard, parallel::ReduceOp::kSum);
  } else {
    b.grad_work = g.pg.all_reduce_async(bucket, parallel::ReduceOp::kSum);
  }
  b.grad_work.trace_as(std::string(g.expert ? "expert " : "") + "grad reduce, bucket " + std::to_string(bucket_index));
  b.grad_launched = true;
}

void DistributedDataParallel::after_backward(const int module) {
  unit_in_backward_ = kNoModule;
  const int m = module - min_module_;
  const bool known = m >= 0 && m < static_cast<int>(module_done_.size());
  if (known && options_.grad_dtype != DType::kF32) {
    for (const int i : module_params_[static_cast<size_t>(m)]) {
      ops::round_to_dtype_(params_[static_cast<size_t>(i)].grad, options_.grad_dtype);
    }
  }
  if (fsdp_sharded_grads()) reduce_unit_grads(module);
  if (fsdp_zero3()) free_unit_params(module);
  if (!options_.overlap_grad_reduce || !last_microbatch_) return;
  parallel::drive_progress();  // the buckets launched so far advance while backward goes on
  if (!known) return;
  module_done_[static_cast<size_t>(m)] = 1;
  for (int i = static_cast<int>(params_.size()) - 1; i >= 0; --i) {
    if (params_[static_cast<size_t>(i)].module == module) tp_sum(i);
  }
  for (size_t b = 0; b < buckets_.size(); ++b) {
    const Bucket& bk = buckets_[b];
    if (bk.grad_launched) continue;
    const bool ready = std::all_of(bk.modules.begin(), bk.modules.end(), [&](const int mod) {
      return module_done_[static_cast<size_t>(mod - min_module_)] != 0;
    });
    if (ready) launch(static_cast<int>(b));
  }
}

void DistributedDataParallel::scale_gradients(const double factor) {
  if (options_.fsdp) throw std::logic_error("scale_gradients is not available under Megatron-FSDP");
  for (size_t b = 0; b < buckets_.size(); ++b) {
    Tensor grads = grad_view(static_cast<int>(b), buckets_[b].begin, buckets_[b].end);
    ops::scale_(grads, factor);
    if (options_.grad_dtype != DType::kF32) ops::round_to_dtype_(grads, options_.grad_dtype);
  }
}

void DistributedDataParallel::finish_grad_sync() {
  complete_unit_reduces();
  for (int i = static_cast<int>(params_.size()) - 1; i >= 0; --i) tp_sum(i);
  for (size_t b = 0; b < buckets_.size(); ++b) launch(static_cast<int>(b));
  {
    const CommTimer timer(CommKind::kGradReduce);
    for (Bucket& b : buckets_) b.grad_work.wait();
  }
  if (options_.grad_dtype != DType::kF32) {  // widen the 16-bit results
    for (Bucket& b : buckets_) {
      if (b.grads_sharded) continue;  // widened and accumulated per unit
      if (options_.use_distributed_optimizer) {
        ops::convert(b.comm_shard, b.wire_shard);
      } else {
        Tensor grad = grad_view(static_cast<int>(&b - buckets_.data()), b.begin, b.end);
        ops::convert(grad, b.wire);
      }
    }
  }
  if (options_.use_distributed_optimizer) {
    for (size_t bi = 0; bi < buckets_.size(); ++bi) {
      const Bucket& b = buckets_[bi];
      if (b.grads_sharded) continue;  // already accumulated into the shard
      Tensor grad = grad_view(static_cast<int>(bi), b.shard_begin, b.shard_begin + b.shard_size);
      std::memcpy(grad.data<float>(), std::as_const(b.comm_shard).data<float>(),
                  static_cast<size_t>(b.shard_size) * sizeof(float));
    }
  }
  allreduce_embedding_grads();
  reset_round();
}

void DistributedDataParallel::allreduce_embedding_grads() {
  if (parallel_.embedding.size() == 1) return;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!params_[i].sum_over_embedding_group) continue;
    const Slot& slot = slots_[i];
    const Bucket& b = buckets_[static_cast<size_t>(slot.bucket)];
    // The bucket holds this param alone on both stages, so with the distributed optimizer this rank's shard covers
    // the same elements there: the shard is what the optimizer reads.
    const int64_t begin = options_.use_distributed_optimizer ? b.shard_begin : slot.offset;
    const int64_t end = options_.use_distributed_optimizer ? b.shard_begin + b.shard_size : slot.offset + slot.numel;
    Tensor grad = grad_view(slot.bucket, begin, end);
    const CommTimer timer(CommKind::kGradReduce);
    all_reduce_grads(parallel_.embedding, grad);
  }
}

void DistributedDataParallel::start_param_gather() {
  if (!options_.use_distributed_optimizer) return;
  for (size_t bi = 0; bi < buckets_.size(); ++bi) {
    if (buckets_[bi].params_sharded) {
      // ZeRO-3: the updated shard is gathered before the unit's next forward; a prefetched copy is stale now.
      free_unit_params(buckets_[bi].modules.front());
      continue;
    }
    start_bucket_gather(static_cast<int>(bi));
  }
}

void DistributedDataParallel::start_bucket_gather(const int bucket_index) {
  Bucket& b = buckets_[static_cast<size_t>(bucket_index)];
  wait_bucket_gather(b);
  if (b.grad_launched) b.grad_work.wait();  // comm_shard is the reduce-scatter's output
  Group& g = groups_[static_cast<size_t>(b.group)];
  const std::string trace_name = "param gather, bucket " + std::to_string(bucket_index);
  if (g.quantized) {  // the shard's codes travel, one byte per FP8 element or per two FP4 elements
    quantize_shard(b);
    const CommTimer timer(CommKind::kParamGather);
    parallel::CommStats::instance().add_bytes(CommKind::kParamGather, static_cast<double>(b.code_shard.numel()));
    b.decode_gather = true;
    if (options_.overlap_param_gather) {
      b.param_work = g.pg.all_gather_async(b.code_shard, b.codes);
      b.param_work.trace_as(trace_name);
      b.param_in_flight = true;
    } else {
      g.pg.all_gather(b.code_shard, b.codes);
      decode_param_gather(b);
    }
    return;
  }
  const CommTimer timer(CommKind::kParamGather);
  const DType wire = options_.param_gather_dtype;
  parallel::CommStats::instance().add_bytes(CommKind::kParamGather,
                                            static_cast<double>(static_cast<size_t>(b.shard_size) * dtype_size(wire)));
  if (wire != DType::kF32) {  // 16-bit weights travel in 16 bits (exact: they hold 16-bit values)
    // An FSDP unit with sharded gradients keeps no standing wire (build): one lives from here to the decode.
    if (!b.wire.defined()) b.wire = Tensor({b.end - b.begin}, wire, MemCategory::kComm);
    ops::convert(b.wire_shard, param_view(bucket_index, b.shard_begin, b.shard_begin + b.shard_size));
    b.decode_gather = true;
    if (options_.overlap_param_gather) {
      b.param_work = g.pg.all_gather_async(b.wire_shard, b.wire);
      b.param_work.trace_as(trace_name);
      b.param_in_flight = true;
    } else {
      g.pg.all_gather(b.wire_shard, b.wire);
      decode_param_gather(b);
    }
    return;
  }
  const Tensor own = param_view(bucket_index, b.shard_begin, b.shard_begin + b.shard_size);
  std::memcpy(b.comm_shard.data<float>(), own.data<float>(), static_cast<size_t>(b.shard_size) * sizeof(float));
  const Tensor shard = b.comm_shard.slice_rows(0, b.shard_size);
  Tensor full = param_view(bucket_index, b.begin, b.end);
  if (options_.overlap_param_gather) {
    b.param_work = g.pg.all_gather_async(shard, full);
    b.param_work.trace_as(trace_name);
    b.param_in_flight = true;
  } else {
    g.pg.all_gather(shard, full);
  }
}

void DistributedDataParallel::quantize_shard(Bucket& bucket) {
  Group& g = groups_[static_cast<size_t>(bucket.group)];
  const float* values = g.param_buffer.data<float>();
  const int64_t shard_end = bucket.shard_begin + bucket.shard_size;
  // 1. Block amaxes of this rank's elements of every weight (zero for blocks it holds nothing of) ...
  std::vector<size_t> first_block(bucket.params.size() + 1, 0);
  for (size_t k = 0; k < bucket.params.size(); ++k) {
    first_block[k + 1] = first_block[k] + static_cast<size_t>(bucket.quantizers[k].num_blocks());
  }
  std::vector<float> amax(first_block.back(), 0.0f);
  const auto amax_of = [&](const size_t k) {
    return std::span<float>(amax.data() + first_block[k], first_block[k + 1] - first_block[k]);
  };
  for (size_t k = 0; k < bucket.params.size(); ++k) {
    const Slot& slot = slots_[static_cast<size_t>(bucket.params[k])];
    const Overlap o = overlap(slot.offset, slot.numel, bucket.shard_begin, shard_end);
    if (o.lo >= o.hi) continue;
    bucket.quantizers[k].accumulate_amax(
        o.lo - slot.offset, std::span<const float>(values + o.lo, static_cast<size_t>(o.hi - o.lo)), amax_of(k));
  }
  // 2. ... MAX-reduced over the group (TE's quantize_master_weights: one all-reduce of the packed amaxes) ...
  {
    const CommTimer timer(CommKind::kParamGather);
    parallel::CommStats::instance().add_bytes(CommKind::kParamGather, static_cast<double>(amax.size() * sizeof(float)));
    g.pg.all_reduce(std::span<float>(amax), parallel::ReduceOp::kMax);
  }
  // 3. ... give every rank the same scales; this rank encodes its elements (padding stays code 0).
  const bool packed = bucket.code_shard.numel() != bucket.shard_size;
  std::vector<uint8_t> unpacked;
  uint8_t* codes = bucket.code_shard.data<uint8_t>();
  if (packed) {
    unpacked.assign(static_cast<size_t>(bucket.shard_size), 0);
    codes = unpacked.data();
  } else {
    std::fill_n(codes, bucket.shard_size, uint8_t{0});
  }
  for (size_t k = 0; k < bucket.params.size(); ++k) {
    quant::ShardedWeightQuantizer& q = bucket.quantizers[k];
    Param& param = params_[static_cast<size_t>(bucket.params[k])];
    if (param.delayed_scaling) {
      // Delayed scaling (TE's cast_master_weights_to_fp8 with Float8Quantizer): the weight's current scale from its
      // amax history, the shard amaxes' maximum recorded into the history's pending row (the weight's slot).
      std::span<float> pending = param.delayed_scaling->pending_forward_amaxes();
      pending[1] = std::fmax(pending[1], amax_of(k)[0]);
      q.set_tensor_scale(param.delayed_scaling->scale_fwd()[1]);
    } else {
      q.set_scales(amax_of(k));
    }
    const Slot& slot = slots_[static_cast<size_t>(bucket.params[k])];
    const Overlap o = overlap(slot.offset, slot.numel, bucket.shard_begin, shard_end);
    if (o.lo >= o.hi) continue;
    const auto n = static_cast<size_t>(o.hi - o.lo);
    q.encode(o.lo - slot.offset, std::span<const float>(values + o.lo, n),
             std::span<uint8_t>(codes + (o.lo - bucket.shard_begin), n));
  }
  if (packed) {  // two E2M1 codes per byte, the even element in the low nibble
    uint8_t* out = bucket.code_shard.data<uint8_t>();
    for (int64_t j = 0; j < bucket.code_shard.numel(); ++j) {
      out[j] =
          static_cast<uint8_t>(unpacked[static_cast<size_t>(2 * j)] | (unpacked[static_cast<size_t>(2 * j + 1)] << 4));
    }
  }
}

void DistributedDataParallel::decode_codes(Bucket& bucket) {
  float* values = groups_[static_cast<size_t>(bucket.group)].param_buffer.data<float>();
  const uint8_t* codes = std::as_const(bucket.codes).data<uint8_t>();
  const bool packed = bucket.codes.numel() != bucket.end - bucket.begin;
  const auto count = static_cast<int64_t>(bucket.params.size());
#pragma omp parallel for schedule(dynamic) if (count > 1)
  for (int64_t k = 0; k < count; ++k) {
    const Slot& slot = slots_[static_cast<size_t>(bucket.params[static_cast<size_t>(k)])];
    const int64_t at = slot.offset - bucket.begin;
    const auto n = static_cast<size_t>(slot.numel);
    std::vector<uint8_t> unpacked;
    std::span<const uint8_t> param_codes(codes + at, packed ? 0 : n);
    if (packed) {
      unpacked.resize(n);
      for (size_t j = 0; j < n; ++j) {
        const int64_t e = at + static_cast<int64_t>(j);
        const uint8_t byte = codes[e / 2];
        unpacked[j] = static_cast<uint8_t>(e % 2 == 0 ? byte & 0x0F : byte >> 4);
      }
      param_codes = unpacked;
    }
    bucket.quantizers[static_cast<size_t>(k)].decode(0, param_codes, std::span<float>(values + slot.offset, n));
  }
}

void DistributedDataParallel::wait_bucket_gather(Bucket& bucket) {
  if (!bucket.param_in_flight) return;
  const CommTimer timer(CommKind::kParamGather);
  bucket.param_in_flight = false;
  bucket.param_work.wait();
  decode_param_gather(bucket);
}

void DistributedDataParallel::decode_param_gather(Bucket& bucket) {
  if (!bucket.decode_gather) return;
  bucket.decode_gather = false;
  if (groups_[static_cast<size_t>(bucket.group)].quantized) return decode_codes(bucket);
  Tensor full = param_view(static_cast<int>(&bucket - buckets_.data()), bucket.begin, bucket.end);
  ops::convert(full, bucket.wire);
  if (bucket.grads_sharded) bucket.wire = Tensor();
}

void DistributedDataParallel::before_forward(const int module) {
  before_recompute(module);
  if (fsdp_zero3() && unit_in_backward_ == kNoModule) start_unit_gather(module + 1);  // the next unit's prefetch
}

void DistributedDataParallel::before_recompute(const int module) {
  if (fsdp_zero3()) bind_unit_params(module);
  if (!options_.overlap_param_gather) return;
  parallel::drive_progress();
  for (const int b : buckets_of(module)) wait_bucket_gather(buckets_[static_cast<size_t>(b)]);
}

void DistributedDataParallel::after_forward(const int module) {
  // A forward recomputed inside the unit's backward keeps the parameters: Megatron-FSDP reshards post-backward under
  // recompute.
  if (fsdp_zero3() && module != unit_in_backward_) free_unit_params(module);
}

void DistributedDataParallel::before_backward(const int module) {
  unit_in_backward_ = module;
  if (fsdp_zero3()) {
    bind_unit_params(module);
    start_unit_gather(module - 1);  // the previous unit's prefetch
  }
  if (fsdp_sharded_grads()) bind_unit_grads(module);
}

void DistributedDataParallel::wait_param_gather() {
  for (Bucket& b : buckets_) wait_bucket_gather(b);
}

bool DistributedDataParallel::has_quantized_groups() const {
  return std::any_of(groups_.begin(), groups_.end(), [](const Group& g) { return g.quantized; });
}

void DistributedDataParallel::gather_quantized_params() {
  for (size_t bi = 0; bi < buckets_.size(); ++bi) {
    if (!groups_[static_cast<size_t>(buckets_[bi].group)].quantized) continue;
    start_bucket_gather(static_cast<int>(bi));
    wait_bucket_gather(buckets_[bi]);
  }
}

void DistributedDataParallel::quantize_replicated_weights() {
  for (Bucket& b : buckets_) {
    for (size_t k = 0; k < b.params.size() && !b.quantizers.empty(); ++k) {
      Param& p = params_[static_cast<size_t>(b.params[k])];
      quant::ShardedWeightQuantizer& q = b.quantizers[k];
      const std::span<float> values = p.value.span<float>();
      std::vector<float> amax(static_cast<size_t>(q.num_blocks()), 0.0f);
      q.accumulate_amax(0, values, amax);
      if (p.delayed_scaling) {  // the weight's current scale (1 before any update, TE's initial fp8_meta)
        q.set_tensor_scale(p.delayed_scaling->scale_fwd()[1]);
      } else {
        q.set_scales(amax);
      }
      std::vector<uint8_t> codes(values.size());
      q.encode(0, values, codes);
      q.decode(0, codes, values);
    }
  }
}

}  // namespace moecore
