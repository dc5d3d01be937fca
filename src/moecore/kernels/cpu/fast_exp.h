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

// exp(x) for double x <= 0 in plain arithmetic (vectorises like fast_exp): x = n ln2 + r with ln2 split in two
// constants (fdlibm's ln2_hi, whose trailing zeros make n ln2_hi exact, and ln2_lo), |r| <= ln2 / 2, then the Taylor
// series of exp(r) to degree 13 (truncation below 5e-18) by Horner, scaled by 2^n built in the exponent bits. Error
// a few ulp of double (kernels_fast_exp_test bounds it). x < -708 (exp(x) under 2^-1021): 0, -inf included; NaN: NaN.
// For x > 0 the result is not defined.
inline double fast_exp_nonpositive(const double x) {
  constexpr double kLowest = -708.0;                 // n >= -1022: 2^n stays a normal double
  constexpr double kLog2e = 1.44269504088896338700;  // 1 / ln 2
  constexpr double kLn2Hi = 6.93147180369123816490e-01, kLn2Lo = 1.90821492927058770002e-10;
  constexpr double kRound = 6755399441055744.0;  // 1.5 * 2^52: adding it rounds |v| < 2^51 to an integer
  const double clamped = x < kLowest ? kLowest : x;
  const double shifted = clamped * kLog2e + kRound;
  const double n = shifted - kRound;  // round(x / ln 2), in [-1021, 0]
  const double r = (clamped - n * kLn2Hi) - n * kLn2Lo;
  double p = 1.0 / 6227020800.0;  // 1/13!
  p = p * r + 1.0 / 479001600.0;
  p = p * r + 1.0 / 39916800.0;
  p = p * r + 1.0 / 3628800.0;
  p = p * r + 1.0 / 362880.0;
  p = p * r + 1.0 / 40320.0;
  p = p * r + 1.0 / 5040.0;
  p = p * r + 1.0 / 720.0;
  p = p * r + 1.0 / 120.0;
  p = p * r + 1.0 / 24.0;
  p = p * r + 1.0 / 6.0;
  p = p * r + 0.5;
  const double exp_r = p * r * r + r + 1.0;
  // 2^n from its exponent bits (n mod 2^64 is the difference of the bit patterns).
  const uint64_t n_bits = std::bit_cast<uint64_t>(shifted) - std::bit_cast<uint64_t>(kRound);
  const double two_n = std::bit_cast<double>((n_bits + 1023u) << 52);
  return x < kLowest ? 0.0 : exp_r * two_n;
}

}  // namespace moecore::kernels::cpu
