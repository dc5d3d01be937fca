#include "moecore/model/norm_module.h"

#include "moecore/kernels/cpu/norm.h"

namespace moecore {

NormStats NormModule::forward(float* out_RD, const float* inp_RD, const int64_t rows) const {
  const int64_t D = weight_->value.numel();
  NormStats stats;
  stats.rstd_R = Tensor({rows}, DType::kF32, MemCategory::kActivations);
  if (kind_ == Normalization::kRMSNorm) {
    kernels::cpu::rmsnorm_forward(out_RD, stats.rstd_R.data<float>(), inp_RD, weight_->value.data<float>(), rows, D,
                                  eps_);
  } else {
    stats.mean_R = Tensor({rows}, DType::kF32, MemCategory::kActivations);
    kernels::cpu::layernorm_forward(out_RD, stats.mean_R.data<float>(), stats.rstd_R.data<float>(), inp_RD,
                                    weight_->value.data<float>(), bias_ ? bias_->value.data<float>() : nullptr, rows, D,
                                    eps_);
  }
  return stats;
}

void NormModule::backward(float* dinp_RD, const float* dout_RD, const float* inp_RD, const NormStats& stats,
                          const int64_t rows) const {
  const int64_t D = weight_->value.numel();
  if (kind_ == Normalization::kRMSNorm) {
    kernels::cpu::rmsnorm_backward(dinp_RD, weight_->grad.data<float>(), dout_RD, inp_RD, weight_->value.data<float>(),
                                   stats.rstd_R.data<float>(), rows, D);
  } else {
    kernels::cpu::layernorm_backward(dinp_RD, weight_->grad.data<float>(), bias_ ? bias_->grad.data<float>() : nullptr,
                                     dout_RD, inp_RD, weight_->value.data<float>(), stats.mean_R.data<float>(),
                                     stats.rstd_R.data<float>(), rows, D);
  }
}

}  // namespace moecore
