// Causal GQA self-attention and rotary embeddings on tensors (semantics: kernels/cpu/attention.h, rope.h).
// q_SBNd [S, B, N, d], k_SBGd / v_SBGd [S, B, G, d], lse_BNS [B, N, S]. Backward accumulates.
#pragma once

#include <cstdint>

#include "moecore/kernels/cpu/attention.h"
#include "moecore/kernels/cpu/dropout.h"
#include "moecore/tensor/tensor.h"

namespace moecore::ops {

using kernels::AttentionDims;
using kernels::DropoutSpec;

void attention_forward(Tensor& out_SBNd, Tensor& lse_BNS, const Tensor& q_SBNd, const Tensor& k_SBGd,
                       const Tensor& v_SBGd, const AttentionDims& dims, const DropoutSpec& dropout);
void attention_backward(Tensor& dq_SBNd, Tensor& dk_SBGd, Tensor& dv_SBGd, const Tensor& dout_SBNd,
                        const Tensor& q_SBNd, const Tensor& k_SBGd, const Tensor& v_SBGd, const Tensor& out_SBNd,
                        const Tensor& lse_BNS, const AttentionDims& dims, const DropoutSpec& dropout);

// Rotary position embedding over the first rot_dim channels of each d-wide head of [S, B, N, d] (N = numel /
// (S B d)); row s has position s + position_offset. rope_forward overwrites out; rope_backward accumulates dinp.
void rope_forward(Tensor& out_SBNd, const Tensor& inp_SBNd, int64_t S, int64_t B, int64_t head_dim, int64_t rot_dim,
                  double base, int64_t position_offset = 0);
void rope_backward(Tensor& dinp_SBNd, const Tensor& dout_SBNd, int64_t S, int64_t B, int64_t head_dim, int64_t rot_dim,
                   double base, int64_t position_offset = 0);

}  // namespace moecore::ops
