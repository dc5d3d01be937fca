// Naive references of elementwise.h.
#include <cmath>

#include "moecore/kernels/cpu/elementwise.h"

namespace moecore::kernels::ref {

template <typename T>
void add_inplace(T* y, const T* x, const int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += x[i];
}

template <typename T>
void scale_inplace(T* y, const T alpha, const int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] *= alpha;
}

template <typename T>
double sum_squares(const T* x, const int64_t n) {
  double total = 0.0;
  for (int64_t i = 0; i < n; ++i) total += static_cast<double>(x[i]) * static_cast<double>(x[i]);
  return total;
}

template <typename T>
void sum_squares_each(const T* const* xs, const int64_t* ns, const int64_t count, double* sums) {
  for (int64_t j = 0; j < count; ++j) sums[j] = sum_squares(xs[j], ns[j]);
}

template <typename T>
bool all_finite(const T* x, const int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    if (!std::isfinite(x[i])) return false;
  }
  return true;
}

template <typename T>
int64_t count_zeros(const T* x, const int64_t n) {
  int64_t zeros = 0;
  for (int64_t i = 0; i < n; ++i) zeros += x[i] == T(0) ? 1 : 0;
  return zeros;
}

float abs_max(const float* x, const int64_t n) {
  float amax = 0.0f;
  for (int64_t i = 0; i < n; ++i) amax = std::fmax(amax, std::fabs(x[i]));
  return amax;
}

MOECORE_ELEMENTWISE_INSTANTIATE(float)
MOECORE_ELEMENTWISE_INSTANTIATE(double)

}  // namespace moecore::kernels::ref
