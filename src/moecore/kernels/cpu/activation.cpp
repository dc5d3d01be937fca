// Fast MLP activations: flat OpenMP loops over elements (SwiGLU over tokens) with vectorisable bodies.
#include "moecore/kernels/cpu/activation.h"

#include <cmath>
#include <numbers>

namespace moecore::kernels::cpu {
namespace {

constexpr int64_t kParallelMin = 32768;

template <typename T>
inline T sigmoid(const T x) {
  return T(1) / (T(1) + std::exp(-x));
}

}  // namespace

template <typename T>
void swiglu_forward(T* out_TF, const T* inp_T2F, const int64_t n_tokens, const int64_t F) {
#pragma omp parallel for schedule(static) if (n_tokens * F > kParallelMin)
  for (int64_t t = 0; t < n_tokens; ++t) {
    const T* gate = inp_T2F + t * 2 * F;
    const T* up = gate + F;
    T* out = out_TF + t * F;
#pragma omp simd
    for (int64_t f = 0; f < F; ++f) out[f] = gate[f] * sigmoid(gate[f]) * up[f];
  }
}

template <typename T>
void swiglu_backward(T* dinp_T2F, const T* dout_TF, const T* inp_T2F, const int64_t n_tokens, const int64_t F) {
#pragma omp parallel for schedule(static) if (n_tokens * F > kParallelMin)
  for (int64_t t = 0; t < n_tokens; ++t) {
    const T* gate = inp_T2F + t * 2 * F;
    const T* up = gate + F;
    const T* dout = dout_TF + t * F;
    T* dgate = dinp_T2F + t * 2 * F;
    T* dup = dgate + F;
#pragma omp simd
    for (int64_t f = 0; f < F; ++f) {
      const T g = gate[f];
      const T sig = sigmoid(g);
      dgate[f] += dout[f] * up[f] * sig * (T(1) + g * (T(1) - sig));  // silu'(g)
      dup[f] += dout[f] * g * sig;
    }
  }
}

// Phi(x) = erfc(-x / sqrt 2) / 2: the same function as (1 + erf(x / sqrt 2)) / 2, but without the cancellation
// that costs the erf form most of its relative precision for negative x.
template <typename T>
void gelu_forward(T* out, const T* inp, const int64_t n) {
  const T inv_sqrt2 = static_cast<T>(1.0 / std::numbers::sqrt2);
#pragma omp parallel for simd schedule(static) if (n > kParallelMin)
  for (int64_t i = 0; i < n; ++i) out[i] = T(0.5) * inp[i] * std::erfc(-inp[i] * inv_sqrt2);
}

template <typename T>
void gelu_backward(T* dinp, const T* dout, const T* inp, const int64_t n) {
  const T inv_sqrt2 = static_cast<T>(1.0 / std::numbers::sqrt2);
  const T inv_sqrt_2pi = static_cast<T>(std::numbers::inv_sqrtpi / std::numbers::sqrt2);
#pragma omp parallel for simd schedule(static) if (n > kParallelMin)
  for (int64_t i = 0; i < n; ++i) {
    const T x = inp[i];
    const T cdf = T(0.5) * std::erfc(-x * inv_sqrt2);
    const T pdf = inv_sqrt_2pi * std::exp(T(-0.5) * x * x);
    dinp[i] += dout[i] * (cdf + x * pdf);
  }
}

template <typename T>
void squared_relu_forward(T* out, const T* inp, const int64_t n) {
#pragma omp parallel for simd schedule(static) if (n > kParallelMin)
  for (int64_t i = 0; i < n; ++i) out[i] = inp[i] > T(0) ? inp[i] * inp[i] : T(0);
}

template <typename T>
void squared_relu_backward(T* dinp, const T* dout, const T* inp, const int64_t n) {
#pragma omp parallel for simd schedule(static) if (n > kParallelMin)
  for (int64_t i = 0; i < n; ++i) dinp[i] += inp[i] > T(0) ? T(2) * inp[i] * dout[i] : T(0);
}

#define MOECORE_INSTANTIATE(T)                                                \
  template void swiglu_forward<T>(T*, const T*, int64_t, int64_t);            \
  template void swiglu_backward<T>(T*, const T*, const T*, int64_t, int64_t); \
  template void gelu_forward<T>(T*, const T*, int64_t);                       \
  template void gelu_backward<T>(T*, const T*, const T*, int64_t);            \
  template void squared_relu_forward<T>(T*, const T*, int64_t);               \
  template void squared_relu_backward<T>(T*, const T*, const T*, int64_t);
MOECORE_INSTANTIATE(float)
MOECORE_INSTANTIATE(double)
#undef MOECORE_INSTANTIATE

}  // namespace moecore::kernels::cpu
