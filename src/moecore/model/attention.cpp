#include "moecore/model/attention.h"

#include <cmath>

#include "moecore/model/rotary_embedding.h"
#include "moecore/ops/attention.h"
#include "moecore/ops/precision.h"
#include "moecore/ops/rows.h"

namespace moecore {

SelfAttention::SelfAttention(const ModelConfig& config, const std::string& prefix, const TensorParallel& tp,
                             const int module, NormOverflowLog* norm_overflow_log, ParamStore& params,
                             const parallel::ProcessGroup& cp)
    : config_(config), prefix_(prefix + "self_attention."), cp_(cp) {
  const std::vector<std::string>& types = config.cp_comm_type;
  cp_type_ = parse_cp_comm_type(types.size() == 1 ? types[0] : types.at(static_cast<size_t>(module)));
  const int64_t H = config.hidden_size, d = config.kv_channels, N = config.num_attention_heads;
  const int64_t G = config.num_query_groups, n = tp.size();
  if (N % n != 0 || G % n != 0) {
    throw ConfigError("--num-attention-heads (" + std::to_string(N) + ") and --num-query-groups (" + std::to_string(G) +
                      ") must be divisible by --tensor-model-parallel-size (" + std::to_string(n) + ")");
  }
  heads_ = N / n;
  groups_ = G / n;
  if (cp.size() > 1 && cp_type_ == CpCommType::kA2A && (heads_ % cp.size() != 0 || groups_ % cp.size() != 0)) {
    throw ConfigError("--cp-comm-type a2a needs the attention heads (" + std::to_string(heads_) +
                      ") and query groups (" + std::to_string(groups_) + ") of a tensor-parallel rank divisible by " +
                      "--context-parallel-size (" + std::to_string(cp.size()) + ")");
  }
  head_offset_ = tp.rank() * heads_;
  if (has_rope()) rope_ = attention_rope_spec(config);
  LinearOptions qkv;
  qkv.bias = config.add_bias_linear;
  qkv.module = module;
  // The fused rows are grouped per query group, so a rank's groups are one contiguous block of rows.
  qkv_ = ColumnParallelLinear(prefix_ + "linear_qkv", H, config.qkv_out(), tp, qkv, params);
  if (config.qk_layernorm) {  // shared by all heads; each TP rank sees only its own heads
    const bool partial = tp.size() > 1;
    const NormOptions norm = norm_options(config, partial, module, norm_overflow_log);
    q_norm_ = NormModule(prefix_ + "q_layernorm", d, norm, params);
    k_norm_ = NormModule(prefix_ + "k_layernorm", d, norm, params);
  }
  LinearOptions proj;
  proj.bias = config.add_bias_linear;
  proj.init = InitKind::kScaledNormal;
  proj.module = module;
  proj_ = RowParallelLinear(prefix_ + "linear_proj", N * d, H, tp, proj, params);
}

ops::AttentionDims SelfAttention::dims(const int64_t S, const int64_t B) const {
  ops::AttentionDims dims{
      S, B, heads_, groups_, config_.kv_channels, 1.0 / std::sqrt(static_cast<double>(config_.kv_channels))};
  dims.dropout_total_heads = config_.num_attention_heads;
  dims.dropout_head_offset = head_offset_;
  return dims;
}

Tensor SelfAttention::forward(const Tensor& x_TH, const int64_t S, const int64_t B, const ops::DropoutSpec& dropout,
                              AttentionActivations& a, const SequenceInfo& sequence,
                              const InputKeepers x_keepers) const {
  const int64_t T = S * B, N = heads_, G = groups_, d = config_.kv_channels;
  Tensor qkv_TQ = qkv_.forward(x_TH, a.qkv, x_keepers);
  a.q_TNd = ops::uninitialized_activation({T, N, d});
  a.k_TGd = ops::uninitialized_activation({T, G, d});
  a.v_TGd = ops::uninitialized_activation({T, G, d});
  ops::split_qkv(a.q_TNd, a.k_TGd, a.v_TGd, qkv_TQ, N, G, d);
  qkv_TQ = Tensor();
  if (config_.qk_layernorm) {
    a.q_raw_TNd = a.q_TNd;
    a.k_raw_TGd = a.k_TGd;
    a.q_TNd = ops::uninitialized_activation({T, N, d});
    a.k_TGd = ops::uninitialized_activation({T, G, d});
    a.q_norm_stats = q_norm_.forward(a.q_TNd, a.q_raw_TNd);
    a.k_norm_stats = k_norm_.forward(a.k_TGd, a.k_raw_TGd);
  }
  if (has_rope()) {
    Tensor q_rot = ops::uninitialized_activation({T, N, d});
    Tensor k_rot = ops::uninitialized_activation({T, G, d});
    ops::rope_forward(q_rot, a.q_TNd, S, B, rope_, sequence.positions_SB);
    ops::rope_forward(k_rot, a.k_TGd, S, B, rope_, sequence.positions_SB);
    a.q_TNd = std::move(q_rot);
    a.k_TGd = std::move(k_rot);
  }
  a.attn_TNd = ops::activation_tensor({T, N, d});
  a.lse_BNS = Tensor({B, N, S}, DType::kF32, MemCategory::kActivations);  // fp32 statistics
  context_parallel_attention_forward(a.attn_TNd, a.lse_BNS, a.q_TNd, a.k_TGd, a.v_TGd, dims(S, B), dropout, sequence,
                                     cp_, cp_type_);
  return proj_.forward(a.attn_TNd, a.proj);
}

void SelfAttention::recompute_core_attention(AttentionActivations& a, const int64_t S, const int64_t B,
                                             const ops::DropoutSpec& dropout, const SequenceInfo& sequence) const {
  // The output is rewritten with the same values: it is linear_proj's saved input.
  a.lse_BNS = Tensor({B, heads_, S}, DType::kF32, MemCategory::kActivations);  // fp32 statistics
  context_parallel_attention_forward(a.attn_TNd, a.lse_BNS, a.q_TNd, a.k_TGd, a.v_TGd, dims(S, B), dropout, sequence,
                                     cp_, cp_type_);
}

void SelfAttention::backward(Tensor& dx_TH, const Tensor& dout_TH, const int64_t S, const int64_t B,
                             const ops::DropoutSpec& dropout, const AttentionActivations& a,
                             const SequenceInfo& sequence) const {
  const int64_t T = S * B, N = heads_, G = groups_, d = config_.kv_channels;
  Tensor dattn_TNd = ops::activation_tensor({T, N, d});
  proj_.backward(dattn_TNd, dout_TH, a.proj);
  Tensor dq_TNd = ops::activation_tensor({T, N, d});
  Tensor dk_TGd = ops::activation_tensor({T, G, d});
  Tensor dv_TGd = ops::activation_tensor({T, G, d});
  context_parallel_attention_backward(dq_TNd, dk_TGd, dv_TGd, dattn_TNd, a.q_TNd, a.k_TGd, a.v_TGd, a.attn_TNd,
                                      a.lse_BNS, dims(S, B), dropout, sequence, cp_, cp_type_);
  dattn_TNd = Tensor();
  if (has_rope()) {
    Tensor dq_pre = ops::activation_tensor({T, N, d});
    Tensor dk_pre = ops::activation_tensor({T, G, d});
    ops::rope_backward(dq_pre, dq_TNd, S, B, rope_, sequence.positions_SB);
    ops::rope_backward(dk_pre, dk_TGd, S, B, rope_, sequence.positions_SB);
    dq_TNd = std::move(dq_pre);
    dk_TGd = std::move(dk_pre);
  }
  if (config_.qk_layernorm) {
    Tensor dq_raw = ops::activation_tensor({T, N, d});
    Tensor dk_raw = ops::activation_tensor({T, G, d});
    q_norm_.backward(dq_raw, dq_TNd, a.q_raw_TNd, a.q_norm_stats);
    k_norm_.backward(dk_raw, dk_TGd, a.k_raw_TGd, a.k_norm_stats);
    dq_TNd = std::move(dq_raw);
    dk_TGd = std::move(dk_raw);
  }
  Tensor dqkv_TQ = ops::activation_tensor({T, (N + 2 * G) * d});
  ops::merge_qkv(dqkv_TQ, dq_TNd, dk_TGd, dv_TGd, N, G, d);
  dq_TNd = dk_TGd = dv_TGd = Tensor();
  qkv_.backward(dx_TH, dqkv_TQ, a.qkv);
}

Tensor SelfAttention::forward_decode(const Tensor& x_TH, const std::span<const int64_t> positions,
                                     LayerKvCache& cache) const {
  const int64_t T = x_TH.dim(0), N = heads_, G = groups_, d = config_.kv_channels;
  LinearActivations unused_qkv, unused_proj;
  Tensor qkv_TQ = qkv_.forward(x_TH, unused_qkv);
  Tensor q_TNd = ops::uninitialized_activation({T, N, d});
  Tensor k_TGd = ops::uninitialized_activation({T, G, d});
  Tensor v_TGd = ops::uninitialized_activation({T, G, d});
  ops::split_qkv(q_TNd, k_TGd, v_TGd, qkv_TQ, N, G, d);
  qkv_TQ = Tensor();
  if (config_.qk_layernorm) {
    Tensor q_normed = ops::uninitialized_activation({T, N, d});
    Tensor k_normed = ops::uninitialized_activation({T, G, d});
    q_norm_.forward(q_normed, q_TNd);
    k_norm_.forward(k_normed, k_TGd);
    q_TNd = std::move(q_normed);
    k_TGd = std::move(k_normed);
  }
  if (has_rope()) {
    Tensor q_rot = ops::uninitialized_activation({T, N, d});
    Tensor k_rot = ops::uninitialized_activation({T, G, d});
    ops::rope_forward(q_rot, q_TNd, T, 1, rope_, positions);
    ops::rope_forward(k_rot, k_TGd, T, 1, rope_, positions);
    q_TNd = std::move(q_rot);
    k_TGd = std::move(k_rot);
  }
  cache.write(positions, k_TGd, v_TGd);
  const int64_t Sk = attended_positions(positions);
  ops::AttentionDims decode = dims(T, 1);
  decode.Sk = Sk;
  decode.q_index = positions.data();
  Tensor attn_TNd = ops::activation_tensor({T, N, d});
  Tensor lse_BNS = Tensor({1, N, T}, DType::kF32, MemCategory::kActivations);  // fp32 statistics
  ops::attention_forward(attn_TNd, lse_BNS, q_TNd, cache.first_SX.slice_rows(0, Sk).view({Sk, 1, G, d}),
                         cache.second_SY.slice_rows(0, Sk).view({Sk, 1, G, d}), decode, ops::DropoutSpec{});
  return proj_.forward(attn_TNd, unused_proj);
}

}  // namespace moecore
