#include "moecore/model/gpt_model.h"

#include <cstring>
#include <stdexcept>

#include "moecore/kernels/cpu/dropout.h"
#include "moecore/kernels/cpu/elementwise.h"
#include "moecore/kernels/cpu/embedding.h"
#include "moecore/kernels/cpu/gemm.h"
#include "moecore/kernels/cpu/loss.h"
#include "moecore/model/norm_module.h"
#include "moecore/model/tp_comm.h"
#include "moecore/model/transformer_layer.h"
#include "moecore/model/vocab_parallel.h"

namespace moecore {

struct GPTModel::Modules {
  std::vector<TransformerLayer> layers;
  int64_t vocab_begin = 0, vocab_local = 0;  // this TP rank's vocabulary rows
  int64_t tp = 1, tp_rank = 0;
  bool sequence_parallel = false;
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

GPTModel::GPTModel(const ModelConfig& config, const uint64_t seed, const parallel::ParallelState& parallel)
    : config_(config), parallel_(parallel), modules_(std::make_unique<Modules>()) {
  config_.validate();
  const int64_t H = config_.hidden_size, V = config_.vocab_size, L = config_.num_layers;
  Modules& m = *modules_;
  m.tp = parallel_.tp_size();
  m.tp_rank = parallel_.tp_rank();
  m.sequence_parallel = parallel_.sequence_parallel && m.tp > 1;
  if (V % m.tp != 0) {
    throw ConfigError("the padded vocabulary (" + std::to_string(V) +
                      ") must be divisible by --tensor-model-parallel-size (" + std::to_string(m.tp) + ")");
  }
  if (m.tp > 1 && (m.sequence_parallel || config_.moe.enabled()) && config_.seq_length % m.tp != 0) {
    throw ConfigError("--seq-length (" + std::to_string(config_.seq_length) +
                      ") must be divisible by --tensor-model-parallel-size (" + std::to_string(m.tp) +
                      ") with --sequence-parallel or MoE layers");
  }
  m.vocab_local = V / m.tp;
  m.vocab_begin = m.tp_rank * m.vocab_local;
  const ParamShard vocab_shard{0, 1, static_cast<int>(m.tp), static_cast<int>(m.tp_rank), {V, H}};
  params_.push_back(make_sharded_param("embedding.word_embeddings.weight", vocab_shard, InitKind::kNormal));
  if (config_.position_embedding_type == PositionEmbedding::kLearnedAbsolute) {
    params_.push_back(
        make_param("embedding.position_embeddings.weight", {config_.max_position_embeddings, H}, InitKind::kNormal));
    params_.back().grad_sum_over_tp = m.sequence_parallel;  // added on the local sequence shard
  }
  for (int64_t i = 0; i < L; ++i) m.layers.emplace_back(config_, i, params_, parallel_);
  params_.push_back(make_param("decoder.final_layernorm.weight", {H}, InitKind::kOnes));
  params_.back().grad_sum_over_tp = m.sequence_parallel;
  params_.back().module = static_cast<int>(L);
  if (config_.normalization == Normalization::kLayerNorm) {
    params_.push_back(make_param("decoder.final_layernorm.bias", {H}, InitKind::kZeros));
    params_.back().grad_sum_over_tp = m.sequence_parallel;
    params_.back().module = static_cast<int>(L);
  }
  if (config_.untie_embeddings_and_output_weights) {
    params_.push_back(make_sharded_param("output_layer.weight", vocab_shard, InitKind::kNormal));
    params_.back().module = static_cast<int>(L);
  }
  // params_ is complete: pointers into it stay valid from here on.
  for (TransformerLayer& layer : m.layers) layer.bind(params_);
  m.word_embeddings = &param("embedding.word_embeddings.weight");
  if (config_.position_embedding_type == PositionEmbedding::kLearnedAbsolute) {
    m.position_embeddings = &param("embedding.position_embeddings.weight");
  }
  m.final_norm =
      NormModule(config_.normalization, config_.norm_epsilon, &param("decoder.final_layernorm.weight"),
                 config_.normalization == Normalization::kLayerNorm ? &param("decoder.final_layernorm.bias") : nullptr);
  m.output_layer = config_.untie_embeddings_and_output_weights ? &param("output_layer.weight") : m.word_embeddings;
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
  Modules& m = *modules_;
  auto ctx = std::make_unique<MicroBatchContext>();
  ctx->S = S;
  ctx->B = B;
  ctx->training = options.training;
  ctx->dropout_seed = options.dropout_seed;
  ctx->dropout_stream = options.dropout_stream;
  const int64_t T = S * B, H = config_.hidden_size, V = config_.vocab_size, Vl = m.vocab_local;
  if (m.tp > 1 && (m.sequence_parallel || config_.moe.enabled()) && S % m.tp != 0) {
    throw std::invalid_argument("sequence length " + std::to_string(S) + " is not divisible by the TP size");
  }
  // Rows of this rank's activations: its sequence shard under sequence parallelism, else every token.
  const int64_t rows = m.sequence_parallel ? T / m.tp : T;
  const int64_t row_offset = m.sequence_parallel ? m.tp_rank * rows : 0;
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

  // Embedding: word (vocabulary-parallel: summed over TP, or reduce-scattered to the sequence shard), then
  // position, then dropout.
  if (hooks_) hooks_->before_forward(-1);
  Tensor emb_TH(std::vector<int64_t>{rows, H}, DType::kF32, MemCategory::kActivations);
  if (m.tp == 1) {
    k::embedding_forward(emb_TH.data<float>(), ctx->tokens_SB.data(), m.word_embeddings->value.data<float>(), T, V, H);
  } else {
    Tensor partial_TH(std::vector<int64_t>{T, H}, DType::kF32, MemCategory::kActivations);
    tp::vocab_embedding_forward(partial_TH.data<float>(), ctx->tokens_SB.data(), m.word_embeddings->value.data<float>(),
                                T, V, m.vocab_begin, Vl, H);
    if (m.sequence_parallel) {
      tp::reduce_scatter_rows(emb_TH.data<float>(), partial_TH.data<float>(), rows, H, parallel_.tp);
    } else {
      tp::all_reduce(partial_TH.data<float>(), T * H, parallel_.tp);
      emb_TH = std::move(partial_TH);
    }
  }
  if (m.position_embeddings) {
    const float* pos_PH = m.position_embeddings->value.data<float>();
    float* emb = emb_TH.data<float>();
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < rows; ++t) {
      const float* pos = pos_PH + ((row_offset + t) / B) * H;
      for (int64_t h = 0; h < H; ++h) emb[t * H + h] += pos[h];
    }
  }
  Tensor x_TH(std::vector<int64_t>{rows, H}, DType::kF32, MemCategory::kActivations);
  kernels::DropoutSpec emb_dropout{
      options.training ? static_cast<float>(config_.hidden_dropout) : 0.0f, options.dropout_seed,
      layer_stream(options.dropout_stream, -1) + kEmbeddingDropoutSite, static_cast<uint64_t>(row_offset * H)};
  k::dropout_forward(x_TH.data<float>(), emb_TH.data<float>(), rows * H, emb_dropout);
  emb_TH = Tensor();

