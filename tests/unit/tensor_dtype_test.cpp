// bf16 / fp16 conversions: hand-derived IEEE bit patterns (round-to-nearest-even ties, subnormals, overflow,
// NaN), exhaustive round trips, and the nearest-value property on many random inputs.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>

#include "moecore/tensor/dtype.h"

namespace moecore {
namespace {

float from_bits(uint32_t bits) { return std::bit_cast<float>(bits); }

TEST(DTypeTest, SizesAndNames) {
  EXPECT_EQ(dtype_size(DType::kF32), 4u);
  EXPECT_EQ(dtype_size(DType::kF64), 8u);
  EXPECT_EQ(dtype_size(DType::kBF16), 2u);
  EXPECT_EQ(dtype_size(DType::kF16), 2u);
  EXPECT_EQ(dtype_size(DType::kI32), 4u);
  EXPECT_EQ(dtype_size(DType::kI64), 8u);
  EXPECT_EQ(dtype_size(DType::kU8), 1u);
  EXPECT_EQ(dtype_name(DType::kBF16), "bfloat16");
  EXPECT_EQ(dtype_name(DType::kF16), "float16");
  EXPECT_EQ(dtype_name(DType::kF32), "float32");
}

// bf16 keeps the top 16 bits of fp32; the dropped low 16 bits decide rounding (0x8000 is exactly half).
TEST(BF16Test, HandDerivedBitPatterns) {
  EXPECT_EQ(fp32_to_bf16(1.0f), 0x3F80);   // 0x3F800000
  EXPECT_EQ(fp32_to_bf16(-2.0f), 0xC000);  // 0xC0000000
  EXPECT_EQ(fp32_to_bf16(0.0f), 0x0000);
  EXPECT_EQ(fp32_to_bf16(-0.0f), 0x8000);
  EXPECT_EQ(fp32_to_bf16(from_bits(0x3F807FFF)), 0x3F80);  // below half: down
  EXPECT_EQ(fp32_to_bf16(from_bits(0x3F808000)), 0x3F80);  // tie, 0x3F80 even: down
  EXPECT_EQ(fp32_to_bf16(from_bits(0x3F808001)), 0x3F81);  // above half: up
  EXPECT_EQ(fp32_to_bf16(from_bits(0x3F818000)), 0x3F82);  // tie, 0x3F81 odd: up to even
  EXPECT_EQ(fp32_to_bf16(from_bits(0x3F81FFFF)), 0x3F82);  // carry within the mantissa
  EXPECT_EQ(fp32_to_bf16(from_bits(0x3FFF8000)), 0x4000);  // tie, odd: carry into the exponent (2.0)
  // Subnormals round the same way.
  EXPECT_EQ(fp32_to_bf16(from_bits(0x00000001)), 0x0000);
  EXPECT_EQ(fp32_to_bf16(from_bits(0x00008000)), 0x0000);  // tie with 0: even
  EXPECT_EQ(fp32_to_bf16(from_bits(0x00018000)), 0x0002);  // tie, odd: up
  EXPECT_EQ(fp32_to_bf16(from_bits(0x80010000)), 0x8001);  // negative subnormal, exact
  // Overflow: the largest bf16 is 0x7F7F; FLT_MAX (0x7F7FFFFF) and the tie 0x7F7F8000 round to Inf.
  EXPECT_EQ(fp32_to_bf16(from_bits(0x7F7F7FFF)), 0x7F7F);
  EXPECT_EQ(fp32_to_bf16(from_bits(0x7F7F8000)), 0x7F80);
  EXPECT_EQ(fp32_to_bf16(std::numeric_limits<float>::max()), 0x7F80);
  EXPECT_EQ(fp32_to_bf16(-std::numeric_limits<float>::max()), 0xFF80);
  EXPECT_EQ(fp32_to_bf16(std::numeric_limits<float>::infinity()), 0x7F80);
  EXPECT_EQ(fp32_to_bf16(-std::numeric_limits<float>::infinity()), 0xFF80);
  // NaN stays NaN, including payloads that live only in the dropped low bits (truncation would give Inf).
  for (const uint32_t nan_bits : {0x7FC00000u, 0x7F800001u, 0xFF800001u, 0x7FFFFFFFu}) {
    const uint16_t out = fp32_to_bf16(from_bits(nan_bits));
    EXPECT_EQ(out & 0x7F80, 0x7F80) << std::hex << nan_bits;
    EXPECT_NE(out & 0x007F, 0) << std::hex << nan_bits;
    EXPECT_EQ(out & 0x8000, (nan_bits >> 16) & 0x8000) << std::hex << nan_bits;
  }
}

TEST(BF16Test, DecodeIsExact) {
  EXPECT_EQ(bf16_to_fp32(0x3F80), 1.0f);
  EXPECT_EQ(bf16_to_fp32(0x3F81), 1.0078125f);  // 1 + 2^-7
  EXPECT_EQ(bf16_to_fp32(0xC0A0), -5.0f);
  EXPECT_EQ(bf16_to_fp32(0x7F7F), 3.38953139e38f);
  EXPECT_EQ(bf16_to_fp32(0x0001), std::ldexp(1.0f, -133));  // smallest subnormal: 2^-126 * 2^-7
  EXPECT_TRUE(std::isinf(bf16_to_fp32(0xFF80)));
  EXPECT_TRUE(std::isnan(bf16_to_fp32(0x7FC0)));
}

TEST(BF16Test, EveryNonNanPatternRoundTrips) {
  for (uint32_t bits = 0; bits <= 0xFFFF; ++bits) {
    const auto b = static_cast<uint16_t>(bits);
    const bool is_nan = (b & 0x7F80) == 0x7F80 && (b & 0x7F) != 0;
    if (is_nan) {
      ASSERT_TRUE(std::isnan(bf16_to_fp32(b)));
      continue;
    }
    ASSERT_EQ(fp32_to_bf16(bf16_to_fp32(b)), b) << std::hex << bits;
  }
}

// fp16: 1 sign, 5 exponent (bias 15), 10 mantissa bits. Max 65504 (0x7BFF); 65520 is the tie with 65536
// (which does not exist) and rounds to Inf; smallest normal 2^-14 (0x0400); smallest subnormal 2^-24 (0x0001).
TEST(FP16Test, HandDerivedBitPatterns) {
  EXPECT_EQ(fp32_to_fp16(1.0f), 0x3C00);
  EXPECT_EQ(fp32_to_fp16(-2.0f), 0xC000);
  EXPECT_EQ(fp32_to_fp16(0.5f), 0x3800);
  EXPECT_EQ(fp32_to_fp16(0.0f), 0x0000);
  EXPECT_EQ(fp32_to_fp16(-0.0f), 0x8000);
  // Normal range ties: 1 + 2^-11 lies halfway between 0x3C00 and 0x3C01.
  EXPECT_EQ(fp32_to_fp16(from_bits(0x3F801000)), 0x3C00);  // tie, even: down
  EXPECT_EQ(fp32_to_fp16(from_bits(0x3F801001)), 0x3C01);  // above half
  EXPECT_EQ(fp32_to_fp16(from_bits(0x3F800FFF)), 0x3C00);  // below half
  EXPECT_EQ(fp32_to_fp16(from_bits(0x3F803000)), 0x3C02);  // 1 + 3*2^-11: tie, odd: up
  EXPECT_EQ(fp32_to_fp16(from_bits(0x3FFFF000)), 0x4000);  // tie, odd: carry into the exponent (2.0)
  // Overflow.
  EXPECT_EQ(fp32_to_fp16(65504.0f), 0x7BFF);
  EXPECT_EQ(fp32_to_fp16(from_bits(0x477FEFFF)), 0x7BFF);  // just below 65520
  EXPECT_EQ(fp32_to_fp16(65520.0f), 0x7C00);               // tie, odd: Inf
  EXPECT_EQ(fp32_to_fp16(-70000.0f), 0xFC00);
  EXPECT_EQ(fp32_to_fp16(std::numeric_limits<float>::max()), 0x7C00);
  EXPECT_EQ(fp32_to_fp16(std::numeric_limits<float>::infinity()), 0x7C00);
  EXPECT_EQ(fp32_to_fp16(-std::numeric_limits<float>::infinity()), 0xFC00);
  // Normal / subnormal boundary and subnormals.
  EXPECT_EQ(fp32_to_fp16(std::ldexp(1.0f, -14)), 0x0400);
  EXPECT_EQ(fp32_to_fp16(std::ldexp(1023.0f, -24)), 0x03FF);  // largest subnormal
  EXPECT_EQ(fp32_to_fp16(std::ldexp(1023.5f, -24)), 0x0400);  // tie, odd: up into the smallest normal
  EXPECT_EQ(fp32_to_fp16(std::ldexp(1.0f, -24)), 0x0001);     // smallest subnormal
  EXPECT_EQ(fp32_to_fp16(std::ldexp(1.0f, -25)), 0x0000);     // tie with 0: even
  EXPECT_EQ(fp32_to_fp16(from_bits(0x33000001)), 0x0001);     // just above 2^-25
  EXPECT_EQ(fp32_to_fp16(std::ldexp(1.5f, -24)), 0x0002);     // tie, odd: up
  EXPECT_EQ(fp32_to_fp16(std::ldexp(2.5f, -24)), 0x0002);     // tie, even: down
  EXPECT_EQ(fp32_to_fp16(-std::ldexp(3.0f, -24)), 0x8003);
  EXPECT_EQ(fp32_to_fp16(std::ldexp(1.0f, -30)), 0x0000);  // far underflow
  EXPECT_EQ(fp32_to_fp16(from_bits(0x00000001)), 0x0000);  // fp32 subnormal
  // NaN stays NaN with its sign.
  for (const uint32_t nan_bits : {0x7FC00000u, 0x7F800001u, 0xFF800001u}) {
    const uint16_t out = fp32_to_fp16(from_bits(nan_bits));
    EXPECT_EQ(out & 0x7C00, 0x7C00) << std::hex << nan_bits;
    EXPECT_NE(out & 0x03FF, 0) << std::hex << nan_bits;
    EXPECT_EQ(out & 0x8000, (nan_bits >> 16) & 0x8000) << std::hex << nan_bits;
  }
}

TEST(FP16Test, DecodeIsExact) {
  EXPECT_EQ(fp16_to_fp32(0x3C00), 1.0f);
  EXPECT_EQ(fp16_to_fp32(0xC000), -2.0f);
  EXPECT_EQ(fp16_to_fp32(0x3555), 0.333251953125f);  // 2^-2 * (1 + 341/1024)
  EXPECT_EQ(fp16_to_fp32(0x7BFF), 65504.0f);
  EXPECT_EQ(fp16_to_fp32(0x0400), std::ldexp(1.0f, -14));
  EXPECT_EQ(fp16_to_fp32(0x0001), std::ldexp(1.0f, -24));
  EXPECT_EQ(fp16_to_fp32(0x03FF), std::ldexp(1023.0f, -24));
  EXPECT_EQ(fp16_to_fp32(0x8200), -std::ldexp(512.0f, -24));
  EXPECT_EQ(std::bit_cast<uint32_t>(fp16_to_fp32(0x8000)), 0x80000000u);
  EXPECT_EQ(fp16_to_fp32(0x7C00), std::numeric_limits<float>::infinity());
  EXPECT_EQ(fp16_to_fp32(0xFC00), -std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(fp16_to_fp32(0x7E00)));
  EXPECT_TRUE(std::isnan(fp16_to_fp32(0x7C01)));
}

TEST(FP16Test, EveryNonNanPatternRoundTrips) {
  for (uint32_t bits = 0; bits <= 0xFFFF; ++bits) {
    const auto h = static_cast<uint16_t>(bits);
    const bool is_nan = (h & 0x7C00) == 0x7C00 && (h & 0x3FF) != 0;
    if (is_nan) {
      ASSERT_TRUE(std::isnan(fp16_to_fp32(h)));
      continue;
    }
    ASSERT_EQ(fp32_to_fp16(fp16_to_fp32(h)), h) << std::hex << bits;
  }
}

// For random finite inputs in range, the result must be a nearest representable value, and on a tie the
// one with an even mantissa. Neighbours are decoded with the (exhaustively round-trip tested) decoder.
template <typename Encode, typename Decode>
void check_nearest(Encode encode, Decode decode, uint32_t exp_lo, uint32_t exp_hi, uint16_t inf_bits) {
  std::mt19937 gen(12345);
  std::uniform_int_distribution<uint32_t> exponent(exp_lo, exp_hi), mantissa(0, 0x7FFFFF), sign(0, 1);
  for (int trial = 0; trial < 200000; ++trial) {
    uint32_t m = mantissa(gen);
    if (trial % 4 == 0) m = (m & ~0x1FFFu) | 0x1000u;  // many exact fp16 ties
    if (trial % 4 == 1) m = (m & ~0xFFFFu) | 0x8000u;  // many exact bf16 ties
    const float f = from_bits((sign(gen) << 31) | (exponent(gen) << 23) | m);
    const uint16_t h = encode(f);
    const uint16_t mag = h & 0x7FFF;
    ASSERT_LT(mag, inf_bits) << "finite input " << f << " gave Inf/NaN";
    const double err = std::abs(static_cast<double>(decode(h)) - f);
    for (const int step : {-1, 1}) {
      const int neighbour = static_cast<int>(mag) + step;
      if (neighbour < 0 || neighbour > inf_bits) continue;
      const uint16_t other = static_cast<uint16_t>((h & 0x8000) | neighbour);
      const double other_err = neighbour == inf_bits ? INFINITY : std::abs(static_cast<double>(decode(other)) - f);
      ASSERT_LE(err, other_err) << "f=" << f << std::hex << " h=" << h;
      if (err == other_err) {
        ASSERT_EQ(h & 1, 0) << "tie not to even: f=" << f << std::hex << " h=" << h;
      }
    }
  }
}

TEST(FP16Test, RoundsToNearestEvenOnRandomInputs) {
  // Exponents 2^-31 .. 2^15: deep underflow, subnormals, normals up to 65504 (2^15 * 1.99 < 65520 overflows
  // only above 0x477FEFFF, so stop at exponent 0x8D = 2^14 to stay finite).
  check_nearest(fp32_to_fp16, fp16_to_fp32, 0x60, 0x8D, 0x7C00);
}

TEST(BF16Test, RoundsToNearestEvenOnRandomInputs) {
  // Every fp32 exponent except the top one (where rounding may overflow to Inf, tested by hand above).
  check_nearest(fp32_to_bf16, bf16_to_fp32, 0x00, 0xFD, 0x7F80);
}

}  // namespace
}  // namespace moecore
