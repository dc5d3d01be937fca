// Fast MLP activations: OpenMP loops over chunks of elements (SwiGLU over tokens) with vectorisable bodies.
#include "moecore/kernels/cpu/activation.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "moecore/kernels/cpu/vector_isa.h"

namespace moecore::kernels::cpu {
namespace {

constexpr int64_t kParallelMin = 32768;
constexpr int64_t kChunk = 4096;  // elements per call of an element-wise body

template <typename T>
inline T sigmoid(const T x) {
  return T(1) / (T(1) + std::exp(-x));
}

// The loop bodies, compiled per vector ISA: one token of SwiGLU, elements [i0, i1) of the others.
template <typename T>
MOECORE_VECTOR_CLONES void swiglu_row(T* out, const T* gate, const T* up, const int64_t F) {
#pragma omp simd
  for (int64_t f = 0; f < F; ++f) out[f] = gate[f] * sigmoid(gate[f]) * up[f];
}

// The backward bodies evaluate the reference kernels' expressions operation for operation (and the library is
// built without FMA contraction), so they round identically whatever vector ISA runs them.
template <typename T>
MOECORE_VECTOR_CLONES void swiglu_row_backward(T* dgate, T* dup, const T* dout, const T* gate, const T* up,
                                               const int64_t F) {
#pragma omp simd
  for (int64_t f = 0; f < F; ++f) {
    const T g = gate[f];
    const T one_plus_exp = T(1) + std::exp(-g);
    const T sig = T(1) / one_plus_exp;
    dgate[f] += dout[f] * up[f] * (sig + g * sig * (T(1) - sig));  // silu'(g)
    dup[f] += dout[f] * (g / one_plus_exp);
  }
}

// Phi(x) = erfc(-x / sqrt 2) / 2: the same function as (1 + erf(x / sqrt 2)) / 2, but without the cancellation
// that costs the erf form most of its relative precision for negative x.
template <typename T>
MOECORE_VECTOR_CLONES void gelu_chunk(T* out, const T* inp, const int64_t i0, const int64_t i1) {
  const T inv_sqrt2 = static_cast<T>(1.0 / std::numbers::sqrt2);
#pragma omp simd
  for (int64_t i = i0; i < i1; ++i) out[i] = T(0.5) * inp[i] * std::erfc(-inp[i] * inv_sqrt2);
}

template <typename T>
MOECORE_VECTOR_CLONES void gelu_chunk_backward(T* dinp, const T* dout, const T* inp, const int64_t i0,
                                               const int64_t i1) {
  const T sqrt2 = std::sqrt(T(2)), sqrt_2pi = std::sqrt(T(2) * T(3.14159265358979323846));
#pragma omp simd
  for (int64_t i = i0; i < i1; ++i) {
    const T x = inp[i];
    const T cdf = T(0.5) * std::erfc(-x / sqrt2);
    const T pdf = std::exp(-x * x / T(2)) / sqrt_2pi;
    dinp[i] += dout[i] * (cdf + x * pdf);
  }
}

template <typename T>
MOECORE_VECTOR_CLONES void squared_relu_chunk(T* out, const T* inp, const int64_t i0, const int64_t i1) {
#pragma omp simd
  for (int64_t i = i0; i < i1; ++i) out[i] = inp[i] > T(0) ? inp[i] * inp[i] : T(0);
}

template <typename T>
MOECORE_VECTOR_CLONES void squared_relu_chunk_backward(T* dinp, const T* dout, const T* inp, const int64_t i0,
                                                       const int64_t i1) {
#pragma omp simd
  for (int64_t i = i0; i < i1; ++i) dinp[i] += inp[i] > T(0) ? T(2) * inp[i] * dout[i] : T(0);
}

}  // namespace

template <typename T>
void swiglu_forward(T* out_TF, const T* inp_T2F, const int64_t n_tokens, const int64_t F) {
#pragma omp parallel for schedule(static) if (n_tokens * F > kParallelMin)
  for (int64_t t = 0; t < n_tokens; ++t) swiglu_row(out_TF + t * F, inp_T2F + t * 2 * F, inp_T2F + t * 2 * F + F, F);
}

template <typename T>
void swiglu_backward(T* dinp_T2F, const T* dout_TF, const T* inp_T2F, const int64_t n_tokens, const int64_t F) {
#pragma omp parallel for schedule(static) if (n_tokens * F > kParallelMin)
  for (int64_t t = 0; t < n_tokens; ++t) {
    swiglu_row_backward(dinp_T2F + t * 2 * F, dinp_T2F + t * 2 * F + F, dout_TF + t * F, inp_T2F + t * 2 * F,
                        inp_T2F + t * 2 * F + F, F);
  }
}

template <typename T>
void gelu_forward(T* out, const T* inp, const int64_t n) {
#pragma omp parallel for schedule(static) if (n > kParallelMin)
  for (int64_t i = 0; i < n; i += kChunk) gelu_chunk(out, inp, i, std::min(n, i + kChunk));
}

template <typename T>
void gelu_backward(T* dinp, const T* dout, const T* inp, const int64_t n) {
#pragma omp parallel for schedule(static) if (n > kParallelMin)
  for (int64_t i = 0; i < n; i += kChunk) gelu_chunk_backward(dinp, dout, inp, i, std::min(n, i + kChunk));
}

template <typename T>
void squared_relu_forward(T* out, const T* inp, const int64_t n) {
#pragma omp parallel for schedule(static) if (n > kParallelMin)
  for (int64_t i = 0; i < n; i += kChunk) squared_relu_chunk(out, inp, i, std::min(n, i + kChunk));
}

template <typename T>
void squared_relu_backward(T* dinp, const T* dout, const T* inp, const int64_t n) {
#pragma omp parallel for schedule(static) if (n > kParallelMin)
  for (int64_t i = 0; i < n; i += kChunk) squared_relu_chunk_backward(dinp, dout, inp, i, std::min(n, i + kChunk));
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
