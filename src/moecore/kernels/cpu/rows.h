// Row-wise layout and scaling kernels: the fused qkv split, biases, per-row scales (router probabilities, gates),
// row gather / scatter (token permutation) and learned position embeddings. R rows of width W. The fast kernels
// split_qkv, merge_qkv and gather_rows also take T = uint16_t: 16-bit activations, whose bits they move.
#pragma once

#include <cstdint>

namespace moecore::kernels {

#define MOECORE_ROWS_DECL                                                                                            \
  /* Megatron's fused qkv row, per query group g: [N/G query heads | k | v], each d wide. Overwrites q, k, v. */     \
  template <typename T>                                                                                              \
  void split_qkv(T* q_TNd, T* k_TGd, T* v_TGd, const T* qkv_TQ, int64_t n_tokens, int64_t N, int64_t G, int64_t d);  \
  /* The inverse of split_qkv (overwrites qkv_TQ). */                                                                \
  template <typename T>                                                                                              \
  void merge_qkv(T* qkv_TQ, const T* q_TNd, const T* k_TGd, const T* v_TGd, int64_t n_tokens, int64_t N, int64_t G,  \
                 int64_t d);                                                                                         \
  /* Columns [src_col, src_col + width) of each of R rows of src (rows src_width wide) go to columns                 \
     [dst_col, dst_col + width) of the same row of dst (rows dst_width wide): overwritten, or added with accumulate. \
     Splits and joins of per-head sub-vectors (multi-latent attention's [nope | rope] heads). */                     \
  template <typename T>                                                                                              \
  void copy_columns(T* dst, int64_t dst_width, int64_t dst_col, const T* src, int64_t src_width, int64_t src_col,    \
                    int64_t R, int64_t width, bool accumulate);                                                      \
  /* y_RW += bias_W on every row. */                                                                                 \
  template <typename T>                                                                                              \
  void add_bias_rows(T* y_RW, const T* bias_W, int64_t R, int64_t W);                                                \
  /* dbias_W += column sums of dy_RW (rows summed in order, in double: independent of the thread count). */          \
  template <typename T>                                                                                              \
  void bias_grad_rows(T* dbias_W, const T* dy_RW, int64_t R, int64_t W);                                             \
  /* out_RW = x_RW * s_R[r] (overwrites; may alias x). */                                                            \
  template <typename T>                                                                                              \
  void scale_rows(T* out_RW, const T* x_RW, const T* s_R, int64_t R, int64_t W);                                     \
  /* Backward of scale_rows: dx_RW += dout_RW * s_R[r] (dx may be null); ds_R = <dout_RW[r], x_RW[r]> (OVERWRITES,   \
     summed in double; ds may be null). */                                                                           \
  template <typename T>                                                                                              \
  void scale_rows_backward(T* dx_RW, T* ds_R, const T* dout_RW, const T* x_RW, const T* s_R, int64_t R, int64_t W);  \
  /* y_RW += s_R[r] * b_W (a bias scaled per row). */                                                                \
  template <typename T>                                                                                              \
  void add_outer(T* y_RW, const T* s_R, const T* b_W, int64_t R, int64_t W);                                         \
  /* Backward of add_outer: ds_R += <dy_RW[r], b_W> (may be null); db_W += sum_r s_R[r] dy_RW[r] (may be null). */   \
  template <typename T>                                                                                              \
  void add_outer_backward(T* ds_R, T* db_W, const T* dy_RW, const T* s_R, const T* b_W, int64_t R, int64_t W);       \
  /* out_R = <x_RW[r], w_W> (summed in double; overwrites). */                                                       \
  template <typename T>                                                                                              \
  void row_dot(T* out_R, const T* x_RW, const T* w_W, int64_t R, int64_t W);                                         \
  /* out = 1 / (1 + exp(-x)) elementwise, computed in double (overwrites; may alias x). */                           \
  template <typename T>                                                                                              \
  void sigmoid_forward(T* out, const T* x, int64_t n);                                                               \
  /* dx += dout * y (1 - y), y the sigmoid output. */                                                                \
  template <typename T>                                                                                              \
  void sigmoid_backward(T* dx, const T* dout, const T* y, int64_t n);                                                \
  /* out_RW[r] = in_NW[index_R[r]], or zeros where index_R[r] < 0 (overwrites). */                                   \
  template <typename T>                                                                                              \
  void gather_rows(T* out_RW, const T* in_NW, const int64_t* index_R, int64_t R, int64_t N, int64_t W);              \
  /* out_NW[index_R[r]] += in_RW[r] for index_R[r] >= 0; each destination sums its rows in ascending r. */           \
  template <typename T>                                                                                              \
  void scatter_add_rows(T* out_NW, const T* in_RW, const int64_t* index_R, int64_t R, int64_t N, int64_t W);         \
  /* Learned absolute positions: x_TH[t] += pos_PH[(row_offset + t) / B] (token row t = s * B + b). */               \
  template <typename T>                                                                                              \
  void add_position_embedding(T* x_TH, const T* pos_PH, int64_t n_tokens, int64_t B, int64_t H, int64_t row_offset); \
  template <typename T>                                                                                              \
  void position_embedding_backward(T* dpos_PH, const T* dx_TH, int64_t n_tokens, int64_t B, int64_t H,               \
                                   int64_t row_offset);

namespace cpu {
MOECORE_ROWS_DECL
}
namespace ref {
MOECORE_ROWS_DECL
}
#undef MOECORE_ROWS_DECL

}  // namespace moecore::kernels
