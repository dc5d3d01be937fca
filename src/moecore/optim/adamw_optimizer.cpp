#include "moecore/optim/adamw_optimizer.h"

#include <cmath>

#include "moecore/ops/elementwise.h"
#include "moecore/ops/optim.h"

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

AdamWOptimizer::AdamWOptimizer(std::vector<Param>& params, const AdamWOptions& options)
    : params_(params), options_(options) {
  exp_avg_.reserve(params_.size());
  exp_avg_sq_.reserve(params_.size());
  for (const Param& p : params_) {
    exp_avg_.emplace_back(p.value.shape(), DType::kF32, MemCategory::kOptimizer);
    exp_avg_sq_.emplace_back(p.value.shape(), DType::kF32, MemCategory::kOptimizer);
  }
}

double AdamWOptimizer::grad_norm() const {
  double sum = 0.0;
  for (const Param& p : params_) sum += ops::sum_squares(p.grad);
  return std::sqrt(sum);
}

double AdamWOptimizer::clip_grad_norm(const double max_norm) {
  const double norm = grad_norm();
  if (max_norm > 0.0 && norm > max_norm) {
    const auto coeff = static_cast<float>(max_norm / (norm + 1e-6));
    for (Param& p : params_) ops::scale_(p.grad, coeff);
  }
  return norm;
}

void AdamWOptimizer::step(const double lr) {
  ++step_;
  for (size_t i = 0; i < params_.size(); ++i) {
    Param& p = params_[i];
    ops::adamw_step(p.value, p.grad, exp_avg_[i], exp_avg_sq_[i], adamw_hyper(options_, lr, step_, p.no_weight_decay));
  }
}

std::vector<AdamWMomentSlice> AdamWOptimizer::moment_slices() const {
  std::vector<AdamWMomentSlice> slices;
  slices.reserve(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    const int64_t n = exp_avg_[i].numel();
    slices.push_back({static_cast<int>(i), 0, n, exp_avg_[i].view({n}), exp_avg_sq_[i].view({n})});
  }
  return slices;
}

}  // namespace moecore
