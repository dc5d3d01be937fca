// Rotary embedding: hand-computed values, pass-through tail, fp32 angle recipe, position offset, per-row positions
// (packed documents, context-parallel chunks), fast vs reference, and backward vs central finite differences.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernel_test_util.h"
#include "moecore/kernels/cpu/rope.h"

namespace moecore::kernels {
namespace {

using test::max_rel_error;
using test::numeric_grad;
using test::random_vector;

// rope_forward / rope_backward are overloaded on their last argument (position offset or per-row positions).
template <typename T>
using OffsetFn = void (*)(T*, const T*, int64_t, int64_t, int64_t, int64_t, int64_t, double, int64_t);
template <typename T>
using PositionsFn = void (*)(T*, const T*, int64_t, int64_t, int64_t, int64_t, int64_t, double, const int64_t*);

template <typename T>
OffsetFn<T> offset_forward(const bool fast) {
  return fast ? OffsetFn<T>(cpu::rope_forward<T>) : OffsetFn<T>(ref::rope_forward<T>);
}
template <typename T>
OffsetFn<T> offset_backward(const bool fast) {
  return fast ? OffsetFn<T>(cpu::rope_backward<T>) : OffsetFn<T>(ref::rope_backward<T>);
}
template <typename T>
PositionsFn<T> positions_forward(const bool fast) {
  return fast ? PositionsFn<T>(cpu::rope_forward<T>) : PositionsFn<T>(ref::rope_forward<T>);
}
template <typename T>
PositionsFn<T> positions_backward(const bool fast) {
  return fast ? PositionsFn<T>(cpu::rope_backward<T>) : PositionsFn<T>(ref::rope_backward<T>);
}

// Position 1, one 4-channel head, base 10000: inv_freq = [1, 10000^(-2/4)] = [1, 0.01], so the angles are
// 1 and 0.01, and for x = [1, 2, 3, 4] (x1 = [1, 2], x2 = [3, 4]):
//   y0 = 1 cos(1) - 3 sin(1), y1 = 2 cos(0.01) - 4 sin(0.01), y2 = 3 cos(1) + 1 sin(1), y3 = 4 cos(0.01) + 2 sin(0.01)
// with cos(1) = 0.5403023058681398, sin(1) = 0.8414709848078965, cos(0.01) = 0.9999500004166653,
// sin(0.01) = 0.009999833334166664.
template <typename T>
void check_hand_computed() {
  const std::vector<T> x = {9, 9, 9, 9, 1, 2, 3, 4};  // S = 2; row 0 (position 0) must be unchanged
  const std::vector<double> expected = {
      9, 9, 9, 9, -1.9841106485555497, 1.9599006674966640, 2.4623779024123160, 4.0197996683349940};
  for (const bool fast : {true, false}) {
    std::vector<T> y(8);
    offset_forward<T>(fast)(y.data(), x.data(), 2, 1, 1, 4, 4, 10000.0, 0);
    // cos/sin are evaluated in fp32 (Megatron's recipe), so agreement is to fp32 precision.
    for (size_t i = 0; i < 8; ++i) EXPECT_NEAR(y[i], expected[i], 2e-6) << "i=" << i << " fast=" << fast;
  }
}

TEST(RopeTest, HandComputedValuesFloat) { check_hand_computed<float>(); }
TEST(RopeTest, HandComputedValuesDouble) { check_hand_computed<double>(); }

TEST(RopeTest, ChannelsBeyondRotDimPassThrough) {
  const int64_t S = 7, B = 2, N = 3, head_dim = 13, rot_dim = 6;
  const auto x = random_vector<double>(S * B * N * head_dim, 1);
  for (const bool fast : {true, false}) {
    std::vector<double> y(x.size());
    offset_forward<double>(fast)(y.data(), x.data(), S, B, N, head_dim, rot_dim, 10000.0, 0);
    for (int64_t row = 0; row < S * B * N; ++row) {
      for (int64_t c = rot_dim; c < head_dim; ++c) ASSERT_EQ(y[row * head_dim + c], x[row * head_dim + c]);
      // The rotated part keeps each (c, c + rot_dim/2) pair's norm (to fp32 precision: cos/sin are fp32).
      for (int64_t c = 0; c < rot_dim / 2; ++c) {
        const double* xr = &x[row * head_dim];
        const double* yr = &y[row * head_dim];
        ASSERT_NEAR(std::hypot(yr[c], yr[c + rot_dim / 2]), std::hypot(xr[c], xr[c + rot_dim / 2]), 1e-6);
      }
    }
  }
}

// The angle is float(position) * inv_freq in fp32, and cos/sin are taken of that fp32 angle, like
// torch.outer(arange(S, dtype=float32), inv_freq) in Megatron. At large positions this differs measurably
// from an all-double computation, so the test also proves which recipe is used.
TEST(RopeTest, AnglesFollowTheFp32Recipe) {
  const int64_t S = 3, head_dim = 8, rot_dim = 8, offset = 100000;  // a long-context position: ulp(100000.f) = 0.0078
  const double base = 10000.0;
  const std::vector<double> x(S * head_dim, 0.0);
  std::vector<double> x_unit = x;
  for (int64_t s = 0; s < S; ++s) {
    for (int64_t c = 0; c < rot_dim / 2; ++c) x_unit[s * head_dim + c] = 1.0;  // x1 = 1, x2 = 0: y = [cos, sin]
  }
  std::vector<double> y(x.size());
  cpu::rope_forward<double>(y.data(), x_unit.data(), S, 1, 1, head_dim, rot_dim, base, offset);
  double max_diff_from_double_recipe = 0.0;
  for (int64_t s = 0; s < S; ++s) {
    for (int64_t i = 0; i < rot_dim / 2; ++i) {
      const float inv_freq = 1.0f / std::pow(static_cast<float>(base), static_cast<float>(2 * i) / float{rot_dim});
      const float angle = static_cast<float>(s + offset) * inv_freq;
      EXPECT_NEAR(y[s * head_dim + i], std::cos(angle), 1e-6);
      EXPECT_NEAR(y[s * head_dim + i + rot_dim / 2], std::sin(angle), 1e-6);
      const double angle64 = static_cast<double>(s + offset) * std::pow(base, -2.0 * i / rot_dim);
      max_diff_from_double_recipe =
          std::max(max_diff_from_double_recipe, std::abs(y[s * head_dim + i] - std::cos(angle64)));
    }
  }
  EXPECT_GT(max_diff_from_double_recipe, 1e-4);
}

TEST(RopeTest, PositionOffsetShiftsPositions) {
  const int64_t B = 2, N = 3, head_dim = 10, rot_dim = 8, offset = 5, S = 4;
  const int64_t row = B * N * head_dim;
  const auto x_long = random_vector<float>((S + offset) * row, 3);
  const std::vector<float> x_tail(x_long.begin() + offset * row, x_long.end());
  std::vector<float> y_long(x_long.size()), y_tail(x_tail.size());
  cpu::rope_forward<float>(y_long.data(), x_long.data(), S + offset, B, N, head_dim, rot_dim, 500.0, int64_t{0});
  cpu::rope_forward<float>(y_tail.data(), x_tail.data(), S, B, N, head_dim, rot_dim, 500.0, offset);
  for (size_t i = 0; i < y_tail.size(); ++i) ASSERT_NEAR(y_tail[i], y_long[offset * row + i], 1e-7);
}

template <typename T>
void check_vs_ref(int64_t S, int64_t B, int64_t N, int64_t head_dim, int64_t rot_dim, double tol) {
  const auto x = random_vector<T>(S * B * N * head_dim, 7);
  std::vector<T> y_fast(x.size()), y_ref(x.size());
  cpu::rope_forward<T>(y_fast.data(), x.data(), S, B, N, head_dim, rot_dim, 10000.0, 3);
  ref::rope_forward<T>(y_ref.data(), x.data(), S, B, N, head_dim, rot_dim, 10000.0, 3);
  // Each output is a 2-term combination of O(1) values; the floor absorbs cancellation to near zero.
  EXPECT_LT(max_rel_error(y_fast.data(), y_ref.data(), y_fast.size(), 1e-2), tol);

  const auto dy = random_vector<T>(x.size(), 8);
  auto dx_fast = random_vector<T>(x.size(), 9), dx_ref = dx_fast;  // must accumulate
  cpu::rope_backward<T>(dx_fast.data(), dy.data(), S, B, N, head_dim, rot_dim, 10000.0, 3);
  ref::rope_backward<T>(dx_ref.data(), dy.data(), S, B, N, head_dim, rot_dim, 10000.0, 3);
  EXPECT_LT(max_rel_error(dx_fast.data(), dx_ref.data(), dx_fast.size(), 1e-2), tol);
}

TEST(RopeTest, MatchesReferenceFloat) {
  check_vs_ref<float>(37, 2, 3, 13, 8, 1e-5);
  check_vs_ref<float>(37, 3, 5, 32, 32, 1e-5);  // large enough for the OpenMP path
}

TEST(RopeTest, MatchesReferenceDouble) {
  check_vs_ref<double>(37, 2, 3, 13, 8, 1e-12);
  check_vs_ref<double>(37, 3, 5, 32, 32, 1e-12);
}

// loss = sum(rope(x) * R) is linear in x, so central differences are exact up to rounding (~1e-10).
TEST(RopeTest, BackwardMatchesFiniteDifferences) {
  const int64_t S = 3, B = 2, N = 2, head_dim = 10, rot_dim = 6, offset = 3;
  const auto x = random_vector<double>(S * B * N * head_dim, 11);
  const auto R = random_vector<double>(x.size(), 12);
  for (const bool fast : {true, false}) {
    const auto forward = offset_forward<double>(fast);
    const auto backward = offset_backward<double>(fast);
    const auto g = numeric_grad(
        [&](const std::vector<double>& v) {
          std::vector<double> y(v.size());
          forward(y.data(), v.data(), S, B, N, head_dim, rot_dim, 10000.0, offset);
          return test::weighted_sum(y, R);
        },
        x);
    std::vector<double> dx(x.size());
    backward(dx.data(), R.data(), S, B, N, head_dim, rot_dim, 10000.0, offset);
    EXPECT_LT(max_rel_error(dx.data(), g.data(), dx.size(), 1e-2), 1e-6) << "fast=" << fast;
  }
}

// Packed documents: positions restart at 0 in every document, differently in each batch row (lengths 3, 5, 2 and
// 6, 4), as Megatron's --reset-position-ids gives them.
std::vector<int64_t> document_positions() {
  const int64_t B = 2;
  const std::vector<std::vector<int64_t>> lengths = {{3, 5, 2}, {6, 4}};
  std::vector<int64_t> positions(10 * B);
  for (int64_t b = 0; b < B; ++b) {
    int64_t s = 0;
    for (const int64_t length : lengths[static_cast<size_t>(b)]) {
      for (int64_t p = 0; p < length; ++p, ++s) positions[static_cast<size_t>(s * B + b)] = p;
    }
  }
  return positions;
}

// Context-parallel rank 1 of 3 over a 60-token sequence: chunks 1 and 4 of 6 (positions 10..19 and 40..49) in every
// batch row. With B = 1 the range of positions (40) is longer than the S * B = 20 rows: the per-row table; with
// B = 2 it is not: the table by position.
std::vector<int64_t> cp_chunk_positions(const int64_t B) {
  const int64_t chunk = 10;
  std::vector<int64_t> positions;
  for (const int64_t first : {chunk, 4 * chunk}) {
    for (int64_t p = 0; p < chunk; ++p) {
      for (int64_t b = 0; b < B; ++b) positions.push_back(first + p);
    }
  }
  return positions;
}

// Row (s, b) at position p is the one-row offset kernel at offset p: bit for bit on each backend (same fp32 angle).
template <typename T>
void check_positions_are_per_row_offsets(const std::vector<int64_t>& positions, const int64_t B) {
  const int64_t S = static_cast<int64_t>(positions.size()) / B, N = 3, head_dim = 12, rot_dim = 8;
  const int64_t row = N * head_dim;
  const auto x = random_vector<T>(S * B * row, 21);
  const auto dy = random_vector<T>(x.size(), 22);
  for (const bool fast : {true, false}) {
    SCOPED_TRACE(std::string(fast ? "cpu" : "ref") + " S=" + std::to_string(S));
    std::vector<T> y(x.size()), y_row(row);
    auto dx = random_vector<T>(x.size(), 23), dx_row = dx;  // must accumulate
    positions_forward<T>(fast)(y.data(), x.data(), S, B, N, head_dim, rot_dim, 10000.0, positions.data());
    positions_backward<T>(fast)(dx.data(), dy.data(), S, B, N, head_dim, rot_dim, 10000.0, positions.data());
    for (int64_t sb = 0; sb < S * B; ++sb) {
      const int64_t position = positions[static_cast<size_t>(sb)];
      offset_forward<T>(fast)(y_row.data(), x.data() + sb * row, 1, 1, N, head_dim, rot_dim, 10000.0, position);
      offset_backward<T>(fast)(dx_row.data() + sb * row, dy.data() + sb * row, 1, 1, N, head_dim, rot_dim, 10000.0,
                               position);
      for (int64_t c = 0; c < row; ++c) ASSERT_EQ(y[sb * row + c], y_row[c]) << "row " << sb << " channel " << c;
    }
    EXPECT_TRUE(dx == dx_row);
  }
}

TEST(RopeTest, PositionsAreRowwiseOffsets) {
  check_positions_are_per_row_offsets<float>(document_positions(), 2);
  check_positions_are_per_row_offsets<double>(document_positions(), 2);
  for (const int64_t B : {1, 2}) {
    check_positions_are_per_row_offsets<float>(cp_chunk_positions(B), B);
    check_positions_are_per_row_offsets<double>(cp_chunk_positions(B), B);
  }
}

// Positions s + offset in every batch row give the offset kernel's values exactly.
TEST(RopeTest, PositionsOfConsecutiveRowsEqualTheOffset) {
  const int64_t S = 9, B = 3, N = 2, head_dim = 16, rot_dim = 16, offset = 1000;
  std::vector<int64_t> positions(S * B);
  for (int64_t s = 0; s < S; ++s) {
    for (int64_t b = 0; b < B; ++b) positions[static_cast<size_t>(s * B + b)] = s + offset;
  }
  const auto x = random_vector<float>(S * B * N * head_dim, 24);
  std::vector<float> by_offset(x.size()), by_positions(x.size());
  cpu::rope_forward<float>(by_offset.data(), x.data(), S, B, N, head_dim, rot_dim, 10000.0, offset);
  cpu::rope_forward<float>(by_positions.data(), x.data(), S, B, N, head_dim, rot_dim, 10000.0, positions.data());
  EXPECT_TRUE(by_offset == by_positions);
}

template <typename T>
void check_positions_vs_ref(const std::vector<int64_t>& positions, const int64_t B, const int64_t N,
                            const int64_t head_dim, const int64_t rot_dim, const double tol) {
  const int64_t S = static_cast<int64_t>(positions.size()) / B;
  const auto x = random_vector<T>(S * B * N * head_dim, 25);
  std::vector<T> y_fast(x.size()), y_ref(x.size());
  cpu::rope_forward<T>(y_fast.data(), x.data(), S, B, N, head_dim, rot_dim, 10000.0, positions.data());
  ref::rope_forward<T>(y_ref.data(), x.data(), S, B, N, head_dim, rot_dim, 10000.0, positions.data());
  EXPECT_LT(max_rel_error(y_fast.data(), y_ref.data(), y_fast.size(), 1e-2), tol);
  const auto dy = random_vector<T>(x.size(), 26);
  auto dx_fast = random_vector<T>(x.size(), 27), dx_ref = dx_fast;
  cpu::rope_backward<T>(dx_fast.data(), dy.data(), S, B, N, head_dim, rot_dim, 10000.0, positions.data());
  ref::rope_backward<T>(dx_ref.data(), dy.data(), S, B, N, head_dim, rot_dim, 10000.0, positions.data());
  EXPECT_LT(max_rel_error(dx_fast.data(), dx_ref.data(), dx_fast.size(), 1e-2), tol);
}

// Random positions (some repeated, range both shorter and longer than the rows), and the OpenMP path.
TEST(RopeTest, PositionsMatchReference) {
  for (const int64_t range : {int64_t{7}, int64_t{100000}}) {
    SCOPED_TRACE("range " + std::to_string(range));
    std::vector<int64_t> positions(37 * 3);
    const auto u = random_vector<double>(positions.size(), 28, 0.0, 1.0);
    for (size_t r = 0; r < positions.size(); ++r) positions[r] = static_cast<int64_t>(u[r] * range);
    check_positions_vs_ref<float>(positions, 3, 5, 32, 32, 1e-5);
    check_positions_vs_ref<double>(positions, 3, 5, 32, 32, 1e-12);
    check_positions_vs_ref<float>(positions, 3, 2, 13, 8, 1e-5);
  }
}

TEST(RopeTest, PositionsBackwardMatchesFiniteDifferences) {
  const std::vector<int64_t> positions = document_positions();
  const int64_t B = 2, S = static_cast<int64_t>(positions.size()) / B, N = 2, head_dim = 6, rot_dim = 4;
  const auto x = random_vector<double>(S * B * N * head_dim, 29);
  const auto R = random_vector<double>(x.size(), 30);
  for (const bool fast : {true, false}) {
    const auto g = numeric_grad(
        [&](const std::vector<double>& v) {
          std::vector<double> y(v.size());
          positions_forward<double>(fast)(y.data(), v.data(), S, B, N, head_dim, rot_dim, 10000.0, positions.data());
          return test::weighted_sum(y, R);
        },
        x);
    std::vector<double> dx(x.size());
    positions_backward<double>(fast)(dx.data(), R.data(), S, B, N, head_dim, rot_dim, 10000.0, positions.data());
    EXPECT_LT(max_rel_error(dx.data(), g.data(), dx.size(), 1e-2), 1e-6) << "fast=" << fast;
  }
}

TEST(RopeTest, RejectsMissingOrNegativePositions) {
  std::vector<float> buf(64);
  const std::vector<int64_t> negative = {0, 3, -1, 2};
  for (const bool fast : {true, false}) {
    EXPECT_THROW(positions_forward<float>(fast)(buf.data(), buf.data(), 2, 2, 1, 8, 8, 10000.0, negative.data()),
                 std::invalid_argument);
    EXPECT_THROW(positions_backward<float>(fast)(buf.data(), buf.data(), 2, 2, 1, 8, 8, 10000.0, nullptr),
                 std::invalid_argument);
  }
}

TEST(RopeTest, RejectsBadRotDim) {
  std::vector<float> buf(64);
  EXPECT_THROW(cpu::rope_forward<float>(buf.data(), buf.data(), 1, 1, 1, 8, 7, 10000.0), std::invalid_argument);
  EXPECT_THROW(cpu::rope_forward<float>(buf.data(), buf.data(), 1, 1, 1, 8, 10, 10000.0), std::invalid_argument);
  EXPECT_THROW(cpu::rope_backward<float>(buf.data(), buf.data(), 1, 1, 1, 8, -2, 10000.0), std::invalid_argument);
  EXPECT_THROW(ref::rope_forward<float>(buf.data(), buf.data(), 1, 1, 1, 8, 7, 10000.0), std::invalid_argument);
}

// Multi-latent attention's layout (Megatron's rope_utils.py, mla_rotary_interleaved): channel pairs (2i, 2i+1) are
// rotated and written to (i, i + rot/2); cos and sin carry the attention factor.
TEST(RopeTest, MlaInterleavedLayoutByHand) {
  const std::vector<float> inv_freq = {0.5f, 0.125f};
  const float factor = 1.5f;
  const RopeSpec spec{5, inv_freq, factor, true};
  const std::vector<double> x = {0.3, -0.7, 1.1, 0.4, 2.0};  // [a, b, c, d | pass]
  const std::vector<int64_t> positions = {3};
  for (const bool fast : {true, false}) {
    std::vector<double> y(5);
    if (fast) {
      cpu::rope_forward<double>(y.data(), x.data(), 1, 1, 1, spec, positions.data());
    } else {
      ref::rope_forward<double>(y.data(), x.data(), 1, 1, 1, spec, positions.data());
    }
    const double c0 = std::cos(3.0f * 0.5f) * factor, s0 = std::sin(3.0f * 0.5f) * factor;
    const double c1 = std::cos(3.0f * 0.125f) * factor, s1 = std::sin(3.0f * 0.125f) * factor;
    EXPECT_NEAR(y[0], 0.3 * c0 - (-0.7) * s0, 1e-6);
    EXPECT_NEAR(y[1], 1.1 * c1 - 0.4 * s1, 1e-6);
    EXPECT_NEAR(y[2], -0.7 * c0 + 0.3 * s0, 1e-6);
    EXPECT_NEAR(y[3], 0.4 * c1 + 1.1 * s1, 1e-6);
    EXPECT_EQ(y[4], 2.0);
  }
}

// The interleaved backward against central finite differences, fast and reference.
TEST(RopeTest, MlaInterleavedBackwardMatchesFiniteDifferences) {
  const int64_t S = 3, B = 2, N = 2, d = 6;
  YarnParams yarn;
  yarn.scaling_factor = 8.0;
  yarn.original_max_position_embeddings = 8;
  const RopeSpec spec{d, yarn_inv_freq(4, 10000.0, yarn), 0.9f, true};
  const std::vector<int64_t> positions = {0, 5, 1, 6, 2, 7};
  const std::vector<double> x = random_vector<double>(S * B * N * d, 11);
  const std::vector<double> w = random_vector<double>(S * B * N * d, 12);  // loss = sum(w * y)
  for (const bool fast : {true, false}) {
    const auto forward = [&](const std::vector<double>& in) {
      std::vector<double> y(in.size());
      if (fast) {
        cpu::rope_forward<double>(y.data(), in.data(), S, B, N, spec, positions.data());
      } else {
        ref::rope_forward<double>(y.data(), in.data(), S, B, N, spec, positions.data());
      }
      double loss = 0;
      for (size_t i = 0; i < y.size(); ++i) loss += w[i] * y[i];
      return loss;
    };
    std::vector<double> dx(x.size(), 0.0);
    if (fast) {
      cpu::rope_backward<double>(dx.data(), w.data(), S, B, N, spec, positions.data());
    } else {
      ref::rope_backward<double>(dx.data(), w.data(), S, B, N, spec, positions.data());
    }
    EXPECT_LT(max_rel_error(dx, numeric_grad(forward, x)), 1e-6) << (fast ? "fast" : "reference");
  }
}

// YaRN with DeepSeek-V3's settings (rope dim 64, base 10000, original length 4096, factor 40, beta 32 / 1): the ramp
// spans dimensions 10..23 (Megatron's _yarn_find_correction_range), below it the original frequencies, above it
// the interpolated ones, and the concentration factor is 1 for mscale = mscale_all_dim.
TEST(RopeTest, YarnFrequenciesOfDeepSeekV3) {
  YarnParams yarn;
  yarn.scaling_factor = 40.0;
  const YarnRange range = yarn_correction_range(64, 10000.0, yarn);
  EXPECT_EQ(range.low, 10.0);
  EXPECT_EQ(range.high, 23.0);
  const std::vector<float> inv_freq = yarn_inv_freq(64, 10000.0, yarn);
  ASSERT_EQ(inv_freq.size(), 32u);
  for (int i = 0; i < 32; ++i) {
    const double extra = std::pow(10000.0, -2.0 * i / 64.0), inter = extra / 40.0;
    const double ramp = std::clamp((i - 10.0) / 13.0, 0.0, 1.0);
    EXPECT_NEAR(inv_freq[static_cast<size_t>(i)], inter * ramp + extra * (1 - ramp), 2e-7 * extra) << i;
  }
  EXPECT_DOUBLE_EQ(yarn_concentration_factor(40.0, 1.0, 1.0), 1.0);
  EXPECT_NEAR(yarn_concentration_factor(40.0, 1.0, 0.0), 0.1 * std::log(40.0) + 1.0, 1e-12);
  EXPECT_DOUBLE_EQ(yarn_get_mscale(1.0, 1.0), 1.0);
  // Unrounded range and equal ends (the +0.001 guard keeps the ramp finite).
  yarn.round_to_int = false;
  const YarnRange exact = yarn_correction_range(64, 10000.0, yarn);
  EXPECT_NEAR(exact.low, 64 * std::log(4096 / (32 * 2 * M_PI)) / (2 * std::log(10000.0)), 1e-12);
  yarn.beta_fast = yarn.beta_slow = 1.0;
  for (const float f : yarn_inv_freq(64, 10000.0, yarn)) EXPECT_TRUE(std::isfinite(f));
}

}  // namespace
}  // namespace moecore::kernels
