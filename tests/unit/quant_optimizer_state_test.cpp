// The precision-aware optimizer's state formats (quant/optimizer_state.h) against an independent reference: values
// stored and read back equal the nearest point of each format's enumerated grid with fused_adam.py's scale
// (absmax / 32752 for fp16, absmax / 448 for fp8 E4M3, none for bf16), bit for bit; the stored codes are the grid's.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "moecore/quant/fp8_formats.h"
#include "moecore/quant/optimizer_state.h"
#include "moecore/tensor/rng.h"
#include "optimizer_state_reference.h"

namespace moecore {
namespace {

using quant::StateFormat;

// Values over many binades (Adam's moments span several), with exact ties of every format and the extremes.
std::vector<float> sample_values(const uint64_t seed) {
  std::vector<float> x;
  const CounterRng rng(seed, stream_key("optimizer_state"));
  for (uint64_t i = 0; i < 3000; ++i) {
    const double magnitude = std::ldexp(1.0, static_cast<int>(i % 40) - 30);
    x.push_back(static_cast<float>(rng.normal(i) * magnitude));
  }
  // Ties: halfway between two bf16 values (even and odd lower neighbours), and values near fp16 / E4M3 ties after
  // scaling come from the random draws.
  x.push_back(std::bit_cast<float>(0x3F808000u));  // 1 + 2^-8: between bf16 0x3F80 (even) and 0x3F81
  x.push_back(std::bit_cast<float>(0x3F818000u));  // between 0x3F81 (odd) and 0x3F82
  x.push_back(-std::bit_cast<float>(0x3F818000u));
  x.push_back(0.0f);
  x.push_back(1e-30f);
  return x;
}

std::vector<float> round_trip(const StateFormat format, const std::vector<float>& x, float* scale_out = nullptr) {
  const float scale = quant::state_scale(format, quant::abs_max(x));
  if (scale_out) *scale_out = scale;
  std::vector<std::byte> stored(x.size() * quant::state_format_bytes(format));
  quant::encode_state(format, scale, x, stored);
  std::vector<float> back(x.size());
  quant::decode_state(format, scale, stored, back);
  return back;
}

TEST(OptimizerState, NamesBytesAndRanges) {
  for (const char* name : {"fp32", "fp16", "bf16", "fp8"}) {
    EXPECT_EQ(quant::state_format_name(quant::parse_state_format(name)), name);
  }
  EXPECT_THROW((void)quant::parse_state_format("fp64"), std::invalid_argument);
  EXPECT_EQ(quant::state_format_bytes(StateFormat::kF32), 4u);
  EXPECT_EQ(quant::state_format_bytes(StateFormat::kF16), 2u);
  EXPECT_EQ(quant::state_format_bytes(StateFormat::kBF16), 2u);
  EXPECT_EQ(quant::state_format_bytes(StateFormat::kFP8), 1u);
  // torch.finfo(torch.float16).max / 2 = 65504 / 2 and E4M3's max.
  EXPECT_EQ(quant::state_format_range(StateFormat::kF16), 32752.0f);
  EXPECT_EQ(quant::state_format_range(StateFormat::kFP8), 448.0f);
  EXPECT_EQ(quant::state_scale(StateFormat::kF16, 65504.0f), 2.0f);
  EXPECT_EQ(quant::state_scale(StateFormat::kFP8, 896.0f), 2.0f);
  EXPECT_EQ(quant::state_scale(StateFormat::kBF16, 5.0f), 1.0f);
  EXPECT_EQ(quant::state_scale(StateFormat::kF32, 5.0f), 1.0f);
  EXPECT_EQ(quant::abs_max(std::vector<float>{1.0f, -3.5f, 2.0f}), 3.5f);
  EXPECT_TRUE(std::isnan(quant::abs_max(std::vector<float>{1.0f, std::nanf(""), 2.0f})));
}

TEST(OptimizerState, Bf16IsTheNearestGridValueTiesToEven) {
  const std::vector<float> x = sample_values(1);
  const std::vector<float> back = round_trip(StateFormat::kBF16, x);
  for (size_t i = 0; i < x.size(); ++i) {
    EXPECT_EQ(back[i], static_cast<float>(test::nearest_on_grid(test::bf16_grid(), x[i]))) << "x=" << x[i];
  }
  // The ties by hand: 1 + 2^-8 goes down to 1 (even), 1 + 3 * 2^-8 up to 1 + 2^-6 (0x3F82, even).
  EXPECT_EQ(back[x.size() - 5], 1.0f);
  EXPECT_EQ(back[x.size() - 4], std::bit_cast<float>(0x3F820000u));
  EXPECT_EQ(back[x.size() - 3], -std::bit_cast<float>(0x3F820000u));
}

TEST(OptimizerState, Fp16IsScaledByAbsmaxOver32752) {
  const std::vector<float> x = sample_values(2);
  float scale = 0.0f;
  const std::vector<float> back = round_trip(StateFormat::kF16, x, &scale);
  EXPECT_EQ(scale, test::reference_abs_max(x) / 32752.0f);
  for (size_t i = 0; i < x.size(); ++i) {
    EXPECT_EQ(back[i], test::reference_round_trip(StateFormat::kF16, scale, x[i])) << "x=" << x[i];
  }
  // The stored codes: the largest magnitude lands on 32752 (= 32768 - 16, an fp16 value), half of fp16's range.
  std::vector<std::byte> stored(x.size() * 2);
  quant::encode_state(StateFormat::kF16, scale, x, stored);
  uint16_t largest = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    uint16_t h = 0;
    std::memcpy(&h, stored.data() + 2 * i, 2);
    largest = std::max<uint16_t>(largest, h & 0x7FFFu);
  }
  EXPECT_EQ(test::fp16_grid()[largest].value, 32752.0);
}

TEST(OptimizerState, Fp8IsE4M3ScaledByAbsmaxOver448) {
  const std::vector<float> x = sample_values(3);
  float scale = 0.0f;
  const std::vector<float> back = round_trip(StateFormat::kFP8, x, &scale);
  EXPECT_EQ(scale, test::reference_abs_max(x) / 448.0f);
  std::vector<std::byte> stored(x.size());
  quant::encode_state(StateFormat::kFP8, scale, x, stored);
  const float q = 1.0f / scale;
  for (size_t i = 0; i < x.size(); ++i) {
    EXPECT_EQ(back[i], test::reference_round_trip(StateFormat::kFP8, scale, x[i])) << "x=" << x[i];
    // The code is the grid point's (sign bit 0x80).
    const double v = test::nearest_on_grid(test::e4m3_grid(), x[i] * q);
    const auto code = static_cast<uint8_t>(stored[i]);
    EXPECT_EQ(test::e4m3_grid()[code & 0x7Fu].value, std::fabs(v)) << "x=" << x[i];
    if (v != 0.0) {
      EXPECT_EQ((code & 0x80u) != 0, v < 0.0);
    }
  }
  // The largest magnitude maps to 448 exactly (its code 0x7E), so nothing saturates beyond it.
  const size_t at = static_cast<size_t>(
      std::max_element(x.begin(), x.end(), [](float a, float b) { return std::fabs(a) < std::fabs(b); }) - x.begin());
  EXPECT_EQ(static_cast<uint8_t>(stored[at]) & 0x7Fu, 0x7Eu);
}

// With scale 1 the stored code is the E4M3 cast itself: bit for bit the general-format encoder of fp8_formats.h over
// a sweep of fp32 bit patterns (both signs, every binade, Inf and NaN) and at every midpoint between two E4M3 values
// and its fp32 neighbours.
TEST(OptimizerState, Fp8CastMatchesTheE4M3Encoder) {
  std::vector<float> x;
  for (uint64_t bits = 0; bits <= 0xFFFFFFFFu; bits += 977)
    x.push_back(std::bit_cast<float>(static_cast<uint32_t>(bits)));
  const std::vector<test::GridPoint>& grid = test::e4m3_grid();
  for (size_t i = 0; i + 1 < grid.size(); ++i) {
    const auto mid = static_cast<float>((grid[i].value + grid[i + 1].value) / 2);
    for (const float v : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e9f)}) {
      x.push_back(v);
      x.push_back(-v);
    }
  }
  for (const float v : {448.0f, 464.0f, 480.0f, 1e30f, INFINITY, -INFINITY, std::nanf(""), 0.0f, -0.0f}) x.push_back(v);
  std::vector<std::byte> stored(x.size());
  quant::encode_state(StateFormat::kFP8, 1.0f, x, stored);
  for (size_t i = 0; i < x.size(); ++i) {
    ASSERT_EQ(static_cast<uint8_t>(stored[i]), quant::encode_e4m3(x[i])) << "x=" << x[i];
  }
}

