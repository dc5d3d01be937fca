#include "moecore/optim/distributed_optimizer.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <functional>
#include <limits>
#include <span>
#include <stdexcept>

#include "moecore/ops/elementwise.h"
#include "moecore/ops/optim.h"
#include "moecore/ops/precision.h"
#include "moecore/parallel/comm_stats.h"

namespace moecore {

DistributedAdamW::DistributedAdamW(DistributedDataParallel& ddp, ParamStore& params, const AdamWOptions& options)
    : ddp_(ddp), params_(params), options_(options) {
  if (&params != &ddp.params()) throw std::invalid_argument("DistributedAdamW: params differ from the DDP's");
  const bool reduced = options_.exp_avg_format != StateFormat::kF32 ||
                       options_.exp_avg_sq_format != StateFormat::kF32 ||
                       options_.main_params_format != StateFormat::kF32 || options_.store_param_remainders;
  // TE keeps remainders only for bf16 weights with an fp32 master (fused_adam.py: store_param_remainders), and only
  // where it holds the master weights (the option is set as Megatron does, config/optimizer_master.h). A quantized
  // weight (--fp8-param-gather) holds decoded codes, not the high half of its main value: no remainders there.
  remainders_ = options_.store_param_remainders && options_.params_dtype == DType::kBF16 &&
                options_.main_params_format == StateFormat::kF32 && !ddp_.has_quantized_groups();
  if (options_.main_params_format != StateFormat::kF32 &&
      (options_.main_params_format != StateFormat::kF16 || options_.params_dtype == DType::kF32)) {
    throw std::invalid_argument("DistributedAdamW: main parameters are fp32, or fp16 with 16-bit weights");
  }
  if (!ddp_.options().use_distributed_optimizer) {
    if (reduced) throw std::invalid_argument("reduced-precision optimizer states need the distributed optimizer");
    replicated_.emplace(params_, options_);
    return;
  }
  const auto storage = [](const StateFormat format, const int64_t n) {
    return Tensor(std::vector<int64_t>{n}, ops::state_storage_dtype(format), MemCategory::kOptimizer);
  };
  const auto& buckets = ddp_.buckets();
  // Quantized weights (--fp8-param-gather) hold their decoded codes, so their fp32 main parameters live here even
  // with fp32 weights (Megatron keeps every FP8 param in its float16 groups with an fp32 main copy).
  const bool keep_main = options_.params_dtype != DType::kF32 || ddp_.has_quantized_groups();
  for (const auto& b : buckets) {
    exp_avg_.push_back(storage(options_.exp_avg_format, b.shard_size));
    exp_avg_sq_.push_back(storage(options_.exp_avg_sq_format, b.shard_size));
    if (remainders_) {
      // The int16 remainders, in a 16-bit tensor.
      main_.emplace_back(std::vector<int64_t>{b.shard_size}, DType::kBF16, MemCategory::kOptimizer);
    } else if (keep_main) {
      main_.push_back(storage(options_.main_params_format, b.shard_size));
    }
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    const DistributedDataParallel::Slot& slot = ddp_.slots()[i];
    const auto bucket = static_cast<size_t>(slot.bucket);
    const auto& b = buckets[bucket];
    const int64_t lo = std::max(slot.offset, b.shard_begin);
    const int64_t hi = std::min(slot.offset + slot.numel, b.shard_begin + b.shard_size);
    if (lo >= hi) continue;
    Piece piece{static_cast<int>(i), slot.bucket, lo, hi - lo, {}, {}, {}, {}};
    const int64_t state = lo - b.shard_begin;
    piece.exp_avg = ScaledState(exp_avg_[bucket].slice_rows(state, state + piece.numel), options_.exp_avg_format);
    piece.exp_avg_sq =
        ScaledState(exp_avg_sq_[bucket].slice_rows(state, state + piece.numel), options_.exp_avg_sq_format);
    if (remainders_) {
      piece.remainder = main_[bucket].slice_rows(state, state + piece.numel);
    } else if (!main_.empty()) {
      piece.main = ScaledState(main_[bucket].slice_rows(state, state + piece.numel), options_.main_params_format);
    }
    pieces_.push_back(std::move(piece));
  }
  main_params_from_model();
}

DType DistributedAdamW::decoupled_grad_dtype() const {
  return options_.decoupled_grads ? ddp_.options().grad_dtype : DType::kF32;
}

bool DistributedAdamW::fp32_states() const {
  return options_.exp_avg_format == StateFormat::kF32 && options_.exp_avg_sq_format == StateFormat::kF32 &&
         options_.main_params_format == StateFormat::kF32 && !remainders_;
}

Tensor DistributedAdamW::param_piece(const Piece& piece) const {
  return ddp_.param_view(piece.bucket, piece.offset, piece.offset + piece.numel);
}

void DistributedAdamW::main_params_from_model() {
  if (replicated_) return replicated_->main_params_from_model();
  if (main_.empty()) return;
  if (remainders_) {  // TE: the master is the bf16 weight with a zero remainder
    ddp_.round_params_(options_.params_dtype);
    for (Piece& piece : pieces_) piece.remainder.zero_();
    return;
  }
  // Megatron's main parameters are the 16-bit model parameters widened (shard_model_param.clone().float()): every
  // rank rounds the whole replicated model alike (so the shards gathered later agree with the rest), then copies its
  // shard; the quantized weights become their quantization (of the rounded values, as every later gather).
  ddp_.round_params_(options_.params_dtype);
  for (Piece& piece : pieces_) piece.main.assign(param_piece(piece));
  ddp_.quantize_replicated_weights();
}

void DistributedAdamW::model_from_main_params() {
  if (replicated_) return replicated_->model_from_main_params();
  if (main_.empty() || remainders_) return;  // remainders: the weights are the main values' high halves
  if (options_.main_params_format != StateFormat::kF32) {
    // TE holds the master weights: the loaded model weights stay (rounded to their dtype), as Megatron's
    // precision-aware path copies main to model parameters only inside the optimizer step.
    ddp_.round_params_(options_.params_dtype);
    return;
  }
  for (const Piece& piece : pieces_) {
    Tensor param = param_piece(piece);
    copy_main_to_model(param, piece.main.stored(), options_.params_dtype);
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
  return ddp_.grad_view(piece.bucket, piece.offset, piece.offset + piece.numel);
}

void DistributedAdamW::for_each_counted(
    const std::function<void(size_t param, const Param& p, const Piece* piece)>& visit) const {
  if (replicated_) {
    for (size_t i = 0; i < params_.size(); ++i) {
      if (counted_in_norm(params_[i])) visit(i, params_[i], nullptr);
    }
  } else {
    for (const Piece& piece : pieces_) {
      const auto i = static_cast<size_t>(piece.param);
      if (counted_in_norm(params_[i])) visit(i, params_[i], &piece);
    }
  }
}

double DistributedAdamW::sum_over_world(double sum) const {
  const parallel::ProcessGroup& world = ddp_.parallel().world;
  if (world.size() > 1) {
    const parallel::CommTimer timer(parallel::CommKind::kOther);
    sum = parallel::sum_double(world, sum);
  }
  return sum;
}

double DistributedAdamW::sum_over_counted(
    const std::function<double(size_t param, const Param& p, const Piece* piece)>& term) const {
  double sum = 0.0;
  for_each_counted([&](const size_t i, const Param& p, const Piece* piece) { sum += term(i, p, piece); });
  return sum_over_world(sum);
}

// The counted gradients' sums of squares in one pass over all of them (ops::sum_squares_each), added in order.
double DistributedAdamW::grad_norm() const {
  std::vector<Tensor> grads;
  for_each_counted(
      [&](size_t, const Param& p, const Piece* piece) { grads.push_back(piece ? grad_piece(*piece) : p.grad); });
  double sum = 0.0;
  for (const double term : ops::sum_squares_each(grads)) sum += term;
  return std::sqrt(sum_over_world(sum));
}

Tensor DistributedAdamW::main_param_fp32(const Piece& piece) const {
  if (remainders_) {
    Tensor main({piece.numel}, DType::kF32);
    ops::join_param_remainders(param_piece(piece), piece.remainder, main);
    return main;
  }
  return piece.main.format() == StateFormat::kF32 ? piece.main.stored() : piece.main.unscaled();
}

// Megatron's calc_params_l2_norm reads the fp32 main parameters where the optimizer keeps them (param.main_param,
// sharded under the distributed optimizer) and the model's values otherwise, each element once: the same elements
// the gradient norm counts.
double DistributedAdamW::params_norm() const {
  std::vector<AdamWMomentSlice> whole;  // the replicated optimizer's states, views in parameter order
  if (replicated_) whole = replicated_->moment_slices();
  return std::sqrt(sum_over_counted([&](const size_t i, const Param& p, const Piece* piece) {
    if (piece) return ops::sum_squares(main_.empty() ? param_piece(*piece) : main_param_fp32(*piece));
    const Tensor& main = whole[i].main_param;
    return ops::sum_squares(main.defined() ? main : p.value);
  }));
}

// Megatron's count_zeros_fp32: over the gradients the optimizer reads, each element once, summed over the ranks (a
// double holds every count below 2^53 exactly).
int64_t DistributedAdamW::count_zero_grads() const {
  return static_cast<int64_t>(sum_over_counted([&](size_t, const Param& p, const Piece* piece) {
    return static_cast<double>(ops::count_zeros(piece ? grad_piece(*piece) : p.grad));
  }));
}

double DistributedAdamW::clip_grad_norm(const double max_norm) {
  const double norm = grad_norm();
  if (const std::optional<float> coeff = clip_coefficient(max_norm, norm)) {
    if (replicated_) {
      for (Param& p : params_) ops::scale_(p.grad, *coeff);
    } else {
      for (const Piece& piece : pieces_) {
        Tensor grad = grad_piece(piece);
        ops::scale_(grad, *coeff);
        ops::round_to_dtype_(grad, decoupled_grad_dtype());
      }
    }
  }
  return norm;
}

bool DistributedAdamW::unscale_grads_and_check_for_nan(const float inv_scale) {
  const NonFiniteGrads found = unscale_grads_and_check_for_nan(inv_scale, inv_scale);
  return found.dense || found.expert;
}

DistributedAdamW::NonFiniteGrads DistributedAdamW::unscale_grads_and_check_for_nan(const float dense_inv_scale,
                                                                                   const float expert_inv_scale) {
  std::array<float, 2> found = {0.0f, 0.0f};  // dense, expert
  std::vector<Tensor> grads;
  std::vector<bool> expert_grads;
  const auto visit = [&](Tensor& grad, const bool expert) {
    const float inv_scale = expert ? expert_inv_scale : dense_inv_scale;
    if (inv_scale != 1.0f) {
      ops::scale_(grad, inv_scale);
      ops::round_to_dtype_(grad, decoupled_grad_dtype());
    }
    grads.push_back(grad);
    expert_grads.push_back(expert);
  };
  if (replicated_) {
    for (Param& p : params_) visit(p.grad, p.is_expert);
  } else {
    for (const Piece& piece : pieces_) {
      Tensor grad = grad_piece(piece);
      visit(grad, params_[static_cast<size_t>(piece.param)].is_expert);
    }
  }
  // Squares of fp32 values summed in double cannot overflow, so only an Inf or NaN element makes a sum non-finite.
  const std::vector<double> sums = ops::sum_squares_each(grads);
  for (size_t j = 0; j < sums.size(); ++j) {
    if (!std::isfinite(sums[j])) found[expert_grads[j] ? 1 : 0] = 1.0f;
  }
  const parallel::ProcessGroup& world = ddp_.parallel().world;
  if (world.size() > 1) {
    const parallel::CommTimer timer(parallel::CommKind::kOther);
    world.all_reduce(std::span<float>(found), parallel::ReduceOp::kMax);
  }
  return {found[0] > 0.0f, found[1] > 0.0f};
}

void DistributedAdamW::inject_nonfinite_grad() {
  Tensor grad = replicated_ ? params_.front().grad : (pieces_.empty() ? Tensor() : grad_piece(pieces_.front()));
  if (grad.numel() > 0) grad.data<float>()[0] = std::numeric_limits<float>::infinity();
}

void DistributedAdamW::step(const double lr, float grad_scale, const bool consume_grads, ops::WeightCastCarry* casts) {
  if (replicated_) {
    replicated_->step(lr, grad_scale, consume_grads, casts);
    if (consume_grads) ddp_.grads_zeroed();
    return;
  }
  ddp_.wait_param_gather();  // the gather writes this rank's shard too
  ++step_;
  const bool fp32 = fp32_states();
  // Where clipping rounds the scaled gradient (16-bit gradients) or the update reads the gradient elsewhere (reduced
  // states), the gradients are clipped in place first, as clip_grad_norm does.
  if (grad_scale != 1.0f && (!fp32 || decoupled_grad_dtype() != DType::kF32)) {
    for (const Piece& piece : pieces_) {
      Tensor grad = grad_piece(piece);
      ops::scale_(grad, grad_scale);
      ops::round_to_dtype_(grad, decoupled_grad_dtype());
    }
    grad_scale = 1.0f;
  }
  for (Piece& piece : pieces_) {
    const Param& p = params_[static_cast<size_t>(piece.param)];
    const ops::AdamWHyper hyper = adamw_hyper(options_, lr, step_, p.no_weight_decay);
    Tensor param = param_piece(piece);
    ScaledState* main = main_.empty() || remainders_ ? nullptr : &piece.main;
    if (!fp32) {
      scaled_adamw_step(param, grad_piece(piece), piece.exp_avg, piece.exp_avg_sq, main, options_.params_dtype, hyper,
                        remainders_ ? &piece.remainder : nullptr);
      continue;
    }
    Tensor exp_avg = piece.exp_avg.stored(), exp_avg_sq = piece.exp_avg_sq.stored();
    ops::AdamWHyper scaled = hyper;
    scaled.grad_scale = grad_scale;
    if (main) {
      Tensor target = main->stored();
      ops::adamw_step(target, grad_piece(piece), exp_avg, exp_avg_sq, scaled, &param, options_.params_dtype);
    } else {
      ops::adamw_step(param, grad_piece(piece), exp_avg, exp_avg_sq, scaled);
    }
  }
  ddp_.start_param_gather();
}

std::vector<AdamWMomentSlice> DistributedAdamW::moment_slices() const {
  if (replicated_) return replicated_->moment_slices();
  // fp32 states as views, reduced ones as fp32 copies (TE's get_unscaled_state).
  const auto tensor_of = [](const ScaledState& state) {
    return state.format() == StateFormat::kF32 ? state.stored() : state.unscaled();
  };
  std::vector<AdamWMomentSlice> slices;
  slices.reserve(pieces_.size());
  for (const Piece& piece : pieces_) {
    const DistributedDataParallel::Slot& slot = ddp_.slots()[static_cast<size_t>(piece.param)];
    const int64_t begin = piece.offset - slot.offset;  // the piece's first element within the parameter
    slices.push_back({piece.param, begin, begin + piece.numel, tensor_of(piece.exp_avg), tensor_of(piece.exp_avg_sq),
                      main_.empty() ? Tensor() : main_param_fp32(piece)});
  }
  return slices;
}

void DistributedAdamW::load_moment_slices(const std::vector<AdamWMomentSlice>& slices, const bool main_params) {
  if (replicated_) return;  // views: already written
  if (slices.size() != pieces_.size()) throw std::invalid_argument("load_moment_slices: not this optimizer's slices");
  for (size_t i = 0; i < pieces_.size(); ++i) {
    Piece& piece = pieces_[i];
    const AdamWMomentSlice& slice = slices[i];
    if (slice.param != piece.param || slice.end - slice.begin != piece.numel) {
      throw std::invalid_argument("load_moment_slices: not this optimizer's slices");
    }
    piece.exp_avg.assign(slice.exp_avg);
    piece.exp_avg_sq.assign(slice.exp_avg_sq);
    if (main_.empty() || !main_params) continue;
    if (remainders_) {
      Tensor param = param_piece(piece);
      ops::split_param_remainders(slice.main_param, param, piece.remainder);
    } else {
      piece.main.assign(slice.main_param);
    }
  }
}

int64_t DistributedAdamW::state_bytes() const {
  if (replicated_) {
    int64_t bytes = 0;
    for (const AdamWMomentSlice& s : replicated_->moment_slices()) {
      bytes += static_cast<int64_t>(s.exp_avg.nbytes() + s.exp_avg_sq.nbytes() +
                                    (s.main_param.defined() ? s.main_param.nbytes() : 0));
    }
    return bytes;
  }
  int64_t bytes = 0;
  for (const std::vector<Tensor>* states : {&exp_avg_, &exp_avg_sq_, &main_}) {
    for (const Tensor& t : *states) bytes += static_cast<int64_t>(t.nbytes());
  }
  return bytes;
}

}  // namespace moecore
