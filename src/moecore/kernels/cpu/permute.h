// Token permutation kernels of the MoE layer (Megatron's moe_utils.py: unpermute, sort_chunks_by_idxs; permute is
// the row gather of rows.h).
// Rows of width W; an index of -1 names no row (a padding row of the expert input).
#pragma once

#include <cstdint>

#include "moecore/kernels/cpu/gemm_lowp.h"

namespace moecore::kernels {

#define MOECORE_PERMUTE_DECL                                                                                         \
  /* Megatron's unpermute: out_NW[index_R[r]] += probs_R[r] * in_RW[r] (probs_R null: weight 1), rows with a         \
     negative index skipped. Each destination sums its rows in ascending r, whatever the thread count. */            \
  template <typename T>                                                                                              \
  void moe_unpermute(T* out_NW, const T* in_RW, const int64_t* index_R, const T* probs_R, int64_t R, int64_t N,      \
                     int64_t W);                                                                                     \
  /* Backward of moe_unpermute: din_RW[r] = probs_R[r] * dout_NW[index_R[r]] (din null: skipped) and, when dprobs_R  \
     is given (with probs_R and in_RW), dprobs_R[r] = <dout_NW[index_R[r]], in_RW[r]> (summed in double); both       \
     overwrite and are zero for a negative index. */                                                                 \
  template <typename T>                                                                                              \
  void moe_unpermute_backward(T* din_RW, T* dprobs_R, const T* dout_NW, const T* in_RW, const int64_t* index_R,      \
                              const T* probs_R, int64_t R, int64_t W);                                               \
  /* Megatron's sort_chunks_by_idxs: chunk c of out (chunks back to back, in order) is the rows_C[c] rows of in_NW   \
     from row first_C[c] (overwrites). */                                                                            \
  template <typename T>                                                                                              \
  void sort_chunks(T* out_RW, const T* in_NW, const int64_t* first_C, const int64_t* rows_C, int64_t C, int64_t W);  \
  /* The inverse: the rows of chunk c of in_RW go back to rows [first_C[c], first_C[c] + rows_C[c]) of out_NW; rows  \
     no chunk covers are zero (overwrites all N rows). */                                                            \
  template <typename T>                                                                                              \
  void unsort_chunks(T* out_NW, const T* in_RW, const int64_t* first_C, const int64_t* rows_C, int64_t C, int64_t N, \
                     int64_t W);

namespace cpu {
MOECORE_PERMUTE_DECL

// moe_unpermute and its backward on 16-bit activations (bits of `type`; probabilities and dprobs_R fp32): each row is
// widened into fp32, combined as by the fp32 kernel and narrowed once (round to nearest even), so every output equals
// the fp32 kernel's on the widened tensors, rounded, bit for bit. sort_chunks and unsort_chunks also take
// T = uint16_t (they move bits).
void moe_unpermute16(LowpType type, uint16_t* out_NW, const uint16_t* in_RW, const int64_t* index_R,
                     const float* probs_R, int64_t R, int64_t N, int64_t W);
void moe_unpermute_backward16(LowpType type, uint16_t* din_RW, float* dprobs_R, const uint16_t* dout_NW,
                              const uint16_t* in_RW, const int64_t* index_R, const float* probs_R, int64_t R,
                              int64_t W);
}  // namespace cpu
namespace ref {
MOECORE_PERMUTE_DECL
}
#undef MOECORE_PERMUTE_DECL

}  // namespace moecore::kernels
