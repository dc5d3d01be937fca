// Small vector helpers (OpenMP + SIMD).
#include "moecore/kernels/cpu/elementwise.h"

#include <cmath>

namespace moecore::kernels::cpu {
namespace {
constexpr int64_t kParallelMin = 65536;
}  // namespace

template <typename T>
void add_inplace(T* y, const T* x, const int64_t n) {
#pragma omp parallel for simd schedule(static) if (n > kParallelMin)
  for (int64_t i = 0; i < n; ++i) y[i] += x[i];
}

template <typename T>
void scale_inplace(T* y, const T alpha, const int64_t n) {
#pragma omp parallel for simd schedule(static) if (n > kParallelMin)
  for (int64_t i = 0; i < n; ++i) y[i] *= alpha;
}

template <typename T>
double sum_squares(const T* x, const int64_t n) {
  double total = 0.0;
#pragma omp parallel for simd schedule(static) reduction(+ : total) if (n > kParallelMin)
  for (int64_t i = 0; i < n; ++i) total += static_cast<double>(x[i]) * static_cast<double>(x[i]);
  return total;
}

template <typename T>
bool all_finite(const T* x, const int64_t n) {
  int64_t n_bad = 0;
#pragma omp parallel for simd schedule(static) reduction(+ : n_bad) if (n > kParallelMin)
  for (int64_t i = 0; i < n; ++i) n_bad += std::isfinite(x[i]) ? 0 : 1;
  return n_bad == 0;
}

#define MOECORE_INSTANTIATE(T)                         \
  template void add_inplace<T>(T*, const T*, int64_t); \
  template void scale_inplace<T>(T*, T, int64_t);      \
  template double sum_squares<T>(const T*, int64_t);   \
  template bool all_finite<T>(const T*, int64_t);
MOECORE_INSTANTIATE(float)
MOECORE_INSTANTIATE(double)
#undef MOECORE_INSTANTIATE

}  // namespace moecore::kernels::cpu
