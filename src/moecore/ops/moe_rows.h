// The MoE layer's row moves on tensors (semantics: kernels/cpu/permute.h; Megatron's moe_utils.py permute,
// unpermute and sort_chunks_by_idxs). Rows of width W: a tensor of R rows may carry any shape with R * W elements.
// Index spans hold row numbers (negative: no row, a padding row of the expert input).
#pragma once

#include <cstdint>
#include <span>

#include "moecore/tensor/tensor.h"

namespace moecore::ops {

// out_RW[r] = in_NW[index_R[r]], zeros for a negative index (overwrites). R = index_R.size().
void moe_permute(Tensor& out_RW, const Tensor& in_NW, std::span<const int64_t> index_R);
// out_NW[index_R[r]] += probs_R[r] * in_RW[r] (probs_R null: weight 1); each destination sums its rows in ascending
// r. The backward of moe_permute (probs null) and of itself with moe_unpermute_backward.
void moe_unpermute(Tensor& out_NW, const Tensor& in_RW, std::span<const int64_t> index_R,
                   const Tensor* probs_R = nullptr);
// Backward of moe_unpermute: din_RW[r] = probs_R[r] * dout_NW[index_R[r]] (weight 1 without probs) and
// dprobs_R[r] = <dout_NW[index_R[r]], in_RW[r]> (needs probs_R and in_RW, the forward's input); both overwrite, are
// zero for a negative index, and may be null.
void moe_unpermute_backward(Tensor* din_RW, Tensor* dprobs_R, const Tensor& dout_NW, std::span<const int64_t> index_R,
                            const Tensor* probs_R = nullptr, const Tensor* in_RW = nullptr);
// out = the chunks [first_C[c], first_C[c] + rows_C[c]) of in_NW's rows back to back, in chunk order (overwrites;
// out holds exactly their rows). unsort_chunks puts them back: out_NW's rows outside every chunk become zero
// (overwrites); the chunks must not overlap.
void sort_chunks(Tensor& out_RW, const Tensor& in_NW, std::span<const int64_t> first_C,
                 std::span<const int64_t> rows_C);
void unsort_chunks(Tensor& out_NW, const Tensor& in_RW, std::span<const int64_t> first_C,
                   std::span<const int64_t> rows_C);

}  // namespace moecore::ops
