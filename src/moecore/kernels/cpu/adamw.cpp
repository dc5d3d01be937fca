// Fast AdamW: the step's scalars precomputed in double, one fused OpenMP SIMD pass over the elements.
// The loop vectorises only when the compiler may drop errno handling for sqrt (-fno-math-errno); GCC ignores that
// option in pragmas and attributes, so it has to come from the build flags.
#include "moecore/kernels/cpu/adamw.h"

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace moecore::kernels::cpu {

namespace {
// Below this many elements a call runs on one thread: fork/join would cost more than it saves.
constexpr int64_t kParallelWork = 65536;
}  // namespace

template <typename T>
void adamw_step(T* param, const T* grad, T* exp_avg, T* exp_avg_sq, int64_t n, const AdamWHyper& hp) {
  if (hp.step < 1) throw std::invalid_argument("adamw_step: step=" + std::to_string(hp.step) + " must be >= 1");
  const double bias_correction1 = 1.0 - std::pow(hp.beta1, static_cast<double>(hp.step));
  const double bias_correction2 = 1.0 - std::pow(hp.beta2, static_cast<double>(hp.step));
  const T decay = static_cast<T>(1.0 - hp.lr * hp.weight_decay);
  const T beta1 = static_cast<T>(hp.beta1), one_minus_beta1 = static_cast<T>(1.0 - hp.beta1);
  const T beta2 = static_cast<T>(hp.beta2), one_minus_beta2 = static_cast<T>(1.0 - hp.beta2);
  const T step_size = static_cast<T>(hp.lr / bias_correction1);
  const T bias_correction2_sqrt = static_cast<T>(std::sqrt(bias_correction2));
  const T eps = static_cast<T>(hp.eps);
#pragma omp parallel for simd schedule(static) if (n > kParallelWork)
  for (int64_t i = 0; i < n; ++i) {
    const T g = grad[i];
    const T m = beta1 * exp_avg[i] + one_minus_beta1 * g;
    const T v = beta2 * exp_avg_sq[i] + one_minus_beta2 * g * g;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    param[i] = param[i] * decay - step_size * m / (std::sqrt(v) / bias_correction2_sqrt + eps);
  }
}

template void adamw_step<float>(float*, const float*, float*, float*, int64_t, const AdamWHyper&);
template void adamw_step<double>(double*, const double*, double*, double*, int64_t, const AdamWHyper&);

}  // namespace moecore::kernels::cpu
