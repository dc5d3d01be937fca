// Naive reference MLP activations, used by the tests.
#include <cmath>

#include "moecore/kernels/cpu/activation.h"

namespace moecore::kernels::ref {
namespace {

template <typename T>
T silu(const T x) {
  return x / (T(1) + std::exp(-x));
}

}  // namespace

template <typename T>
void swiglu_forward(T* out_TF, const T* inp_T2F, const int64_t n_tokens, const int64_t F) {
  for (int64_t t = 0; t < n_tokens; ++t) {
    for (int64_t f = 0; f < F; ++f) out_TF[t * F + f] = silu(inp_T2F[t * 2 * F + f]) * inp_T2F[t * 2 * F + F + f];
  }
}

// d silu(g)/dg = sigma(g) + g sigma(g) (1 - sigma(g)).
template <typename T>
void swiglu_backward(T* dinp_T2F, const T* dout_TF, const T* inp_T2F, const int64_t n_tokens, const int64_t F) {
  for (int64_t t = 0; t < n_tokens; ++t) {
    for (int64_t f = 0; f < F; ++f) {
      const T g = inp_T2F[t * 2 * F + f];
      const T u = inp_T2F[t * 2 * F + F + f];
      const T sig = T(1) / (T(1) + std::exp(-g));
      const T dy = dout_TF[t * F + f];
      dinp_T2F[t * 2 * F + f] += dy * u * (sig + g * sig * (T(1) - sig));
      dinp_T2F[t * 2 * F + F + f] += dy * silu(g);
    }
  }
}

// gelu(x) = x Phi(x), Phi(x) = erfc(-x / sqrt 2) / 2 (equal to (1 + erf(x / sqrt 2)) / 2, without cancellation).
template <typename T>
void gelu_forward(T* out, const T* inp, const int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = inp[i] * T(0.5) * std::erfc(-inp[i] / std::sqrt(T(2)));
}

// d/dx [x Phi(x)] = Phi(x) + x phi(x), phi(x) = exp(-x^2/2) / sqrt(2 pi).
template <typename T>
void gelu_backward(T* dinp, const T* dout, const T* inp, const int64_t n) {
  const T pi = T(3.14159265358979323846);
  for (int64_t i = 0; i < n; ++i) {
    const T x = inp[i];
    const T cdf = T(0.5) * std::erfc(-x / std::sqrt(T(2)));
    const T pdf = std::exp(-x * x / T(2)) / std::sqrt(T(2) * pi);
    dinp[i] += dout[i] * (cdf + x * pdf);
  }
}

template <typename T>
void squared_relu_forward(T* out, const T* inp, const int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const T r = inp[i] > T(0) ? inp[i] : T(0);
    out[i] = r * r;
  }
}

template <typename T>
void squared_relu_backward(T* dinp, const T* dout, const T* inp, const int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    if (inp[i] > T(0)) dinp[i] += T(2) * inp[i] * dout[i];
  }
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

}  // namespace moecore::kernels::ref
