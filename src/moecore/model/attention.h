// Megatron's SelfAttention (megatron/core/transformer/attention.py): linear_qkv (ColumnParallelLinear over query
// groups) -> optional q/k LayerNorm -> RoPE -> causal GQA core attention with dropout -> linear_proj
// (RowParallelLinear over heads). Parameters under `<prefix>self_attention.`: linear_qkv.{weight,bias}
// [(N+2G)d, H] (rows per query group g: its N/G query heads, then k, then v), {q,k}_layernorm.{weight,bias} [d],
// linear_proj.{weight,bias} [H, N d]. Legend: T tokens, H hidden, N / G this rank's query heads / groups, d head dim.
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

struct AttentionActivations {
  LinearActivations qkv, proj;
  Tensor q_raw_TNd, k_raw_TGd;  // before qk-norm (only with --qk-layernorm)
  NormStats q_norm_stats, k_norm_stats;
  Tensor q_TNd, k_TGd, v_TGd;  // core attention inputs (after qk-norm and RoPE)
  Tensor attn_TNd;
  Tensor lse_BNS;
};

class SelfAttention {
 public:
  SelfAttention() = default;
  // cp: the context-parallel group the layer's sequence is split over (self() without context parallelism).
  // norm_overflow_log (may be null): where the q/k norms record overflows.
  SelfAttention(const ModelConfig& config, const std::string& prefix, const TensorParallel& tp, int module,
                NormOverflowLog* norm_overflow_log, ParamStore& params,
                const parallel::ProcessGroup& cp = parallel::ProcessGroup::self());

  // x_TH: the normed layer input (this rank's rows) -> the projected output (this rank's rows), bias included.
  // S: the local sequence (S / CP positions); `sequence` gives the positions, documents and the CP split.
  // x_keepers: who besides linear_qkv keeps x_TH (parallel_linear.h).
  Tensor forward(const Tensor& x_TH, int64_t S, int64_t B, const ops::DropoutSpec& dropout, AttentionActivations& saved,
                 const SequenceInfo& sequence, InputKeepers x_keepers = InputKeepers::kShared) const;
  // dx_TH += d(out)/d(x)^T dout_TH; parameter gradients accumulate.
  void backward(Tensor& dx_TH, const Tensor& dout_TH, int64_t S, int64_t B, const ops::DropoutSpec& dropout,
                const AttentionActivations& saved, const SequenceInfo& sequence) const;
  // --recompute-modules core_attn (Megatron's CheckpointWithoutOutput-free "normal" checkpoint of core attention):
  // core attention keeps q, k, v, and its output stays as linear_proj's input, so what it drops is the rest of its
  // saved state, the log-sum-exp; backward reruns core attention from q, k, v (dropout from the same counter-RNG
  // stream, the context-parallel exchange again).
  static void drop_core_attention(AttentionActivations& saved) { saved.lse_BNS = Tensor(); }
  void recompute_core_attention(AttentionActivations& saved, int64_t S, int64_t B, const ops::DropoutSpec& dropout,
                                const SequenceInfo& sequence) const;
  // Incremental decoding (inference, one process, one sequence): x_TH the normed input of the new tokens at
  // `positions` (one each). Their keys and values go into `cache` at their positions; each new token attends the
  // cached positions up to its own. Returns the projected output of the new tokens, bias included.
  Tensor forward_decode(const Tensor& x_TH, std::span<const int64_t> positions, LayerKvCache& cache) const;

 private:
  ops::AttentionDims dims(int64_t S, int64_t B) const;
  bool has_rope() const {
    return config_.position_embedding_type == PositionEmbedding::kRope ||
           config_.position_embedding_type == PositionEmbedding::kYarn;
  }

  ModelConfig config_;
  std::string prefix_;
  int64_t heads_ = 0, groups_ = 0, head_offset_ = 0;  // this rank's query heads and groups, first global head
  parallel::ProcessGroup cp_ = parallel::ProcessGroup::self();
  CpCommType cp_type_ = CpCommType::kP2P;
  ColumnParallelLinear qkv_;
  RowParallelLinear proj_;
  NormModule q_norm_, k_norm_;
  ops::RopeSpec rope_;
};

}  // namespace moecore
