#include "moecore/quant/nvfp4_scaling.h"

#include <cmath>
#include <limits>

#include "moecore/quant/scale_math.h"
#include "moecore/quant/stochastic_rounding.h"

namespace moecore::quant {
namespace {

constexpr uint8_t kE4M3NanCode = 0x7F;

bool has_nan_block(const float* x, const int64_t ld, const int64_t rows, const int64_t cols) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      if (std::isnan(x[r * ld + c])) return true;
    }
  }
  return false;
}

}  // namespace

float nvfp4_global_encode_scale(const float global_amax) {
  constexpr float kFp8Max = 448.0f;
  constexpr float kFp4Max = 6.0f;
  float scale = kFp8Max * kFp4Max / global_amax;
  scale = std::fmin(scale, std::numeric_limits<float>::max());
  if (global_amax == 0.0f || scale == 0.0f) return 1.0f;
  return scale;
}

uint8_t nvfp4_block_scale_code(const float block_amax, const float s_enc) {
  constexpr float kFp4MaxInv = 1.0f / 6.0f;
  return encode_e4m3(block_amax * (s_enc * kFp4MaxInv));
}

QuantizedTensor quantize_nvfp4(const float* x, const int64_t rows, const int64_t cols, const QuantSpec& spec,
                               const RoundingStream* rounding) {
  QuantizedTensor q = make_blocked(Recipe::kNvfp4, ElementFormat::kE2M1, rows, cols, spec, true);
  q.amax = abs_max(x, rows * cols);
  const float s_enc = nvfp4_global_encode_scale(q.amax);
  const float s_dec = 1.0f / s_enc;
#pragma omp parallel for schedule(static) if (rows * cols > (1 << 16))
  for (int64_t br = 0; br < q.scale_rows; ++br) {
    for (int64_t bc = 0; bc < q.scale_cols; ++bc) {
      const int64_t r0 = br * spec.block_rows;
      const int64_t c0 = bc * spec.block_cols;
      const float block_amax = abs_max_block(x + r0 * cols + c0, cols, spec.block_rows, spec.block_cols);
      const uint8_t scale_code = nvfp4_block_scale_code(block_amax, s_enc);
      const float block_scale = decode_e4m3(scale_code);
      const float factor = std::fmin(1.0f / (block_scale * s_dec), std::numeric_limits<float>::max());
      // E2M1 has no NaN: a block holding one keeps its codes and gets the E4M3 NaN scale, so it decodes to NaN.
      const bool nan_block = has_nan_block(x + r0 * cols + c0, cols, spec.block_rows, spec.block_cols);
      q.scale_codes[br * q.scale_cols + bc] = nan_block ? kE4M3NanCode : scale_code;
      q.scales[br * q.scale_cols + bc] = nan_block ? std::numeric_limits<float>::quiet_NaN() : block_scale;
      for (int64_t r = r0; r < r0 + spec.block_rows; ++r) {
        for (int64_t c = c0; c < c0 + spec.block_cols; ++c) {
          const int64_t i = r * cols + c;
          const float scaled = x[i] * factor;
          q.codes[i] = rounding ? encode_e2m1_stochastic(scaled, random_byte(rounding->seed, rounding->key, i))
                                : encode_e2m1(scaled);
        }
      }
    }
  }
  return q;
}

}  // namespace moecore::quant
