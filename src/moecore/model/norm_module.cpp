#include "moecore/model/norm_module.h"

#include "moecore/ops/norm.h"

namespace moecore {

void NormModule::add_params(std::vector<Param>& params, const std::string& name, const int64_t width,
                            const Normalization kind, const bool grad_sum_over_tp, const int module) {
  auto add = [&](const char* suffix, const InitKind init) {
    Param p = make_param(name + suffix, {width}, init);
    p.grad_sum_over_tp = grad_sum_over_tp;
    p.module = module;
    params.push_back(std::move(p));
  };
  add(".weight", InitKind::kOnes);
  if (kind == Normalization::kLayerNorm) add(".bias", InitKind::kZeros);
}

NormModule NormModule::bind(std::vector<Param>& params, const std::string& name, const Normalization kind,
                            const double eps) {
  return NormModule(kind, eps, find_param(params, name + ".weight"),
                    kind == Normalization::kLayerNorm ? find_param(params, name + ".bias") : nullptr);
}

NormStats NormModule::forward(Tensor& out_RD, const Tensor& inp_RD) const {
  const int64_t rows = inp_RD.numel() / weight_->value.numel();
  NormStats stats;
  stats.rstd_R = Tensor({rows}, DType::kF32, MemCategory::kActivations);
  if (kind_ == Normalization::kRMSNorm) {
    ops::rmsnorm_forward(out_RD, stats.rstd_R, inp_RD, weight_->value, eps_);
  } else {
    stats.mean_R = Tensor({rows}, DType::kF32, MemCategory::kActivations);
    ops::layernorm_forward(out_RD, stats.mean_R, stats.rstd_R, inp_RD, weight_->value, bias_ ? &bias_->value : nullptr,
                           eps_);
  }
  return stats;
}

void NormModule::backward(Tensor& dinp_RD, const Tensor& dout_RD, const Tensor& inp_RD, const NormStats& stats) const {
  if (kind_ == Normalization::kRMSNorm) {
    ops::rmsnorm_backward(dinp_RD, weight_->grad, dout_RD, inp_RD, weight_->value, stats.rstd_R);
  } else {
    ops::layernorm_backward(dinp_RD, weight_->grad, bias_ ? &bias_->grad : nullptr, dout_RD, inp_RD, weight_->value,
                            stats.mean_R, stats.rstd_R);
  }
}

}  // namespace moecore