TEST(OptimizerState, AnAllZeroStateStoresZeros) {
  const std::vector<float> zeros(5, 0.0f);
  for (const StateFormat f : {StateFormat::kF32, StateFormat::kF16, StateFormat::kBF16, StateFormat::kFP8}) {
    float scale = -1.0f;
    const std::vector<float> back = round_trip(f, zeros, &scale);
    EXPECT_EQ(scale, f == StateFormat::kF16 || f == StateFormat::kFP8 ? 0.0f : 1.0f);
    for (const float v : back) EXPECT_EQ(v, 0.0f) << quant::state_format_name(f);
  }
}

TEST(OptimizerState, RoundTripErrorWithinTheFormatsRounding) {
  const std::vector<float> x = sample_values(4);
  for (const StateFormat f : {StateFormat::kF16, StateFormat::kBF16, StateFormat::kFP8}) {
    float scale = 0.0f;
    const std::vector<float> back = round_trip(f, x, &scale);
    const test::RoundingBound bound = test::rounding_bound(f, scale);
    for (size_t i = 0; i < x.size(); ++i) {
      const double err = std::fabs(static_cast<double>(back[i]) - x[i]);
      EXPECT_LE(err, bound.relative * std::fabs(x[i]) + bound.absolute) << quant::state_format_name(f) << " x=" << x[i];
    }
  }
}

TEST(OptimizerState, SizesMustMatch) {
  const std::vector<float> x(4, 1.0f);
  std::vector<std::byte> stored(7);
  EXPECT_THROW(quant::encode_state(StateFormat::kF16, 1.0f, x, stored), std::invalid_argument);
}

}  // namespace
}  // namespace moecore
