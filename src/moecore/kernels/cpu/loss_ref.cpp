// Naive softmax cross-entropy in double, one token at a time.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

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

// The unfused sequence, token by token: round the row, forward, backward, round the gradient.
template <typename T>
void cross_entropy_fused(T* losses_T, T* lse_T, T* logits_TV, const T* dlosses_T, uint16_t* dlogits16_TV,
                         const int32_t* targets_T, const ActivationRounding rounding, const int64_t n_tokens,
                         const int64_t V) {
  if (rounding != ActivationRounding::kNone && !std::is_same_v<T, float>) {
    throw std::invalid_argument("ref::cross_entropy_fused: rounding applies to float logits only");
  }
  if (dlogits16_TV != nullptr && rounding == ActivationRounding::kNone) {
    throw std::invalid_argument("ref::cross_entropy_fused: 16-bit gradients need a 16-bit rounding");
  }
  for (int64_t t = 0; t < n_tokens; ++t) check_target(targets_T[t], t, V, "ref::cross_entropy_fused");
  std::vector<T> drow(dlogits16_TV != nullptr ? static_cast<size_t>(V) : 0);
  for (int64_t t = 0; t < n_tokens; ++t) {
    T* row = logits_TV + t * V;
    if constexpr (std::is_same_v<T, float>) {
      if (rounding == ActivationRounding::kBF16) round_bf16(row, V);
      if (rounding == ActivationRounding::kF16) round_fp16(row, V);
    }
    cross_entropy_forward(losses_T + t, lse_T + t, row, targets_T + t, 1, V);
    if (dlosses_T == nullptr) continue;
    T* grad = dlogits16_TV != nullptr ? drow.data() : row;
    cross_entropy_backward(grad, dlosses_T + t, row, lse_T + t, targets_T + t, 1, V);
    if constexpr (std::is_same_v<T, float>) {
      if (dlogits16_TV != nullptr) {
        rounding == ActivationRounding::kBF16 ? encode_bf16(dlogits16_TV + t * V, grad, V)
                                              : encode_fp16(dlogits16_TV + t * V, grad, V);
      } else if (rounding == ActivationRounding::kBF16) {
        round_bf16(grad, V);
      } else if (rounding == ActivationRounding::kF16) {
        round_fp16(grad, V);
      }
    }
  }
}

void cross_entropy_fused16(float* losses_T, float* lse_T, uint16_t* logits16_TV, const float* dlosses_T,
                           const int32_t* targets_T, const ActivationRounding format, const int64_t n_tokens,
                           const int64_t V) {
  if (format == ActivationRounding::kNone) {
    throw std::invalid_argument("ref::cross_entropy_fused16: the logits' 16-bit format is needed");
  }
  std::vector<float> logits(static_cast<size_t>(n_tokens * V));
  format == ActivationRounding::kBF16 ? decode_bf16(logits.data(), logits16_TV, n_tokens * V)
                                      : decode_fp16(logits.data(), logits16_TV, n_tokens * V);
  cross_entropy_fused(losses_T, lse_T, logits.data(), dlosses_T, dlosses_T != nullptr ? logits16_TV : nullptr,
                      targets_T, format, n_tokens, V);
}

template void cross_entropy_forward<float>(float*, float*, const float*, const int32_t*, int64_t, int64_t);
template void cross_entropy_forward<double>(double*, double*, const double*, const int32_t*, int64_t, int64_t);
template void cross_entropy_backward<float>(float*, const float*, const float*, const float*, const int32_t*, int64_t,
                                            int64_t);
template void cross_entropy_backward<double>(double*, const double*, const double*, const double*, const int32_t*,
                                             int64_t, int64_t);
template void cross_entropy_fused<float>(float*, float*, float*, const float*, uint16_t*, const int32_t*,
                                         ActivationRounding, int64_t, int64_t);
template void cross_entropy_fused<double>(double*, double*, double*, const double*, uint16_t*, const int32_t*,
                                          ActivationRounding, int64_t, int64_t);

}  // namespace moecore::kernels::ref
