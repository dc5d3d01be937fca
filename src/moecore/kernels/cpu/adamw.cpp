// Fast AdamW: the step's scalars precomputed in double, one fused OpenMP pass over chunks of elements, each a SIMD
// loop compiled per vector ISA.
// The loop vectorises only when the compiler may drop errno handling for sqrt (-fno-math-errno); GCC ignores that
// option in pragmas and attributes, so it has to come from the build flags.
#include "moecore/kernels/cpu/adamw.h"

// GCC 12's AVX-512 intrinsics start from _mm512_undefined_*(), which its flow analysis reports as maybe-uninitialized
// once inlined (GCC bug 105593, fixed in GCC 13).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "moecore/kernels/cpu/bf16_value.h"
#include "moecore/kernels/cpu/vector_isa.h"
#include "moecore/tensor/dtype.h"

namespace moecore::kernels::cpu {

namespace {
// Below this many elements a call runs on one thread: fork/join would cost more than it saves.
constexpr int64_t kParallelWork = 32768;
constexpr int64_t kChunk = 4096;  // elements per call of the update body

// The step's scalars in the element type.
template <typename T>
struct AdamWScalars {
  T decay, beta1, one_minus_beta1, beta2, one_minus_beta2, step_size, bias_correction2_sqrt, eps, grad_scale;
};

// One element's update; returns the new parameter.
template <typename T>
[[gnu::always_inline]] inline T adamw_element(const int64_t i, T* param, const T* grad, T* exp_avg, T* exp_avg_sq,
                                              const AdamWScalars<T>& k) {
  const T g = grad[i] * k.grad_scale;
  const T m = k.beta1 * exp_avg[i] + k.one_minus_beta1 * g;
  const T v = k.beta2 * exp_avg_sq[i] + k.one_minus_beta2 * g * g;
  exp_avg[i] = m;
  exp_avg_sq[i] = v;
  const T p = param[i] * k.decay - k.step_size * m / (std::sqrt(v) / k.bias_correction2_sqrt + k.eps);
  param[i] = p;
  return p;
}

// Elements [i0, i1) of the update, compiled per vector ISA.
template <typename T>
MOECORE_VECTOR_CLONES void adamw_chunk(T* param, const T* grad, T* exp_avg, T* exp_avg_sq, const int64_t i0,
                                       const int64_t i1, const AdamWScalars<T>& k) {
#pragma omp simd
  for (int64_t i = i0; i < i1; ++i) adamw_element(i, param, grad, exp_avg, exp_avg_sq, k);
}

// The same update, writing each new parameter rounded to bf16 to model_chunk[i - i0] in the loop itself. A copy and a
// rounding pass over the chunk after it cost a fifth of the update's time.
MOECORE_VECTOR_CLONES void adamw_chunk_bf16_model(float* param, const float* grad, float* exp_avg, float* exp_avg_sq,
                                                  float* model_chunk, const int64_t i0, const int64_t i1,
                                                  const AdamWScalars<float>& k) {
#pragma omp simd
  for (int64_t i = i0; i < i1; ++i)
    model_chunk[i - i0] = bf16_value(adamw_element(i, param, grad, exp_avg, exp_avg_sq, k));
}

// The chunk's bf16 model values written out with non-temporal stores where their destinations are aligned: the
// model weights (fp32 holding bf16 values) to `model`, and, if `bits` is not null, their bf16 bits (the upper halves)
// to `bits`. Neither is read again before the next forward, and a plain store would first read each line it writes.
// The stores are weakly ordered: the caller fences once it has written all its chunks.
void stream_model(float* model, uint16_t* bits, const float* values, const int64_t n) {
  int64_t i = 0;
  for (; i < n && reinterpret_cast<uintptr_t>(model + i) % 16 != 0; ++i) model[i] = values[i];
  for (; i + 4 <= n; i += 4) _mm_stream_ps(model + i, _mm_loadu_ps(values + i));
  for (; i < n; ++i) model[i] = values[i];
  if (bits == nullptr) return;
  alignas(64) uint16_t words[kChunk];
  for (i = 0; i < n; ++i) words[i] = static_cast<uint16_t>(std::bit_cast<uint32_t>(values[i]) >> 16);
  for (i = 0; i < n && reinterpret_cast<uintptr_t>(bits + i) % 16 != 0; ++i) bits[i] = words[i];
  for (; i + 8 <= n; i += 8) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(bits + i),
                     _mm_loadu_si128(reinterpret_cast<const __m128i*>(words + i)));
  }
  for (; i < n; ++i) bits[i] = words[i];
}

