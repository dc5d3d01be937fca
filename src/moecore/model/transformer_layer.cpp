#include "moecore/model/transformer_layer.h"

#include <cmath>
#include <cstring>
#include <stdexcept>

#include "moecore/kernels/cpu/activation.h"
#include "moecore/kernels/cpu/attention.h"
#include "moecore/kernels/cpu/dropout.h"
#include "moecore/kernels/cpu/elementwise.h"
#include "moecore/kernels/cpu/gemm.h"
#include "moecore/kernels/cpu/rope.h"

namespace moecore {
namespace {

// Sub-streams of a layer's RNG stream: 0 for the MoE router's input jitter, 1-3 for the dropout sites.
enum DropoutSite : uint64_t { kMoeRouterJitter = 0, kAttentionProbs = 1, kAfterAttention = 2, kAfterMlp = 3 };

kernels::DropoutSpec dropout_spec(const LayerDropout& dropout, const double p, const DropoutSite site) {
  kernels::DropoutSpec spec;
  spec.p = dropout.training ? static_cast<float>(p) : 0.0f;
  spec.seed = dropout.seed;
  spec.key = dropout.stream * 4 + site;
  return spec;
}

Tensor activation_tensor(std::vector<int64_t> shape) {
  return Tensor(std::move(shape), DType::kF32, MemCategory::kActivations);
}

// Megatron's fused qkv row, per query group g: [N/G query heads | k | v], each d wide.
void split_qkv(float* q_TNd, float* k_TGd, float* v_TGd, const float* qkv_TQ, const int64_t T, const int64_t N,
               const int64_t G, const int64_t d) {
  const int64_t heads_per_group = N / G;
  const int64_t row = (N + 2 * G) * d;
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    const float* src = qkv_TQ + t * row;
    for (int64_t g = 0; g < G; ++g) {
      const float* group = src + g * (heads_per_group + 2) * d;
      std::memcpy(q_TNd + (t * N + g * heads_per_group) * d, group, sizeof(float) * heads_per_group * d);
      std::memcpy(k_TGd + (t * G + g) * d, group + heads_per_group * d, sizeof(float) * d);
      std::memcpy(v_TGd + (t * G + g) * d, group + (heads_per_group + 1) * d, sizeof(float) * d);
    }
  }
}

void merge_qkv(float* qkv_TQ, const float* q_TNd, const float* k_TGd, const float* v_TGd, const int64_t T,
               const int64_t N, const int64_t G, const int64_t d) {
  const int64_t heads_per_group = N / G;
  const int64_t row = (N + 2 * G) * d;
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    float* dst = qkv_TQ + t * row;
    for (int64_t g = 0; g < G; ++g) {
      float* group = dst + g * (heads_per_group + 2) * d;
      std::memcpy(group, q_TNd + (t * N + g * heads_per_group) * d, sizeof(float) * heads_per_group * d);
      std::memcpy(group + heads_per_group * d, k_TGd + (t * G + g) * d, sizeof(float) * d);
      std::memcpy(group + (heads_per_group + 1) * d, v_TGd + (t * G + g) * d, sizeof(float) * d);
    }
  }
}

}  // namespace

TransformerLayer::TransformerLayer(const ModelConfig& config, const int64_t index, std::vector<Param>& params,
                                   const dist::ParallelState& parallel)
    : config_(config), prefix_("decoder.layers." + std::to_string(index) + ".") {
  const int64_t H = config.hidden_size, d = config.kv_channels;
  const bool layer_norm = config.normalization == Normalization::kLayerNorm;
  auto add = [&](const std::string& name, std::vector<int64_t> shape, const InitKind init) {
    params.push_back(make_param(prefix_ + name, shape, init));
    names_.push_back(prefix_ + name);
    return static_cast<int>(names_.size() - 1);
  };
  auto add_norm = [&](const std::string& name, const int64_t width, int& w, int& b) {
    w = add(name + ".weight", {width}, InitKind::kOnes);
    if (layer_norm) b = add(name + ".bias", {width}, InitKind::kZeros);
  };
  const bool bias = config.add_bias_linear;
  add_norm("input_layernorm", H, idx_.ln1_w, idx_.ln1_b);
  idx_.qkv_w = add("self_attention.linear_qkv.weight", {config.qkv_out(), H}, InitKind::kNormal);
  if (bias) idx_.qkv_b = add("self_attention.linear_qkv.bias", {config.qkv_out()}, InitKind::kZeros);
  if (config.qk_layernorm) {
    add_norm("self_attention.q_layernorm", d, idx_.qn_w, idx_.qn_b);
    add_norm("self_attention.k_layernorm", d, idx_.kn_w, idx_.kn_b);
  }
  idx_.proj_w = add("self_attention.linear_proj.weight", {H, config.num_attention_heads * d}, InitKind::kScaledNormal);
  if (bias) idx_.proj_b = add("self_attention.linear_proj.bias", {H}, InitKind::kZeros);
  add_norm("pre_mlp_layernorm", H, idx_.ln2_w, idx_.ln2_b);
  if (config.moe.is_moe_layer(index)) {
    moe_ = std::make_unique<MoELayer>(config, prefix_, params, parallel, static_cast<int>(index));
  } else {
    idx_.fc1_w = add("mlp.linear_fc1.weight", {config.fc1_out(), H}, InitKind::kNormal);
    if (bias) idx_.fc1_b = add("mlp.linear_fc1.bias", {config.fc1_out()}, InitKind::kZeros);
    idx_.fc2_w = add("mlp.linear_fc2.weight", {H, config.ffn_hidden_size}, InitKind::kScaledNormal);
    if (bias) idx_.fc2_b = add("mlp.linear_fc2.bias", {H}, InitKind::kZeros);
  }
}