  ctx->layers.resize(m.layers.size());
  for (size_t i = 0; i < m.layers.size(); ++i) {
    if (hooks_) hooks_->before_forward(static_cast<int>(i));
    Tensor out_TH(std::vector<int64_t>{rows, H}, DType::kF32, MemCategory::kActivations);
    const LayerDropout dropout{options.training, options.dropout_seed,
                               layer_stream(options.dropout_stream, static_cast<int64_t>(i))};
    LayerActivations scratch;
    LayerActivations& saved = options.training ? ctx->layers[i] : scratch;
    m.layers[i].forward(out_TH.data<float>(), x_TH, S, B, dropout, saved);
    if (options.training && m.layers[i].is_moe()) record_moe_stats(static_cast<int64_t>(i), saved.moe.routing);
    x_TH = std::move(out_TH);
  }
  if (hooks_) hooks_->before_forward(static_cast<int>(m.layers.size()));
  ctx->final_in_TH = x_TH;
  ctx->final_out_TH = Tensor(std::vector<int64_t>{rows, H}, DType::kF32, MemCategory::kActivations);
  ctx->final_stats = m.final_norm.forward(ctx->final_out_TH.data<float>(), x_TH.data<float>(), rows);
  if (m.sequence_parallel) {  // the output layer is column-parallel over the vocabulary: it needs every token
    Tensor full_TH(std::vector<int64_t>{T, H}, DType::kF32, MemCategory::kActivations);
    tp::all_gather_rows(full_TH.data<float>(), ctx->final_out_TH.data<float>(), rows, H, parallel_.tp);
    ctx->final_full_TH = std::move(full_TH);
  }
  const float* final_full = m.sequence_parallel ? ctx->final_full_TH.data<float>() : ctx->final_out_TH.data<float>();