// One element of the 16-bit-model update outside the vector loop below: the same operations in the same order (the
// kernels build without FMA contraction), so the same bits.
template <bool kBf16>
[[gnu::always_inline]] inline void model_update_element(const int64_t i, float* param, const float* grad,
                                                        float* exp_avg, float* exp_avg_sq, float* model, uint16_t* bits,
                                                        float* grad_to_zero, const AdamWScalars<float>& k) {
  const float updated = adamw_element(i, param, grad, exp_avg, exp_avg_sq, k);
  const float value = kBf16 ? bf16_value(updated) : fp16_to_fp32(fp32_to_fp16(updated));
  model[i] = value;
  if (bits != nullptr) bits[i] = static_cast<uint16_t>(std::bit_cast<uint32_t>(value) >> 16);
  if (grad_to_zero != nullptr) grad_to_zero[i] = 0.0f;
}

// Eight lanes of bf16_value (round to nearest even on the upper 16 bits), or of round_fp16's rounding (vcvtps2ph and
// back), kept as fp32; NaNs (a rare branch) made quiet as dtype.h makes them.
template <bool kBf16>
__attribute__((target("avx2,fma,f16c"))) inline __m256 value8(const __m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
  const bool any_nan = _mm256_movemask_ps(nan) != 0;
  if constexpr (kBf16) {
    const __m256i upper = _mm256_set1_epi32(static_cast<int32_t>(0xffff0000u));
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i rounded =
        _mm256_and_si256(_mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7fff)), lsb), upper);
    if (!any_nan) return _mm256_castsi256_ps(rounded);
    const __m256i quiet_nan = _mm256_or_si256(_mm256_and_si256(bits, upper), _mm256_set1_epi32(0x00400000));
    return _mm256_blendv_ps(_mm256_castsi256_ps(rounded), _mm256_castsi256_ps(quiet_nan), nan);
  } else {
    const __m256 rounded = _mm256_cvtph_ps(_mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    if (!any_nan) return rounded;
    const __m256i sign = _mm256_and_si256(bits, _mm256_set1_epi32(static_cast<int32_t>(0x80000000u)));
    const __m256i quiet_nan = _mm256_or_si256(sign, _mm256_set1_epi32(0x7fc00000));
    return _mm256_blendv_ps(rounded, _mm256_castsi256_ps(quiet_nan), nan);
  }
}

