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
#include "moecore/model/tp_comm.h"

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

// y_RW += bias_W on every row.
void add_bias(float* y, const float* bias, const int64_t rows, const int64_t width) {
  if (bias == nullptr) return;
#pragma omp parallel for schedule(static) if (rows * width > 65536)
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t w = 0; w < width; ++w) y[r * width + w] += bias[w];
  }
}

// dbias_W += column sums of dy_RW (rows summed in order: independent of the thread count).
void add_bias_grad(float* dbias, const float* dy, const int64_t rows, const int64_t width) {
  if (dbias == nullptr) return;
#pragma omp parallel for schedule(static) if (rows * width > 65536)
  for (int64_t w = 0; w < width; ++w) {
    double sum = 0.0;
    for (int64_t r = 0; r < rows; ++r) sum += dy[r * width + w];
    dbias[w] += static_cast<float>(sum);
  }
}

}  // namespace

TransformerLayer::TransformerLayer(const ModelConfig& config, const int64_t index, std::vector<Param>& params,
                                   const parallel::ParallelState& parallel)
    : config_(config),
      tp_(parallel.tp),
      sequence_parallel_(parallel.sequence_parallel && parallel.tp_size() > 1),
      tp_size_(parallel.tp_size()),
      tp_rank_(parallel.tp_rank()),
      prefix_("decoder.layers." + std::to_string(index) + ".") {
  const int64_t H = config.hidden_size, d = config.kv_channels, N = config.num_attention_heads;
  const int64_t G = config.num_query_groups, tp = tp_size_;
  if (N % tp != 0 || G % tp != 0) {
    throw ConfigError("--num-attention-heads (" + std::to_string(N) + ") and --num-query-groups (" + std::to_string(G) +
                      ") must be divisible by --tensor-model-parallel-size (" + std::to_string(tp) + ")");
  }
  heads_ = N / tp;
  groups_ = G / tp;
  const bool moe_layer = config.moe.is_moe_layer(index);
  if (!moe_layer && config.ffn_hidden_size % tp != 0) {
    throw ConfigError("--ffn-hidden-size (" + std::to_string(config.ffn_hidden_size) +
                      ") must be divisible by --tensor-model-parallel-size (" + std::to_string(tp) + ")");
  }
  ffn_ = config.ffn_hidden_size / tp;
  const bool layer_norm = config.normalization == Normalization::kLayerNorm;
  const bool sp = sequence_parallel();
  auto record = [&](Param p, const bool sum_over_tp) {
    p.grad_sum_over_tp = sum_over_tp && tp > 1;
    p.module = static_cast<int>(index);
    names_.push_back(p.name);
    params.push_back(std::move(p));
    return static_cast<int>(names_.size() - 1);
  };
  // Replicated over TP; the gradient is partial over TP when each rank sees only part of the tokens or heads.
  auto add = [&](const std::string& name, std::vector<int64_t> shape, const InitKind init, const bool partial) {
    return record(make_param(prefix_ + name, shape, init), partial);
  };
  // Sharded over TP along `dim` (segments: SwiGLU's [gate; up] halves are split separately).
  auto add_sharded = [&](const std::string& name, std::vector<int64_t> full_shape, const int dim, const int segments,
                         const InitKind init) {
    ParamShard shard{dim, segments, static_cast<int>(tp), static_cast<int>(tp_rank_), std::move(full_shape)};
    return record(make_sharded_param(prefix_ + name, shard, init), false);
  };
  auto add_norm = [&](const std::string& name, const int64_t width, int& w, int& b, const bool partial) {
    w = add(name + ".weight", {width}, InitKind::kOnes, partial);
    if (layer_norm) b = add(name + ".bias", {width}, InitKind::kZeros, partial);
  };
  const bool bias = config.add_bias_linear;
  add_norm("input_layernorm", H, idx_.ln1_w, idx_.ln1_b, sp);
  // The fused qkv rows are grouped per query group, so a TP rank's groups are one contiguous block of rows.
  idx_.qkv_w = add_sharded("self_attention.linear_qkv.weight", {config.qkv_out(), H}, 0, 1, InitKind::kNormal);
  if (bias) idx_.qkv_b = add_sharded("self_attention.linear_qkv.bias", {config.qkv_out()}, 0, 1, InitKind::kZeros);
  if (config.qk_layernorm) {  // shared by all heads; each TP rank sees only its own heads
    add_norm("self_attention.q_layernorm", d, idx_.qn_w, idx_.qn_b, true);
    add_norm("self_attention.k_layernorm", d, idx_.kn_w, idx_.kn_b, true);
  }
  idx_.proj_w = add_sharded("self_attention.linear_proj.weight", {H, N * d}, 1, 1, InitKind::kScaledNormal);
  if (bias) idx_.proj_b = add("self_attention.linear_proj.bias", {H}, InitKind::kZeros, sp);
  add_norm("pre_mlp_layernorm", H, idx_.ln2_w, idx_.ln2_b, sp);
  if (moe_layer) {
    moe_ = std::make_unique<MoELayer>(config, prefix_, params, parallel, static_cast<int>(index));
  } else {
    const int segments = config.activation == Activation::kSwiGLU ? 2 : 1;
    idx_.fc1_w = add_sharded("mlp.linear_fc1.weight", {config.fc1_out(), H}, 0, segments, InitKind::kNormal);
    if (bias) idx_.fc1_b = add_sharded("mlp.linear_fc1.bias", {config.fc1_out()}, 0, segments, InitKind::kZeros);
    idx_.fc2_w = add_sharded("mlp.linear_fc2.weight", {H, config.ffn_hidden_size}, 1, 1, InitKind::kScaledNormal);
    if (bias) idx_.fc2_b = add("mlp.linear_fc2.bias", {H}, InitKind::kZeros, sp);
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

const float* TransformerLayer::gather_input(Tensor& full, const Tensor& x, const int64_t T) const {
  if (!sequence_parallel()) return x.data<float>();
  const int64_t H = config_.hidden_size;
  full = activation_tensor({T, H});
  tp::all_gather_rows(full.data<float>(), x.data<float>(), local_tokens(T), H, tp_);
  return full.data<float>();
}

void TransformerLayer::reduce_output(float* out, Tensor& partial_TH, const float* bias, const int64_t T) const {
  const int64_t H = config_.hidden_size, rows = local_tokens(T);
  if (sequence_parallel()) {
    tp::reduce_scatter_rows(out, partial_TH.data<float>(), rows, H, tp_);
  } else {
    tp::all_reduce(partial_TH.data<float>(), T * H, tp_);
    std::memcpy(out, partial_TH.data<float>(), sizeof(float) * static_cast<size_t>(T * H));
  }
  add_bias(out, bias, rows, H);
}

void TransformerLayer::reduce_input_grad(float* dx, Tensor& dfull_TH, const int64_t T) const {
  const int64_t H = config_.hidden_size, rows = local_tokens(T);
  if (sequence_parallel()) {
    Tensor shard = activation_tensor({rows, H});
    tp::reduce_scatter_rows(shard.data<float>(), dfull_TH.data<float>(), rows, H, tp_);
    kernels::cpu::add_inplace(dx, shard.data<float>(), rows * H);
  } else {
    tp::all_reduce(dfull_TH.data<float>(), T * H, tp_);
    kernels::cpu::add_inplace(dx, dfull_TH.data<float>(), T * H);
  }
}

const float* TransformerLayer::gather_output_grad(Tensor& full, const float* dout, float* dbias,
                                                  const int64_t T) const {
  const int64_t H = config_.hidden_size, rows = local_tokens(T);
  add_bias_grad(dbias, dout, rows, H);
  if (!sequence_parallel()) return dout;
  full = activation_tensor({T, H});
  tp::all_gather_rows(full.data<float>(), dout, rows, H, tp_);
  return full.data<float>();
}

// The MoE layer always works on a sequence shard when TP > 1: without --sequence-parallel this rank takes its
// shard of the replicated input and the outputs are gathered back (Megatron requires sequence parallelism with
// MoE and TP; this keeps the same numbers without it).
void TransformerLayer::moe_forward(float* out, const float* x, const int64_t S, const int64_t B,
                                   const LayerDropout& dropout, MoELayerActivations& saved) const {
  const int64_t T = S * B, H = config_.hidden_size, tp = tp_size_;
  const uint64_t key = dropout.stream * 4 + kMoeRouterJitter;
  if (tp == 1 || sequence_parallel()) {
    moe_->forward(out, x, S / tp, B, token_offset(T), dropout.training, dropout.seed, key, saved);
    return;
  }
  const int64_t rows = T / tp, offset = tp_rank_ * rows;
  Tensor shard = activation_tensor({rows, H});
  moe_->forward(shard.data<float>(), x + offset * H, S / tp, B, offset, dropout.training, dropout.seed, key, saved);
  tp::all_gather_rows(out, shard.data<float>(), rows, H, tp_);
}

void TransformerLayer::moe_backward(float* dx, const float* dout, const float* x, const int64_t S, const int64_t B,
                                    const double aux_grad_scale, const MoELayerActivations& saved) const {
  const int64_t T = S * B, H = config_.hidden_size, tp = tp_size_;
  if (tp == 1 || sequence_parallel()) {
    moe_->backward(dx, dout, x, aux_grad_scale, saved);
    return;
  }
  const int64_t rows = T / tp, offset = tp_rank_ * rows;
  Tensor dshard = activation_tensor({rows, H});
  moe_->backward(dshard.data<float>(), dout + offset * H, x + offset * H, aux_grad_scale, saved);
  Tensor dfull = activation_tensor({T, H});
  tp::all_gather_rows(dfull.data<float>(), dshard.data<float>(), rows, H, tp_);
  kernels::cpu::add_inplace(dx, dfull.data<float>(), T * H);
}

void TransformerLayer::forward(float* out_TH, const Tensor& x_TH, const int64_t S, const int64_t B,
                               const LayerDropout& dropout, LayerActivations& a) const {
  const int64_t T = S * B, H = config_.hidden_size, N = heads_, G = groups_;
  const int64_t d = config_.kv_channels, F = ffn_, F1 = config_.fc1_out() / tp_size_;
  const int64_t Q = (N + 2 * G) * d, rows = local_tokens(T);
  const auto element_offset = static_cast<uint64_t>(token_offset(T) * H);
  namespace k = kernels::cpu;

  a.x_TH = x_TH;
  a.ln1_TH = activation_tensor({rows, H});
  a.ln1_stats = ln1_.forward(a.ln1_TH.data<float>(), x_TH.data<float>(), rows);
  const float* ln1_full = gather_input(a.ln1_full_TH, a.ln1_TH, T);

  Tensor qkv_TQ = activation_tensor({T, Q});
  k::linear_forward(qkv_TQ.data<float>(), ln1_full, value(idx_.qkv_w), value(idx_.qkv_b), T, H, Q);
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

  const kernels::AttentionDims dims = attention_dims(S, B);
  a.attn_TNd = activation_tensor({T, N, d});
  a.lse_BNS = activation_tensor({B, N, S});
  k::attention_forward(a.attn_TNd.data<float>(), a.lse_BNS.data<float>(), a.q_TNd.data<float>(), a.k_TGd.data<float>(),
                       a.v_TGd.data<float>(), dims, dropout_spec(dropout, config_.attention_dropout, kAttentionProbs));

  // x_mid = x + dropout(proj(attn))
  Tensor proj_partial_TH = activation_tensor({T, H});
  k::linear_forward(proj_partial_TH.data<float>(), a.attn_TNd.data<float>(), value(idx_.proj_w),
                    static_cast<const float*>(nullptr), T, N * d, H);
  Tensor proj_TH = activation_tensor({rows, H});
  reduce_output(proj_TH.data<float>(), proj_partial_TH, value(idx_.proj_b), T);
  proj_partial_TH = Tensor();
  a.x_mid_TH = activation_tensor({rows, H});
  kernels::DropoutSpec after_attention = dropout_spec(dropout, config_.hidden_dropout, kAfterAttention);
  after_attention.offset = element_offset;
  k::dropout_forward(a.x_mid_TH.data<float>(), proj_TH.data<float>(), rows * H, after_attention);
  k::add_inplace(a.x_mid_TH.data<float>(), x_TH.data<float>(), rows * H);
  proj_TH = Tensor();

  a.ln2_TH = activation_tensor({rows, H});
  a.ln2_stats = ln2_.forward(a.ln2_TH.data<float>(), a.x_mid_TH.data<float>(), rows);
  Tensor fc2_TH = activation_tensor({rows, H});  // the MLP (or MoE) output
  if (moe_) {
    moe_forward(fc2_TH.data<float>(), a.ln2_TH.data<float>(), S, B, dropout, a.moe);
  } else {
    const float* ln2_full = gather_input(a.ln2_full_TH, a.ln2_TH, T);
    a.fc1_TF1 = activation_tensor({T, F1});
    k::linear_forward(a.fc1_TF1.data<float>(), ln2_full, value(idx_.fc1_w), value(idx_.fc1_b), T, H, F1);
    a.act_TF = activation_tensor({T, F});
    switch (config_.activation) {
      case Activation::kSwiGLU: k::swiglu_forward(a.act_TF.data<float>(), a.fc1_TF1.data<float>(), T, F); break;
      case Activation::kGelu: k::gelu_forward(a.act_TF.data<float>(), a.fc1_TF1.data<float>(), T * F); break;
      case Activation::kSquaredReLU:
        k::squared_relu_forward(a.act_TF.data<float>(), a.fc1_TF1.data<float>(), T * F);
        break;
    }
    Tensor fc2_partial_TH = activation_tensor({T, H});
    k::linear_forward(fc2_partial_TH.data<float>(), a.act_TF.data<float>(), value(idx_.fc2_w),
                      static_cast<const float*>(nullptr), T, F, H);
    reduce_output(fc2_TH.data<float>(), fc2_partial_TH, value(idx_.fc2_b), T);
  }
  kernels::DropoutSpec after_mlp = dropout_spec(dropout, config_.hidden_dropout, kAfterMlp);
  after_mlp.offset = element_offset;
  k::dropout_forward(out_TH, fc2_TH.data<float>(), rows * H, after_mlp);
  k::add_inplace(out_TH, a.x_mid_TH.data<float>(), rows * H);
}

void TransformerLayer::backward(float* dx_TH, const float* dout_TH, const int64_t S, const int64_t B,
                                const LayerDropout& dropout, const double aux_grad_scale,
                                const LayerActivations& a) const {
  const int64_t T = S * B, H = config_.hidden_size, N = heads_, G = groups_;
  const int64_t d = config_.kv_channels, F = ffn_, F1 = config_.fc1_out() / tp_size_;
  const int64_t Q = (N + 2 * G) * d, rows = local_tokens(T);
  const auto element_offset = static_cast<uint64_t>(token_offset(T) * H);
  namespace k = kernels::cpu;

  // MLP branch: out = x_mid + dropout(fc2(act(fc1(ln2(x_mid)))))
  Tensor dx_mid_TH = activation_tensor({rows, H});
  std::memcpy(dx_mid_TH.data<float>(), dout_TH, sizeof(float) * static_cast<size_t>(rows * H));
  Tensor dfc2_TH = activation_tensor({rows, H});
  kernels::DropoutSpec after_mlp = dropout_spec(dropout, config_.hidden_dropout, kAfterMlp);
  after_mlp.offset = element_offset;
  k::dropout_backward(dfc2_TH.data<float>(), dout_TH, rows * H, after_mlp);
  Tensor dln2_TH = activation_tensor({rows, H});
  if (moe_) {
    moe_backward(dln2_TH.data<float>(), dfc2_TH.data<float>(), a.ln2_TH.data<float>(), S, B, aux_grad_scale, a.moe);
  } else {
    Tensor dfc2_full;
    const float* dfc2 = gather_output_grad(dfc2_full, dfc2_TH.data<float>(), grad(idx_.fc2_b), T);
    Tensor dact_TF = activation_tensor({T, F});
    k::linear_backward(dact_TF.data<float>(), grad(idx_.fc2_w), static_cast<float*>(nullptr), dfc2,
                       a.act_TF.data<float>(), value(idx_.fc2_w), T, F, H);
    dfc2_full = Tensor();
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
    const float* ln2_full = sequence_parallel() ? a.ln2_full_TH.data<float>() : a.ln2_TH.data<float>();
    Tensor dln2_full_TH = activation_tensor({T, H});
    k::linear_backward(dln2_full_TH.data<float>(), grad(idx_.fc1_w), grad(idx_.fc1_b), dfc1_TF1.data<float>(), ln2_full,
                       value(idx_.fc1_w), T, H, F1);
    dfc1_TF1 = Tensor();
    reduce_input_grad(dln2_TH.data<float>(), dln2_full_TH, T);
  }
  dfc2_TH = Tensor();
  ln2_.backward(dx_mid_TH.data<float>(), dln2_TH.data<float>(), a.x_mid_TH.data<float>(), a.ln2_stats, rows);
  dln2_TH = Tensor();

  // Attention branch: x_mid = x + dropout(proj(attn(qkv(ln1(x)))))
  k::add_inplace(dx_TH, dx_mid_TH.data<float>(), rows * H);
  Tensor dproj_TH = activation_tensor({rows, H});
  kernels::DropoutSpec after_attention = dropout_spec(dropout, config_.hidden_dropout, kAfterAttention);
  after_attention.offset = element_offset;
  k::dropout_backward(dproj_TH.data<float>(), dx_mid_TH.data<float>(), rows * H, after_attention);
  dx_mid_TH = Tensor();
  Tensor dproj_full;
  const float* dproj = gather_output_grad(dproj_full, dproj_TH.data<float>(), grad(idx_.proj_b), T);
  Tensor dattn_TNd = activation_tensor({T, N, d});
  k::linear_backward(dattn_TNd.data<float>(), grad(idx_.proj_w), static_cast<float*>(nullptr), dproj,
                     a.attn_TNd.data<float>(), value(idx_.proj_w), T, N * d, H);
  dproj_TH = dproj_full = Tensor();

  Tensor dq_TNd = activation_tensor({T, N, d});
  Tensor dk_TGd = activation_tensor({T, G, d});
  Tensor dv_TGd = activation_tensor({T, G, d});
  const kernels::AttentionDims dims = attention_dims(S, B);
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
  Tensor dqkv_TQ = activation_tensor({T, Q});
  merge_qkv(dqkv_TQ.data<float>(), dq_TNd.data<float>(), dk_TGd.data<float>(), dv_TGd.data<float>(), T, N, G, d);
  dq_TNd = dk_TGd = dv_TGd = Tensor();
  const float* ln1_full = sequence_parallel() ? a.ln1_full_TH.data<float>() : a.ln1_TH.data<float>();
  Tensor dln1_full_TH = activation_tensor({T, H});
  k::linear_backward(dln1_full_TH.data<float>(), grad(idx_.qkv_w), grad(idx_.qkv_b), dqkv_TQ.data<float>(), ln1_full,
                     value(idx_.qkv_w), T, H, Q);
  dqkv_TQ = Tensor();
  Tensor dln1_TH = activation_tensor({rows, H});
  reduce_input_grad(dln1_TH.data<float>(), dln1_full_TH, T);
  dln1_full_TH = Tensor();
  ln1_.backward(dx_TH, dln1_TH.data<float>(), a.x_TH.data<float>(), a.ln1_stats, rows);
}

kernels::AttentionDims TransformerLayer::attention_dims(const int64_t S, const int64_t B) const {
  kernels::AttentionDims dims{
      S, B, heads_, groups_, config_.kv_channels, 1.0 / std::sqrt(static_cast<double>(config_.kv_channels))};
  dims.dropout_total_heads = config_.num_attention_heads;
  dims.dropout_head_offset = tp_rank_ * heads_;
  return dims;
}

}  // namespace moecore
