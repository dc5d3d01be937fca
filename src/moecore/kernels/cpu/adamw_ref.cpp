// Naive AdamW: torch.optim.AdamW's update written out element by element in double.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "moecore/kernels/cpu/adamw.h"

namespace moecore::kernels::ref {

template <typename T>
void adamw_step(T* param, const T* grad, T* exp_avg, T* exp_avg_sq, int64_t n, const AdamWHyper& hp, T* model,
                const ActivationRounding model_rounding, T* grad_to_zero, uint16_t* model_bf16) {
  if (hp.step < 1) throw std::invalid_argument("ref::adamw_step: step=" + std::to_string(hp.step) + " must be >= 1");
  if (model != nullptr && !std::is_same_v<T, float>) {
    throw std::invalid_argument("ref::adamw_step: 16-bit model weights are written from float parameters only");
  }
  if (model_bf16 != nullptr && (model == nullptr || model_rounding != ActivationRounding::kBF16)) {
    throw std::invalid_argument("ref::adamw_step: bf16 bits of the model weights need bf16 model weights");
  }
  for (int64_t i = 0; i < n; ++i) {
    double p = static_cast<double>(param[i]);
    // The clipped gradient as clipping writes it: scaled in the element type.
    const double g = static_cast<double>(static_cast<T>(grad[i] * static_cast<T>(hp.grad_scale)));
    p *= 1.0 - hp.lr * hp.weight_decay;
    const double m = hp.beta1 * static_cast<double>(exp_avg[i]) + (1.0 - hp.beta1) * g;
    const double v = hp.beta2 * static_cast<double>(exp_avg_sq[i]) + (1.0 - hp.beta2) * g * g;
    const double bias_correction1 = 1.0 - std::pow(hp.beta1, static_cast<double>(hp.step));
    const double bias_correction2 = 1.0 - std::pow(hp.beta2, static_cast<double>(hp.step));
    p -= (hp.lr / bias_correction1) * m / (std::sqrt(v) / std::sqrt(bias_correction2) + hp.eps);
    param[i] = static_cast<T>(p);
    exp_avg[i] = static_cast<T>(m);
    exp_avg_sq[i] = static_cast<T>(v);
  }
  if (grad_to_zero != nullptr) std::fill(grad_to_zero, grad_to_zero + n, T(0));
  if constexpr (std::is_same_v<T, float>) {
    if (model == nullptr) return;
    std::copy(param, param + n, model);
    if (model_rounding == ActivationRounding::kBF16) round_bf16(model, n);
    if (model_rounding == ActivationRounding::kF16) round_fp16(model, n);
    if (model_bf16 != nullptr) encode_bf16(model_bf16, model, n);
  }
}

template void adamw_step<float>(float*, const float*, float*, float*, int64_t, const AdamWHyper&, float*,
                                ActivationRounding, float*, uint16_t*);
template void adamw_step<double>(double*, const double*, double*, double*, int64_t, const AdamWHyper&, double*,
                                 ActivationRounding, double*, uint16_t*);

}  // namespace moecore::kernels::ref
