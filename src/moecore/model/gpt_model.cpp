#include "moecore/model/gpt_model.h"

#include <cstring>
#include <stdexcept>

#include "moecore/kernels/cpu/dropout.h"
#include "moecore/kernels/cpu/elementwise.h"
#include "moecore/kernels/cpu/embedding.h"
#include "moecore/kernels/cpu/gemm.h"
#include "moecore/kernels/cpu/loss.h"
#include "moecore/model/norm_module.h"
#include "moecore/model/transformer_layer.h"

namespace moecore {

struct GPTModel::Modules {
  std::vector<TransformerLayer> layers;
  NormModule final_norm;
  Param* word_embeddings = nullptr;
  Param* position_embeddings = nullptr;  // learned_absolute only
  Param* output_layer = nullptr;         // == word_embeddings when tied
};

namespace {

constexpr uint64_t kEmbeddingDropoutSite = 0;

uint64_t layer_stream(const uint64_t stream, const int64_t layer) {
  return (stream * 1024 + static_cast<uint64_t>(layer) + 1) * 16;
}

}  // namespace

GPTModel::GPTModel(const ModelConfig& config, const uint64_t seed)
    : config_(config), modules_(std::make_unique<Modules>()) {
  config_.validate();
  const int64_t H = config_.hidden_size;
  params_.push_back(make_param("embedding.word_embeddings.weight", {config_.vocab_size, H}, InitKind::kNormal));
  if (config_.position_embedding_type == PositionEmbedding::kLearnedAbsolute) {
    params_.push_back(
        make_param("embedding.position_embeddings.weight", {config_.max_position_embeddings, H}, InitKind::kNormal));
  }
  for (int64_t i = 0; i < config_.num_layers; ++i)
    modules_->layers.emplace_back(config_, i, params_, dist::ParallelState::single_process());
  params_.push_back(make_param("decoder.final_layernorm.weight", {H}, InitKind::kOnes));
  if (config_.normalization == Normalization::kLayerNorm) {
    params_.push_back(make_param("decoder.final_layernorm.bias", {H}, InitKind::kZeros));
  }
  if (config_.untie_embeddings_and_output_weights) {
    params_.push_back(make_param("output_layer.weight", {config_.vocab_size, H}, InitKind::kNormal));
  }
  // params_ is complete: pointers into it stay valid from here on.
  for (TransformerLayer& layer : modules_->layers) layer.bind(params_);
  modules_->word_embeddings = &param("embedding.word_embeddings.weight");
  if (config_.position_embedding_type == PositionEmbedding::kLearnedAbsolute) {
    modules_->position_embeddings = &param("embedding.position_embeddings.weight");
  }
  modules_->final_norm =
      NormModule(config_.normalization, config_.norm_epsilon, &param("decoder.final_layernorm.weight"),
                 config_.normalization == Normalization::kLayerNorm ? &param("decoder.final_layernorm.bias") : nullptr);
  modules_->output_layer =
      config_.untie_embeddings_and_output_weights ? &param("output_layer.weight") : modules_->word_embeddings;
  for (Param& p : params_) init_param(p, seed, config_.init_method_std, config_.num_layers);
}

GPTModel::~GPTModel() = default;

Param& GPTModel::param(const std::string& name) {
  return const_cast<Param&>(static_cast<const GPTModel&>(*this).param(name));
}

const Param& GPTModel::param(const std::string& name) const {
  for (const Param& p : params_) {
    if (p.name == name) return p;
  }
  throw std::out_of_range("no parameter named " + name);
}

int64_t GPTModel::num_parameters() const {
  int64_t n = 0;
  for (const Param& p : params_) n += p.value.numel();
  return n;
}

void GPTModel::zero_grad() {
  for (Param& p : params_) p.grad.zero_();
}

double GPTModel::forward(std::unique_ptr<MicroBatchContext>& ctx_out, const int32_t* tokens_BS,
                         const int32_t* labels_BS, const float* loss_mask_BS, const int64_t B, const int64_t S,
                         const ForwardOptions& options, Tensor* logits_SBV) {
  if (config_.position_embedding_type == PositionEmbedding::kLearnedAbsolute && S > config_.max_position_embeddings) {
    throw std::invalid_argument("sequence length " + std::to_string(S) + " exceeds --max-position-embeddings");
  }
  namespace k = kernels::cpu;
  auto ctx = std::make_unique<MicroBatchContext>();
  ctx->S = S;
  ctx->B = B;
  ctx->training = options.training;
  ctx->dropout_seed = options.dropout_seed;
  ctx->dropout_stream = options.dropout_stream;
  const int64_t T = S * B, H = config_.hidden_size, V = config_.vocab_size;
  ctx->tokens_SB.resize(static_cast<size_t>(T));
  ctx->labels_SB.resize(static_cast<size_t>(T));
  ctx->loss_weight_SB.resize(static_cast<size_t>(T));
  double mask_sum = 0.0;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t s = 0; s < S; ++s) {
      const auto t = static_cast<size_t>(s * B + b);
      ctx->tokens_SB[t] = tokens_BS[b * S + s];
      ctx->labels_SB[t] = labels_BS ? labels_BS[b * S + s] : 0;
      ctx->loss_weight_SB[t] = loss_mask_BS ? loss_mask_BS[b * S + s] : 1.0f;
      mask_sum += ctx->loss_weight_SB[t];
    }
  }
  for (float& w : ctx->loss_weight_SB) w = mask_sum > 0 ? static_cast<float>(w / mask_sum) : 0.0f;

  // Embedding: word (+ learned position), then dropout.
  Tensor emb_TH(std::vector<int64_t>{T, H}, DType::kF32, MemCategory::kActivations);
  k::embedding_forward(emb_TH.data<float>(), ctx->tokens_SB.data(), modules_->word_embeddings->value.data<float>(), T,
                       V, H);
  if (modules_->position_embeddings) {
    const float* pos_PH = modules_->position_embeddings->value.data<float>();
    float* emb = emb_TH.data<float>();
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      const float* pos = pos_PH + (t / B) * H;
      for (int64_t h = 0; h < H; ++h) emb[t * H + h] += pos[h];
    }
  }
  Tensor x_TH(std::vector<int64_t>{T, H}, DType::kF32, MemCategory::kActivations);
  kernels::DropoutSpec emb_dropout{options.training ? static_cast<float>(config_.hidden_dropout) : 0.0f,
                                   options.dropout_seed,
                                   layer_stream(options.dropout_stream, -1) + kEmbeddingDropoutSite};
  k::dropout_forward(x_TH.data<float>(), emb_TH.data<float>(), T * H, emb_dropout);
  emb_TH = Tensor();

  ctx->layers.resize(modules_->layers.size());
  for (size_t i = 0; i < modules_->layers.size(); ++i) {
    Tensor out_TH(std::vector<int64_t>{T, H}, DType::kF32, MemCategory::kActivations);
    const LayerDropout dropout{options.training, options.dropout_seed,
                               layer_stream(options.dropout_stream, static_cast<int64_t>(i))};
    LayerActivations scratch;
    LayerActivations& saved = options.training ? ctx->layers[i] : scratch;
    modules_->layers[i].forward(out_TH.data<float>(), x_TH, S, B, dropout, saved);
    if (options.training && modules_->layers[i].is_moe()) record_moe_stats(static_cast<int64_t>(i), saved.moe.routing);
    x_TH = std::move(out_TH);
  }
  ctx->final_in_TH = x_TH;
  ctx->final_out_TH = Tensor(std::vector<int64_t>{T, H}, DType::kF32, MemCategory::kActivations);
  ctx->final_stats = modules_->final_norm.forward(ctx->final_out_TH.data<float>(), x_TH.data<float>(), T);

  ctx->logits_TV = Tensor(std::vector<int64_t>{T, V}, DType::kF32, MemCategory::kActivations);
  k::linear_forward(ctx->logits_TV.data<float>(), ctx->final_out_TH.data<float>(),
                    modules_->output_layer->value.data<float>(), static_cast<const float*>(nullptr), T, H, V);
  if (logits_SBV) *logits_SBV = ctx->logits_TV.clone().view({S, B, V});

  double loss = 0.0;
  if (labels_BS) {
    Tensor losses_T(std::vector<int64_t>{T}, DType::kF32, MemCategory::kActivations);
    ctx->lse_T = Tensor(std::vector<int64_t>{T}, DType::kF32, MemCategory::kActivations);
    k::cross_entropy_forward(losses_T.data<float>(), ctx->lse_T.data<float>(), ctx->logits_TV.data<float>(),
                             ctx->labels_SB.data(), T, V);
    const float* losses = losses_T.data<float>();
    for (int64_t t = 0; t < T; ++t)
      loss += static_cast<double>(losses[t]) * ctx->loss_weight_SB[static_cast<size_t>(t)];
  }
  if (options.training) {
    if (!moe_stats_.moe_layers.empty()) ++moe_stats_.num_forwards;
    ctx_out = std::move(ctx);
  }
  return loss;
}

