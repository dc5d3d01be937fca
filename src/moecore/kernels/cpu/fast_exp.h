// exp(x) for float in plain arithmetic, so that a loop calling it vectorises (glibc's expf is a scalar call) in
// every vector ISA the kernels are compiled for (vector_isa.h): no calls, no float-to-int conversion, only
// multiplies, adds, compares and selects. Cody-Waite range reduction x = n ln2 + r with ln2 split in two constants,
// then Cephes' degree-6 polynomial for exp(r) on |r| <= ln2 / 2 (S. L. Moshier, Cephes Math Library, expf.c), scaled
// by 2^n built in the exponent bits. Error about 2 ulp over the normal range.
//   x < -86.9 (exp(x) < 1.82e-38, under 2 FLT_MIN): 0, -inf included (flushed: subnormal results are slow to produce);
//   x > ln(FLT_MAX) = 88.722...: +inf; NaN: NaN.
#pragma once

#include <bit>
#include <cstdint>
#include <limits>

namespace moecore::kernels::cpu {

inline float fast_exp(const float x) {
  constexpr float kLowest = -86.9f;         // exp(-86.9) = 1.8e-38 < 2 FLT_MIN; n >= -125 from here
  constexpr float kHighest = 88.72283935f;  // ln(FLT_MAX): n <= 128
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;  // kLn2Hi + kLn2Lo = ln 2; kLn2Hi has 9 bits
  // Adding 1.5 * 2^23 rounds a float of magnitude < 2^22 to an integer, which then sits in the low mantissa bits.
  constexpr float kRound = 12582912.0f;
  const float clamped = x < kLowest ? kLowest : (x > kHighest ? kHighest : x);
  const float shifted = clamped * kLog2e + kRound;
  const float n = shifted - kRound;  // round(x / ln 2), in [-125, 128]
  const float r = (clamped - n * kLn2Hi) - n * kLn2Lo;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float exp_r = p * r * r + r + 1.0f;
  // 2^(n-1), n-1 in [-126, 127], from its exponent bits (n mod 2^32 is the difference of the bit patterns); the
  // factor 2 goes on exp_r, exactly, so that n = 128 needs no exponent 255.
  const uint32_t n_bits = std::bit_cast<uint32_t>(shifted) - std::bit_cast<uint32_t>(kRound);
  const float two_n_minus_1 = std::bit_cast<float>((n_bits + 126u) << 23);
  const float y = (exp_r + exp_r) * two_n_minus_1;
  return x < kLowest ? 0.0f : (x > kHighest ? std::numeric_limits<float>::infinity() : y);
}

}  // namespace moecore::kernels::cpu
