// Fast weighted SwiGLU (expert_activation.h): one pass over each token's features, the sigmoid from fast_exp (plain
// arithmetic, so the loop vectorises; glibc's expf is a scalar call), parallel over tokens when
// called outside a parallel region (GroupedMLP calls it per row tile from inside its own).
#include "moecore/kernels/cpu/expert_activation.h"

#include <cmath>

#include "moecore/kernels/cpu/fast_exp.h"
#include "moecore/kernels/cpu/vector_isa.h"

namespace moecore::kernels::cpu {
namespace {

constexpr int64_t kParallelMin = 32768;

inline double exp_of(const double x) { return std::exp(x); }
inline float exp_of(const float x) { return fast_exp(x); }

// sigma(g) = 1 / (1 + exp(-g)); exp(-g) = +inf below g = -88.7 gives 0, as it should.
template <typename T>
inline T sigmoid(const T g) {
  return T(1) / (T(1) + exp_of(-g));
}

template <typename T>
MOECORE_VECTOR_CLONES void forward_row(T* h, const T* gate, const T* up, const T p, const int64_t F) {
#pragma omp simd
  for (int64_t f = 0; f < F; ++f) h[f] = gate[f] * sigmoid(gate[f]) * up[f] * p;
}

template <typename T>
MOECORE_VECTOR_CLONES double backward_row(T* dgate, T* dup, const T* dh, const T* gate, const T* up, const T p,
                                          const int64_t F) {
  double dp = 0.0;
#pragma omp simd reduction(+ : dp)
  for (int64_t f = 0; f < F; ++f) {
    const T g = gate[f], u = up[f], sig = sigmoid(g), silu = g * sig;
    dp += static_cast<double>(silu * u) * static_cast<double>(dh[f]);
    const T dact = dh[f] * p;
    dgate[f] = dact * sig * (T(1) + g * (T(1) - sig)) * u;
    dup[f] = dact * silu;
  }
  return dp;
}

}  // namespace

template <typename T>
void weighted_swiglu_forward(T* h_TF, const T* inp_T2F, const T* probs_T, const int64_t n_tokens, const int64_t F) {
#pragma omp parallel for schedule(static) if (n_tokens * F > kParallelMin)
  for (int64_t t = 0; t < n_tokens; ++t) {
    forward_row(h_TF + t * F, inp_T2F + t * 2 * F, inp_T2F + t * 2 * F + F, probs_T[t], F);
  }
}

template <typename T>
void weighted_swiglu_backward(T* dinp_T2F, T* dprobs_T, const T* dh_TF, const T* inp_T2F, const T* probs_T,
                              const int64_t n_tokens, const int64_t F) {
#pragma omp parallel for schedule(static) if (n_tokens * F > kParallelMin)
  for (int64_t t = 0; t < n_tokens; ++t) {
    const T* inp = inp_T2F + t * 2 * F;
    T* dinp = dinp_T2F + t * 2 * F;
    dprobs_T[t] = static_cast<T>(backward_row(dinp, dinp + F, dh_TF + t * F, inp, inp + F, probs_T[t], F));
  }
}

#define MOECORE_INSTANTIATE(T)                                                        \
  template void weighted_swiglu_forward<T>(T*, const T*, const T*, int64_t, int64_t); \
  template void weighted_swiglu_backward<T>(T*, T*, const T*, const T*, const T*, int64_t, int64_t);
MOECORE_INSTANTIATE(float)
MOECORE_INSTANTIATE(double)
#undef MOECORE_INSTANTIATE

}  // namespace moecore::kernels::cpu
