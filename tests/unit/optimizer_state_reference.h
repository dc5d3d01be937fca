// An independent reference of the precision-aware optimizer's state formats (TransformerEngine FusedAdam's
// _apply_scale / get_unscaled_state) for the tests: the stored value is the nearest point of the format's grid,
// enumerated here from the format's definition (sign, exponent field, mantissa field), ties to the even code; the
// scale and its reciprocals are fp32 operations as in fused_adam.py.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <stdexcept>
#include <vector>

#include "moecore/quant/optimizer_state.h"

namespace moecore::test {

struct GridPoint {
  double value = 0.0;
  uint32_t code = 0;
};

// The non-negative finite values of a binary format with `exp_bits` exponent bits (bias 2^(exp_bits-1) - 1),
// `man_bits` mantissa bits and subnormals, ascending; codes above `max_code` are not finite.
inline std::vector<GridPoint> float_grid(const int exp_bits, const int man_bits, const uint32_t max_code) {
  const int bias = (1 << (exp_bits - 1)) - 1;
  std::vector<GridPoint> grid;
  for (uint32_t code = 0; code <= max_code; ++code) {
    const auto exponent = static_cast<int>(code >> man_bits);
    const auto mantissa = static_cast<double>(code & ((1u << man_bits) - 1u));
    const double fraction = mantissa / static_cast<double>(1u << man_bits);
    const double value = exponent == 0 ? std::ldexp(fraction, 1 - bias) : std::ldexp(1.0 + fraction, exponent - bias);
    grid.push_back({value, code});
  }
  return grid;
}
inline const std::vector<GridPoint>& bf16_grid() {  // 8 exponent bits, 7 mantissa bits; 0x7F80 is Inf
  static const std::vector<GridPoint> grid = float_grid(8, 7, 0x7F7F);
  return grid;
}
inline const std::vector<GridPoint>& fp16_grid() {  // 5 exponent bits, 10 mantissa bits; 0x7C00 is Inf
  static const std::vector<GridPoint> grid = float_grid(5, 10, 0x7BFF);
  return grid;
}
inline const std::vector<GridPoint>& e4m3_grid() {  // 4 exponent bits, 3 mantissa bits; 0x7F is NaN, max 448
  static const std::vector<GridPoint> grid = float_grid(4, 3, 0x7E);
  return grid;
}

// The grid point nearest to x (ties: the even code), with x's sign; beyond the largest point the largest.
inline double nearest_on_grid(const std::vector<GridPoint>& grid, const double x) {
  const double a = std::fabs(x);
  const auto above =
      std::lower_bound(grid.begin(), grid.end(), a, [](const GridPoint& p, const double v) { return p.value < v; });
  double value = 0.0;
  if (above == grid.end()) {
    value = grid.back().value;
  } else if (above == grid.begin() || above->value == a) {
    value = above->value;
  } else {
    const GridPoint& lo = *(above - 1);
    const GridPoint& hi = *above;
    const double dlo = a - lo.value, dhi = hi.value - a;
    value = dlo < dhi ? lo.value : dhi < dlo ? hi.value : (lo.code % 2 == 0 ? lo.value : hi.value);
  }
  return std::signbit(x) ? -value : value;
}

// The bf16 value TE's store_param_remainders gives an fp32 main value: the nearest bf16 value, ties away from zero
// (a low half of exactly 0x8000 reads as a negative int16, which rounds the high half up in magnitude).
inline float bf16_nearest_ties_away(const float x) {
  const std::vector<GridPoint>& grid = bf16_grid();
  const double a = std::fabs(static_cast<double>(x));
  const auto above =
      std::lower_bound(grid.begin(), grid.end(), a, [](const GridPoint& p, const double v) { return p.value < v; });
  double value = above->value;
  if (above != grid.begin() && above->value != a) {
    const double lo = (above - 1)->value;
    value = a - lo < above->value - a ? lo : above->value;
  }
  return static_cast<float>(std::signbit(x) ? -value : value);
}

inline float reference_abs_max(const std::span<const float> x) {
  float m = 0.0f;
  for (const float v : x) m = std::max(m, std::fabs(v));
  return m;
}

// The scale fused_adam.py computes: absmax / (fp16 max / 2) or absmax / 448, in fp32; 1 without scaling.
inline float reference_scale(const quant::StateFormat format, const float absmax) {
  switch (format) {
    case quant::StateFormat::kF16: return absmax / (65504.0f / 2.0f);
    case quant::StateFormat::kFP8: return absmax / 448.0f;
    default: return 1.0f;
  }
}

// The unscaled fp32 value a state element x comes back as after being stored with `scale`.
inline float reference_round_trip(const quant::StateFormat format, const float scale, const float x) {
  switch (format) {
    case quant::StateFormat::kF32: return x;
    case quant::StateFormat::kBF16: return static_cast<float>(nearest_on_grid(bf16_grid(), x));
    case quant::StateFormat::kF16: {
      const float r = scale > 0.0f ? 1.0f / scale : 0.0f;
      const float y = x * r;
      return static_cast<float>(nearest_on_grid(fp16_grid(), y)) * scale;
    }
    case quant::StateFormat::kFP8: {
      const float q = scale > 0.0f ? 1.0f / scale : 0.0f;  // Float8Quantizer.scale = 1 / scale
      const float y = x * q;
      const float scale_inv = q > 0.0f ? 1.0f / q : 0.0f;  // the cast kernel's reciprocal of the quantizer scale
      return static_cast<float>(nearest_on_grid(e4m3_grid(), y)) * scale_inv;
    }
  }
  throw std::logic_error("format");
}

// A whole state: its scale from its absmax, then every element's round trip.
inline std::vector<float> reference_store(const quant::StateFormat format, const std::span<const float> x) {
  const float scale = reference_scale(format, reference_abs_max(x));
  std::vector<float> out;
  out.reserve(x.size());
  for (const float v : x) out.push_back(reference_round_trip(format, scale, v));
  return out;
}

// Bounds on |stored - x| for a state of scale `scale`: relative (the format's unit roundoff, plus fp32 roundings of
// the scaling) and absolute (half the smallest subnormal step, times the scale).
struct RoundingBound {
  double relative = 0.0, absolute = 0.0;
};
inline RoundingBound rounding_bound(const quant::StateFormat format, const float scale) {
  const double fp32_ulp = std::ldexp(1.0, -24);
  switch (format) {
    case quant::StateFormat::kF32: return {0.0, 0.0};
    case quant::StateFormat::kBF16:  // 8 significant bits, no scaling
      return {std::ldexp(1.0, -8), std::ldexp(1.0, -134)};
    case quant::StateFormat::kF16:  // 11 significant bits, subnormal step 2^-24
      return {std::ldexp(1.0, -11) + 4 * fp32_ulp, std::ldexp(1.0, -25) * scale};
    case quant::StateFormat::kFP8:  // 4 significant bits, subnormal step 2^-9
      return {std::ldexp(1.0, -4) + 4 * fp32_ulp, std::ldexp(1.0, -10) * scale * (1.0 + 4 * fp32_ulp)};
  }
  return {};
}

}  // namespace moecore::test