void TransformerLayer::bind(std::vector<Param>& params) {
  params_ = find_params(params, names_);
  auto ptr = [&](const int i) { return i < 0 ? nullptr : params_[static_cast<size_t>(i)]; };
  const double eps = config_.norm_epsilon;
  ln1_ = NormModule(config_.normalization, eps, ptr(idx_.ln1_w), ptr(idx_.ln1_b));
  ln2_ = NormModule(config_.normalization, eps, ptr(idx_.ln2_w), ptr(idx_.ln2_b));
  if (config_.qk_layernorm) {
    q_norm_ = NormModule(config_.normalization, eps, ptr(idx_.qn_w), ptr(idx_.qn_b));
    k_norm_ = NormModule(config_.normalization, eps, ptr(idx_.kn_w), ptr(idx_.kn_b));
  }
  if (moe_) moe_->bind(params);
}

void TransformerLayer::forward(float* out_TH, const Tensor& x_TH, const int64_t S, const int64_t B,
                               const LayerDropout& dropout, LayerActivations& a) const {
  const int64_t T = S * B, H = config_.hidden_size, N = config_.num_attention_heads, G = config_.num_query_groups;
  const int64_t d = config_.kv_channels, F = config_.ffn_hidden_size, F1 = config_.fc1_out();
  namespace k = kernels::cpu;

  a.x_TH = x_TH;
  a.ln1_TH = activation_tensor({T, H});
  a.ln1_stats = ln1_.forward(a.ln1_TH.data<float>(), x_TH.data<float>(), T);

  Tensor qkv_TQ = activation_tensor({T, config_.qkv_out()});
  k::linear_forward(qkv_TQ.data<float>(), a.ln1_TH.data<float>(), value(idx_.qkv_w), value(idx_.qkv_b), T, H,
                    config_.qkv_out());
  a.q_TNd = activation_tensor({T, N, d});
  a.k_TGd = activation_tensor({T, G, d});
  a.v_TGd = activation_tensor({T, G, d});
  split_qkv(a.q_TNd.data<float>(), a.k_TGd.data<float>(), a.v_TGd.data<float>(), qkv_TQ.data<float>(), T, N, G, d);
  qkv_TQ = Tensor();

  if (config_.qk_layernorm) {
    a.q_raw_TNd = a.q_TNd;
    a.k_raw_TGd = a.k_TGd;
    a.q_TNd = activation_tensor({T, N, d});
    a.k_TGd = activation_tensor({T, G, d});
    a.q_norm_stats = q_norm_.forward(a.q_TNd.data<float>(), a.q_raw_TNd.data<float>(), T * N);
    a.k_norm_stats = k_norm_.forward(a.k_TGd.data<float>(), a.k_raw_TGd.data<float>(), T * G);
  }
  if (config_.position_embedding_type == PositionEmbedding::kRope) {
    const int64_t rot = config_.rotary_dim();
    Tensor q_rot = activation_tensor({T, N, d});
    Tensor k_rot = activation_tensor({T, G, d});
    k::rope_forward(q_rot.data<float>(), a.q_TNd.data<float>(), S, B, N, d, rot, config_.rotary_base);
    k::rope_forward(k_rot.data<float>(), a.k_TGd.data<float>(), S, B, G, d, rot, config_.rotary_base);
    a.q_TNd = std::move(q_rot);
    a.k_TGd = std::move(k_rot);
  }

  kernels::AttentionDims dims{S, B, N, G, d, 1.0 / std::sqrt(static_cast<double>(d))};
  a.attn_TNd = activation_tensor({T, N, d});
  a.lse_BNS = activation_tensor({B, N, S});
  k::attention_forward(a.attn_TNd.data<float>(), a.lse_BNS.data<float>(), a.q_TNd.data<float>(), a.k_TGd.data<float>(),
                       a.v_TGd.data<float>(), dims, dropout_spec(dropout, config_.attention_dropout, kAttentionProbs));

  // x_mid = x + dropout(proj(attn))
  Tensor proj_TH = activation_tensor({T, H});
  k::linear_forward(proj_TH.data<float>(), a.attn_TNd.data<float>(), value(idx_.proj_w), value(idx_.proj_b), T, N * d,
                    H);
  a.x_mid_TH = activation_tensor({T, H});
  k::dropout_forward(a.x_mid_TH.data<float>(), proj_TH.data<float>(), T * H,
                     dropout_spec(dropout, config_.hidden_dropout, kAfterAttention));
  k::add_inplace(a.x_mid_TH.data<float>(), x_TH.data<float>(), T * H);
  proj_TH = Tensor();

  a.ln2_TH = activation_tensor({T, H});
  a.ln2_stats = ln2_.forward(a.ln2_TH.data<float>(), a.x_mid_TH.data<float>(), T);
  Tensor fc2_TH = activation_tensor({T, H});  // the MLP (or MoE) output
  if (moe_) {
    moe_->forward(fc2_TH.data<float>(), a.ln2_TH.data<float>(), S, B, 0, dropout.training, dropout.seed,
                  dropout.stream * 4 + kMoeRouterJitter, a.moe);
  } else {
    a.fc1_TF1 = activation_tensor({T, F1});
    k::linear_forward(a.fc1_TF1.data<float>(), a.ln2_TH.data<float>(), value(idx_.fc1_w), value(idx_.fc1_b), T, H, F1);
    a.act_TF = activation_tensor({T, F});
    switch (config_.activation) {
      case Activation::kSwiGLU: k::swiglu_forward(a.act_TF.data<float>(), a.fc1_TF1.data<float>(), T, F); break;
      case Activation::kGelu: k::gelu_forward(a.act_TF.data<float>(), a.fc1_TF1.data<float>(), T * F); break;
      case Activation::kSquaredReLU:
        k::squared_relu_forward(a.act_TF.data<float>(), a.fc1_TF1.data<float>(), T * F);
        break;
    }
    k::linear_forward(fc2_TH.data<float>(), a.act_TF.data<float>(), value(idx_.fc2_w), value(idx_.fc2_b), T, F, H);
  }
  k::dropout_forward(out_TH, fc2_TH.data<float>(), T * H, dropout_spec(dropout, config_.hidden_dropout, kAfterMlp));
  k::add_inplace(out_TH, a.x_mid_TH.data<float>(), T * H);
}

