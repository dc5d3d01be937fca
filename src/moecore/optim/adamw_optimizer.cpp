#include "moecore/optim/adamw_optimizer.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "moecore/ops/elementwise.h"
#include "moecore/ops/optim.h"
#include "moecore/ops/precision.h"

namespace moecore {

ops::AdamWHyper adamw_hyper(const AdamWOptions& options, const double lr, const int64_t step,
                            const bool no_weight_decay) {
  ops::AdamWHyper hp;
  hp.lr = lr;
  hp.beta1 = options.beta1;
  hp.beta2 = options.beta2;
  hp.eps = options.eps;
  hp.weight_decay = no_weight_decay ? 0.0 : options.weight_decay;
  hp.step = step;
  return hp;
}

void copy_main_to_model(Tensor& value, const Tensor& main, const DType params_dtype) {
  if (value.numel() != main.numel()) throw std::logic_error("copy_main_to_model: sizes differ");
  std::copy_n(main.data<float>(), main.numel(), value.data<float>());
  ops::round_to_dtype_(value, params_dtype);
}

AdamWOptimizer::AdamWOptimizer(ParamStore& params, const AdamWOptions& options) : params_(params), options_(options) {
  if (options_.exp_avg_format != quant::StateFormat::kF32 || options_.exp_avg_sq_format != quant::StateFormat::kF32 ||
      options_.main_params_format != quant::StateFormat::kF32 || options_.store_param_remainders) {
    throw std::invalid_argument(
        "AdamWOptimizer keeps fp32 states: reduced-precision states need the distributed optimizer");
  }
  exp_avg_.reserve(params_.size());
  exp_avg_sq_.reserve(params_.size());
  for (const Param& p : params_) {
    exp_avg_.emplace_back(p.value.shape(), DType::kF32, MemCategory::kOptimizer);
    exp_avg_sq_.emplace_back(p.value.shape(), DType::kF32, MemCategory::kOptimizer);
    if (options_.params_dtype != DType::kF32) main_.emplace_back(p.value.shape(), DType::kF32, MemCategory::kOptimizer);
  }
  main_params_from_model();
}

// Megatron's main parameters are the 16-bit model parameters widened (DistributedOptimizer's
// shard_model_param.clone().float(), Float16OptimizerWithFloat16Params alike): the weights are rounded first.
void AdamWOptimizer::main_params_from_model() {
  for (size_t i = 0; i < main_.size(); ++i) {
    ops::round_to_dtype_(params_[i].value, options_.params_dtype);
    std::copy_n(params_[i].value.data<float>(), main_[i].numel(), main_[i].data<float>());
  }
}

void AdamWOptimizer::model_from_main_params() {
  for (size_t i = 0; i < main_.size(); ++i) copy_main_to_model(params_[i].value, main_[i], options_.params_dtype);
}

double AdamWOptimizer::grad_norm() const {
  std::vector<Tensor> grads;
  grads.reserve(params_.size());
  for (const Param& p : params_) grads.push_back(p.grad);
  double sum = 0.0;
  for (const double term : ops::sum_squares_each(grads)) sum += term;
  return std::sqrt(sum);
}

std::optional<float> clip_coefficient(const double max_norm, const double norm) {
  if (!(max_norm > 0.0)) return std::nullopt;
  const double coeff = max_norm / (norm + 1e-6);
  if (!(coeff < 1.0)) return std::nullopt;
  return static_cast<float>(coeff);  // the scale kernel's fp32 factor
}

double AdamWOptimizer::clip_grad_norm(const double max_norm) {
  const double norm = grad_norm();
  if (const std::optional<float> coeff = clip_coefficient(max_norm, norm)) {
    for (Param& p : params_) ops::scale_(p.grad, *coeff);
  }
  return norm;
}

void AdamWOptimizer::step(const double lr, const float grad_scale, const bool consume_grads,
                          ops::WeightCastCarry* casts) {
  ++step_;
  // Last parameter first: the gradients the norm pass (grad_norm, in parameter order) read last are the ones still in
  // the last-level cache.
  for (size_t i = params_.size(); i-- > 0;) {
    Param& p = params_[i];
    ops::AdamWHyper hyper = adamw_hyper(options_, lr, step_, p.no_weight_decay);
    hyper.grad_scale = grad_scale;
    if (main_.empty()) {
      ops::adamw_step(p.value, p.grad, exp_avg_[i], exp_avg_sq_[i], hyper, nullptr, DType::kF32,
                      consume_grads ? &p.grad : nullptr);
    } else {
      Tensor cast =
          casts != nullptr && options_.params_dtype == DType::kBF16 ? casts->refresh(p.value, DType::kBF16) : Tensor();
      ops::adamw_step(main_[i], p.grad, exp_avg_[i], exp_avg_sq_[i], hyper, &p.value, options_.params_dtype,
                      consume_grads ? &p.grad : nullptr, cast.defined() ? &cast : nullptr);
    }
  }
}

std::vector<AdamWMomentSlice> AdamWOptimizer::moment_slices() const {
  std::vector<AdamWMomentSlice> slices;
  slices.reserve(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    const int64_t n = exp_avg_[i].numel();
    slices.push_back({static_cast<int>(i), 0, n, exp_avg_[i].view({n}), exp_avg_sq_[i].view({n}),
                      main_.empty() ? Tensor() : main_[i].view({n})});
  }
  return slices;
}

}  // namespace moecore
