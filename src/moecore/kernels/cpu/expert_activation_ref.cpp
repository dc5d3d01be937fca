// Naive reference of the weighted SwiGLU (expert_activation.h): Megatron's weighted_swiglu / weighted_swiglu_back
// formulas element by element, used by the tests.
#include <cmath>

#include "moecore/kernels/cpu/expert_activation.h"

namespace moecore::kernels::ref {

template <typename T>
void weighted_swiglu_forward(T* h_TF, const T* inp_T2F, const T* probs_T, const int64_t n_tokens, const int64_t F) {
  for (int64_t t = 0; t < n_tokens; ++t) {
    for (int64_t f = 0; f < F; ++f) {
      const T g = inp_T2F[t * 2 * F + f], u = inp_T2F[t * 2 * F + F + f];
      h_TF[t * F + f] = g / (T(1) + std::exp(-g)) * u * probs_T[t];
    }
  }
}

// swiglu_back(g, y) = [g sigma(y1) (1 + y1 (1 - sigma(y1))) y2 | g silu(y1)] with g = dh * p.
template <typename T>
void weighted_swiglu_backward(T* dinp_T2F, T* dprobs_T, const T* dh_TF, const T* inp_T2F, const T* probs_T,
                              const int64_t n_tokens, const int64_t F) {
  for (int64_t t = 0; t < n_tokens; ++t) {
    double dp = 0.0;
    for (int64_t f = 0; f < F; ++f) {
      const T g = inp_T2F[t * 2 * F + f], u = inp_T2F[t * 2 * F + F + f];
      const T sig = T(1) / (T(1) + std::exp(-g));
      const T dh = dh_TF[t * F + f];
      dp += static_cast<double>(g * sig * u) * static_cast<double>(dh);
      const T dact = dh * probs_T[t];
      dinp_T2F[t * 2 * F + f] = dact * sig * (T(1) + g * (T(1) - sig)) * u;
      dinp_T2F[t * 2 * F + F + f] = dact * g * sig;
    }
    dprobs_T[t] = static_cast<T>(dp);
  }
}

#define MOECORE_INSTANTIATE(T)                                                        \
  template void weighted_swiglu_forward<T>(T*, const T*, const T*, int64_t, int64_t); \
  template void weighted_swiglu_backward<T>(T*, T*, const T*, const T*, const T*, int64_t, int64_t);
MOECORE_INSTANTIATE(float)
MOECORE_INSTANTIATE(double)
#undef MOECORE_INSTANTIATE

}  // namespace moecore::kernels::ref