// The 16-bit-model update of elements [i0, i1) from registers, eight lanes on AVX2 + FMA + F16C: parameters, moments
// and (with grad_to_zero) the zeroed gradients stored back in place, the model values (value8) streamed to `model`
// and, for bf16, their bits to `bits`, without the round trip through a chunk buffer and stream_model, which cost a
// quarter of the pass. The pass is bound by memory: 16 lanes on AVX-512 ran no faster (0.95-1.09x the fp32 update
// against these 0.95-1.03x, 71.3M parameters, 2 threads). Elements before model's first 32-byte boundary and past the
// last full vector take model_update_element.
template <bool kBf16>
__attribute__((target("avx2,fma,f16c"))) void adamw_chunk_16bit_model_avx2(
    float* param, const float* grad, float* exp_avg, float* exp_avg_sq, float* model, uint16_t* bits,
    float* grad_to_zero, const int64_t i0, const int64_t i1, const AdamWScalars<float>& k) {
  int64_t i = i0;
  for (; i < i1 && reinterpret_cast<uintptr_t>(model + i) % 32 != 0; ++i) {
    model_update_element<kBf16>(i, param, grad, exp_avg, exp_avg_sq, model, bits, grad_to_zero, k);
  }
  const bool bits_aligned = bits != nullptr && reinterpret_cast<uintptr_t>(bits + i) % 16 == 0;
  const __m256 decay = _mm256_set1_ps(k.decay), beta1 = _mm256_set1_ps(k.beta1);
  const __m256 one_minus_beta1 = _mm256_set1_ps(k.one_minus_beta1), beta2 = _mm256_set1_ps(k.beta2);
  const __m256 one_minus_beta2 = _mm256_set1_ps(k.one_minus_beta2), step_size = _mm256_set1_ps(k.step_size);
  const __m256 bias_correction2_sqrt = _mm256_set1_ps(k.bias_correction2_sqrt), eps = _mm256_set1_ps(k.eps);
  const __m256 grad_scale = _mm256_set1_ps(k.grad_scale);
  for (; i + 8 <= i1; i += 8) {
    const __m256 g = _mm256_mul_ps(_mm256_loadu_ps(grad + i), grad_scale);
    const __m256 m =
        _mm256_add_ps(_mm256_mul_ps(beta1, _mm256_loadu_ps(exp_avg + i)), _mm256_mul_ps(one_minus_beta1, g));
    const __m256 v = _mm256_add_ps(_mm256_mul_ps(beta2, _mm256_loadu_ps(exp_avg_sq + i)),
                                   _mm256_mul_ps(_mm256_mul_ps(one_minus_beta2, g), g));
    _mm256_storeu_ps(exp_avg + i, m);
    _mm256_storeu_ps(exp_avg_sq + i, v);
    if (grad_to_zero != nullptr) _mm256_storeu_ps(grad_to_zero + i, _mm256_setzero_ps());
    const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v), bias_correction2_sqrt), eps);
    const __m256 p = _mm256_sub_ps(_mm256_mul_ps(_mm256_loadu_ps(param + i), decay),
                                   _mm256_div_ps(_mm256_mul_ps(step_size, m), denom));
    _mm256_storeu_ps(param + i, p);
    const __m256 value = value8<kBf16>(p);
    _mm256_stream_ps(model + i, value);
    if (bits == nullptr) continue;
    const __m256i upper = _mm256_srli_epi32(_mm256_castps_si256(value), 16);
    const __m128i words = _mm_packus_epi32(_mm256_castsi256_si128(upper), _mm256_extracti128_si256(upper, 1));
    if (bits_aligned) {
      _mm_stream_si128(reinterpret_cast<__m128i*>(bits + i), words);
    } else {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(bits + i), words);
    }
  }
  for (; i < i1; ++i) model_update_element<kBf16>(i, param, grad, exp_avg, exp_avg_sq, model, bits, grad_to_zero, k);
}

std::atomic<int> g_model_path_override{-1};

AdamWModelPath best_model_path() {
  static const AdamWModelPath best = [] {
    if (adamw_model_path_supported(AdamWModelPath::kAvx2)) return AdamWModelPath::kAvx2;
    return AdamWModelPath::kPortable;
  }();
  return best;
}
}  // namespace

bool adamw_model_path_supported(const AdamWModelPath path) {
  __builtin_cpu_init();
  switch (path) {
    case AdamWModelPath::kPortable: return true;
    case AdamWModelPath::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  }
  return false;
}

AdamWModelPath adamw_model_path() {
  const int forced = g_model_path_override.load();
  return forced < 0 ? best_model_path() : static_cast<AdamWModelPath>(forced);
}

ScopedAdamWModelPath::ScopedAdamWModelPath(const AdamWModelPath path) {
  if (!adamw_model_path_supported(path)) {
    throw std::invalid_argument("ScopedAdamWModelPath: this CPU lacks the vector path " +
                                std::to_string(static_cast<int>(path)));
  }
  previous_ = g_model_path_override.exchange(static_cast<int>(path));
}
ScopedAdamWModelPath::~ScopedAdamWModelPath() { g_model_path_override.store(previous_); }

