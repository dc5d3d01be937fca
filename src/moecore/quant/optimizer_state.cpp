#include "moecore/quant/optimizer_state.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>

#include "moecore/kernels/cpu/convert.h"
#include "moecore/quant/fp8_formats.h"

namespace moecore::quant {
namespace {

// Below this many elements a loop runs on one thread.
constexpr int64_t kParallelWork = 1 << 16;

// fp16 max / 2 (fused_adam.py dtype_to_range_map: torch.finfo(torch.float16).max / 2.0) and E4M3's max.
constexpr float kF16Range = 32752.0f;
constexpr float kFP8Range = 448.0f;

// Elements per block of the fp16 encoding (scaled into a stack buffer, then converted).
constexpr int64_t kBlock = 2048;

// fp32 -> E4M3 code, round to nearest even with saturation: bit for bit encode_e4m3(x) (fp8_formats.h), without its
// general-format arithmetic. Normal results keep the top 3 mantissa bits of x (rounded at bit 20); below E4M3's
// smallest normal 2^-6 the value is a multiple k of 2^-9, k = x * 2^9 rounded to even (exact scaling).
uint8_t e4m3_satfinite(const float x) {
  const uint32_t bits = std::bit_cast<uint32_t>(x);
  const auto sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  const uint32_t magnitude = bits & 0x7FFFFFFFu;
  if (magnitude > 0x7F800000u) return 0x7F;           // NaN: the canonical code
  if (magnitude >= 0x43E00000u) return sign | 0x7Eu;  // >= 448 (and Inf): the largest finite value
  if (magnitude < 0x3C800000u) {                      // < 2^-6
    const float k = std::nearbyint(std::bit_cast<float>(magnitude) * 512.0f);  // 0..8 (8 is 2^-6, code 0x08)
    return sign | static_cast<uint8_t>(k);
  }
  const uint32_t rounded = magnitude + 0x7FFFFu + ((magnitude >> 20) & 1u);
  return sign | static_cast<uint8_t>((rounded >> 20) - (120u << 3));  // fp32 exponent bias 127, E4M3's 7
}

// Every code's value (decode_e4m3).
const std::array<float, 256>& e4m3_values() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (size_t c = 0; c < t.size(); ++c) t[c] = decode_e4m3(static_cast<uint8_t>(c));
    return t;
  }();
  return table;
}

// 1 / scale, or 0 when scale is 0 or its reciprocal overflows fp32 (the stored values are then zeros).
float reciprocal_or_zero(const float scale) {
  const float r = scale > 0.0f ? 1.0f / scale : 0.0f;
  return std::isfinite(r) ? r : 0.0f;
}

void check_sizes(const StateFormat format, const size_t elements, const size_t bytes) {
  if (bytes != elements * state_format_bytes(format)) {
    throw std::invalid_argument("optimizer state of " + std::to_string(elements) + " " +
                                std::string(state_format_name(format)) + " elements given " + std::to_string(bytes) +
                                " bytes");
  }
}

}  // namespace

std::string_view state_format_name(const StateFormat format) {
  switch (format) {
    case StateFormat::kF32: return "fp32";
    case StateFormat::kF16: return "fp16";
    case StateFormat::kBF16: return "bf16";
    case StateFormat::kFP8: return "fp8";
  }
  return "?";
}

StateFormat parse_state_format(const std::string_view name) {
  for (const StateFormat f : {StateFormat::kF32, StateFormat::kF16, StateFormat::kBF16, StateFormat::kFP8}) {
    if (name == state_format_name(f)) return f;
  }
  throw std::invalid_argument("unknown optimizer state dtype '" + std::string(name) +
                              "' (choose from fp32, fp16, bf16, fp8)");
}

size_t state_format_bytes(const StateFormat format) {
  switch (format) {
    case StateFormat::kF32: return 4;
    case StateFormat::kF16:
    case StateFormat::kBF16: return 2;
    case StateFormat::kFP8: return 1;
  }
  return 4;
}

float state_format_range(const StateFormat format) {
  return format == StateFormat::kF16 ? kF16Range : format == StateFormat::kFP8 ? kFP8Range : 0.0f;
}

float state_scale(const StateFormat format, const float absmax) {
  const float range = state_format_range(format);
  return range > 0.0f ? absmax / range : 1.0f;  // torch.div(absmax, max_range, out=scale), fp32
}

float abs_max(const std::span<const float> x) {
  const auto n = static_cast<int64_t>(x.size());
  float out = 0.0f;
  bool nan = false;
#pragma omp parallel for schedule(static) reduction(max : out) reduction(|| : nan) if (n > kParallelWork)
  for (int64_t i = 0; i < n; ++i) {
    const float a = std::fabs(x[static_cast<size_t>(i)]);
    nan = nan || std::isnan(a);
    out = a > out ? a : out;
  }
  return nan ? std::nanf("") : out;
}

