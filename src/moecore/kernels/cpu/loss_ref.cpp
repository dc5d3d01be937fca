// Naive softmax cross-entropy in double, one token at a time.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "moecore/kernels/cpu/loss.h"

namespace moecore::kernels::ref {
namespace {

void check_target(int32_t target, int64_t t, int64_t V, const char* fn) {
  if (target < 0 || target >= V) {
    throw std::out_of_range(std::string(fn) + ": target " + std::to_string(target) + " at token " + std::to_string(t) +
                            " is outside [0, V=" + std::to_string(V) + ")");
  }
}

template <typename T>
double log_sum_exp(const T* row, int64_t V) {
  double max_logit = -INFINITY;
  for (int64_t v = 0; v < V; ++v) max_logit = std::max(max_logit, static_cast<double>(row[v]));
  double sum = 0.0;
  for (int64_t v = 0; v < V; ++v) sum += std::exp(static_cast<double>(row[v]) - max_logit);
  return max_logit + std::log(sum);
}

}  // namespace

template <typename T>
void cross_entropy_forward(T* losses_T, T* lse_T, const T* logits_TV, const int32_t* targets_T, int64_t n_tokens,
                           int64_t V) {
  for (int64_t t = 0; t < n_tokens; ++t) {
    check_target(targets_T[t], t, V, "ref::cross_entropy_forward");
    const double lse = log_sum_exp(logits_TV + t * V, V);
    lse_T[t] = static_cast<T>(lse);
    losses_T[t] = static_cast<T>(lse - static_cast<double>(logits_TV[t * V + targets_T[t]]));
  }
}

template <typename T>
void cross_entropy_backward(T* dlogits_TV, const T* dlosses_T, const T* logits_TV, const T* lse_T,
                            const int32_t* targets_T, int64_t n_tokens, int64_t V) {
  for (int64_t t = 0; t < n_tokens; ++t) {
    check_target(targets_T[t], t, V, "ref::cross_entropy_backward");
    for (int64_t v = 0; v < V; ++v) {
      const double prob = std::exp(static_cast<double>(logits_TV[t * V + v]) - static_cast<double>(lse_T[t]));
      const double onehot = v == targets_T[t] ? 1.0 : 0.0;
      dlogits_TV[t * V + v] = static_cast<T>(static_cast<double>(dlosses_T[t]) * (prob - onehot));
    }
  }
}

template void cross_entropy_forward<float>(float*, float*, const float*, const int32_t*, int64_t, int64_t);
template void cross_entropy_forward<double>(double*, double*, const double*, const int32_t*, int64_t, int64_t);
template void cross_entropy_backward<float>(float*, const float*, const float*, const float*, const int32_t*, int64_t,
                                            int64_t);
template void cross_entropy_backward<double>(double*, const double*, const double*, const double*, const int32_t*,
                                             int64_t, int64_t);

}  // namespace moecore::kernels::ref