void GPTModel::backward(std::unique_ptr<MicroBatchContext> ctx, const double loss_scale) {
  if (!ctx || !ctx->training || !ctx->lse_T.defined()) {
    throw std::logic_error("backward needs the context of a training forward with labels");
  }
  namespace k = kernels::cpu;
  const int64_t S = ctx->S, B = ctx->B, T = S * B, H = config_.hidden_size, V = config_.vocab_size;

  std::vector<float> dlosses_T(static_cast<size_t>(T));
  for (size_t t = 0; t < dlosses_T.size(); ++t) dlosses_T[t] = static_cast<float>(ctx->loss_weight_SB[t] * loss_scale);
  float* dlogits_TV = ctx->logits_TV.data<float>();
  k::cross_entropy_backward(dlogits_TV, dlosses_T.data(), dlogits_TV, ctx->lse_T.data<float>(), ctx->labels_SB.data(),
                            T, V);
  Tensor dfinal_TH(std::vector<int64_t>{T, H}, DType::kF32, MemCategory::kActivations);
  k::linear_backward(dfinal_TH.data<float>(), modules_->output_layer->grad.data<float>(), static_cast<float*>(nullptr),
                     dlogits_TV, ctx->final_out_TH.data<float>(), modules_->output_layer->value.data<float>(), T, H, V);
  ctx->logits_TV = Tensor();

  Tensor dx_TH(std::vector<int64_t>{T, H}, DType::kF32, MemCategory::kActivations);
  modules_->final_norm.backward(dx_TH.data<float>(), dfinal_TH.data<float>(), ctx->final_in_TH.data<float>(),
                                ctx->final_stats, T);
  dfinal_TH = Tensor();

  for (size_t i = modules_->layers.size(); i-- > 0;) {
    Tensor dprev_TH(std::vector<int64_t>{T, H}, DType::kF32, MemCategory::kActivations);
    const LayerDropout dropout{true, ctx->dropout_seed, layer_stream(ctx->dropout_stream, static_cast<int64_t>(i))};
    modules_->layers[i].backward(dprev_TH.data<float>(), dx_TH.data<float>(), S, B, dropout, loss_scale,
                                 ctx->layers[i]);
    ctx->layers[i] = LayerActivations();
    dx_TH = std::move(dprev_TH);
  }

  Tensor demb_TH(std::vector<int64_t>{T, H}, DType::kF32, MemCategory::kActivations);
  kernels::DropoutSpec emb_dropout{static_cast<float>(config_.hidden_dropout), ctx->dropout_seed,
                                   layer_stream(ctx->dropout_stream, -1) + kEmbeddingDropoutSite};
  k::dropout_backward(demb_TH.data<float>(), dx_TH.data<float>(), T * H, emb_dropout);
  k::embedding_backward(modules_->word_embeddings->grad.data<float>(), demb_TH.data<float>(), ctx->tokens_SB.data(), T,
                        V, H);
  if (modules_->position_embeddings) {
    float* dpos_PH = modules_->position_embeddings->grad.data<float>();
    const float* demb = demb_TH.data<float>();
#pragma omp parallel for schedule(static)
    for (int64_t s = 0; s < S; ++s) {
      for (int64_t b = 0; b < B; ++b) {
        for (int64_t h = 0; h < H; ++h) dpos_PH[s * H + h] += demb[(s * B + b) * H + h];
      }
    }
  }
}

