// One pre-norm decoder layer: x + dropout(attention(norm1(x))), then + dropout(mlp(norm2(.))).
// Tensor legend: T = S*B tokens (row t = s*B + b), H hidden, N query heads, G query groups, d head dim,
// F ffn hidden, F1 = fc1 width (2F with SwiGLU).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "moecore/dist/parallel_state.h"
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
struct LayerActivations {
  Tensor x_TH;  // layer input
  Tensor ln1_TH;
  NormStats ln1_stats;
  Tensor q_raw_TNd, k_raw_TGd;  // before qk-norm (only with --qk-layernorm)
  NormStats q_norm_stats, k_norm_stats;
  Tensor q_TNd, k_TGd, v_TGd;  // attention inputs (after qk-norm and RoPE)
  Tensor attn_TNd;
  Tensor lse_BNS;
  Tensor x_mid_TH;  // after the attention residual
  Tensor ln2_TH;
  NormStats ln2_stats;
  Tensor fc1_TF1;           // dense MLP only
  Tensor act_TF;            // dense MLP only
  MoELayerActivations moe;  // MoE layers only
};

class TransformerLayer {
 public:
  // Registers this layer's parameters into `params` (names prefixed "decoder.layers.{index}.").
  TransformerLayer(const ModelConfig& config, int64_t index, std::vector<Param>& params,
                   const dist::ParallelState& parallel);
  // Resolves parameter pointers once `params` no longer grows.
  void bind(std::vector<Param>& params);

  // x_TH -> out_TH (may not alias). Fills `saved` when dropout.training (backward will follow).
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

  ModelConfig config_;
  std::string prefix_;
  std::vector<std::string> names_;  // registration order
  Index idx_;
  std::vector<Param*> params_;  // resolved by bind(), indexed like names_
  NormModule ln1_, ln2_, q_norm_, k_norm_;
  std::unique_ptr<MoELayer> moe_;  // replaces the dense MLP on MoE layers
};

}  // namespace moecore
