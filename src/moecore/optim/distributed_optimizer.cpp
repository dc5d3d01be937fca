#include "moecore/optim/distributed_optimizer.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <span>
#include <stdexcept>

#include "moecore/ops/elementwise.h"
#include "moecore/ops/optim.h"
#include "moecore/ops/precision.h"
#include "moecore/parallel/comm_stats.h"

namespace moecore {

DistributedAdamW::DistributedAdamW(DistributedDataParallel& ddp, std::vector<Param>& params,
                                   const AdamWOptions& options)
    : ddp_(ddp), params_(params), options_(options) {
  if (&params != &ddp.params()) throw std::invalid_argument("DistributedAdamW: params differ from the DDP's");
  if (!ddp_.options().use_distributed_optimizer) {
    replicated_.emplace(params_, options_);
    return;
  }
  const auto& buckets = ddp_.buckets();
  // Quantized weights (--fp8-param-gather) hold their decoded codes, so their fp32 main parameters live here even
  // with fp32 weights (Megatron keeps every FP8 param in its float16 groups with an fp32 main copy).
  const bool keep_main = options_.params_dtype != DType::kF32 || ddp_.has_quantized_groups();
  for (const auto& b : buckets) {
    exp_avg_.emplace_back(std::vector<int64_t>{b.shard_size}, DType::kF32, MemCategory::kOptimizer);
    exp_avg_sq_.emplace_back(std::vector<int64_t>{b.shard_size}, DType::kF32, MemCategory::kOptimizer);
    if (keep_main) {
      main_.emplace_back(std::vector<int64_t>{b.shard_size}, DType::kF32, MemCategory::kOptimizer);
    }
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    const DistributedDataParallel::Slot& slot = ddp_.slots()[i];
    const auto& b = buckets[static_cast<size_t>(slot.bucket)];
    const int64_t lo = std::max(slot.offset, b.shard_begin);
    const int64_t hi = std::min(slot.offset + slot.numel, b.shard_begin + b.shard_size);
    if (lo < hi) pieces_.push_back({static_cast<int>(i), slot.bucket, lo, hi - lo});
  }
  main_params_from_model();
}

Tensor DistributedAdamW::param_piece(const Piece& piece) const {
  const auto& group = ddp_.groups()[static_cast<size_t>(ddp_.slots()[static_cast<size_t>(piece.param)].group)];
  return group.param_buffer.slice_rows(piece.offset, piece.offset + piece.numel);
}

Tensor DistributedAdamW::main_piece(const Piece& piece) const {
  const int64_t state = piece.offset - ddp_.buckets()[static_cast<size_t>(piece.bucket)].shard_begin;
  return main_[static_cast<size_t>(piece.bucket)].slice_rows(state, state + piece.numel);
}

void DistributedAdamW::main_params_from_model() {
  if (replicated_) return replicated_->main_params_from_model();
  if (main_.empty()) return;
  for (const Piece& piece : pieces_) {
    const Tensor param = param_piece(piece);
    Tensor main = main_piece(piece);
    std::copy_n(param.data<float>(), piece.numel, main.data<float>());
  }
  // Every rank rounds the whole replicated model alike, so the shards gathered later agree with the rest; the
  // quantized weights become their quantization (of the rounded values, as every later gather).
  for (Param& p : params_) ops::round_to_dtype_(p.value, options_.params_dtype);
  ddp_.quantize_replicated_weights();
}

void DistributedAdamW::model_from_main_params() {
  if (replicated_) return replicated_->model_from_main_params();
  if (main_.empty()) return;
  for (const Piece& piece : pieces_) {
    Tensor param = param_piece(piece);
    copy_main_to_model(param, main_piece(piece), options_.params_dtype);
  }
  // A quantized weight's scales depend on every shard: quantize and gather them now.
  if (ddp_.has_quantized_groups()) ddp_.gather_quantized_params();
}

bool DistributedAdamW::counted_in_norm(const Param& p) const {
  const parallel::ParallelState& ps = ddp_.parallel();
  const bool sharded = ddp_.options().use_distributed_optimizer;  // shards are disjoint over the DP group
  if (p.pipeline_copy) return false;                              // the first stage counts the tied embedding
  if (p.is_expert) return (sharded || ps.edp.rank() == 0) && (p.tensor_sharded() || ps.etp.rank() == 0);
  return (sharded || ps.dp_cp.rank() == 0) && (p.tensor_sharded() || ps.tp.rank() == 0);
}

Tensor DistributedAdamW::grad_piece(const Piece& piece) const {
  const auto& group = ddp_.groups()[static_cast<size_t>(ddp_.slots()[static_cast<size_t>(piece.param)].group)];
  return group.grad_buffer.slice_rows(piece.offset, piece.offset + piece.numel);
}

double DistributedAdamW::grad_norm() const {
  double sum = 0.0;
  if (replicated_) {
    for (const Param& p : params_) {
      if (counted_in_norm(p)) sum += ops::sum_squares(p.grad);
    }
  } else {
    for (const Piece& piece : pieces_) {
      const Param& p = params_[static_cast<size_t>(piece.param)];
      if (!counted_in_norm(p)) continue;
      sum += ops::sum_squares(grad_piece(piece));
    }
  }
  const parallel::ProcessGroup& world = ddp_.parallel().world;
  if (world.size() > 1) {
    const parallel::CommTimer timer(parallel::CommKind::kOther);
    sum = parallel::sum_double(world, sum);
  }
  return std::sqrt(sum);
}

double DistributedAdamW::clip_grad_norm(const double max_norm) {
  const double norm = grad_norm();
  if (max_norm > 0.0 && norm > max_norm) {
    const auto coeff = static_cast<float>(max_norm / (norm + 1e-6));
    if (replicated_) {
      for (Param& p : params_) ops::scale_(p.grad, coeff);
    } else {
      for (const Piece& piece : pieces_) {
        Tensor grad = grad_piece(piece);
        ops::scale_(grad, coeff);
      }
    }
  }
  return norm;
}

bool DistributedAdamW::unscale_grads_and_check_for_nan(const float inv_scale) {
  bool found = false;
  const auto visit = [&](Tensor& grad) {
    if (inv_scale != 1.0f) ops::scale_(grad, inv_scale);
    // Squares of fp32 values summed in double cannot overflow, so only an Inf or NaN element makes this non-finite.
    if (!std::isfinite(ops::sum_squares(grad))) found = true;
  };
  if (replicated_) {
    for (Param& p : params_) visit(p.grad);
  } else {
    for (const Piece& piece : pieces_) {
      Tensor grad = grad_piece(piece);
      visit(grad);
    }
  }
  const parallel::ProcessGroup& world = ddp_.parallel().world;
  if (world.size() == 1) return found;
  const parallel::CommTimer timer(parallel::CommKind::kOther);
  return parallel::sum_double(world, found ? 1.0 : 0.0) > 0.0;
}

void DistributedAdamW::inject_nonfinite_grad() {
  Tensor grad = replicated_ ? params_.front().grad : (pieces_.empty() ? Tensor() : grad_piece(pieces_.front()));
  if (grad.numel() > 0) grad.data<float>()[0] = std::numeric_limits<float>::infinity();
}

void DistributedAdamW::step(const double lr) {
  if (replicated_) return replicated_->step(lr);
  ddp_.wait_param_gather();  // the gather writes this rank's shard too
  ++step_;
  for (const Piece& piece : pieces_) {
    const Param& p = params_[static_cast<size_t>(piece.param)];
    auto& group = ddp_.groups()[static_cast<size_t>(ddp_.slots()[static_cast<size_t>(piece.param)].group)];
    const auto& bucket = ddp_.buckets()[static_cast<size_t>(piece.bucket)];
    const int64_t state = piece.offset - bucket.shard_begin;
    Tensor param = group.param_buffer.slice_rows(piece.offset, piece.offset + piece.numel);
    Tensor exp_avg = exp_avg_[static_cast<size_t>(piece.bucket)].slice_rows(state, state + piece.numel);
    Tensor exp_avg_sq = exp_avg_sq_[static_cast<size_t>(piece.bucket)].slice_rows(state, state + piece.numel);
    Tensor target = main_.empty() ? param : main_piece(piece);
    ops::adamw_step(target, grad_piece(piece), exp_avg, exp_avg_sq,
                    adamw_hyper(options_, lr, step_, p.no_weight_decay));
    if (!main_.empty()) copy_main_to_model(param, target, options_.params_dtype);
  }
  ddp_.start_param_gather();
}

std::vector<AdamWMomentSlice> DistributedAdamW::moment_slices() const {
  if (replicated_) return replicated_->moment_slices();
  std::vector<AdamWMomentSlice> slices;
  slices.reserve(pieces_.size());
  for (const Piece& piece : pieces_) {
    const DistributedDataParallel::Slot& slot = ddp_.slots()[static_cast<size_t>(piece.param)];
    const int64_t state = piece.offset - ddp_.buckets()[static_cast<size_t>(piece.bucket)].shard_begin;
    const auto bucket = static_cast<size_t>(piece.bucket);
    const int64_t begin = piece.offset - slot.offset;  // the piece's first element within the parameter
    slices.push_back({piece.param, begin, begin + piece.numel, exp_avg_[bucket].slice_rows(state, state + piece.numel),
                      exp_avg_sq_[bucket].slice_rows(state, state + piece.numel),
                      main_.empty() ? Tensor() : main_piece(piece)});
  }
  return slices;
}

}  // namespace moecore
