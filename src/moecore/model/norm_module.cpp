#include "moecore/model/norm_module.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <utility>

#include "moecore/ops/convert.h"
#include "moecore/ops/norm.h"

namespace moecore {
namespace {

// The largest |x| of the finite rows whose statistics overflowed (rstd 0, or NaN from a LayerNorm mean of Inf and
// -Inf); nullopt when there is none.
template <typename T>
std::optional<double> largest_overflowed_row(const T* x_RD, const T* rstd_R, const int64_t rows, const int64_t D) {
  std::optional<double> largest;
  for (int64_t r = 0; r < rows; ++r) {
    if (rstd_R[r] > T(0)) continue;  // 1 / sqrt(a finite statistic + eps) is positive
    double row_largest = 0.0;
    bool finite = true;
    for (int64_t d = 0; d < D && finite; ++d) {
      const double value = static_cast<double>(x_RD[r * D + d]);
      finite = std::isfinite(value);
      row_largest = std::max(row_largest, std::fabs(value));
    }
    if (finite) largest = std::max(largest.value_or(0.0), row_largest);
  }
  return largest;
}

}  // namespace

NormOptions norm_options(const ModelConfig& config, const bool grad_sum_over_tp, const int module,
                         NormOverflowLog* overflow_log) {
  return NormOptions{config.normalization, config.norm_epsilon, grad_sum_over_tp, module, overflow_log};
}

NormModule::NormModule(const std::string& name, const int64_t width, const NormOptions& options, ParamStore& params)
    : kind_(options.kind), eps_(options.eps), name_(name), overflow_log_(options.overflow_log) {
  auto add = [&](const char* suffix, const InitKind init) -> Param& {
    Param p = make_param(name + suffix, {width}, init);
    p.grad_sum_over_tp = options.grad_sum_over_tp;
    p.module = options.module;
    return params.push_back(std::move(p));
  };
  weight_ = &add(".weight", InitKind::kOnes);
  if (kind_ == Normalization::kLayerNorm) bias_ = &add(".bias", InitKind::kZeros);
}

NormStats NormModule::forward(Tensor& out_RD, const Tensor& inp_RD) const {
  const int64_t rows = inp_RD.numel() / weight_->value.numel();
  NormStats stats;
  stats.rstd_R = Tensor({rows}, DType::kF32, MemCategory::kActivations);
  int64_t nonfinite_rows = 0;
  if (kind_ == Normalization::kRMSNorm) {
    nonfinite_rows = ops::rmsnorm_forward(out_RD, stats.rstd_R, inp_RD, weight_->value, eps_);
  } else {
    stats.mean_R = Tensor({rows}, DType::kF32, MemCategory::kActivations);
    nonfinite_rows = ops::layernorm_forward(out_RD, stats.mean_R, stats.rstd_R, inp_RD, weight_->value,
                                            bias_ ? &bias_->value : nullptr, eps_);
  }
  if (nonfinite_rows > 0 && overflow_log_ != nullptr) record_overflow(inp_RD, stats.rstd_R);
  return stats;
}

void NormModule::record_overflow(const Tensor& inp_16_RD, const Tensor& rstd_R) const {
  // Only finite rows: a row holding Inf or NaN makes a NaN output, which the loss check reports.
  const int64_t D = weight_->value.numel();
  Tensor inp_RD = inp_16_RD;  // a 16-bit activation read in fp32 (exact)
  if (inp_16_RD.dtype() == DType::kBF16 || inp_16_RD.dtype() == DType::kF16) {
    inp_RD = Tensor(inp_16_RD.shape(), DType::kF32, MemCategory::kOther, inp_16_RD.device());
    ops::convert(inp_RD, inp_16_RD);
  }
  const std::optional<double> largest =
      inp_RD.dtype() == DType::kF64
          ? largest_overflowed_row(inp_RD.data<double>(), rstd_R.data<double>(), rstd_R.numel(), D)
          : largest_overflowed_row(inp_RD.data<float>(), rstd_R.data<float>(), rstd_R.numel(), D);
  if (!largest) return;
  overflow_log_->record(NormOverflow{.module = weight_->module,
                                     .name = name_,
                                     .layernorm = kind_ == Normalization::kLayerNorm,
                                     .dtype = inp_RD.dtype(),
                                     .largest_input = *largest});
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
