// Grouped linear layer: the linear layers of E experts, each over its own rows of one buffer (TransformerEngine's
// GroupedLinear, Megatron's GroupedMLP). Expert e's rows are [offsets_E1[e], offsets_E1[e + 1]) of x_RI / out_RO;
// its weight is weight_E[e] ([O, I], row-major) and its bias bias_E[e] ([O]; bias_E or an entry may be null).
#pragma once

#include <cstdint>

namespace moecore::kernels {

#define MOECORE_GROUPED_LINEAR_DECL                                                                                  \
  /* out_RO = x_RI @ weight_E[e]^T (+ bias_E[e]) on each expert's rows (overwrites). */                              \
  template <typename T>                                                                                              \
  void grouped_linear_forward(T* out_RO, const T* x_RI, const T* const* weight_E, const T* const* bias_E,            \
                              const int64_t* offsets_E1, int64_t E, int64_t I, int64_t O);                           \
  /* On each expert's rows: dx_RI += dout_RO @ weight_E[e]; dweight_E[e] += dout^T @ x; dbias_E[e] += sum of dout    \
     rows. dx_RI, dweight_E, dbias_E (and their entries) may be null to skip them; x_RI is read only for dweight. */ \
  template <typename T>                                                                                              \
  void grouped_linear_backward(T* dx_RI, T* const* dweight_E, T* const* dbias_E, const T* dout_RO, const T* x_RI,    \
                               const T* const* weight_E, const int64_t* offsets_E1, int64_t E, int64_t I, int64_t O);

namespace cpu {
// Scheduling (cpu only): each expert's rows are cut into the fewest tiles of at most kGroupedLinearTileRows rows
// (evenly sized), so an expert with many rows gets GEMMs big enough to run near the GEMM's peak and one with few
// rows one task; tiles run largest first on a dynamic OpenMP schedule (both threads stay busy when the experts'
// loads are uneven), each tile's GEMM on one thread. Weight gradients are one task per expert over all its rows.
// Tiles depend on the row counts only, never on the thread count, so results are the same bit for bit whatever
// the threads.
constexpr int64_t kGroupedLinearTileRows = 256;
MOECORE_GROUPED_LINEAR_DECL
}  // namespace cpu
namespace ref {
MOECORE_GROUPED_LINEAR_DECL
}
#undef MOECORE_GROUPED_LINEAR_DECL

}  // namespace moecore::kernels
