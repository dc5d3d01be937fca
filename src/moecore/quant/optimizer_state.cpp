#include "moecore/quant/optimizer_state.h"

#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>

#include "moecore/quant/fp8_formats.h"
#include "moecore/tensor/dtype.h"

namespace moecore::quant {
namespace {

// Below this many elements a loop runs on one thread.
constexpr int64_t kParallelWork = 1 << 16;

// fp16 max / 2 (fused_adam.py dtype_to_range_map: torch.finfo(torch.float16).max / 2.0) and E4M3's max.
constexpr float kF16Range = 32752.0f;
constexpr float kFP8Range = 448.0f;

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
  switch (format) {
    case StateFormat::kF32:
      if (!x.empty()) std::memmove(stored.data(), x.data(), stored.size());
      return;
    case StateFormat::kBF16: {
      auto* out = reinterpret_cast<uint16_t*>(stored.data());
#pragma omp parallel for schedule(static) if (n > kParallelWork)
      for (int64_t i = 0; i < n; ++i) out[i] = fp32_to_bf16(x[static_cast<size_t>(i)]);
      return;
    }
    case StateFormat::kF16: {
      // rscale = torch.where(scale > 0, scale.reciprocal(), 0.0); unscaled_state.mul_(rscale); scaled_state.copy_
      const float rscale = reciprocal_or_zero(scale);
      auto* out = reinterpret_cast<uint16_t*>(stored.data());
#pragma omp parallel for schedule(static) if (n > kParallelWork)
      for (int64_t i = 0; i < n; ++i) out[i] = fp32_to_fp16(x[static_cast<size_t>(i)] * rscale);
      return;
    }
    case StateFormat::kFP8: {
      // scaled_state._quantizer.scale.copy_(1 / scale); scaled_state.copy_(unscaled_state): the cast kernel
      // multiplies by the quantizer scale and converts with saturation.
      const float q = reciprocal_or_zero(scale);
      auto* out = reinterpret_cast<uint8_t*>(stored.data());
#pragma omp parallel for schedule(static) if (n > kParallelWork)
      for (int64_t i = 0; i < n; ++i) out[i] = encode_e4m3(x[static_cast<size_t>(i)] * q);
      return;
    }
  }
}

void decode_state(const StateFormat format, const float scale, const std::span<const std::byte> stored,
                  const std::span<float> x) {
  check_sizes(format, x.size(), stored.size());
  const auto n = static_cast<int64_t>(x.size());
  switch (format) {
    case StateFormat::kF32:
      if (!x.empty()) std::memmove(x.data(), stored.data(), stored.size());
      return;
    case StateFormat::kBF16: {
      const auto* in = reinterpret_cast<const uint16_t*>(stored.data());
#pragma omp parallel for schedule(static) if (n > kParallelWork)
      for (int64_t i = 0; i < n; ++i) x[static_cast<size_t>(i)] = bf16_to_fp32(in[i]);
      return;
    }
    case StateFormat::kF16: {  // unscaled = stored.float(); unscaled.mul_(scale)
      const auto* in = reinterpret_cast<const uint16_t*>(stored.data());
#pragma omp parallel for schedule(static) if (n > kParallelWork)
      for (int64_t i = 0; i < n; ++i) x[static_cast<size_t>(i)] = fp16_to_fp32(in[i]) * scale;
      return;
    }
    case StateFormat::kFP8: {  // Float8Tensor.float(): codes x scale_inv, scale_inv = 1 / quantizer scale
      const float q = reciprocal_or_zero(scale);
      const float scale_inv = q > 0.0f ? 1.0f / q : 0.0f;
      const auto* in = reinterpret_cast<const uint8_t*>(stored.data());
#pragma omp parallel for schedule(static) if (n > kParallelWork)
      for (int64_t i = 0; i < n; ++i) x[static_cast<size_t>(i)] = decode_e4m3(in[i]) * scale_inv;
      return;
    }
  }
}

}  // namespace moecore::quant
