// Megatron's multi-latent attention (megatron/core/transformer/multi_latent_attention.py, MLASelfAttention with the
// local spec's standalone q / kv norms), DeepSeek-V2/V3's attention:
//   cq     = linear_q_down_proj(x)                 [T, q_lora]        replicated over TP (Megatron's "duplicated")
//   q      = linear_q_up_proj(q_layernorm(cq))     [T, N, dq + dr]    column-parallel over heads
//            (without --q-lora-rank: q = linear_q_proj(x))
//   ckv    = linear_kv_down_proj(x)                [T, kv_lora + dr]  replicated: [latent | k_rope]
//   kv     = linear_kv_up_proj(kv_layernorm(latent)) [T, N, dq + dv]  column-parallel; per head [k_nope | v]
//   query  = [q_nope | rope(q_rope)], key = [k_nope | rope(k_rope)] (one rope key per token, shared by every head),
//   out    = linear_proj(softmax(query key^T * scale) v)   row-parallel over heads
// RoPE (model/rotary_embedding.h) in MLA's de-interleaved layout on the dr rope channels only; the softmax scale is
// get_mscale(rotary_scaling_factor, mscale_all_dim)^2 / sqrt(dq + dr). The q / kv norms exist only with
// --qk-layernorm (q_layernorm only with a q latent). Under sequence parallelism each rank projects its sequence shard
// down; the up projections all-gather the normed latents (ColumnParallelLinear), k_rope is all-gathered here and its
// gradient reduce-scattered; the replicated down projections and norms see a shard of the tokens, so their
// gradients are summed over TP (Param::grad_sum_over_tp, Megatron's finalize_model_grads). Without sequence
// parallelism every rank sees every token and only k_rope's gradient (each rank's heads' share) is all-reduced.
// Legend: T tokens, Tl this rank's rows, N this rank's heads, dq / dr / dv qk_head_dim / qk_pos_emb_head_dim /
// v_head_dim.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "moecore/model/config.h"
#include "moecore/model/context_parallel_attention.h"
#include "moecore/model/kv_cache.h"
#include "moecore/model/norm_module.h"
#include "moecore/model/parallel_linear.h"
#include "moecore/model/sequence_info.h"
#include "moecore/ops/attention.h"
#include "moecore/tensor/tensor.h"

namespace moecore {

struct MlaActivations {
  LinearActivations q_down, q_up, kv_down, kv_up, proj;  // q_up: linear_q_proj's without a q latent
  Tensor cq_TlQ, latent_TlL;                             // the latents before their norms (only with --qk-layernorm)
  NormStats q_norm_stats, kv_norm_stats;
  Tensor q_TNk, k_TNk, v_TNv;  // core attention inputs, k = dq + dr wide
  Tensor attn_TNv;
  Tensor lse_BNS;
  Tensor k_rope_TR;  // --recompute-modules mla_up_proj: the (gathered) rope key, an input of the recompute
};

class MLASelfAttention {
 public:
  MLASelfAttention() = default;
  MLASelfAttention(const ModelConfig& config, const std::string& prefix, const TensorParallel& tp, int module,
                   NormOverflowLog* norm_overflow_log, ParamStore& params,
                   const parallel::ProcessGroup& cp = parallel::ProcessGroup::self());

  // As SelfAttention: x_TH the normed layer input (this rank's rows) -> the projected output, bias included.
  // x_keepers: who besides the projections reading x_TH keeps it (parallel_linear.h).
  Tensor forward(const Tensor& x_TH, int64_t S, int64_t B, const ops::DropoutSpec& dropout, MlaActivations& saved,
                 const SequenceInfo& sequence, InputKeepers x_keepers = InputKeepers::kShared) const;
  void backward(Tensor& dx_TH, const Tensor& dout_TH, int64_t S, int64_t B, const ops::DropoutSpec& dropout,
                const MlaActivations& saved, const SequenceInfo& sequence) const;
  // --recompute-modules core_attn: as SelfAttention's, the log-sum-exp dropped and core attention rerun.
  static void drop_core_attention(MlaActivations& saved) { saved.lse_BNS = Tensor(); }
  void recompute_core_attention(MlaActivations& saved, int64_t S, int64_t B, const ops::DropoutSpec& dropout,
                                const SequenceInfo& sequence) const;
  // --recompute-modules mla_up_proj (Megatron's output-discarding checkpoint of qkv_up_proj_and_rope_apply): the up
  // projections' outputs after RoPE, core attention's q, k and v, are dropped after forward and rebuilt in backward
  // from what the up projections keep (their normed latent inputs) and the rope key.
  static void drop_up_proj(MlaActivations& saved) { saved.q_TNk = saved.k_TNk = saved.v_TNv = Tensor(); }
  void recompute_up_proj(MlaActivations& saved, int64_t S, int64_t B, const SequenceInfo& sequence) const;
  // Incremental decoding as SelfAttention::forward_decode: the new tokens' normed kv latents and rotated rope keys
  // go into `cache`, and attention runs in the latent space with linear_kv_up_proj absorbed into the query and the
  // output (DeepSeek-V2/V3 inference), so no step recomputes k_nope or v over the cached positions; the same numbers
  // as the full forward up to the fp32 summation order.
  Tensor forward_decode(const Tensor& x_TH, std::span<const int64_t> positions, LayerKvCache& cache) const;

 private:
  ops::AttentionDims dims(int64_t S, int64_t B) const;
  bool q_latent() const { return mla_.q_lora_rank > 0; }
  // Core attention's q, k, v from the up projections' outputs q_TQ, kv_TK and the gathered rope key (RoPE applied).
  void core_inputs(MlaActivations& saved, const Tensor& q_TQ, const Tensor& kv_TK, const Tensor& k_rope_TR, int64_t S,
                   int64_t B, const SequenceInfo& sequence) const;

  ModelConfig config_;
  MlaConfig mla_;
  std::string prefix_;
  TensorParallel tp_;
  int64_t heads_ = 0, head_offset_ = 0;
  parallel::ProcessGroup cp_ = parallel::ProcessGroup::self();
  CpCommType cp_type_ = CpCommType::kP2P;
  ColumnParallelLinear q_down_, q_up_, kv_down_, kv_up_;  // q_up_ is linear_q_proj without a q latent
  RowParallelLinear proj_;
  NormModule q_norm_, kv_norm_;
  ops::RopeSpec rope_;
  double softmax_scale_ = 0;
};

}  // namespace moecore