void TransformerLayer::backward(float* dx_TH, const float* dout_TH, const int64_t S, const int64_t B,
                                const LayerDropout& dropout, const double aux_grad_scale,
                                const LayerActivations& a) const {
  const int64_t T = S * B, H = config_.hidden_size, N = config_.num_attention_heads, G = config_.num_query_groups;
  const int64_t d = config_.kv_channels, F = config_.ffn_hidden_size, F1 = config_.fc1_out();
  namespace k = kernels::cpu;

  // MLP branch: out = x_mid + dropout(fc2(act(fc1(ln2(x_mid)))))
  Tensor dx_mid_TH = activation_tensor({T, H});
  std::memcpy(dx_mid_TH.data<float>(), dout_TH, sizeof(float) * T * H);
  Tensor dfc2_TH = activation_tensor({T, H});
  k::dropout_backward(dfc2_TH.data<float>(), dout_TH, T * H, dropout_spec(dropout, config_.hidden_dropout, kAfterMlp));
  Tensor dln2_TH = activation_tensor({T, H});
  if (moe_) {
    moe_->backward(dln2_TH.data<float>(), dfc2_TH.data<float>(), a.ln2_TH.data<float>(), aux_grad_scale, a.moe);
  } else {
    Tensor dact_TF = activation_tensor({T, F});
    k::linear_backward(dact_TF.data<float>(), grad(idx_.fc2_w), grad(idx_.fc2_b), dfc2_TH.data<float>(),
                       a.act_TF.data<float>(), value(idx_.fc2_w), T, F, H);
    Tensor dfc1_TF1 = activation_tensor({T, F1});
    switch (config_.activation) {
      case Activation::kSwiGLU:
        k::swiglu_backward(dfc1_TF1.data<float>(), dact_TF.data<float>(), a.fc1_TF1.data<float>(), T, F);
        break;
      case Activation::kGelu:
        k::gelu_backward(dfc1_TF1.data<float>(), dact_TF.data<float>(), a.fc1_TF1.data<float>(), T * F);
        break;
      case Activation::kSquaredReLU:
        k::squared_relu_backward(dfc1_TF1.data<float>(), dact_TF.data<float>(), a.fc1_TF1.data<float>(), T * F);
        break;
    }
    dact_TF = Tensor();
    k::linear_backward(dln2_TH.data<float>(), grad(idx_.fc1_w), grad(idx_.fc1_b), dfc1_TF1.data<float>(),
                       a.ln2_TH.data<float>(), value(idx_.fc1_w), T, H, F1);
  }
  dfc2_TH = Tensor();
  ln2_.backward(dx_mid_TH.data<float>(), dln2_TH.data<float>(), a.x_mid_TH.data<float>(), a.ln2_stats, T);
  dln2_TH = Tensor();

  // Attention branch: x_mid = x + dropout(proj(attn(qkv(ln1(x)))))
  k::add_inplace(dx_TH, dx_mid_TH.data<float>(), T * H);
  Tensor dproj_TH = activation_tensor({T, H});
  k::dropout_backward(dproj_TH.data<float>(), dx_mid_TH.data<float>(), T * H,
                      dropout_spec(dropout, config_.hidden_dropout, kAfterAttention));
  dx_mid_TH = Tensor();
  Tensor dattn_TNd = activation_tensor({T, N, d});
  k::linear_backward(dattn_TNd.data<float>(), grad(idx_.proj_w), grad(idx_.proj_b), dproj_TH.data<float>(),
                     a.attn_TNd.data<float>(), value(idx_.proj_w), T, N * d, H);
  dproj_TH = Tensor();

  Tensor dq_TNd = activation_tensor({T, N, d});
  Tensor dk_TGd = activation_tensor({T, G, d});
  Tensor dv_TGd = activation_tensor({T, G, d});
  kernels::AttentionDims dims{S, B, N, G, d, 1.0 / std::sqrt(static_cast<double>(d))};
  k::attention_backward(dq_TNd.data<float>(), dk_TGd.data<float>(), dv_TGd.data<float>(), dattn_TNd.data<float>(),
                        a.q_TNd.data<float>(), a.k_TGd.data<float>(), a.v_TGd.data<float>(), a.attn_TNd.data<float>(),
                        a.lse_BNS.data<float>(), dims,
                        dropout_spec(dropout, config_.attention_dropout, kAttentionProbs));
  dattn_TNd = Tensor();

  if (config_.position_embedding_type == PositionEmbedding::kRope) {
    const int64_t rot = config_.rotary_dim();
    Tensor dq_pre = activation_tensor({T, N, d});
    Tensor dk_pre = activation_tensor({T, G, d});
    k::rope_backward(dq_pre.data<float>(), dq_TNd.data<float>(), S, B, N, d, rot, config_.rotary_base);
    k::rope_backward(dk_pre.data<float>(), dk_TGd.data<float>(), S, B, G, d, rot, config_.rotary_base);
    dq_TNd = std::move(dq_pre);
    dk_TGd = std::move(dk_pre);
  }
  if (config_.qk_layernorm) {
    Tensor dq_raw = activation_tensor({T, N, d});
    Tensor dk_raw = activation_tensor({T, G, d});
    q_norm_.backward(dq_raw.data<float>(), dq_TNd.data<float>(), a.q_raw_TNd.data<float>(), a.q_norm_stats, T * N);
    k_norm_.backward(dk_raw.data<float>(), dk_TGd.data<float>(), a.k_raw_TGd.data<float>(), a.k_norm_stats, T * G);
    dq_TNd = std::move(dq_raw);
    dk_TGd = std::move(dk_raw);
  }
  Tensor dqkv_TQ = activation_tensor({T, config_.qkv_out()});
  merge_qkv(dqkv_TQ.data<float>(), dq_TNd.data<float>(), dk_TGd.data<float>(), dv_TGd.data<float>(), T, N, G, d);
  dq_TNd = dk_TGd = dv_TGd = Tensor();
  Tensor dln1_TH = activation_tensor({T, H});
  k::linear_backward(dln1_TH.data<float>(), grad(idx_.qkv_w), grad(idx_.qkv_b), dqkv_TQ.data<float>(),
                     a.ln1_TH.data<float>(), value(idx_.qkv_w), T, H, config_.qkv_out());
  dqkv_TQ = Tensor();
  ln1_.backward(dx_TH, dln1_TH.data<float>(), a.x_TH.data<float>(), a.ln1_stats, T);
}

}  // namespace moecore
