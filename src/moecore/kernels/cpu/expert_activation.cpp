// Fast weighted SwiGLU (expert_activation.h): one pass over each token's features, the sigmoid from an exponential
// written in plain arithmetic so the loop vectorises (glibc's expf is a scalar call), parallel over tokens when
// called outside a parallel region (GroupedMLP calls it per row tile from inside its own).
#include "moecore/kernels/cpu/expert_activation.h"

#include <algorithm>
#include <bit>
#include <cmath>

#include "moecore/kernels/cpu/vector_isa.h"

namespace moecore::kernels::cpu {
namespace {

constexpr int64_t kParallelMin = 32768;

// exp(x) for x <= 0 in float: Cody-Waite range reduction and Cephes' degree-6 polynomial (about 1 ulp), without
// branches so that the loops below vectorise; below -87 it returns exp(-87) ~ 1.6e-38 instead of flushing to 0.
inline float exp_nonpositive(float x) {
  // x = max(x, -87) on the bit patterns: for x <= 0 they grow with |x| (GCC does not vectorise the float max here).
  x = std::bit_cast<float>(std::min(std::bit_cast<uint32_t>(x), std::bit_cast<uint32_t>(-87.0f)));
  // n = x / ln 2 rounded to an integer (truncating x / ln 2 - 0.5 toward zero, x <= 0): std::floor would not
  // vectorise.
  const int32_t n_int = static_cast<int32_t>(x * 1.44269504088896341f - 0.5f);
  const float n = static_cast<float>(n_int);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  return y * std::bit_cast<float>((n_int + 127) << 23);
}
inline double exp_nonpositive(const double x) { return std::exp(x); }

// sigma(g) from e = exp(-|g|), which never overflows: 1 / (1 + e) for g >= 0, e / (1 + e) below.
template <typename T>
inline T sigmoid(const T g) {
  const T e = exp_nonpositive(-std::abs(g));
  return (g >= T(0) ? T(1) : e) / (T(1) + e);
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
