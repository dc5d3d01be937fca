// One pre-norm decoder layer: x + dropout(attention(norm1(x))), then + dropout(mlp(norm2(.))).
// Tensor legend: T = S*B tokens (row t = s*B + b), H hidden, N query heads, G query groups, d head dim,
// F ffn hidden, F1 = fc1 width (2F with SwiGLU).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "moecore/parallel/parallel_state.h"
#include "moecore/kernels/cpu/attention.h"
#include "moecore/model/config.h"
#include "moecore/model/norm_module.h"
#include "moecore/model/param.h"
#include "moecore/moe/moe_layer.h"
#include "moecore/tensor/tensor.h"

namespace moecore {

struct LayerDropout {
  bool training = false;
  uint64_t seed = 0;
  uint64_t stream = 0;  // unique per (iteration, micro-batch, layer)
};

// What one layer's backward needs from its forward.
// Under tensor parallelism with --sequence-parallel, the tensors marked (local) hold this rank's sequence shard
// (T/TP rows); the others hold all T tokens of the micro-batch with this rank's heads / ffn columns.
struct LayerActivations {
  Tensor x_TH;         // layer input (local)
  Tensor ln1_TH;       // (local)
  Tensor ln1_full_TH;  // ln1 gathered over TP (sequence parallel only): the qkv input
  NormStats ln1_stats;
  Tensor q_raw_TNd, k_raw_TGd;  // before qk-norm (only with --qk-layernorm)
  NormStats q_norm_stats, k_norm_stats;
  Tensor q_TNd, k_TGd, v_TGd;  // attention inputs (after qk-norm and RoPE)
  Tensor attn_TNd;
  Tensor lse_BNS;
  Tensor x_mid_TH;     // after the attention residual (local)
  Tensor ln2_TH;       // (local)
  Tensor ln2_full_TH;  // ln2 gathered over TP (sequence parallel, dense MLP only): the fc1 input
  NormStats ln2_stats;
  Tensor fc1_TF1;           // dense MLP only
  Tensor act_TF;            // dense MLP only
  MoELayerActivations moe;  // MoE layers only
};

class TransformerLayer {
 public:
  // Registers this layer's parameters into `params` (names prefixed "decoder.layers.{index}.").
  TransformerLayer(const ModelConfig& config, int64_t index, std::vector<Param>& params,
                   const parallel::ParallelState& parallel);
  // Resolves parameter pointers once `params` no longer grows.
  void bind(std::vector<Param>& params);

  // x_TH -> out_TH (may not alias). S, B: the micro-batch; under --sequence-parallel x_TH and out_TH hold this
  // TP rank's sequence shard (positions [r S/TP, (r+1) S/TP)), else all S*B tokens. Collective over TP (and the
  // expert grid on MoE layers). Fills `saved` when dropout.training (backward will follow).
  void forward(float* out_TH, const Tensor& x_TH, int64_t S, int64_t B, const LayerDropout& dropout,
               LayerActivations& saved) const;
  // dx_TH += d(out)/d(x)^T dout_TH; parameter gradients accumulate. aux_grad_scale: the factor MoE
  // auxiliary losses carry into the gradient (the micro-batch's loss scale).
  void backward(float* dx_TH, const float* dout_TH, int64_t S, int64_t B, const LayerDropout& dropout,
                double aux_grad_scale, const LayerActivations& saved) const;

  bool is_moe() const { return moe_ != nullptr; }
  MoELayer* moe() { return moe_.get(); }

 private:
  struct Index {
    int ln1_w = -1, ln1_b = -1, qkv_w = -1, qkv_b = -1, qn_w = -1, qn_b = -1, kn_w = -1, kn_b = -1;
    int proj_w = -1, proj_b = -1, ln2_w = -1, ln2_b = -1, fc1_w = -1, fc1_b = -1, fc2_w = -1, fc2_b = -1;
  };
  const float* value(int i) const { return i < 0 ? nullptr : params_[static_cast<size_t>(i)]->value.data<float>(); }
  float* grad(int i) const { return i < 0 ? nullptr : params_[static_cast<size_t>(i)]->grad.data<float>(); }

  // Rows of this rank's activations and the one-process index of the first one (dropout / jitter counters).
  int64_t local_tokens(int64_t T) const { return sequence_parallel() ? T / tp_size_ : T; }
  int64_t token_offset(int64_t T) const { return sequence_parallel() ? tp_rank_ * (T / tp_size_) : 0; }
  bool sequence_parallel() const { return sequence_parallel_; }
  // Column-parallel input: the local rows gathered over TP under sequence parallelism (into `full`), else x.
  const float* gather_input(Tensor& full, const Tensor& x, int64_t T) const;
  // Row-parallel output partial_TH [T, H] summed over TP into out (local rows), plus the bias.
  void reduce_output(float* out, Tensor& partial_TH, const float* bias, int64_t T) const;
  // Backward of a column-parallel input: dfull_TH [T, H] partial over TP, summed into dx (local rows, +=).
  void reduce_input_grad(float* dx, Tensor& dfull_TH, int64_t T) const;
  // Backward of a row-parallel output: the local dout rows gathered over TP (into `full`), else dout itself;
  // the bias gradient is taken from the local rows.
  const float* gather_output_grad(Tensor& full, const float* dout, float* dbias, int64_t T) const;
  kernels::AttentionDims attention_dims(int64_t S, int64_t B) const;
  void moe_forward(float* out, const float* x, int64_t S, int64_t B, const LayerDropout& dropout,
                   MoELayerActivations& saved) const;
  void moe_backward(float* dx, const float* dout, const float* x, int64_t S, int64_t B, double aux_grad_scale,
                    const MoELayerActivations& saved) const;

  ModelConfig config_;
  parallel::ProcessGroup tp_;  // the attention TP group
  bool sequence_parallel_ = false;
  int64_t tp_size_ = 1, tp_rank_ = 0;
  int64_t heads_ = 0, groups_ = 0, ffn_ = 0;  // this rank's query heads, query groups and dense ffn columns
  std::string prefix_;
  std::vector<std::string> names_;  // registration order
  Index idx_;
  std::vector<Param*> params_;  // resolved by bind(), indexed like names_
  NormModule ln1_, ln2_, q_norm_, k_norm_;
  std::unique_ptr<MoELayer> moe_;  // replaces the dense MLP on MoE layers
};

}  // namespace moecore
