// Naive AdamW: torch.optim.AdamW's update written out element by element in double.
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "moecore/kernels/cpu/adamw.h"

namespace moecore::kernels::ref {

template <typename T>
void adamw_step(T* param, const T* grad, T* exp_avg, T* exp_avg_sq, int64_t n, const AdamWHyper& hp) {
  if (hp.step < 1) throw std::invalid_argument("ref::adamw_step: step=" + std::to_string(hp.step) + " must be >= 1");
  for (int64_t i = 0; i < n; ++i) {
    double p = static_cast<double>(param[i]);
    const double g = static_cast<double>(grad[i]);
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
}

template void adamw_step<float>(float*, const float*, float*, float*, int64_t, const AdamWHyper&);
template void adamw_step<double>(double*, const double*, double*, double*, int64_t, const AdamWHyper&);

}  // namespace moecore::kernels::ref