void GPTModel::record_moe_stats(const int64_t layer, const RouterOutput& routing) {
  size_t slot = 0;
  while (slot < moe_stats_.moe_layers.size() && moe_stats_.moe_layers[slot] != layer) ++slot;
  if (slot == moe_stats_.moe_layers.size()) {
    moe_stats_.moe_layers.push_back(layer);
    moe_stats_.load_balancing_losses.emplace_back(routing.load_balancing_losses.size(), 0.0);
    moe_stats_.z_losses.push_back(0.0);
    moe_stats_.tokens_per_expert.emplace_back(routing.tokens_per_expert_E.size(), 0);
  }
  for (size_t j = 0; j < routing.load_balancing_losses.size(); ++j) {
    moe_stats_.load_balancing_losses[slot][j] += routing.load_balancing_losses[j];
  }
  moe_stats_.z_losses[slot] += routing.z_loss;
  for (size_t e = 0; e < routing.tokens_per_expert_E.size(); ++e) {
    moe_stats_.tokens_per_expert[slot][e] += routing.tokens_per_expert_E[e];
  }
}

MoEStats GPTModel::take_moe_stats() {
  MoEStats out = std::move(moe_stats_);
  moe_stats_ = MoEStats();
  return out;
}

void GPTModel::finish_global_batch() {
  for (TransformerLayer& layer : modules_->layers) {
    if (layer.is_moe()) layer.moe()->finish_global_batch();
  }
}

std::vector<float>* GPTModel::expert_bias(const int64_t layer) {
  return const_cast<std::vector<float>*>(static_cast<const GPTModel&>(*this).expert_bias(layer));
}

const std::vector<float>* GPTModel::expert_bias(const int64_t layer) const {
  if (layer < 0 || layer >= static_cast<int64_t>(modules_->layers.size())) return nullptr;
  TransformerLayer& l = modules_->layers[static_cast<size_t>(layer)];
  return l.is_moe() ? &l.moe()->router().expert_bias() : nullptr;
}

Tensor GPTModel::last_logits(const int32_t* tokens_BS, const int64_t B, const int64_t S) {
  std::unique_ptr<MicroBatchContext> unused;
  Tensor logits_SBV;
  ForwardOptions options;
  options.training = false;
  forward(unused, tokens_BS, nullptr, nullptr, B, S, options, &logits_SBV);
  const int64_t V = config_.vocab_size;
  Tensor out_BV(std::vector<int64_t>{B, V}, DType::kF32);
  std::memcpy(out_BV.data<float>(), logits_SBV.data<float>() + (S - 1) * B * V, sizeof(float) * B * V);
  return out_BV;
}

}  // namespace moecore
