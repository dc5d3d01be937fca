// Row-wise layout and scaling ops on tensors (semantics: kernels/cpu/rows.h). R rows of width W; a tensor of R rows
// may carry any shape with R * W elements. Index spans hold row numbers (negative: no row).
#pragma once

#include <cstdint>
#include <span>

#include "moecore/tensor/tensor.h"

namespace moecore::ops {

// Megatron's fused qkv rows [T, (N + 2G) d] <-> q [T, N, d], k and v [T, G, d] (both overwrite).
void split_qkv(Tensor& q_TNd, Tensor& k_TGd, Tensor& v_TGd, const Tensor& qkv_TQ, int64_t N, int64_t G, int64_t d);
void merge_qkv(Tensor& qkv_TQ, const Tensor& q_TNd, const Tensor& k_TGd, const Tensor& v_TGd, int64_t N, int64_t G,
               int64_t d);

// Columns [src_col, src_col + width) of every src_width-wide row of src go to columns [dst_col, dst_col + width) of
// the same row of dst (dst_width-wide rows, as many): overwritten, or added with accumulate. Splits and joins of
// per-head sub-vectors ([T, N, a + b] <-> [T, N, a], [T, N, b] as rows of width a + b, a and b).
void copy_columns(Tensor& dst, int64_t dst_width, int64_t dst_col, const Tensor& src, int64_t src_width,
                  int64_t src_col, int64_t width, bool accumulate = false);
void add_bias_rows(Tensor& y_RW, const Tensor& bias_W);     // y_RW += bias_W
void bias_grad_rows(Tensor& dbias_W, const Tensor& dy_RW);  // dbias_W += column sums (in order, in double)

// out_RW = x_RW * s_R (per-row scale; out may be x). Backward: dx_RW += dout * s; ds_R = <dout, x> (overwrites).
void scale_rows(Tensor& out_RW, const Tensor& x_RW, const Tensor& s_R);
void scale_rows_backward(Tensor* dx_RW, Tensor* ds_R, const Tensor& dout_RW, const Tensor& x_RW, const Tensor& s_R);
// y_RW += s_R b_W^T (a bias scaled per row). Backward: ds_R += dy b; db_W += s^T dy.
void add_outer(Tensor& y_RW, const Tensor& s_R, const Tensor& b_W);
void add_outer_backward(Tensor* ds_R, Tensor* db_W, const Tensor& dy_RW, const Tensor& s_R, const Tensor& b_W);
// out_R = x_RW w_W (in double).
void row_dot(Tensor& out_R, const Tensor& x_RW, const Tensor& w_W);

// out = sigmoid(x) elementwise (computed in double; out may be x). Backward: dx += dout * y (1 - y), y = out.
void sigmoid_forward(Tensor& out, const Tensor& x);
void sigmoid_backward(Tensor& dx, const Tensor& dout, const Tensor& y);

// out_RW[r] = in_NW[index_R[r]] (zeros for a negative index; overwrites). R = index_R.size().
void gather_rows(Tensor& out_RW, const Tensor& in_NW, std::span<const int64_t> index_R);
// out_NW[index_R[r]] += in_RW[r]; each destination sums its rows in ascending r.
void scatter_add_rows(Tensor& out_NW, const Tensor& in_RW, std::span<const int64_t> index_R);

// Learned absolute positions on [T, H] token rows t = s * B + b starting at one-process row row_offset:
// x_TH[t] += pos_PH[(row_offset + t) / B]; the backward accumulates into dpos_PH.
void add_position_embedding(Tensor& x_TH, const Tensor& pos_PH, int64_t B, int64_t row_offset);
void position_embedding_backward(Tensor& dpos_PH, const Tensor& dx_TH, int64_t B, int64_t row_offset);

}  // namespace moecore::ops
