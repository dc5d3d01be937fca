#include "moecore/quant/fp8_formats.h"

#include <bit>
#include <cmath>
#include <limits>
#include <stdexcept>

namespace moecore::quant {
namespace {

// A small binary floating-point format: sign bit, `exp_bits` exponent bits with bias `bias`, `man_bits` mantissa
// bits, subnormals at exponent field 0.
struct MiniFloat {
  int exp_bits;
  int man_bits;
  int bias;
  float max_finite;
};
constexpr MiniFloat kE4M3{4, 3, 7, 448.0f};
constexpr MiniFloat kE5M2{5, 2, 15, 57344.0f};
constexpr MiniFloat kE2M1{2, 1, 1, 6.0f};

// Rounds |x| (finite, > 0) to nearest-even on the format's grid with an unbounded exponent; returns the magnitude
// code (exponent field << man_bits | mantissa), or -1 when the rounded value exceeds max_finite.
int round_magnitude(const MiniFloat& f, const float a) {
  const int emin = 1 - f.bias;  // exponent of the smallest normal
  int exponent = 0;
  std::frexp(a, &exponent);  // a = m * 2^exponent, m in [0.5, 1)
  const int e = std::max(exponent - 1, emin);
  // a / 2^(e - man_bits) lies in [0, 2^(man_bits + 1)): exact (a power-of-two scaling of an fp32 value).
  const double m = std::ldexp(static_cast<double>(a), f.man_bits - e);
  double n = std::floor(m);
  const double rest = m - n;
  if (rest > 0.5 || (rest == 0.5 && std::fmod(n, 2.0) == 1.0)) n += 1.0;
  if (std::ldexp(n, e - f.man_bits) > f.max_finite) return -1;
  int field = 0;
  int mantissa = static_cast<int>(n);
  int biased_e = e;
  if (mantissa >= (2 << f.man_bits)) {  // rounded up into the next binade
    mantissa >>= 1;
    ++biased_e;
  }
  if (mantissa >= (1 << f.man_bits)) {
    field = biased_e + f.bias;
    mantissa -= 1 << f.man_bits;
  }  // else subnormal (biased_e == emin): exponent field 0
  return (field << f.man_bits) | mantissa;
}

uint8_t encode_minifloat(const MiniFloat& f, const float x, const Saturation saturation, const uint8_t nan_code,
                         const uint8_t overflow_code) {
  const int sign_shift = f.exp_bits + f.man_bits;
  if (std::isnan(x)) return nan_code;
  const uint8_t sign = std::signbit(x) ? static_cast<uint8_t>(1u << sign_shift) : 0;
  const float a = std::fabs(x);
  if (a == 0.0f) return sign;
  const int magnitude = std::isinf(a) ? -1 : round_magnitude(f, a);
  if (magnitude < 0) {
    if (saturation == Saturation::kSatFinite) return sign | round_magnitude(f, f.max_finite);
    return sign | overflow_code;
  }
  return sign | static_cast<uint8_t>(magnitude);
}

float decode_minifloat(const MiniFloat& f, const uint8_t code) {
  const int sign_shift = f.exp_bits + f.man_bits;
  const int field = (code >> f.man_bits) & ((1 << f.exp_bits) - 1);
  const int mantissa = code & ((1 << f.man_bits) - 1);
  const float magnitude =
      field == 0 ? std::ldexp(static_cast<float>(mantissa), 1 - f.bias - f.man_bits)
                 : std::ldexp(static_cast<float>(mantissa + (1 << f.man_bits)), field - f.bias - f.man_bits);
  return ((code >> sign_shift) & 1) ? -magnitude : magnitude;
}

}  // namespace

std::string format_name(const ElementFormat format) {
  switch (format) {
    case ElementFormat::kE4M3: return "e4m3";
    case ElementFormat::kE5M2: return "e5m2";
    case ElementFormat::kE2M1: return "e2m1";
  }
  throw std::logic_error("unknown element format");
}

float format_max(const ElementFormat format) {
  switch (format) {
    case ElementFormat::kE4M3: return kE4M3.max_finite;
    case ElementFormat::kE5M2: return kE5M2.max_finite;
    case ElementFormat::kE2M1: return kE2M1.max_finite;
  }
  throw std::logic_error("unknown element format");
}

uint8_t encode_e4m3(const float x, const Saturation saturation) {
  return encode_minifloat(kE4M3, x, saturation, 0x7F, 0x7F);  // no Inf: a non-saturated overflow is NaN
}

uint8_t encode_e5m2(const float x, const Saturation saturation) {
  return encode_minifloat(kE5M2, x, saturation, 0x7F, 0x7C);
}

uint8_t encode_e2m1(const float x) {
  return encode_minifloat(kE2M1, x, Saturation::kSatFinite, 0x7, 0x7);  // NaN -> +6 as satfinite
}

float decode_e4m3(const uint8_t code) {
  if ((code & 0x7F) == 0x7F) return std::numeric_limits<float>::quiet_NaN();
  return decode_minifloat(kE4M3, code);
}

float decode_e5m2(const uint8_t code) {
  const uint8_t magnitude = code & 0x7F;
  if (magnitude == 0x7C)
    return (code & 0x80) ? -std::numeric_limits<float>::infinity() : std::numeric_limits<float>::infinity();
  if (magnitude > 0x7C) return std::numeric_limits<float>::quiet_NaN();
  return decode_minifloat(kE5M2, code);
}

float decode_e2m1(const uint8_t code) { return decode_minifloat(kE2M1, code & 0x0F); }

uint8_t encode(const ElementFormat format, const float x, const Saturation saturation) {
  switch (format) {
    case ElementFormat::kE4M3: return encode_e4m3(x, saturation);
    case ElementFormat::kE5M2: return encode_e5m2(x, saturation);
    case ElementFormat::kE2M1: return encode_e2m1(x);
  }
  throw std::logic_error("unknown element format");
}

float decode(const ElementFormat format, const uint8_t code) {
  switch (format) {
    case ElementFormat::kE4M3: return decode_e4m3(code);
    case ElementFormat::kE5M2: return decode_e5m2(code);
    case ElementFormat::kE2M1: return decode_e2m1(code);
  }
  throw std::logic_error("unknown element format");
}

uint8_t encode_e2m1_stochastic(const float x, const uint8_t rbits) {
  constexpr float kMaxNorm = 6.0f;
  const float u = static_cast<float>(rbits) * (1.0f / 256.0f);
  const float a = std::fabs(x);
  const float step = a >= 4.0f ? 2.0f : (a >= 2.0f ? 1.0f : 0.5f);
  const float t = std::fma(u, step, a);  // one rounding, as fmaf
  // The jitter may carry t across a region boundary: the step comes from t (TE's comment in ptx.cuh).
  const float step_t = t >= 4.0f ? 2.0f : (t >= 2.0f ? 1.0f : 0.5f);
  const float inv_step_t = t >= 4.0f ? 0.5f : (t >= 2.0f ? 1.0f : 2.0f);
  const float q = std::fmin(std::floor(t * inv_step_t) * step_t, kMaxNorm);  // fmin maps a NaN t to 6
  const bool negative = !std::isnan(x) && std::signbit(x);
  return encode_e2m1(negative ? -q : q);  // q is on the grid: the encode is exact
}

uint8_t e8m0_round_up(const float value) {
  if (std::isnan(value)) return 0xFF;
  if (std::isinf(value)) return 0xFE;
  if (value == 0.0f) return 0x00;
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  uint32_t exponent = (bits >> 23) & 0xFF;
  const uint32_t mantissa = bits & 0x7FFFFF;
  // Round the exponent up unless the value is a power of two, keeping 0xFE as the saturated maximum; a subnormal
  // up to 2^-127 (mantissa 0x400000) stays at code 0, which means 2^-127.
  if (mantissa > 0 && exponent != 0xFE && !(exponent == 0 && mantissa <= 0x400000)) ++exponent;
  return static_cast<uint8_t>(exponent);
}

float decode_e8m0(const uint8_t code) {
  if (code == 0xFF) return std::numeric_limits<float>::quiet_NaN();
  if (code == 0) return std::bit_cast<float>(uint32_t{0x00400000});  // 2^-127, a subnormal
  return std::bit_cast<float>(static_cast<uint32_t>(code) << 23);
}

float e8m0_reciprocal(const uint8_t code) {
  if (code == 0xFF) return std::numeric_limits<float>::quiet_NaN();
  if (code == 0xFE) return std::bit_cast<float>(uint32_t{0x00400000});  // 2^-127
  return std::bit_cast<float>(static_cast<uint32_t>(254 - code) << 23);
}

}  // namespace moecore::quant
