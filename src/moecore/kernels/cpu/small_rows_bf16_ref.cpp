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

void small_rows_data_bf16(float* dx_nI, const float* dy_nO, const uint16_t* w_OI, const int64_t n, const int64_t I,
                          const int64_t O) {
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t o = 0; o < O; ++o) {
      for (int64_t i = 0; i < I; ++i) dx_nI[r * I + i] += dy_nO[r * O + o] * bf16_to_fp32(w_OI[o * I + i]);
    }
  }
}

}  // namespace moecore::kernels::ref
