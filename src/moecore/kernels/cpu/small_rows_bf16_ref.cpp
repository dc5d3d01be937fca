#include <cmath>
#include <limits>

#include "moecore/kernels/cpu/small_rows_bf16.h"
#include "moecore/tensor/dtype.h"

namespace moecore::kernels::ref {

void small_rows_forward_bf16(float* out_nO, const uint16_t* x_nI, const uint16_t* w_OI, const int64_t n,
                             const int64_t I, const int64_t O) {
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t o = 0; o < O; ++o) {
      double sum = 0.0;
      for (int64_t i = 0; i < I; ++i) {
        sum += static_cast<double>(bf16_to_fp32(x_nI[r * I + i])) * bf16_to_fp32(w_OI[o * I + i]);
      }
      out_nO[r * O + o] = static_cast<float>(sum);
    }
  }
}

namespace {

// vdpbf16ps's operand: a bf16 value with denormals read as zero.
float daz(const uint16_t bits) { return (bits & 0x7f80u) == 0 ? 0.0f : bf16_to_fp32(bits); }

// Its result: a denormal flushed to zero (keeping the sign).
float ftz(const float value) { return std::fabs(value) < std::numeric_limits<float>::min() ? value * 0.0f : value; }

}  // namespace

void small_rows_data_bf16(float* dx_nI, const float* dy_nO, const uint16_t* w_OI, const int64_t n, const int64_t I,
                          const int64_t O) {
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t o = 0; o < O; o += 2) {
      const float dy_even = daz(fp32_to_bf16(dy_nO[r * O + o]));
      const float dy_odd = o + 1 < O ? daz(fp32_to_bf16(dy_nO[r * O + o + 1])) : 0.0f;
      for (int64_t i = 0; i < I; ++i) {
        const float w_even = daz(w_OI[o * I + i]), w_odd = o + 1 < O ? daz(w_OI[(o + 1) * I + i]) : 0.0f;
        float& acc = dx_nI[r * I + i];
        acc = ftz(std::fmaf(dy_odd, w_odd, acc));
        acc = ftz(std::fmaf(dy_even, w_even, acc));
      }
    }
  }
}

void small_rows_data_widened(float* dx_nI, const float* dy_nO, const uint16_t* w_OI, const int64_t n, const int64_t I,
                             const int64_t O) {
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t o = 0; o < O; ++o) {
      for (int64_t i = 0; i < I; ++i) dx_nI[r * I + i] += dy_nO[r * O + o] * bf16_to_fp32(w_OI[o * I + i]);
    }
  }
}

}  // namespace moecore::kernels::ref
