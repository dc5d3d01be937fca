#include "moecore/model/mla_attention.h"

#include <utility>

#include "moecore/model/rotary_embedding.h"
#include "moecore/ops/attention.h"
#include "moecore/ops/linear.h"
#include "moecore/ops/precision.h"
#include "moecore/ops/rows.h"

namespace moecore {
namespace {

// Columns [col, col + width) of every `from_width`-wide row of `from`, as a new tensor of `shape`.
Tensor columns(const Tensor& from, const int64_t from_width, const int64_t col, const int64_t width,
               std::vector<int64_t> shape) {
  Tensor out = ops::activation_tensor(std::move(shape));
  ops::copy_columns(out, width, 0, from, from_width, col, width);
  return out;
}

}  // namespace

MLASelfAttention::MLASelfAttention(const ModelConfig& config, const std::string& prefix, const TensorParallel& tp,
                                   const int module, NormOverflowLog* norm_overflow_log, ParamStore& params,
                                   const parallel::ProcessGroup& cp)
    : config_(config), mla_(config.mla.value()), prefix_(prefix + "self_attention."), tp_(tp), cp_(cp) {
  const std::vector<std::string>& types = config.cp_comm_type;
  cp_type_ = parse_cp_comm_type(types.size() == 1 ? types[0] : types.at(static_cast<size_t>(module)));
  const int64_t H = config.hidden_size, N = config.num_attention_heads, n = tp.size();
  if (N % n != 0) {
    throw ConfigError("--num-attention-heads (" + std::to_string(N) +
                      ") must be divisible by --tensor-model-parallel-size (" + std::to_string(n) + ")");
  }
  heads_ = N / n;
  head_offset_ = tp.rank() * heads_;
  if (cp.size() > 1 && cp_type_ == CpCommType::kA2A && heads_ % cp.size() != 0) {
    throw ConfigError("--cp-comm-type a2a needs the attention heads of a tensor-parallel rank (" +
                      std::to_string(heads_) + ") divisible by --context-parallel-size (" + std::to_string(cp.size()) +
                      ")");
  }
  const int64_t dqk = mla_.q_head_dim(), dv = mla_.v_head_dim, L = mla_.kv_lora_rank, dr = mla_.qk_pos_emb_head_dim;
  LinearOptions linear;
  linear.module = module;
  const TensorParallel replicated;  // Megatron's duplicated linear: the whole weight on every rank, no communication
  const bool partial = tp.sequence_sharded();
  const NormOptions norm = norm_options(config, partial, module, norm_overflow_log);
  if (q_latent()) {
    q_down_ = ColumnParallelLinear(prefix_ + "linear_q_down_proj", H, mla_.q_lora_rank, replicated, linear, params);
    q_down_.weight().grad_sum_over_tp = partial;
    if (config.qk_layernorm) q_norm_ = NormModule(prefix_ + "q_layernorm", mla_.q_lora_rank, norm, params);
    q_up_ = ColumnParallelLinear(prefix_ + "linear_q_up_proj", mla_.q_lora_rank, N * dqk, tp, linear, params);
  } else {
    q_up_ = ColumnParallelLinear(prefix_ + "linear_q_proj", H, N * dqk, tp, linear, params);
  }
  kv_down_ = ColumnParallelLinear(prefix_ + "linear_kv_down_proj", H, L + dr, replicated, linear, params);
  kv_down_.weight().grad_sum_over_tp = partial;
  if (config.qk_layernorm) kv_norm_ = NormModule(prefix_ + "kv_layernorm", L, norm, params);
  kv_up_ = ColumnParallelLinear(prefix_ + "linear_kv_up_proj", L, N * (mla_.qk_head_dim + dv), tp, linear, params);
  LinearOptions proj = linear;
  proj.bias = config.add_bias_linear;
  proj.init = InitKind::kScaledNormal;
  proj_ = RowParallelLinear(prefix_ + "linear_proj", N * dv, H, tp, proj, params);
  rope_ = mla_rope_spec(config);
  softmax_scale_ = mla_softmax_scale(config);
}

ops::AttentionDims MLASelfAttention::dims(const int64_t S, const int64_t B) const {
  ops::AttentionDims dims{S, B, heads_, heads_, mla_.q_head_dim(), softmax_scale_};
  dims.v_head_dim = mla_.v_head_dim;
  dims.dropout_total_heads = config_.num_attention_heads;
  dims.dropout_head_offset = head_offset_;
  return dims;
}

Tensor MLASelfAttention::forward(const Tensor& x_TH, const int64_t S, const int64_t B, const ops::DropoutSpec& dropout,
                                 MlaActivations& a, const SequenceInfo& sequence, const InputKeepers x_keepers) const {
  const int64_t T = S * B, Tl = x_TH.dim(0), N = heads_;
  const int64_t dr = mla_.qk_pos_emb_head_dim, dv = mla_.v_head_dim;
  const int64_t L = mla_.kv_lora_rank, Q = mla_.q_lora_rank;
  // The up projections' inputs (the normed latents) are theirs alone, kept quantized under FP8 / FP4 unless
  // mla_up_proj recomputation reruns the projections from them.
  const InputKeepers up_inputs =
      config_.recompute.has("mla_up_proj") ? InputKeepers::kRecomputed : InputKeepers::kLinearOnly;
  Tensor q_TQ;
  if (q_latent()) {
    Tensor cq_TlQ = q_down_.forward(x_TH, a.q_down, x_keepers);
    if (config_.qk_layernorm) {
      a.cq_TlQ = std::move(cq_TlQ);
      cq_TlQ = ops::activation_tensor({Tl, Q});
      a.q_norm_stats = q_norm_.forward(cq_TlQ, a.cq_TlQ);
    }
    q_TQ = q_up_.forward(cq_TlQ, a.q_up, up_inputs);
  } else {
    q_TQ = q_up_.forward(x_TH, a.q_up, up_inputs == InputKeepers::kRecomputed ? up_inputs : x_keepers);
  }
  Tensor ckv_TlC = kv_down_.forward(x_TH, a.kv_down, x_keepers);
  Tensor latent_TlL = columns(ckv_TlC, L + dr, 0, L, {Tl, L});
  const Tensor k_rope_TlR = columns(ckv_TlC, L + dr, L, dr, {Tl, dr});
  ckv_TlC = Tensor();
  if (config_.qk_layernorm) {
    a.latent_TlL = std::move(latent_TlL);
    latent_TlL = ops::activation_tensor({Tl, L});
    a.kv_norm_stats = kv_norm_.forward(latent_TlL, a.latent_TlL);
  }
  Tensor kv_TK = kv_up_.forward(latent_TlL, a.kv_up, up_inputs);
  latent_TlL = Tensor();
  const Tensor k_rope_TR = tp_.sequence_sharded() ? tp_.all_gather_rows(k_rope_TlR) : k_rope_TlR;
  if (config_.recompute.has("mla_up_proj")) a.k_rope_TR = k_rope_TR;
  core_inputs(a, q_TQ, kv_TK, k_rope_TR, S, B, sequence);
  q_TQ = kv_TK = Tensor();

  a.attn_TNv = ops::activation_tensor({T, N, dv});
  a.lse_BNS = Tensor({B, N, S}, DType::kF32, MemCategory::kActivations);  // fp32 statistics
  context_parallel_attention_forward(a.attn_TNv, a.lse_BNS, a.q_TNk, a.k_TNk, a.v_TNv, dims(S, B), dropout, sequence,
                                     cp_, cp_type_);
  return proj_.forward(a.attn_TNv, a.proj);
}

void MLASelfAttention::core_inputs(MlaActivations& a, const Tensor& q_TQ, const Tensor& kv_TK, const Tensor& k_rope_TR,
                                   const int64_t S, const int64_t B, const SequenceInfo& sequence) const {
  const int64_t T = S * B, N = heads_;
  const int64_t dq = mla_.qk_head_dim, dr = mla_.qk_pos_emb_head_dim, dv = mla_.v_head_dim, dqk = dq + dr;
  // query = [q_nope | rope(q_rope)] per head.
  const Tensor q_rope_TNr = columns(q_TQ, dqk, dq, dr, {T, N, dr});
  Tensor q_rot_TNr = ops::activation_tensor({T, N, dr});
  ops::rope_forward(q_rot_TNr, q_rope_TNr, S, B, rope_, sequence.positions_SB);
  a.q_TNk = ops::activation_tensor({T, N, dqk});
  ops::copy_columns(a.q_TNk, dqk, 0, q_TQ, dqk, 0, dq);
  ops::copy_columns(a.q_TNk, dqk, dq, q_rot_TNr, dr, 0, dr);
  // key = [k_nope | rope(k_rope)], the one rope key of a token in every head; value from the same up projection.
  Tensor k_rot_TR = ops::activation_tensor({T, dr});
  ops::rope_forward(k_rot_TR, k_rope_TR, S, B, rope_, sequence.positions_SB);
  a.k_TNk = ops::activation_tensor({T, N, dqk});
  ops::copy_columns(a.k_TNk, dqk, 0, kv_TK, dq + dv, 0, dq);
  for (int64_t h = 0; h < N; ++h) ops::copy_columns(a.k_TNk, N * dqk, h * dqk + dq, k_rot_TR, dr, 0, dr);
  a.v_TNv = columns(kv_TK, dq + dv, dq, dv, {T, N, dv});
}

void MLASelfAttention::recompute_up_proj(MlaActivations& a, const int64_t S, const int64_t B,
                                         const SequenceInfo& sequence) const {
  const Tensor q_TQ = q_up_.forward_saved(a.q_up);
  const Tensor kv_TK = kv_up_.forward_saved(a.kv_up);
  core_inputs(a, q_TQ, kv_TK, a.k_rope_TR, S, B, sequence);
}

void MLASelfAttention::recompute_core_attention(MlaActivations& a, const int64_t S, const int64_t B,
                                                const ops::DropoutSpec& dropout, const SequenceInfo& sequence) const {
  // The output is rewritten with the same values: it is linear_proj's saved input.
  a.lse_BNS = Tensor({B, heads_, S}, DType::kF32, MemCategory::kActivations);  // fp32 statistics
  context_parallel_attention_forward(a.attn_TNv, a.lse_BNS, a.q_TNk, a.k_TNk, a.v_TNv, dims(S, B), dropout, sequence,
                                     cp_, cp_type_);
}

void MLASelfAttention::backward(Tensor& dx_TH, const Tensor& dout_TH, const int64_t S, const int64_t B,
                                const ops::DropoutSpec& dropout, const MlaActivations& a,
                                const SequenceInfo& sequence) const {
  const int64_t T = S * B, Tl = dx_TH.dim(0), N = heads_;
  const int64_t dq = mla_.qk_head_dim, dr = mla_.qk_pos_emb_head_dim, dv = mla_.v_head_dim, dqk = dq + dr;
  const int64_t L = mla_.kv_lora_rank, Q = mla_.q_lora_rank;
  Tensor dattn_TNv = ops::activation_tensor({T, N, dv});
  proj_.backward(dattn_TNv, dout_TH, a.proj);
  Tensor dq_TNk = ops::activation_tensor({T, N, dqk});
  Tensor dk_TNk = ops::activation_tensor({T, N, dqk});
  Tensor dv_TNv = ops::activation_tensor({T, N, dv});
  context_parallel_attention_backward(dq_TNk, dk_TNk, dv_TNv, dattn_TNv, a.q_TNk, a.k_TNk, a.v_TNv, a.attn_TNv,
                                      a.lse_BNS, dims(S, B), dropout, sequence, cp_, cp_type_);
  dattn_TNv = Tensor();

  // Keys and values back to the up projection's rows; the rope key's gradient summed over this rank's heads.
  Tensor dkv_TK = ops::activation_tensor({T, N * (dq + dv)});
  ops::copy_columns(dkv_TK, dq + dv, 0, dk_TNk, dqk, 0, dq);
  ops::copy_columns(dkv_TK, dq + dv, dq, dv_TNv, dv, 0, dv);
  dv_TNv = Tensor();
  Tensor dk_rot_TR = ops::activation_tensor({T, dr});
  for (int64_t h = 0; h < N; ++h) ops::copy_columns(dk_rot_TR, dr, 0, dk_TNk, N * dqk, h * dqk + dq, dr, true);
  dk_TNk = Tensor();
  Tensor dk_rope_TR = ops::activation_tensor({T, dr});
  ops::rope_backward(dk_rope_TR, dk_rot_TR, S, B, rope_, sequence.positions_SB);
  dk_rot_TR = Tensor();
  Tensor dlatent_TlL = ops::activation_tensor({Tl, L});
  kv_up_.backward(dlatent_TlL, dkv_TK, a.kv_up);
  dkv_TK = Tensor();
  if (config_.qk_layernorm) {
    Tensor dlatent_raw_TlL = ops::activation_tensor({Tl, L});
    kv_norm_.backward(dlatent_raw_TlL, dlatent_TlL, a.latent_TlL, a.kv_norm_stats);
    dlatent_TlL = std::move(dlatent_raw_TlL);
  }
  if (tp_.sequence_sharded()) {
    dk_rope_TR = tp_.reduce_scatter_rows(dk_rope_TR);
  } else {
    tp_.all_reduce_activations_(dk_rope_TR);  // every rank's heads used the replicated rope key
  }
  Tensor dckv_TlC = ops::activation_tensor({Tl, L + dr});
  ops::copy_columns(dckv_TlC, L + dr, 0, dlatent_TlL, L, 0, L);
  ops::copy_columns(dckv_TlC, L + dr, L, dk_rope_TR, dr, 0, dr);
  dlatent_TlL = dk_rope_TR = Tensor();
  kv_down_.backward(dx_TH, dckv_TlC, a.kv_down);
  dckv_TlC = Tensor();

  // Queries: the rope part through RoPE's transpose, then the up (or only) projection.
  Tensor dq_TQ = ops::activation_tensor({T, N * dqk});
  ops::copy_columns(dq_TQ, dqk, 0, dq_TNk, dqk, 0, dq);
  const Tensor dq_rot_TNr = columns(dq_TNk, dqk, dq, dr, {T, N, dr});
  dq_TNk = Tensor();
  Tensor dq_rope_TNr = ops::activation_tensor({T, N, dr});
  ops::rope_backward(dq_rope_TNr, dq_rot_TNr, S, B, rope_, sequence.positions_SB);
  ops::copy_columns(dq_TQ, dqk, dq, dq_rope_TNr, dr, 0, dr);
  dq_rope_TNr = Tensor();
  if (!q_latent()) {
    q_up_.backward(dx_TH, dq_TQ, a.q_up);
    return;
  }
  Tensor dcq_TlQ = ops::activation_tensor({Tl, Q});
  q_up_.backward(dcq_TlQ, dq_TQ, a.q_up);
  dq_TQ = Tensor();
  if (config_.qk_layernorm) {
    Tensor dcq_raw_TlQ = ops::activation_tensor({Tl, Q});
    q_norm_.backward(dcq_raw_TlQ, dcq_TlQ, a.cq_TlQ, a.q_norm_stats);
    dcq_TlQ = std::move(dcq_raw_TlQ);
  }
  q_down_.backward(dx_TH, dcq_TlQ, a.q_down);
}

Tensor MLASelfAttention::forward_decode(const Tensor& x_TH, const std::span<const int64_t> positions,
                                        LayerKvCache& cache) const {
  const int64_t T = x_TH.dim(0), N = heads_;
  const int64_t dq = mla_.qk_head_dim, dr = mla_.qk_pos_emb_head_dim, dv = mla_.v_head_dim, dqk = dq + dr;
  const int64_t L = mla_.kv_lora_rank, Q = mla_.q_lora_rank;
  LinearActivations unused;
  Tensor q_TQ;
  if (q_latent()) {
    Tensor cq_TQ = q_down_.forward(x_TH, unused);
    if (config_.qk_layernorm) {
      Tensor normed_TQ = ops::activation_tensor({T, Q});
      q_norm_.forward(normed_TQ, cq_TQ);
      cq_TQ = std::move(normed_TQ);
    }
    q_TQ = q_up_.forward(cq_TQ, unused);
  } else {
    q_TQ = q_up_.forward(x_TH, unused);
  }
  // The new tokens' normed latents and rotated rope keys join the cache.
  Tensor ckv_TC = kv_down_.forward(x_TH, unused);
  Tensor latent_TL = columns(ckv_TC, L + dr, 0, L, {T, L});
  const Tensor k_rope_TR = columns(ckv_TC, L + dr, L, dr, {T, dr});
  ckv_TC = Tensor();
  if (config_.qk_layernorm) {
    Tensor normed_TL = ops::activation_tensor({T, L});
    kv_norm_.forward(normed_TL, latent_TL);
    latent_TL = std::move(normed_TL);
  }
  Tensor k_rot_TR = ops::activation_tensor({T, dr});
  ops::rope_forward(k_rot_TR, k_rope_TR, T, 1, rope_, positions);
  cache.write(positions, latent_TL, k_rot_TR);
  latent_TL = k_rot_TR = Tensor();

  const Tensor q_rope_TNr = columns(q_TQ, dqk, dq, dr, {T, N, dr});
  Tensor q_rot_TNr = ops::activation_tensor({T, N, dr});
  ops::rope_forward(q_rot_TNr, q_rope_TNr, T, 1, rope_, positions);
  Tensor q_TNk = ops::activation_tensor({T, N, dqk});
  ops::copy_columns(q_TNk, dqk, 0, q_TQ, dqk, 0, dq);
  ops::copy_columns(q_TNk, dqk, dq, q_rot_TNr, dr, 0, dr);
  q_TQ = Tensor();

  // Attention in the latent space (DeepSeek-V2/V3's absorbed form): head h's k_nope is W_uk[h] latent and its value
  // W_uv[h] latent (the rows of linear_kv_up_proj), so q_nope . k_nope = (W_uk[h]^T q_nope) . latent and the output
  // is W_uv[h] (sum_j p_j latent_j). Every head then attends the same keys [latent | rope key] and values [latent]
  // (one key / value group), and no step recomputes k_nope or v over the cached positions.
  const int64_t Sk = attended_positions(positions), K = L + dr;
  const Tensor& w_up = kv_up_.weight().value;  // [N (dq + dv), L], per head [W_uk (dq rows); W_uv (dv rows)]
  Tensor q_TNK = ops::activation_tensor({T, N, K});
  Tensor q_nope_Tq = ops::activation_tensor({T, dq});
  for (int64_t h = 0; h < N; ++h) {
    ops::copy_columns(q_nope_Tq, dq, 0, q_TNk, N * dqk, h * dqk, dq);
    // q_abs = q_nope W_uk[h]: the linear layer's input-gradient product (dinp += dout @ weight) into zeros.
    Tensor q_abs_TL = ops::activation_tensor({T, L});
    ops::linear_backward(&q_abs_TL, nullptr, nullptr, q_nope_Tq, nullptr,
                         w_up.slice_rows(h * (dq + dv), h * (dq + dv) + dq));
    ops::copy_columns(q_TNK, N * K, h * K, q_abs_TL, L, 0, L);
    ops::copy_columns(q_TNK, N * K, h * K + L, q_TNk, N * dqk, h * dqk + dq, dr);
  }
  q_TNk = Tensor();
  Tensor k_SK = ops::activation_tensor({Sk, 1, K});
  ops::copy_columns(k_SK, K, 0, cache.first_SX.slice_rows(0, Sk), L, 0, L);
  ops::copy_columns(k_SK, K, L, cache.second_SY.slice_rows(0, Sk), dr, 0, dr);
  const Tensor v_SL = cache.first_SX.slice_rows(0, Sk);

  ops::AttentionDims decode{T, 1, N, 1, K, softmax_scale_};
  decode.v_head_dim = L;
  decode.Sk = Sk;
  decode.q_index = positions.data();
  Tensor attn_latent_TNL = ops::activation_tensor({T, N, L});
  Tensor lse_BNS = Tensor({1, N, T}, DType::kF32, MemCategory::kActivations);  // fp32 statistics
  ops::attention_forward(attn_latent_TNL, lse_BNS, q_TNK, k_SK, v_SL, decode, ops::DropoutSpec{});
  Tensor attn_TNv = ops::activation_tensor({T, N, dv});
  Tensor head_latent_TL = ops::activation_tensor({T, L});
  Tensor out_Tv = ops::activation_tensor({T, dv});
  for (int64_t h = 0; h < N; ++h) {
    ops::copy_columns(head_latent_TL, L, 0, attn_latent_TNL, N * L, h * L, L);
    ops::linear_forward(out_Tv, head_latent_TL, w_up.slice_rows(h * (dq + dv) + dq, (h + 1) * (dq + dv)));
    ops::copy_columns(attn_TNv, N * dv, h * dv, out_Tv, dv, 0, dv);
  }
  return proj_.forward(attn_TNv, unused);
}

}  // namespace moecore
