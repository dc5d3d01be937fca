// One pre-norm decoder layer (Megatron's TransformerLayer): x + dropout(attention(norm1(x))), then
// + dropout(mlp(norm2(.))), the MLP replaced by the MoE layer on the layers --moe-layer-freq marks.
// Activations are this rank's rows of the T = S*B tokens (TensorParallel::local_rows: a sequence shard under
// --sequence-parallel). Legend: T tokens, H hidden.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "moecore/model/attention.h"
#include "moecore/model/buffer.h"
#include "moecore/model/config.h"
#include "moecore/model/kv_cache.h"
#include "moecore/model/mla_attention.h"
#include "moecore/model/mlp.h"
#include "moecore/model/norm_module.h"
#include "moecore/model/param.h"
#include "moecore/model/sequence_info.h"
#include "moecore/model/tensor_parallel.h"
#include "moecore/model/token_rows.h"
#include "moecore/moe/moe_layer.h"
#include "moecore/ops/delayed_scales_replay.h"
#include "moecore/parallel/parallel_state.h"
#include "moecore/tensor/tensor.h"

namespace moecore {

struct LayerDropout {
  bool training = false;
  uint64_t seed = 0;
  uint64_t stream = 0;  // unique per (iteration, micro-batch, layer)
  // Where the layer's S * B rows (the whole local sequence, before any sequence-parallel shard) sit in the one-process
  // micro-batch; empty: rows 0..S*B-1. Counter-RNG draws are keyed by the one-process element.
  TokenRows rows;
  const SequenceInfo* sequence = nullptr;  // positions, documents and the CP split (null: one plain sequence)
  // Full recomputation's second forward of the layer (training): the same numbers, no side effects (the MoE router's
  // counts), under FP8 delayed scaling the scales the first forward logged.
  bool recompute = false;
  // Router replay: the micro-batch's recorded routing (moe/routing_replay.h; null: the routers choose).
  const RoutingReplayBatch* routing_replay = nullptr;
};

// What one layer's backward needs from its forward.
struct LayerActivations {
  Tensor x_TH;  // layer input
  Tensor ln1_TH;
  NormStats ln1_stats;
  AttentionActivations attention;
  MlaActivations mla_attention;  // multi-latent attention's (--multi-latent-attention)
  Tensor x_mid_TH;               // after the attention residual
  Tensor ln2_TH;
  NormStats ln2_stats;
  MLPActivations mlp;       // dense layers
  MoELayerActivations moe;  // MoE layers
  // Recomputation: which saved tensors the dropped norm outputs were also kept as (restored with them), and under FP8
  // delayed scaling the scales this forward's linear layers used (replayed by the recompute).
  uint8_t ln1_aliases = 0, ln2_aliases = 0;
  std::unique_ptr<ops::DelayedScalesLog> delayed_scales;
};

// Where a layer's parameters live: a decoder layer's are named "decoder.layers.{index}." and completed by backward
// hook `index`; a Multi-Token Prediction depth builds a decoder layer's structure under a name of its own.
struct LayerPlacement {
  std::string prefix;
  int module = 0;  // Param::module
};

class TransformerLayer {
 public:
  // Registers this layer's parameters into `params` and buffers into `buffers` (names prefixed
  // "decoder.layers.{index}.", the global index). The norms record overflows into norm_overflow_log (the model's; may
  // be null; not owned).
  TransformerLayer(const ModelConfig& config, int64_t index, ParamStore& params, BufferStore& buffers,
                   const parallel::ParallelState& parallel, NormOverflowLog* norm_overflow_log = nullptr);
  // The structure of decoder layer `index` (dense or MoE, its quantization) under `placement`'s names.
  TransformerLayer(const ModelConfig& config, int64_t index, ParamStore& params, BufferStore& buffers,
                   const parallel::ParallelState& parallel, const LayerPlacement& placement,
                   NormOverflowLog* norm_overflow_log = nullptr);

  // x_TH (this rank's rows) -> out_TH (same rows). S, B: the micro-batch. Collective over TP (and the expert grid
  // on MoE layers). Fills `saved` when dropout.training (backward will follow).
  Tensor forward(const Tensor& x_TH, int64_t S, int64_t B, const LayerDropout& dropout, LayerActivations& saved) const;
  // dx_TH += d(out)/d(x)^T dout_TH; parameter gradients accumulate. aux_grad_scale: the factor MoE auxiliary losses
  // carry into the gradient (the micro-batch's loss scale). First recomputes what --recompute-modules dropped (each
  // branch just before its backward).
  void backward(Tensor& dx_TH, const Tensor& dout_TH, int64_t S, int64_t B, const LayerDropout& dropout,
                double aux_grad_scale, LayerActivations& saved) const;
  // Full recomputation: frees everything a training forward kept but what its recompute (forward with
  // dropout.recompute) needs besides the input: the MoE router's keys and aux-loss gradient, the FP8 delayed scales.
  static void drop_for_full_recompute(LayerActivations& saved);
  // Incremental decoding (inference, one process, one sequence): the forward of the new tokens x_TH [T, H] at
  // `positions`, attending the positions `cache` holds up to each one's own (attention's forward_decode).
  Tensor forward_decode(const Tensor& x_TH, std::span<const int64_t> positions, LayerKvCache& cache) const;

  bool is_moe() const { return moe_ != nullptr; }
  int64_t index() const { return index_; }  // the global layer number
  MoELayer* moe() { return moe_.get(); }
  const MoELayer* moe() const { return moe_.get(); }

 private:
  ActivationOwner mlp_owner() const { return moe_ ? ActivationOwner::kMoE : ActivationOwner::kMlp; }

  Tensor moe_forward(const Tensor& x_TH, int64_t S, int64_t B, const LayerDropout& dropout,
                     MoELayerActivations& saved) const;
  // Selective recomputation (--recompute-modules): what a training forward drops, and its recompute before the MLP /
  // MoE branch's backward and before the attention branch's.
  void drop_selected(LayerActivations& saved) const;
  void recompute_mlp_branch(LayerActivations& saved) const;
  void recompute_attention_branch(LayerActivations& saved, int64_t S, int64_t B, const LayerDropout& dropout,
                                  const SequenceInfo& sequence) const;
  // Whether this layer's forward logs its FP8 delayed scales for a recompute.
  bool logs_delayed_scales() const;
  void moe_backward(Tensor& dx_TH, const Tensor& dout_TH, const Tensor& x_TH, int64_t S, int64_t B,
                    double aux_grad_scale, const MoELayerActivations& saved) const;

  ModelConfig config_;
  int64_t index_;  // global layer number
  TensorParallel tp_;
  std::string prefix_;
  NormModule ln1_, ln2_;
  SelfAttention attention_;        // standard attention, or
  MLASelfAttention mla_;           // multi-latent attention (config.mla)
  MLP mlp_;                        // dense layers
  std::unique_ptr<MoELayer> moe_;  // MoE layers: replaces the dense MLP
};

}  // namespace moecore
