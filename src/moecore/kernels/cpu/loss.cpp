// Fast softmax cross-entropy: one token per OpenMP iteration, max-subtracted exponentials (vectorised for float:
// AVX2 + FMA code chosen at run time when the CPU has it, so a portable build uses it too).
#include "moecore/kernels/cpu/loss.h"

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "moecore/kernels/cpu/softmax_rows.h"

namespace moecore::kernels::cpu {
namespace {

using softmax_rows::row_max;
using softmax_rows::scaled_softmax;
using softmax_rows::sum_exp;

// Below this many logits a call runs on one thread: fork/join would cost more than it saves.
constexpr int64_t kParallelWork = 32768;

// Runs before any parallel region: an exception must not escape one.
void check_targets(const int32_t* targets_T, int64_t n_tokens, int64_t V, const char* fn) {
  if (V <= 0 && n_tokens > 0) throw std::invalid_argument(std::string(fn) + ": V=" + std::to_string(V) + " <= 0");
  for (int64_t t = 0; t < n_tokens; ++t) {
    if (targets_T[t] < 0 || targets_T[t] >= V) {
      throw std::out_of_range(std::string(fn) + ": target " + std::to_string(targets_T[t]) + " at token " +
                              std::to_string(t) + " is outside [0, V=" + std::to_string(V) + ")");
    }
  }
}

}  // namespace

template <typename T>
void cross_entropy_forward(T* losses_T, T* lse_T, const T* logits_TV, const int32_t* targets_T, int64_t n_tokens,
                           int64_t V) {
  check_targets(targets_T, n_tokens, V, "cross_entropy_forward");
#pragma omp parallel for schedule(static) if (n_tokens * V > kParallelWork)
  for (int64_t t = 0; t < n_tokens; ++t) {
    const T* row = logits_TV + t * V;
    const T max_logit = row_max(row, V);
    const double sum = sum_exp(row, V, max_logit);
    const double lse = static_cast<double>(max_logit) + std::log(sum);
    lse_T[t] = static_cast<T>(lse);
    losses_T[t] = static_cast<T>(lse - static_cast<double>(row[targets_T[t]]));
  }
}

template <typename T>
void cross_entropy_backward(T* dlogits_TV, const T* dlosses_T, const T* logits_TV, const T* lse_T,
                            const int32_t* targets_T, int64_t n_tokens, int64_t V) {
  check_targets(targets_T, n_tokens, V, "cross_entropy_backward");
#pragma omp parallel for schedule(static) if (n_tokens * V > kParallelWork)
  for (int64_t t = 0; t < n_tokens; ++t) {
    const T* row = logits_TV + t * V;  // may be the same memory as drow: each element is read before it is written
    T* drow = dlogits_TV + t * V;
    const T dloss = dlosses_T[t], lse = lse_T[t];
    scaled_softmax(drow, row, V, lse, dloss);
    drow[targets_T[t]] -= dloss;
  }
}

template void cross_entropy_forward<float>(float*, float*, const float*, const int32_t*, int64_t, int64_t);
template void cross_entropy_forward<double>(double*, double*, const double*, const int32_t*, int64_t, int64_t);
template void cross_entropy_backward<float>(float*, const float*, const float*, const float*, const int32_t*, int64_t,
                                            int64_t);
template void cross_entropy_backward<double>(double*, const double*, const double*, const double*, const int32_t*,
                                             int64_t, int64_t);

}  // namespace moecore::kernels::cpu