void encode_state(const StateFormat format, const float scale, const std::span<const float> x,
                  const std::span<std::byte> stored) {
  check_sizes(format, x.size(), stored.size());
  const auto n = static_cast<int64_t>(x.size());
  if (n == 0) return;
  const float* in = x.data();
  switch (format) {
    case StateFormat::kF32: std::memmove(stored.data(), in, stored.size()); return;
    case StateFormat::kBF16:  // scaled_state.copy_(unscaled_state.bfloat16())
      kernels::cpu::encode_bf16(reinterpret_cast<uint16_t*>(stored.data()), in, n);
      return;
    case StateFormat::kF16: {
      // rscale = torch.where(scale > 0, scale.reciprocal(), 0.0); unscaled_state.mul_(rscale); scaled_state.copy_
      const float rscale = reciprocal_or_zero(scale);
      auto* out = reinterpret_cast<uint16_t*>(stored.data());
      const kernels::cpu::ConvertIsa isa = kernels::cpu::best_convert_isa();
#pragma omp parallel for schedule(static) if (n > kParallelWork)
      for (int64_t b = 0; b < n; b += kBlock) {
        const int64_t k = std::min(kBlock, n - b);
        float scaled[kBlock];
        for (int64_t i = 0; i < k; ++i) scaled[i] = in[b + i] * rscale;
        kernels::cpu::encode_fp16(out + b, scaled, k, isa);
      }
      return;
    }
    case StateFormat::kFP8: {
      // scaled_state._quantizer.scale.copy_(1 / scale); scaled_state.copy_(unscaled_state): the cast kernel
      // multiplies by the quantizer scale and converts with saturation.
      const float q = reciprocal_or_zero(scale);
      auto* out = reinterpret_cast<uint8_t*>(stored.data());
#pragma omp parallel for schedule(static) if (n > kParallelWork)
      for (int64_t i = 0; i < n; ++i) out[i] = e4m3_satfinite(in[i] * q);
      return;
    }
  }
}

void decode_state(const StateFormat format, const float scale, const std::span<const std::byte> stored,
                  const std::span<float> x) {
  check_sizes(format, x.size(), stored.size());
  const auto n = static_cast<int64_t>(x.size());
  if (n == 0) return;
  float* out = x.data();
  switch (format) {
    case StateFormat::kF32: std::memmove(out, stored.data(), stored.size()); return;
    case StateFormat::kBF16:
      kernels::cpu::decode_bf16(out, reinterpret_cast<const uint16_t*>(stored.data()), n);
      return;
    case StateFormat::kF16: {  // unscaled = stored.float(); unscaled.mul_(scale)
      kernels::cpu::decode_fp16(out, reinterpret_cast<const uint16_t*>(stored.data()), n);
#pragma omp parallel for schedule(static) if (n > kParallelWork)
      for (int64_t i = 0; i < n; ++i) out[i] *= scale;
      return;
    }
    case StateFormat::kFP8: {  // Float8Tensor.float(): codes x scale_inv, scale_inv = 1 / quantizer scale
      const float q = reciprocal_or_zero(scale);
      const float scale_inv = q > 0.0f ? 1.0f / q : 0.0f;
      const auto* in = reinterpret_cast<const uint8_t*>(stored.data());
      const std::array<float, 256>& table = e4m3_values();
#pragma omp parallel for schedule(static) if (n > kParallelWork)
      for (int64_t i = 0; i < n; ++i) out[i] = table[in[i]] * scale_inv;
      return;
    }
  }
}

void split_param_remainders(const std::span<const float> main, const std::span<float> weight,
                            const std::span<int16_t> remainder) {
  if (weight.size() != main.size() || remainder.size() != main.size()) {
    throw std::invalid_argument("split_param_remainders: sizes differ");
  }
  const auto n = static_cast<int64_t>(main.size());
#pragma omp parallel for schedule(static) if (n > kParallelWork)
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t bits = std::bit_cast<uint32_t>(main[static_cast<size_t>(i)]);
    const auto rem = static_cast<int16_t>(static_cast<uint16_t>(bits & 0xFFFFu));
    uint32_t high = bits >> 16;
    if (rem < 0) ++high;  // "Round up"
    remainder[static_cast<size_t>(i)] = rem;
    weight[static_cast<size_t>(i)] = std::bit_cast<float>((high & 0xFFFFu) << 16);
  }
}

void join_param_remainders(const std::span<const float> weight, const std::span<const int16_t> remainder,
                           const std::span<float> main) {
  if (weight.size() != main.size() || remainder.size() != main.size()) {
    throw std::invalid_argument("join_param_remainders: sizes differ");
  }
  const auto n = static_cast<int64_t>(main.size());
#pragma omp parallel for schedule(static) if (n > kParallelWork)
  for (int64_t i = 0; i < n; ++i) {
    uint32_t high = std::bit_cast<uint32_t>(weight[static_cast<size_t>(i)]) >> 16;
    const int16_t rem = remainder[static_cast<size_t>(i)];
    if (rem < 0) --high;  // "Undo rounding"
    main[static_cast<size_t>(i)] =
        std::bit_cast<float>(((high & 0xFFFFu) << 16) | static_cast<uint32_t>(static_cast<uint16_t>(rem)));
  }
}

}  // namespace moecore::quant