template <typename T>
void adamw_step(T* param, const T* grad, T* exp_avg, T* exp_avg_sq, int64_t n, const AdamWHyper& hp, T* model,
                const ActivationRounding model_rounding, T* grad_to_zero, uint16_t* model_bf16) {
  if (hp.step < 1) throw std::invalid_argument("adamw_step: step=" + std::to_string(hp.step) + " must be >= 1");
  if (model != nullptr && !std::is_same_v<T, float>) {
    throw std::invalid_argument("adamw_step: 16-bit model weights are written from float parameters only");
  }
  if (model_bf16 != nullptr && (model == nullptr || model_rounding != ActivationRounding::kBF16)) {
    throw std::invalid_argument("adamw_step: bf16 bits of the model weights need bf16 model weights");
  }
  const double bias_correction1 = 1.0 - std::pow(hp.beta1, static_cast<double>(hp.step));
  const double bias_correction2 = 1.0 - std::pow(hp.beta2, static_cast<double>(hp.step));
  const AdamWScalars<T> k{static_cast<T>(1.0 - hp.lr * hp.weight_decay),
                          static_cast<T>(hp.beta1),
                          static_cast<T>(1.0 - hp.beta1),
                          static_cast<T>(hp.beta2),
                          static_cast<T>(1.0 - hp.beta2),
                          static_cast<T>(hp.lr / bias_correction1),
                          static_cast<T>(std::sqrt(bias_correction2)),
                          static_cast<T>(hp.eps),
                          static_cast<T>(hp.grad_scale)};
  const bool bf16_model = model != nullptr && model_rounding == ActivationRounding::kBF16;
  const bool rounded_model = model != nullptr && model_rounding != ActivationRounding::kNone;
  const AdamWModelPath path = adamw_model_path();
  const bool model_in_registers = rounded_model && path != AdamWModelPath::kPortable;
#pragma omp parallel if (n > kParallelWork)
  {
#pragma omp for schedule(static) nowait
    for (int64_t i = 0; i < n; i += kChunk) {
      const int64_t end = std::min(n, i + kChunk);
      if constexpr (std::is_same_v<T, float>) {
        if (model_in_registers) {
          const auto update = bf16_model ? adamw_chunk_16bit_model_avx2<true> : adamw_chunk_16bit_model_avx2<false>;
          update(param, grad, exp_avg, exp_avg_sq, model, model_bf16, grad_to_zero, i, end, k);
          continue;
        }
        if (bf16_model) {
          alignas(64) float model_chunk[kChunk];
          adamw_chunk_bf16_model(param, grad, exp_avg, exp_avg_sq, model_chunk, i, end, k);
          stream_model(model + i, model_bf16 != nullptr ? model_bf16 + i : nullptr, model_chunk, end - i);
        } else {
          adamw_chunk(param, grad, exp_avg, exp_avg_sq, i, end, k);
        }
      } else {
        adamw_chunk(param, grad, exp_avg, exp_avg_sq, i, end, k);
      }
      if (grad_to_zero != nullptr) std::fill(grad_to_zero + i, grad_to_zero + end, T(0));  // the chunk is in cache
      if constexpr (std::is_same_v<T, float>) {
        if (model == nullptr || bf16_model) continue;
        std::copy(param + i, param + end, model + i);  // the chunk is still in cache
        if (model_rounding == ActivationRounding::kF16) round_fp16(model + i, end - i);
      }
    }
    // The streaming stores are weakly ordered: fenced once per thread, before the region's closing barrier publishes
    // them (a fence per chunk stalled each one until its lines had been written).
    if (bf16_model || model_in_registers) _mm_sfence();
  }
}

template void adamw_step<float>(float*, const float*, float*, float*, int64_t, const AdamWHyper&, float*,
                                ActivationRounding, float*, uint16_t*);
template void adamw_step<double>(double*, const double*, double*, double*, int64_t, const AdamWHyper&, double*,
                                 ActivationRounding, double*, uint16_t*);

}  // namespace moecore::kernels::cpu
