// Fast softmax cross-entropy: one token per OpenMP iteration, max-subtracted exponentials (vectorised for float:
// AVX-512 or AVX2 + FMA code chosen at run time when the CPU has it, so a portable build uses it too).
#include "moecore/kernels/cpu/loss.h"

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "moecore/kernels/cpu/bf16_value.h"
#include "moecore/kernels/cpu/softmax_rows.h"
#include "moecore/kernels/cpu/vector_isa.h"

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

// A row rounded to bf16 values in place, in registers (through 16-bit bits it is two passes).
MOECORE_VECTOR_CLONES void round_bf16_row(float* row, const int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) row[i] = bf16_value(row[i]);
}

// cross_entropy_fused's row with 16-bit rounding and the gradient in place: the loss and lse of the row rounded to the
// format, and its gradient, rounded. Rounding the row, its max, the sum of exponentials, the softmax gradient and
// rounding it are five passes over the row (fp16 rounds through 16-bit bits: seven), the roundings a third of the
// time or more; here three, on the 16-lane prefix: the max of the unrounded row, rounded (rounding to nearest is
// monotonic: the max of the rounded values), the sum rounding each value in registers as it reads it and writing it
// back, and the gradient rounding each value before it stores it (bf16_value16 / fp16_value16: the same bits). The
// tail past the prefix is rounded in place first and takes the passes as they are.
void loss_and_gradient_rounded_row(float* loss, float* lse, float* row, const int64_t V, const int32_t target,
                                   const float dloss, const ActivationRounding rounding) {
  const bool bf16 = rounding == ActivationRounding::kBF16;
  const auto round_in_place = [&](float* data, const int64_t n) {
    if (n == 0) return;
    bf16 ? round_bf16_row(data, n) : round_fp16(data, n);
  };
  int64_t prefix = 0;
#if defined(MOECORE_HAVE_AVX2_PATH)
  if (softmax_rows::cpu_has_avx512f()) prefix = V - V % 16;
#endif
  round_in_place(row + prefix, V - prefix);
  float max_logit = row_max(row, V);
  round_in_place(&max_logit, 1);
  double sum = 0.0;
#if defined(MOECORE_HAVE_AVX2_PATH)
  if (prefix > 0) {
    using softmax_rows::bf16_value16, softmax_rows::fp16_value16;
    int64_t v = bf16 ? softmax_rows::sum_exp_rounded_avx512<bf16_value16>(sum, row, V, max_logit)
                     : softmax_rows::sum_exp_rounded_avx512<fp16_value16>(sum, row, V, max_logit);
    for (; v < V; ++v) sum += softmax_rows::exp_nonpositive(row[v] - max_logit);
  }
#endif
  if (prefix == 0) sum = sum_exp(row, V, max_logit);
  const double lse_row = static_cast<double>(max_logit) + std::log(sum);
  *lse = static_cast<float>(lse_row);
  *loss = static_cast<float>(lse_row - static_cast<double>(row[target]));  // rounded in place by now
#if defined(MOECORE_HAVE_AVX2_PATH)
  if (prefix > 0) {
    using softmax_rows::bf16_value16, softmax_rows::fp16_value16;
    bf16 ? softmax_rows::scaled_softmax_rounded_avx512<bf16_value16>(row, V, *lse, dloss, target)
         : softmax_rows::scaled_softmax_rounded_avx512<fp16_value16>(row, V, *lse, dloss, target);
  }
#endif
  scaled_softmax(row + prefix, row + prefix, V - prefix, *lse, dloss);
  if (target >= prefix) row[target] -= dloss;
  round_in_place(row + prefix, V - prefix);
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

template <typename T>
void cross_entropy_fused(T* losses_T, T* lse_T, T* logits_TV, const T* dlosses_T, uint16_t* dlogits16_TV,
                         const int32_t* targets_T, const ActivationRounding rounding, const int64_t n_tokens,
                         const int64_t V) {
  if (rounding != ActivationRounding::kNone && !std::is_same_v<T, float>) {
    throw std::invalid_argument("cross_entropy_fused: rounding applies to float logits only");
  }
  if (dlogits16_TV != nullptr && rounding == ActivationRounding::kNone) {
    throw std::invalid_argument("cross_entropy_fused: 16-bit gradients need a 16-bit rounding");
  }
  check_targets(targets_T, n_tokens, V, "cross_entropy_fused");
  const ConvertIsa isa = best_convert_isa();
#pragma omp parallel if (n_tokens * V > kParallelWork)
  {
    // One row's fp16 bits (fp16 rounding goes through them; bf16 rounds in registers) and, for 16-bit gradients, its
    // fp32 gradient.
    std::vector<uint16_t> bits(rounding == ActivationRounding::kF16 ? static_cast<size_t>(V) : 0);
    std::vector<T> drow(dlogits16_TV != nullptr ? static_cast<size_t>(V) : 0);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < n_tokens; ++t) {
      T* row = logits_TV + t * V;
      if constexpr (std::is_same_v<T, float>) {
        if (rounding != ActivationRounding::kNone && dlosses_T != nullptr && dlogits16_TV == nullptr) {
          loss_and_gradient_rounded_row(losses_T + t, lse_T + t, row, V, targets_T[t], dlosses_T[t], rounding);
          continue;
        }
        if (rounding == ActivationRounding::kBF16) {
          round_bf16_row(row, V);
        } else if (rounding == ActivationRounding::kF16) {
          encode_fp16(bits.data(), row, V, isa);
          decode_fp16(row, bits.data(), V, isa);
        }
      }
      const T max_logit = row_max(row, V);
      const double lse = static_cast<double>(max_logit) + std::log(sum_exp(row, V, max_logit));
      lse_T[t] = static_cast<T>(lse);
      losses_T[t] = static_cast<T>(lse - static_cast<double>(row[targets_T[t]]));
      if (dlosses_T == nullptr) continue;
      T* grad = dlogits16_TV != nullptr ? drow.data() : row;
      scaled_softmax(grad, row, V, lse_T[t], dlosses_T[t]);
      grad[targets_T[t]] -= dlosses_T[t];
      if constexpr (std::is_same_v<T, float>) {
        if (dlogits16_TV == nullptr && rounding == ActivationRounding::kBF16) {
          round_bf16_row(grad, V);
          continue;
        }
        uint16_t* out = dlogits16_TV != nullptr ? dlogits16_TV + t * V : bits.data();
        if (rounding == ActivationRounding::kBF16) encode_bf16(out, grad, V, isa);
        if (rounding == ActivationRounding::kF16) encode_fp16(out, grad, V, isa);
        if (dlogits16_TV == nullptr && rounding == ActivationRounding::kF16) decode_fp16(grad, out, V, isa);
      }
    }
  }
}

