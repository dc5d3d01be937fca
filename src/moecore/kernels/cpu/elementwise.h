// Small vector helpers used by the modules and the optimizer.
#pragma once

#include <cstdint>

namespace moecore::kernels {

#define MOECORE_ELEMENTWISE_DECL                                                             \
  template <typename T>                                                                      \
  void add_inplace(T* y, const T* x, int64_t n); /* y += x */                                \
  template <typename T>                                                                      \
  void scale_inplace(T* y, T alpha, int64_t n); /* y *= alpha */                             \
  template <typename T>                                                                      \
  double sum_squares(const T* x, int64_t n); /* sum x^2, accumulated in double */            \
  /* sums[j] = sum_squares of xs[j][0, ns[j]) for j < count, in one pass over all:           \
   * fixed chunks summed in chunk order (cpu), so the sums do not depend on the              \
   * thread count */                                                                         \
  template <typename T>                                                                      \
  void sum_squares_each(const T* const* xs, const int64_t* ns, int64_t count, double* sums); \
  template <typename T>                                                                      \
  bool all_finite(const T* x, int64_t n);                                                    \
  /* elements equal to zero (-0 too): Megatron's count_zeros_fp32 */                         \
  template <typename T>                                                                      \
  int64_t count_zeros(const T* x, int64_t n);                                                \
  /* max |x_i| (NaN skipped): the amax an FP8 cast records */                                \
  float abs_max(const float* x, int64_t n);

namespace cpu {
MOECORE_ELEMENTWISE_DECL
}
namespace ref {
MOECORE_ELEMENTWISE_DECL
}
#undef MOECORE_ELEMENTWISE_DECL

// The templates' explicit instantiations, for the fast kernels' and the references' source files.
#define MOECORE_ELEMENTWISE_INSTANTIATE(T)                                              \
  template void add_inplace<T>(T*, const T*, int64_t);                                  \
  template void scale_inplace<T>(T*, T, int64_t);                                       \
  template double sum_squares<T>(const T*, int64_t);                                    \
  template void sum_squares_each<T>(const T* const*, const int64_t*, int64_t, double*); \
  template bool all_finite<T>(const T*, int64_t);                                       \
  template int64_t count_zeros<T>(const T*, int64_t);

}  // namespace moecore::kernels
