// Causal scaled-dot-product attention with grouped-query attention, over the whole sequence or over one block of
// it (context parallelism, packed sequences).
// q_SBNd [S, B, N, d], k_SBGd [Sk, B, G, d], v_SBGd [Sk, B, G, dv] (Sk = S unless AttentionDims::Sk says
// otherwise; dv = AttentionDims::v_head_dim, d unless set: multi-latent attention's value heads are narrower than its
// query / key heads); query head h reads kv group h / (N / G). out_SBNd [S, B, N, dv] = softmax(mask(q k^T * scale))
// v, with dropout (DropoutSpec) on the probabilities. dout_SBNd is out's shape, dq q's, dk k's, dv v's.
//
// The mask: key row j is visible to query row i (batch b) iff k_index[j] <= q_index[i] (causal, on the rows' indices
// in the whole sequence) and, with documents, q_document_SB[i, b] == k_document_SB[j, b] (Megatron's
// --reset-attention-mask: no attention across documents of a packed sequence, without an S x S mask). Without
// indices, query row i is index i and key row j is index j: self-attention over one sequence. A query row that
// sees no key of this block gets out = 0 and lse = -inf.
//
// Dropout: probability (b, h, i, j) uses RNG counter ((b * N + h) * L + q_index[i]) * L + k_index[j], with N, h the
// global head count and index under tensor parallelism and L = dropout_seq_len (default S), so that every
// tensor-parallel and context-parallel layout draws the one-process mask.
//
// Forward keeps the row log-sum-exp lse_BNS [B, N, S] (of the scaled, masked scores) so backward can recompute the
// probabilities instead of storing the S x Sk matrix.
//
// Context parallelism (ring attention, Megatron / TransformerEngine's AttnFuncWithCPAndKVP2P): attention over the
// union of key blocks is attention_forward over each block merged with attention_merge. Its backward needs no merge
// backward: attention_backward over one key block, given the FINAL (merged) out and lse, adds that block's share of
// dq and its dk, dv (P = exp(s - lse_final), rowsum(dP * P) = dout . out_final).
#pragma once

#include <cstdint>

#include "moecore/kernels/cpu/dropout.h"

namespace moecore::kernels {

struct AttentionDims {
  int64_t S = 0, B = 0, N = 0, G = 0, head_dim = 0;  // head_dim: the width d of the query and key heads
  double scale = 0.0;                                // usually 1/sqrt(head_dim)
  // Tensor parallelism: these N heads are heads [dropout_head_offset, + N) of dropout_total_heads (0: N), and the
  // dropout counters use the global head index, so every layout draws the one-process mask.
  int64_t dropout_total_heads = 0, dropout_head_offset = 0;
  // Key / value rows (0: S, self-attention).
  int64_t Sk = 0;
  // The index in the whole sequence of each query row [S] and key row [Sk] (null: 0..S-1 / 0..Sk-1), >= 0.
  const int64_t* q_index = nullptr;
  const int64_t* k_index = nullptr;
  // Packed sequences: the document of every query row (s, b) [S, B] and key row [Sk, B]; both or neither (null:
  // one document).
  const int32_t* q_document_SB = nullptr;
  const int32_t* k_document_SB = nullptr;
  // The sequence length L of the dropout counters (0: S); with dropout every index must be below it.
  int64_t dropout_seq_len = 0;
  // The width dv of the value heads, hence of out, dout and dv (0: head_dim; TransformerEngine's v_channels).
  int64_t v_head_dim = 0;
  // The products in bf16, as FlashAttention-2 / TransformerEngine compute attention under bf16: q, k, v and dout are
  // rounded to bf16, the probabilities P are rounded to bf16 for the P v and dV = P^T dout products, and the score
  // gradients dS = P (dP - delta) (scaled) for dq = dS k and dk = dS^T q; every product sums in fp32 and the softmax
  // statistics (row max, sum, lse, delta) stay fp32. The fast kernel runs them on AMX tiles where it can
  // (attention_products.h); the reference rounds the same operands (its forward rounds exp(s - row max) once).
  bool bf16_products = false;
};

#define MOECORE_ATTENTION_DECL                                                                                      \
  template <typename T>                                                                                             \
  void attention_forward(T* out_SBNd, T* lse_BNS, const T* q_SBNd, const T* k_SBGd, const T* v_SBGd,                \
                         const AttentionDims& dims, const DropoutSpec& dropout);                                    \
  template <typename T>                                                                                             \
  void attention_backward(T* dq_SBNd, T* dk_SBGd, T* dv_SBGd, const T* dout_SBNd, const T* q_SBNd, const T* k_SBGd, \
                          const T* v_SBGd, const T* out_SBNd, const T* lse_BNS, const AttentionDims& dims,          \
                          const DropoutSpec& dropout);                                                              \
  template <typename T>                                                                                             \
  void attention_merge(T* out_SBNd, T* lse_BNS, const T* part_out_SBNd, const T* part_lse_BNS,                      \
                       const AttentionDims& dims);

// attention_backward: dq, dk, dv accumulate; out_SBNd and lse_BNS are the forward's (or, for one key block of a
// merged attention, the final merged ones).
// attention_merge: in place, (out, lse) over key set A and (part_out, part_lse) over a disjoint key set B become
// the attention over A and B: lse = log(exp(lse) + exp(part_lse)), out = out exp(lse_A - lse) + part_out
// exp(lse_B - lse) (either side may be -inf: a row that saw no key). out and part_out are [S, B, N, dv]. Uses S,
// B, N, head_dim and v_head_dim of dims.

namespace cpu {
MOECORE_ATTENTION_DECL
}
namespace ref {
MOECORE_ATTENTION_DECL
}
#undef MOECORE_ATTENTION_DECL

}  // namespace moecore::kernels
