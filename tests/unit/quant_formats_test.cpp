// The element and scale codecs (quant/fp8_formats.h): every code, rounding at midpoints, saturation, subnormals,
// NaN / Inf, E8M0 and E2M1 stochastic rounding. Expected values are derived from the format definitions.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "moecore/quant/fp8_formats.h"
#include "moecore/quant/stochastic_rounding.h"

namespace moecore::quant {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
const float kNaN = std::numeric_limits<float>::quiet_NaN();

bool is_e4m3_nan(const int code) { return (code & 0x7F) == 0x7F; }
bool is_e5m2_nan(const int code) { return (code & 0x7F) > 0x7C; }

TEST(QuantFormats, E4M3DecodesHandCheckedCodes) {
  EXPECT_EQ(decode_e4m3(0x00), 0.0f);
  EXPECT_TRUE(std::signbit(decode_e4m3(0x80)));
  EXPECT_EQ(decode_e4m3(0x01), std::ldexp(1.0f, -9));  // smallest subnormal: 1/8 x 2^-6
  EXPECT_EQ(decode_e4m3(0x07), 7.0f * std::ldexp(1.0f, -9));
  EXPECT_EQ(decode_e4m3(0x08), std::ldexp(1.0f, -6));  // smallest normal
  EXPECT_EQ(decode_e4m3(0x38), 1.0f);
  EXPECT_EQ(decode_e4m3(0x39), 1.125f);
  EXPECT_EQ(decode_e4m3(0xB8), -1.0f);
  EXPECT_EQ(decode_e4m3(0x7E), 448.0f);  // S.1111.110
  EXPECT_EQ(decode_e4m3(0xFE), -448.0f);
  EXPECT_TRUE(std::isnan(decode_e4m3(0x7F)));
  EXPECT_TRUE(std::isnan(decode_e4m3(0xFF)));
  EXPECT_EQ(format_max(ElementFormat::kE4M3), 448.0f);
}

TEST(QuantFormats, E5M2DecodesHandCheckedCodes) {
  EXPECT_EQ(decode_e5m2(0x01), std::ldexp(1.0f, -16));
  EXPECT_EQ(decode_e5m2(0x04), std::ldexp(1.0f, -14));
  EXPECT_EQ(decode_e5m2(0x3C), 1.0f);
  EXPECT_EQ(decode_e5m2(0x3D), 1.25f);
  EXPECT_EQ(decode_e5m2(0x7B), 57344.0f);
  EXPECT_EQ(decode_e5m2(0x7C), kInf);
  EXPECT_EQ(decode_e5m2(0xFC), -kInf);
  for (const int code : {0x7D, 0x7E, 0x7F, 0xFD, 0xFE, 0xFF}) EXPECT_TRUE(std::isnan(decode_e5m2(code)));
  EXPECT_EQ(format_max(ElementFormat::kE5M2), 57344.0f);
}

TEST(QuantFormats, E2M1DecodesAllSixteenCodes) {
  const std::vector<float> values = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
  for (int code = 0; code < 16; ++code) {
    const float expected = code < 8 ? values[code] : -values[code - 8];
    EXPECT_EQ(decode_e2m1(code), expected) << code;
    EXPECT_EQ(std::signbit(decode_e2m1(code)), code >= 8) << code;
  }
}

TEST(QuantFormats, EveryCodeReEncodesToItself) {
  for (int code = 0; code < 256; ++code) {
    const float e4m3 = decode_e4m3(code);
    EXPECT_EQ(encode_e4m3(e4m3, Saturation::kNoSat), is_e4m3_nan(code) ? 0x7F : code) << code;
    EXPECT_EQ(encode_e4m3(e4m3), is_e4m3_nan(code) ? 0x7F : code) << code;
    const float e5m2 = decode_e5m2(code);
    EXPECT_EQ(encode_e5m2(e5m2, Saturation::kNoSat), is_e5m2_nan(code) ? 0x7F : code) << code;
    // Under satfinite (TE's casts) the infinities become the largest finite value.
    const int e5m2_sat = is_e5m2_nan(code) ? 0x7F : ((code & 0x7F) == 0x7C ? (code & 0x80) | 0x7B : code);
    EXPECT_EQ(encode_e5m2(e5m2), e5m2_sat) << code;
  }
  for (int code = 0; code < 16; ++code) EXPECT_EQ(encode_e2m1(decode_e2m1(code)), code) << code;
}

// Midpoints between neighbouring codes go to the one with an even mantissa; just off the midpoint, to the nearer.
void check_midpoints(const ElementFormat format, const int max_code) {
  for (int code = 0; code < max_code; ++code) {
    const float lo = decode(format, code);
    const float hi = decode(format, code + 1);
    const float mid = 0.5f * (lo + hi);  // exact: both are short binary fractions
    const int even = (code % 2 == 0) ? code : code + 1;
    EXPECT_EQ(encode(format, mid), even) << format_name(format) << " " << code;
    EXPECT_EQ(encode(format, -mid), even | (format == ElementFormat::kE2M1 ? 0x8 : 0x80));
    EXPECT_EQ(encode(format, std::nextafter(mid, 0.0f)), code) << format_name(format) << " " << code;
    EXPECT_EQ(encode(format, std::nextafter(mid, kInf)), code + 1) << format_name(format) << " " << code;
  }
}

TEST(QuantFormats, MidpointsRoundToEven) {
  check_midpoints(ElementFormat::kE4M3, 0x7E);
  check_midpoints(ElementFormat::kE5M2, 0x7B);
  check_midpoints(ElementFormat::kE2M1, 0x7);
  // Hand-picked: 1.0625 lies between 1 (0x38, even) and 1.125; 1.1875 between 1.125 and 1.25 (0x3A, even).
  EXPECT_EQ(encode_e4m3(1.0625f), 0x38);
  EXPECT_EQ(encode_e4m3(1.1875f), 0x3A);
  // E2M1 boundaries of TE's reference cast (custom_recipes/reference_nvfp4.py cast_to_fp4x2).
  EXPECT_EQ(decode_e2m1(encode_e2m1(0.25f)), 0.0f);
  EXPECT_EQ(decode_e2m1(encode_e2m1(0.75f)), 1.0f);
  EXPECT_EQ(decode_e2m1(encode_e2m1(1.25f)), 1.0f);
  EXPECT_EQ(decode_e2m1(encode_e2m1(1.75f)), 2.0f);
  EXPECT_EQ(decode_e2m1(encode_e2m1(2.5f)), 2.0f);
  EXPECT_EQ(decode_e2m1(encode_e2m1(3.5f)), 4.0f);
  EXPECT_EQ(decode_e2m1(encode_e2m1(5.0f)), 4.0f);
  EXPECT_EQ(decode_e2m1(encode_e2m1(5.001f)), 6.0f);
}

TEST(QuantFormats, SaturatesAtAndBeyondTheMaximum) {
  EXPECT_EQ(encode_e4m3(448.0f), 0x7E);
  EXPECT_EQ(encode_e4m3(464.0f), 0x7E);  // midpoint to the (NaN) next step: ties to the even 448
  EXPECT_EQ(encode_e4m3(464.0f, Saturation::kNoSat), 0x7E);
  EXPECT_EQ(encode_e4m3(std::nextafter(464.0f, kInf)), 0x7E);
  EXPECT_EQ(encode_e4m3(std::nextafter(464.0f, kInf), Saturation::kNoSat), 0x7F);  // no Inf: NaN
  EXPECT_EQ(encode_e4m3(1e30f), 0x7E);
  EXPECT_EQ(encode_e4m3(-1e30f), 0xFE);
  EXPECT_EQ(encode_e4m3(kInf), 0x7E);
  EXPECT_EQ(encode_e4m3(-kInf), 0xFE);
  EXPECT_EQ(encode_e5m2(57344.0f), 0x7B);
  EXPECT_EQ(encode_e5m2(std::nextafter(61440.0f, 0.0f)), 0x7B);
  EXPECT_EQ(encode_e5m2(61440.0f), 0x7B);  // ties away from the odd 57344 into overflow: saturated
  EXPECT_EQ(encode_e5m2(61440.0f, Saturation::kNoSat), 0x7C);
  EXPECT_EQ(encode_e5m2(kInf), 0x7B);
  EXPECT_EQ(encode_e5m2(-kInf), 0xFB);
  EXPECT_EQ(encode_e5m2(-kInf, Saturation::kNoSat), 0xFC);
  EXPECT_EQ(encode_e2m1(6.0f), 0x7);
  EXPECT_EQ(encode_e2m1(7.0f), 0x7);
  EXPECT_EQ(encode_e2m1(1e30f), 0x7);
  EXPECT_EQ(encode_e2m1(kInf), 0x7);
  EXPECT_EQ(encode_e2m1(-kInf), 0xF);
}

TEST(QuantFormats, SubnormalsAndUnderflow) {
  const float e4m3_min = std::ldexp(1.0f, -9);
  EXPECT_EQ(encode_e4m3(e4m3_min), 0x01);
  EXPECT_EQ(encode_e4m3(0.5f * e4m3_min), 0x00);  // tie between 0 and the smallest subnormal: 0 is even
  EXPECT_EQ(encode_e4m3(std::nextafter(0.5f * e4m3_min, 1.0f)), 0x01);
  EXPECT_EQ(encode_e4m3(1.5f * e4m3_min), 0x02);    // tie between subnormals 1 and 2
  EXPECT_EQ(encode_e4m3(7.5f * e4m3_min), 0x08);    // tie between the largest subnormal and the smallest normal
  EXPECT_EQ(encode_e4m3(-0.25f * e4m3_min), 0x80);  // underflow keeps the sign
  EXPECT_EQ(encode_e4m3(std::numeric_limits<float>::denorm_min()), 0x00);
  EXPECT_EQ(encode_e4m3(-0.0f), 0x80);
  const float e5m2_min = std::ldexp(1.0f, -16);
  EXPECT_EQ(encode_e5m2(e5m2_min), 0x01);
  EXPECT_EQ(encode_e5m2(0.5f * e5m2_min), 0x00);
  EXPECT_EQ(encode_e5m2(3.5f * e5m2_min), 0x04);  // tie between 3 (odd) and the smallest normal 4
  EXPECT_EQ(encode_e2m1(0.2f), 0x0);
  EXPECT_EQ(encode_e2m1(-0.2f), 0x8);
  EXPECT_EQ(encode_e2m1(0.3f), 0x1);
}

TEST(QuantFormats, NaNBecomesTheCanonicalNaNOrMaxForE2M1) {
  EXPECT_EQ(encode_e4m3(kNaN), 0x7F);
  EXPECT_EQ(encode_e4m3(-kNaN), 0x7F);
  EXPECT_EQ(encode_e5m2(kNaN), 0x7F);
  EXPECT_EQ(encode_e5m2(kNaN, Saturation::kNoSat), 0x7F);
  EXPECT_EQ(encode_e2m1(kNaN), 0x7);
  EXPECT_EQ(encode_e2m1(-kNaN), 0x7);
}

TEST(QuantFormats, E8M0RoundsUpToPowersOfTwo) {
  EXPECT_EQ(e8m0_round_up(1.0f), 127);
  EXPECT_EQ(e8m0_round_up(1.5f), 128);
  EXPECT_EQ(e8m0_round_up(2.0f), 128);
  EXPECT_EQ(e8m0_round_up(std::nextafter(2.0f, 3.0f)), 129);
  EXPECT_EQ(e8m0_round_up(0.0078125f), 120);  // 2^-7
  EXPECT_EQ(e8m0_round_up(0.0f), 0);
  EXPECT_EQ(e8m0_round_up(std::ldexp(1.0f, -127)), 0);
  EXPECT_EQ(e8m0_round_up(std::ldexp(1.0f, -140)), 0);  // below the smallest scale: 2^-127
  EXPECT_EQ(e8m0_round_up(1.5f * std::ldexp(1.0f, -127)), 1);
  EXPECT_EQ(e8m0_round_up(std::ldexp(1.0f, 127)), 254);
  EXPECT_EQ(e8m0_round_up(std::numeric_limits<float>::max()), 254);  // saturates (0xFF is NaN)
  EXPECT_EQ(e8m0_round_up(kInf), 254);
  EXPECT_EQ(e8m0_round_up(kNaN), 255);
  EXPECT_EQ(decode_e8m0(127), 1.0f);
  EXPECT_EQ(decode_e8m0(0), std::ldexp(1.0f, -127));
  EXPECT_EQ(decode_e8m0(254), std::ldexp(1.0f, 127));
  EXPECT_TRUE(std::isnan(decode_e8m0(255)));
  EXPECT_EQ(e8m0_reciprocal(127), 1.0f);
  EXPECT_EQ(e8m0_reciprocal(0), std::ldexp(1.0f, 127));
  EXPECT_EQ(e8m0_reciprocal(254), std::ldexp(1.0f, -127));
  for (int code = 0; code < 255; ++code) {
    EXPECT_EQ(e8m0_round_up(decode_e8m0(code)), code);
    EXPECT_EQ(decode_e8m0(code) * e8m0_reciprocal(code), 1.0f) << code;
  }
}

TEST(QuantFormats, StochasticRoundingPicksANeighbourWithTheRightOdds) {
  // x = 1.2 lies between 1 and 1.5 (step 0.5): it rounds up when 1.2 + 0.5 u >= 1.5, u = rbits / 256, i.e. for
  // rbits >= 153.6: 102 of the 256 values.
  int up = 0;
  for (int rbits = 0; rbits < 256; ++rbits) {
    const uint8_t code = encode_e2m1_stochastic(1.2f, static_cast<uint8_t>(rbits));
    ASSERT_TRUE(code == 0x2 || code == 0x3) << rbits;
    up += code == 0x3;
  }
  EXPECT_EQ(up, 102);
  EXPECT_EQ(encode_e2m1_stochastic(-1.2f, 255), 0xB);  // sign kept
  EXPECT_EQ(encode_e2m1_stochastic(3.0f, 255), 0x5);   // grid values stay put
  EXPECT_EQ(encode_e2m1_stochastic(5.9f, 255), 0x7);   // clamps at 6
  EXPECT_EQ(encode_e2m1_stochastic(100.0f, 0), 0x7);
  EXPECT_EQ(encode_e2m1_stochastic(-kInf, 0), 0xF);
  EXPECT_EQ(encode_e2m1_stochastic(kNaN, 7), 0x7);  // NaN -> +6
}

TEST(QuantFormats, StochasticRoundingIsUnbiasedOverManyDraws) {
  const uint64_t key = rowwise_rounding_key();
  for (const float x : {0.1f, 0.7f, 1.2f, 2.3f, 3.9f, 4.5f, 5.2f, -2.6f}) {
    double sum = 0.0;
    constexpr int kDraws = 200000;
    for (int i = 0; i < kDraws; ++i) sum += decode_e2m1(encode_e2m1_stochastic(x, random_byte(7, key, i)));
    const double step = std::fabs(x) >= 4 ? 2.0 : (std::fabs(x) >= 2 ? 1.0 : 0.5);
    // Bias of the 8-bit draw: below step / 256; sampling error: about step / (2 sqrt(draws)) ~ 0.0011 step.
    EXPECT_NEAR(sum / kDraws, x, step / 256 + 0.006 * step) << x;
  }
}

TEST(QuantFormats, RandomBytesDependOnlyOnSeedKeyAndIndex) {
  const uint64_t key = rowwise_rounding_key();
  std::vector<uint8_t> first, again, other_seed;
  for (uint64_t i = 0; i < 64; ++i) {
    first.push_back(random_byte(11, key, i));
    other_seed.push_back(random_byte(12, key, i));
  }
  for (uint64_t i = 64; i-- > 0;) again.insert(again.begin(), random_byte(11, key, i));  // reverse order
  EXPECT_EQ(first, again);
  EXPECT_NE(first, other_seed);
  EXPECT_NE(rowwise_rounding_key(), columnwise_rounding_key());
}

}  // namespace
}  // namespace moecore::quant
