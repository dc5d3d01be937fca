// Reference conversions: the scalar functions of tensor/dtype.h element by element; doubles are rounded by a binary
// search for the two neighbouring low-precision values and a comparison of distances (ties to the even pattern).
#include <cmath>
#include <cstdint>

#include "moecore/kernels/cpu/convert.h"
#include "moecore/tensor/dtype.h"

namespace moecore::kernels::ref {
namespace {

// Nearest bits to `value` among the finite patterns of a format whose positive patterns 0 .. inf_bits increase with
// their values; beyond the largest finite value the grid continues with one more step of the same size.
template <typename Decode>
uint16_t round_nearest(const double value, const uint16_t inf_bits, const uint16_t nan_bits, Decode decode) {
  if (std::isnan(value)) return nan_bits;
  const uint16_t sign = std::signbit(value) ? 0x8000u : 0u;
  const long double magnitude = std::abs(static_cast<long double>(value));
  const auto at = [&](const uint32_t bits) -> long double {
    if (bits < inf_bits) return static_cast<long double>(decode(static_cast<uint16_t>(bits)));
    const long double largest = decode(static_cast<uint16_t>(inf_bits - 1));
    return 2 * largest - static_cast<long double>(decode(static_cast<uint16_t>(inf_bits - 2)));
  };
  if (magnitude >= at(inf_bits)) return sign | inf_bits;
  uint32_t lo = 0, hi = inf_bits;  // at(lo) <= magnitude < at(hi)
  while (hi - lo > 1) {
    const uint32_t mid = (lo + hi) / 2;
    (at(mid) <= magnitude ? lo : hi) = mid;
  }
  const long double below = magnitude - at(lo), above = at(hi) - magnitude;
  const uint32_t nearest = below < above ? lo : (above < below ? hi : ((lo & 1u) == 0 ? lo : hi));
  return static_cast<uint16_t>(sign | nearest);
}

}  // namespace

uint16_t round_to_bf16(const double value) {
  return round_nearest(value, 0x7f80u, moecore::fp32_to_bf16(static_cast<float>(value)), moecore::bf16_to_fp32);
}
uint16_t round_to_fp16(const double value) {
  return round_nearest(value, 0x7c00u, moecore::fp32_to_fp16(static_cast<float>(value)), moecore::fp16_to_fp32);
}

void encode_bf16(uint16_t* out, const float* in, const int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = moecore::fp32_to_bf16(in[i]);
}
void encode_bf16(uint16_t* out, const double* in, const int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = round_to_bf16(in[i]);
}
void decode_bf16(float* out, const uint16_t* in, const int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = moecore::bf16_to_fp32(in[i]);
}
void decode_bf16(double* out, const uint16_t* in, const int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = moecore::bf16_to_fp32(in[i]);
}
void encode_fp16(uint16_t* out, const float* in, const int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = moecore::fp32_to_fp16(in[i]);
}
void encode_fp16(uint16_t* out, const double* in, const int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = round_to_fp16(in[i]);
}
void decode_fp16(float* out, const uint16_t* in, const int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = moecore::fp16_to_fp32(in[i]);
}
void decode_fp16(double* out, const uint16_t* in, const int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = moecore::fp16_to_fp32(in[i]);
}

void round_bf16(float* data, const int64_t n) {
  for (int64_t i = 0; i < n; ++i) data[i] = bf16_to_fp32(round_to_bf16(data[i]));
}
void round_fp16(float* data, const int64_t n) {
  for (int64_t i = 0; i < n; ++i) data[i] = fp16_to_fp32(round_to_fp16(data[i]));
}

}  // namespace moecore::kernels::ref