  ctx->logits_TV = Tensor(std::vector<int64_t>{T, Vl}, DType::kF32, MemCategory::kActivations);
  k::linear_forward(ctx->logits_TV.data<float>(), final_full, m.output_layer->value.data<float>(),
                    static_cast<const float*>(nullptr), T, H, Vl);
  if (logits_SBV) *logits_SBV = ctx->logits_TV.clone().view({S, B, Vl});

  double loss = 0.0;
  if (labels_BS) {
    Tensor losses_T(std::vector<int64_t>{T}, DType::kF32, MemCategory::kActivations);
    ctx->lse_T = Tensor(std::vector<int64_t>{T}, DType::kF32, MemCategory::kActivations);
    if (m.tp == 1) {
      k::cross_entropy_forward(losses_T.data<float>(), ctx->lse_T.data<float>(), ctx->logits_TV.data<float>(),
                               ctx->labels_SB.data(), T, V);
    } else {
      tp::vocab_cross_entropy_forward(losses_T.data<float>(), ctx->lse_T.data<float>(), ctx->logits_TV.data<float>(),
                                      ctx->labels_SB.data(), T, V, m.vocab_begin, Vl, parallel_.tp);
    }
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
  Modules& m = *modules_;
  const int64_t S = ctx->S, B = ctx->B, T = S * B, H = config_.hidden_size, V = config_.vocab_size;
  const int64_t Vl = m.vocab_local;
  const int64_t rows = m.sequence_parallel ? T / m.tp : T;
  const int64_t row_offset = m.sequence_parallel ? m.tp_rank * rows : 0;

  std::vector<float> dlosses_T(static_cast<size_t>(T));
  for (size_t t = 0; t < dlosses_T.size(); ++t) dlosses_T[t] = static_cast<float>(ctx->loss_weight_SB[t] * loss_scale);
  float* dlogits_TV = ctx->logits_TV.data<float>();
  if (m.tp == 1) {
    k::cross_entropy_backward(dlogits_TV, dlosses_T.data(), dlogits_TV, ctx->lse_T.data<float>(), ctx->labels_SB.data(),
                              T, V);
  } else {
    tp::vocab_cross_entropy_backward(dlogits_TV, dlosses_T.data(), dlogits_TV, ctx->lse_T.data<float>(),
                                     ctx->labels_SB.data(), T, m.vocab_begin, Vl);
  }
  // d(final norm output) over every token, partial over the TP ranks' vocabulary columns.
  Tensor dfinal_full_TH(std::vector<int64_t>{T, H}, DType::kF32, MemCategory::kActivations);
  const float* final_full = m.sequence_parallel ? ctx->final_full_TH.data<float>() : ctx->final_out_TH.data<float>();
  k::linear_backward(dfinal_full_TH.data<float>(), m.output_layer->grad.data<float>(), static_cast<float*>(nullptr),
                     dlogits_TV, final_full, m.output_layer->value.data<float>(), T, H, Vl);
  ctx->logits_TV = Tensor();
  ctx->final_full_TH = Tensor();
  Tensor dfinal_TH(std::vector<int64_t>{rows, H}, DType::kF32, MemCategory::kActivations);
  if (m.sequence_parallel) {
    tp::reduce_scatter_rows(dfinal_TH.data<float>(), dfinal_full_TH.data<float>(), rows, H, parallel_.tp);
  } else {
    tp::all_reduce(dfinal_full_TH.data<float>(), T * H, parallel_.tp);
    dfinal_TH = std::move(dfinal_full_TH);
  }
  dfinal_full_TH = Tensor();

  Tensor dx_TH(std::vector<int64_t>{rows, H}, DType::kF32, MemCategory::kActivations);
  m.final_norm.backward(dx_TH.data<float>(), dfinal_TH.data<float>(), ctx->final_in_TH.data<float>(), ctx->final_stats,
                        rows);
  dfinal_TH = Tensor();
  if (hooks_) hooks_->after_backward(static_cast<int>(m.layers.size()));

  for (size_t i = m.layers.size(); i-- > 0;) {
    Tensor dprev_TH(std::vector<int64_t>{rows, H}, DType::kF32, MemCategory::kActivations);
    const LayerDropout dropout{true, ctx->dropout_seed, layer_stream(ctx->dropout_stream, static_cast<int64_t>(i))};
    m.layers[i].backward(dprev_TH.data<float>(), dx_TH.data<float>(), S, B, dropout, loss_scale, ctx->layers[i]);
    ctx->layers[i] = LayerActivations();
    dx_TH = std::move(dprev_TH);
    if (hooks_) hooks_->after_backward(static_cast<int>(i));
  }

  Tensor demb_TH(std::vector<int64_t>{rows, H}, DType::kF32, MemCategory::kActivations);
  kernels::DropoutSpec emb_dropout{static_cast<float>(config_.hidden_dropout), ctx->dropout_seed,
                                   layer_stream(ctx->dropout_stream, -1) + kEmbeddingDropoutSite,
                                   static_cast<uint64_t>(row_offset * H)};
  k::dropout_backward(demb_TH.data<float>(), dx_TH.data<float>(), rows * H, emb_dropout);
  if (m.position_embeddings) {
    float* dpos_PH = m.position_embeddings->grad.data<float>();
    const float* demb = demb_TH.data<float>();
    const int64_t s_begin = row_offset / B, s_end = (row_offset + rows) / B;
#pragma omp parallel for schedule(static)
    for (int64_t s = s_begin; s < s_end; ++s) {
      for (int64_t b = 0; b < B; ++b) {
        for (int64_t h = 0; h < H; ++h) dpos_PH[s * H + h] += demb[(s * B + b - row_offset) * H + h];
      }
    }
  }
  if (m.tp == 1) {
    k::embedding_backward(m.word_embeddings->grad.data<float>(), demb_TH.data<float>(), ctx->tokens_SB.data(), T, V, H);
  } else {
    const float* demb_full = demb_TH.data<float>();
    Tensor full_TH;
    if (m.sequence_parallel) {  // backward of the reduce-scatter: every token's gradient
      full_TH = Tensor(std::vector<int64_t>{T, H}, DType::kF32, MemCategory::kActivations);
      tp::all_gather_rows(full_TH.data<float>(), demb_TH.data<float>(), rows, H, parallel_.tp);
      demb_full = full_TH.data<float>();
    }
    tp::vocab_embedding_backward(m.word_embeddings->grad.data<float>(), demb_full, ctx->tokens_SB.data(), T,
                                 m.vocab_begin, Vl, H);
  }
  if (hooks_) hooks_->after_backward(-1);
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
  if (modules_->tp > 1) throw std::logic_error("last_logits needs the whole vocabulary: gather the model first");
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
