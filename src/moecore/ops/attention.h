// Causal GQA attention and rotary embeddings on tensors (semantics: kernels/cpu/attention.h, rope.h).
// q_SBNd [S, B, N, d], k_SBGd [Sk, B, G, d], v_SBGd [Sk, B, G, dv], out_SBNd [S, B, N, dv] (Sk = dims.Sk, or S when
// 0; d = dims.head_dim, dv = dims.v_head_dim, or d when 0), lse_BNS [B, N, S]; gradients have their tensor's shape.
// Backward accumulates. Block attention (context parallelism, packed sequences): dims.q_index [S], k_index [Sk],
// q_document_SB [S, B], k_document_SB [Sk, B] point at caller-owned arrays of those sizes.
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "moecore/kernels/cpu/attention.h"
#include "moecore/kernels/cpu/dropout.h"
#include "moecore/kernels/cpu/rotary_frequencies.h"
#include "moecore/tensor/tensor.h"

namespace moecore::ops {

using kernels::AttentionDims;
using kernels::DropoutSpec;
using kernels::RopeSpec;

// How the fast attention_forward / attention_backward multiply under activations of `activation`: "bf16 products on
// AMX-BF16 tiles" (bf16 activations where attention_product_path() picks bf16 products), else "fp32 products".
std::string attention_products(DType activation);

void attention_forward(Tensor& out_SBNd, Tensor& lse_BNS, const Tensor& q_SBNd, const Tensor& k_SBGd,
                       const Tensor& v_SBGd, const AttentionDims& dims, const DropoutSpec& dropout);
void attention_backward(Tensor& dq_SBNd, Tensor& dk_SBGd, Tensor& dv_SBGd, const Tensor& dout_SBNd,
                        const Tensor& q_SBNd, const Tensor& k_SBGd, const Tensor& v_SBGd, const Tensor& out_SBNd,
                        const Tensor& lse_BNS, const AttentionDims& dims, const DropoutSpec& dropout);
// In place: (out, lse) over one key set and (part_out, part_lse) over another become the attention over both
// (ring attention's merge of a step's block; -inf lse: a row that saw no key). out and part_out are [S, B, N, dv];
// uses S, B, N, head_dim and v_head_dim of dims.
void attention_merge(Tensor& out_SBNd, Tensor& lse_BNS, const Tensor& part_out_SBNd, const Tensor& part_lse_BNS,
                     const AttentionDims& dims);

// Rotary position embedding over the first rot_dim channels of each d-wide head of [S, B, N, d] (N = numel /
// (S B d)); row s has position s + position_offset. rope_forward overwrites out; rope_backward accumulates dinp.
void rope_forward(Tensor& out_SBNd, const Tensor& inp_SBNd, int64_t S, int64_t B, int64_t head_dim, int64_t rot_dim,
                  double base, int64_t position_offset = 0);
void rope_backward(Tensor& dinp_SBNd, const Tensor& dout_SBNd, int64_t S, int64_t B, int64_t head_dim, int64_t rot_dim,
                   double base, int64_t position_offset = 0);
// The same with the position of every row (s, b) given, positions_SB [S * B] (>= 0): packed sequences restart
// positions in every document, a context-parallel rank's chunks have their positions in the whole sequence.
void rope_forward(Tensor& out_SBNd, const Tensor& inp_SBNd, int64_t S, int64_t B, int64_t head_dim, int64_t rot_dim,
                  double base, std::span<const int64_t> positions_SB);
void rope_backward(Tensor& dinp_SBNd, const Tensor& dout_SBNd, int64_t S, int64_t B, int64_t head_dim, int64_t rot_dim,
                   double base, std::span<const int64_t> positions_SB);
// Any rotary embedding (frequencies, cos / sin factor, multi-latent attention's layout: kernels/cpu/rope.h) over
// spec.head_dim-wide head vectors, positions_SB [S * B] as above.
void rope_forward(Tensor& out_SBNd, const Tensor& inp_SBNd, int64_t S, int64_t B, const RopeSpec& spec,
                  std::span<const int64_t> positions_SB);
void rope_backward(Tensor& dinp_SBNd, const Tensor& dout_SBNd, int64_t S, int64_t B, const RopeSpec& spec,
                   std::span<const int64_t> positions_SB);

}  // namespace moecore::ops
