// Naive reference RMSNorm / LayerNorm (textbook formulas, one row at a time), used by the tests.
#include <cmath>

#include "moecore/kernels/cpu/norm.h"

namespace moecore::kernels::ref {

template <typename T>
int64_t rmsnorm_forward(T* out_RD, T* rstd_R, const T* inp_RD, const T* weight_D, const int64_t n_rows, const int64_t D,
                        const double eps) {
  int64_t nonfinite_rows = 0;
  for (int64_t r = 0; r < n_rows; ++r) {
    T sum_sq = 0;
    for (int64_t d = 0; d < D; ++d) sum_sq += inp_RD[r * D + d] * inp_RD[r * D + d];
    const T mean_sq = sum_sq / T(D);
    const T rstd = T(1) / std::sqrt(mean_sq + T(eps));
    for (int64_t d = 0; d < D; ++d) out_RD[r * D + d] = inp_RD[r * D + d] * rstd * weight_D[d];
    rstd_R[r] = rstd;
    if (!std::isfinite(mean_sq)) ++nonfinite_rows;
  }
  return nonfinite_rows;
}

// y_i = w_i x_i s with s = (mean(x^2) + eps)^(-1/2); ds/dx_j = -s^3 x_j / D, so
// dx_j = s w_j dy_j - (s^3 x_j / D) sum_i w_i dy_i x_i.
template <typename T>
void rmsnorm_backward(T* dinp_RD, T* dweight_D, const T* dout_RD, const T* inp_RD, const T* weight_D, const T* rstd_R,
                      const int64_t n_rows, const int64_t D) {
  for (int64_t r = 0; r < n_rows; ++r) {
    const T* x = inp_RD + r * D;
    const T* dy = dout_RD + r * D;
    const T s = rstd_R[r];
    T dot = 0;
    for (int64_t i = 0; i < D; ++i) dot += weight_D[i] * dy[i] * x[i];
    for (int64_t j = 0; j < D; ++j) {
      if (dinp_RD != nullptr) dinp_RD[r * D + j] += s * weight_D[j] * dy[j] - s * s * s * x[j] * dot / T(D);
      if (dweight_D != nullptr) dweight_D[j] += dy[j] * x[j] * s;
    }
  }
}

template <typename T>
int64_t layernorm_forward(T* out_RD, T* mean_R, T* rstd_R, const T* inp_RD, const T* weight_D, const T* bias_D,
                          const int64_t n_rows, const int64_t D, const double eps) {
  int64_t nonfinite_rows = 0;
  for (int64_t r = 0; r < n_rows; ++r) {
    const T* x = inp_RD + r * D;
    T sum = 0;
    for (int64_t d = 0; d < D; ++d) sum += x[d];
    const T mean = sum / T(D);
    T var = 0;
    for (int64_t d = 0; d < D; ++d) var += (x[d] - mean) * (x[d] - mean);
    var /= T(D);
    const T rstd = T(1) / std::sqrt(var + T(eps));
    for (int64_t d = 0; d < D; ++d) {
      out_RD[r * D + d] = (x[d] - mean) * rstd * weight_D[d] + (bias_D != nullptr ? bias_D[d] : T(0));
    }
    mean_R[r] = mean;
    rstd_R[r] = rstd;
    if (!std::isfinite(mean) || !std::isfinite(var)) ++nonfinite_rows;
  }
  return nonfinite_rows;
}

// With xhat = (x - mean) s and g = w dy: dx_j = s (g_j - mean(g) - xhat_j mean(g xhat)).
template <typename T>
void layernorm_backward(T* dinp_RD, T* dweight_D, T* dbias_D, const T* dout_RD, const T* inp_RD, const T* weight_D,
                        const T* mean_R, const T* rstd_R, const int64_t n_rows, const int64_t D) {
  for (int64_t r = 0; r < n_rows; ++r) {
    const T* x = inp_RD + r * D;
    const T* dy = dout_RD + r * D;
    const T s = rstd_R[r];
    T mean_g = 0, mean_gxhat = 0;
    for (int64_t i = 0; i < D; ++i) {
      mean_g += weight_D[i] * dy[i];
      mean_gxhat += weight_D[i] * dy[i] * (x[i] - mean_R[r]) * s;
    }
    mean_g /= T(D);
    mean_gxhat /= T(D);
    for (int64_t j = 0; j < D; ++j) {
      const T xhat = (x[j] - mean_R[r]) * s;
      if (dinp_RD != nullptr) dinp_RD[r * D + j] += s * (weight_D[j] * dy[j] - mean_g - xhat * mean_gxhat);
      if (dweight_D != nullptr) dweight_D[j] += dy[j] * xhat;
      if (dbias_D != nullptr) dbias_D[j] += dy[j];
    }
  }
}

#define MOECORE_INSTANTIATE(T)                                                                               \
  template int64_t rmsnorm_forward<T>(T*, T*, const T*, const T*, int64_t, int64_t, double);                 \
  template void rmsnorm_backward<T>(T*, T*, const T*, const T*, const T*, const T*, int64_t, int64_t);       \
  template int64_t layernorm_forward<T>(T*, T*, T*, const T*, const T*, const T*, int64_t, int64_t, double); \
  template void layernorm_backward<T>(T*, T*, T*, const T*, const T*, const T*, const T*, const T*, int64_t, int64_t);
MOECORE_INSTANTIATE(float)
MOECORE_INSTANTIATE(double)
#undef MOECORE_INSTANTIATE

}  // namespace moecore::kernels::ref
