// Megatron's Multi-Token Prediction block (megatron/core/transformer/multi_token_prediction.py, --mtp-num-layers D),
// on the stage that holds the loss. Depth k (0-based) owns
//   mtp.layers.{k}.enorm.{weight,bias} [H]   mtp.layers.{k}.hnorm.{weight,bias} [H]   (bias: LayerNorm only)
//   mtp.layers.{k}.eh_proj.weight [H, 2H]    (column-parallel, no bias)
//   mtp.layers.{k}.mtp_model_layer.*         (a TransformerLayer built as the last decoder layer: MoE if it is)
//   mtp.layers.{k}.final_layernorm.{weight,bias} [H]
// and shares the model's word embedding and output layer. With h_0 the decoder's output after its final norm:
//   ids_k = ids shifted left k+1 places (0 past the end), e_k = dropout(embedding(ids_k)),
//   h_{k+1} = final_layernorm_k(layer_k(eh_proj_k([enorm_k(e_k) ; hnorm_k(h_k)]))),
//   loss_k = sum(CE(output_layer(h_{k+1}), labels shifted k+1) * mask shifted k+1) / max(unmasked, 1).
// Training adds (mtp_loss_scaling_factor / D) * sum_k loss_k to the micro-batch's loss (Megatron's
// MTPLossAutoScaler: the MTP gradients carry the main loss's backward seed); the reported loss stays the main one.
// Activations are this rank's rows of the T = S*B tokens (t = s * B + b), as the decoder's.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "moecore/model/buffer.h"
#include "moecore/model/config.h"
#include "moecore/model/norm_module.h"
#include "moecore/model/norm_overflow.h"
#include "moecore/model/parallel_linear.h"
#include "moecore/model/param.h"
#include "moecore/model/sequence_info.h"
#include "moecore/model/tensor_parallel.h"
#include "moecore/model/token_rows.h"
#include "moecore/model/transformer_layer.h"
#include "moecore/model/vocab_parallel.h"
#include "moecore/parallel/parallel_state.h"
#include "moecore/tensor/tensor.h"

namespace moecore {

// What one depth's backward needs.
struct MtpDepthActivations {
  std::vector<int32_t> tokens_SB;  // this depth's input ids (this rank's S * B rows)
  Tensor embedded_TH;              // enorm input: the embedding after dropout
  Tensor hidden_in_TH;             // hnorm input: the previous depth's output (h_0: the decoder's)
  NormStats enorm_stats, hnorm_stats, final_stats;
  LinearActivations eh_proj;
  LayerActivations layer;
  Tensor layer_out_TH;      // final_layernorm input
  Tensor output_dinput_TH;  // d(weighted loss_k) / d(h_{k+1}), scale = the forward's backward seed
};

struct MtpActivations {
  std::vector<MtpDepthActivations> depths;
  double grad_seed = 1.0;  // the forward's backward seed (the output-layer weight gradients went to the main grad)
};

// The micro-batch as the block reads it.
struct MtpBatch {
  int64_t S = 0, B = 0;                 // this rank's sequence (a context-parallel rank's share) and batch
  int64_t full_S = 0;                   // the whole sequence
  const int32_t* tokens_BS = nullptr;   // the whole micro-batch [B, full_S]
  const int32_t* labels_BS = nullptr;   // [B, full_S]
  const float* loss_mask_BS = nullptr;  // [B, full_S]; null: all ones
  const TokenRows* rows = nullptr;      // where this rank's S * B rows sit in the one-process micro-batch
  const SequenceInfo* sequence = nullptr;
};

struct MtpForwardOptions {
  bool training = false;
  uint64_t dropout_seed = 0;
  std::vector<uint64_t> layer_streams;   // per depth: the layer's dropout stream
  std::vector<uint64_t> embedding_keys;  // per depth: the embedding dropout's counter key
  double backward_seed = 1.0;            // the micro-batch's backward seed (ForwardOptions::backward_seed)
  // Per-token loss (ForwardOptions::per_token_loss): a depth's token losses weigh the main loss's unmasked tokens on
  // this rank / the depth's (Megatron's original_num_tokens / num_tokens) instead of 1 / the depth's.
  bool per_token_loss = false;
  double main_loss_tokens = 0.0;
};

class MultiTokenPrediction {
 public:
  MultiTokenPrediction() = default;
  // Registers the D depths' parameters (Param::module = module) and their MoE buffers. The depths use the model's
  // word embedding, output layer and cross-entropy (not owned); their norms record overflows into norm_overflow_log
  // (the model's; may be null; not owned).
  MultiTokenPrediction(const ModelConfig& config, int module, ParamStore& params, BufferStore& buffers,
                       const parallel::ParallelState& parallel, NormOverflowLog* norm_overflow_log,
                       const VocabParallelEmbedding* word_embeddings, const ColumnParallelLinear* output_layer,
                       const VocabParallelCrossEntropy* cross_entropy);

  int64_t depths() const { return static_cast<int64_t>(layers_.size()); }
  std::vector<TransformerLayer>& layers() { return layers_; }

  // h0_TH: the decoder's output after its final norm (this rank's rows). Returns each depth's loss_k (unscaled);
  // fills `saved` when training.
  std::vector<double> forward(const Tensor& h0_TH, const MtpBatch& batch, const MtpForwardOptions& options,
                              MtpActivations& saved) const;
  // Accumulates the parameter gradients of loss_scale * (factor / D) * sum_k loss_k and returns its gradient with
  // respect to h0_TH. aux_grad_scale: the MoE auxiliary losses' gradient scale.
  Tensor backward(MtpActivations& saved, const MtpBatch& batch, double loss_scale, double aux_grad_scale,
                  const MtpForwardOptions& options) const;

 private:
  Tensor project(size_t depth, const Tensor& cat_T2H, LinearActivations& saved) const;
  // d(cat) with the rows of rows_like (this rank's rows).
  // Full recomputation: the depth's norms, projection and layer forward again, into `saved`.
  void recompute_depth(size_t depth, MtpDepthActivations& saved, int64_t S, int64_t B,
                       const LayerDropout& dropout) const;
  Tensor project_backward(size_t depth, const Tensor& dz_TH, const Tensor& rows_like,
                          const LinearActivations& saved) const;

  ModelConfig config_;
  TensorParallel tp_;
  std::vector<NormModule> enorm_, hnorm_, final_norm_;
  std::vector<ColumnParallelLinear> eh_proj_;
  std::vector<TransformerLayer> layers_;
  const VocabParallelEmbedding* word_embeddings_ = nullptr;
  const ColumnParallelLinear* output_layer_ = nullptr;
  const VocabParallelCrossEntropy* cross_entropy_ = nullptr;
};

// The counter-RNG layer number of depth k's transformer layer and of its embedding dropout: after the decoder's L
// layers, two per depth, so no draw repeats a decoder layer's.
int64_t mtp_layer_number(int64_t num_layers, int64_t depth);
int64_t mtp_embedding_number(int64_t num_layers, int64_t depth);

}  // namespace moecore
