#include "moecore/quant/blockwise_scaling.h"

#include <algorithm>
#include <limits>

#include "moecore/quant/scale_math.h"

namespace moecore::quant {

QuantizedTensor quantize_blockwise(const float* x, const int64_t rows, const int64_t cols, const QuantSpec& spec) {
  QuantizedTensor q = make_blocked(Recipe::kBlockwise, spec.element, rows, cols, spec, false);
  q.amax = abs_max(x, rows * cols);
  const float max_fp8 = format_max(spec.element);
#pragma omp parallel for schedule(static) if (rows * cols > (1 << 16))
  for (int64_t br = 0; br < q.scale_rows; ++br) {
    const int64_t r0 = br * spec.block_rows;
    const int64_t nr = std::min(spec.block_rows, rows - r0);
    for (int64_t bc = 0; bc < q.scale_cols; ++bc) {
      const int64_t c0 = bc * spec.block_cols;
      const int64_t nc = std::min(spec.block_cols, cols - c0);
      const float amax = abs_max_block(x + r0 * cols + c0, cols, nr, nc);
      const float scale = compute_scale_from_amax(amax, max_fp8, spec.pow2_scales, spec.amax_epsilon,
                                                  std::numeric_limits<float>::max());
      q.scales[br * q.scale_cols + bc] = reciprocal(scale);
      for (int64_t r = r0; r < r0 + nr; ++r) {
        for (int64_t c = c0; c < c0 + nc; ++c) q.codes[r * cols + c] = encode(spec.element, x[r * cols + c] * scale);
      }
    }
  }
  return q;
}

}  // namespace moecore::quant