void cross_entropy_fused16(float* losses_T, float* lse_T, uint16_t* logits16_TV, const float* dlosses_T,
                           const int32_t* targets_T, const ActivationRounding format, const int64_t n_tokens,
                           const int64_t V) {
  if (format == ActivationRounding::kNone) {
    throw std::invalid_argument("cross_entropy_fused16: the logits' 16-bit format is needed");
  }
  check_targets(targets_T, n_tokens, V, "cross_entropy_fused16");
  const ConvertIsa isa = best_convert_isa();
  const bool bf16 = format == ActivationRounding::kBF16;
#pragma omp parallel if (n_tokens * V > kParallelWork)
  {
    std::vector<float> row(static_cast<size_t>(V));  // one token's logits, then their gradient, in fp32
#pragma omp for schedule(static)
    for (int64_t t = 0; t < n_tokens; ++t) {
      uint16_t* bits = logits16_TV + t * V;
      bf16 ? decode_bf16(row.data(), bits, V, isa) : decode_fp16(row.data(), bits, V, isa);
      const float max_logit = row_max(row.data(), V);
      const double lse = static_cast<double>(max_logit) + std::log(sum_exp(row.data(), V, max_logit));
      lse_T[t] = static_cast<float>(lse);
      losses_T[t] = static_cast<float>(lse - static_cast<double>(row[static_cast<size_t>(targets_T[t])]));
      if (dlosses_T == nullptr) continue;
      scaled_softmax(row.data(), row.data(), V, lse_T[t], dlosses_T[t]);
      row[static_cast<size_t>(targets_T[t])] -= dlosses_T[t];
      bf16 ? encode_bf16(bits, row.data(), V, isa) : encode_fp16(bits, row.data(), V, isa);
    }
  }
}

template void cross_entropy_forward<float>(float*, float*, const float*, const int32_t*, int64_t, int64_t);
template void cross_entropy_forward<double>(double*, double*, const double*, const int32_t*, int64_t, int64_t);
template void cross_entropy_backward<float>(float*, const float*, const float*, const float*, const int32_t*, int64_t,
                                            int64_t);
template void cross_entropy_fused<float>(float*, float*, float*, const float*, uint16_t*, const int32_t*,
                                         ActivationRounding, int64_t, int64_t);
template void cross_entropy_fused<double>(double*, double*, double*, const double*, uint16_t*, const int32_t*,
                                          ActivationRounding, int64_t, int64_t);
template void cross_entropy_backward<double>(double*, const double*, const double*, const double*, const int32_t*,
                                             int64_t, int64_t);

}  // namespace moecore::kernels::cpu
