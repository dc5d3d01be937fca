// Causal scaled-dot-product self-attention with grouped-query attention.
// q_SBNd [S, B, N, d], k_SBGd and v_SBGd [S, B, G, d]; query head h reads kv group h / (N / G).
// out_SBNd = softmax(causal_mask(q k^T * scale)) v, with dropout (DropoutSpec) on the probabilities:
// probability (b, h, i, j) uses RNG counter ((b * N + h) * S + i) * S + j (N, h: the global head count and index
// under tensor parallelism, see AttentionDims).
// Forward keeps the row log-sum-exp lse_BNS (of the scaled, masked scores) so backward can recompute
// the probabilities instead of storing the S x S matrix.
#pragma once

#include <cstdint>

#include "moecore/kernels/cpu/dropout.h"

namespace moecore::kernels {

struct AttentionDims {
  int64_t S = 0, B = 0, N = 0, G = 0, head_dim = 0;
  double scale = 0.0;  // usually 1/sqrt(head_dim)
  // Tensor parallelism: these N heads are heads [dropout_head_offset, + N) of dropout_total_heads (0: N), and the
  // dropout counters use the global head index, so every layout draws the one-process mask.
  int64_t dropout_total_heads = 0, dropout_head_offset = 0;
};

#define MOECORE_ATTENTION_DECL                                                                                      \
  template <typename T>                                                                                             \
  void attention_forward(T* out_SBNd, T* lse_BNS, const T* q_SBNd, const T* k_SBGd, const T* v_SBGd,                \
                         const AttentionDims& dims, const DropoutSpec& dropout);                                    \
  template <typename T>                                                                                             \
  void attention_backward(T* dq_SBNd, T* dk_SBGd, T* dv_SBGd, const T* dout_SBNd, const T* q_SBNd, const T* k_SBGd, \
                          const T* v_SBGd, const T* out_SBNd, const T* lse_BNS, const AttentionDims& dims,          \
                          const DropoutSpec& dropout);

namespace cpu {
MOECORE_ATTENTION_DECL
}
namespace ref {
MOECORE_ATTENTION_DECL
}
#undef MOECORE_ATTENTION_DECL

}  // namespace moecore::kernels
