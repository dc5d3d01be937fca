// Reference grouped linear layer: each expert's rows through the reference linear kernels, one expert at a time.
#include "moecore/kernels/cpu/gemm.h"
#include "moecore/kernels/cpu/grouped_linear.h"

namespace moecore::kernels::ref {

template <typename T>
void grouped_linear_forward(T* out_RO, const T* x_RI, const T* const* weight_E, const T* const* bias_E,
                            const int64_t* offsets_E1, const int64_t E, const int64_t I, const int64_t O) {
  for (int64_t e = 0; e < E; ++e) {
    const int64_t begin = offsets_E1[e];
    linear_forward(out_RO + begin * O, x_RI + begin * I, weight_E[e], bias_E == nullptr ? nullptr : bias_E[e],
                   offsets_E1[e + 1] - begin, I, O);
  }
}

template <typename T>
void grouped_linear_backward(T* dx_RI, T* const* dweight_E, T* const* dbias_E, const T* dout_RO, const T* x_RI,
                             const T* const* weight_E, const int64_t* offsets_E1, const int64_t E, const int64_t I,
                             const int64_t O) {
  for (int64_t e = 0; e < E; ++e) {
    const int64_t begin = offsets_E1[e], rows = offsets_E1[e + 1] - begin;
    if (rows == 0) continue;
    linear_backward(dx_RI == nullptr ? nullptr : dx_RI + begin * I, dweight_E == nullptr ? nullptr : dweight_E[e],
                    dbias_E == nullptr ? nullptr : dbias_E[e], dout_RO + begin * O,
                    x_RI == nullptr ? nullptr : x_RI + begin * I, weight_E[e], rows, I, O);
  }
}

#define MOECORE_INSTANTIATE(T)                                                                                     \
  template void grouped_linear_forward<T>(T*, const T*, const T* const*, const T* const*, const int64_t*, int64_t, \
                                          int64_t, int64_t);                                                       \
  template void grouped_linear_backward<T>(T*, T* const*, T* const*, const T*, const T*, const T* const*,          \
                                           const int64_t*, int64_t, int64_t, int64_t);
MOECORE_INSTANTIATE(float)
MOECORE_INSTANTIATE(double)
#undef MOECORE_INSTANTIATE

}  // namespace moecore::kernels::ref
