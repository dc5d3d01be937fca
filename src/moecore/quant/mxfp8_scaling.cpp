#include "moecore/quant/mxfp8_scaling.h"

#include "moecore/quant/scale_math.h"

namespace moecore::quant {

QuantizedTensor quantize_mxfp8(const float* x, const int64_t rows, const int64_t cols, const QuantSpec& spec) {
  QuantizedTensor q = make_blocked(Recipe::kMxfp8, spec.element, rows, cols, spec, true);
  q.amax = abs_max(x, rows * cols);
  // Quantized_Limits<OType>::max_norm_rcp = 1.0 / max_norm, a double quotient stored as float (utils.cuh).
  const float max_norm_rcp = static_cast<float>(1.0 / static_cast<double>(format_max(spec.element)));
#pragma omp parallel for schedule(static) if (rows * cols > (1 << 16))
  for (int64_t br = 0; br < q.scale_rows; ++br) {
    for (int64_t bc = 0; bc < q.scale_cols; ++bc) {
      const int64_t r0 = br * spec.block_rows;
      const int64_t c0 = bc * spec.block_cols;
      const float amax = abs_max_block(x + r0 * cols + c0, cols, spec.block_rows, spec.block_cols);
      const uint8_t e = e8m0_round_up(amax * max_norm_rcp);
      const float inverse = e8m0_reciprocal(e);
      q.scale_codes[br * q.scale_cols + bc] = e;
      q.scales[br * q.scale_cols + bc] = decode_e8m0(e);
      for (int64_t r = r0; r < r0 + spec.block_rows; ++r) {
        for (int64_t c = c0; c < c0 + spec.block_cols; ++c) {
          q.codes[r * cols + c] = encode(spec.element, x[r * cols + c] * inverse);
        }
      }
    }
  }
  return q;
}

}  // namespace moecore::quant
