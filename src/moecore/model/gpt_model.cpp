#include "moecore/model/gpt_model.h"

#include <algorithm>
#include <stdexcept>

#include "moecore/model/kv_cache.h"
#include "moecore/model/multi_token_prediction.h"
#include "moecore/model/norm_module.h"
#include "moecore/model/parallel_linear.h"
#include "moecore/model/tensor_parallel.h"
#include "moecore/model/transformer_layer.h"
#include "moecore/model/vocab_parallel.h"
#include "moecore/ops/convert.h"
#include "moecore/ops/dropout.h"
#include "moecore/ops/elementwise.h"
#include "moecore/ops/linear_cross_entropy.h"
#include "moecore/ops/precision.h"
#include "moecore/ops/rows.h"
#include "moecore/util/trace.h"

namespace moecore {

struct GPTModel::Modules {
  TensorParallel tp;
  std::vector<TransformerLayer> layers;    // this stage's layers, global numbers first_layer, first_layer + 1, ...
  VocabParallelEmbedding word_embeddings;  // pre_process
  Param* position_embeddings = nullptr;    // pre_process with learned_absolute
  NormModule final_norm;                   // post_process
  ColumnParallelLinear output_layer;       // post_process: vocabulary-parallel, never gathered
  VocabParallelCrossEntropy cross_entropy;
  MultiTokenPrediction mtp;  // post_process with --mtp-num-layers
};

namespace {

constexpr uint64_t kEmbeddingDropoutSite = 0;
constexpr const char* kWordEmbeddings = "embedding.word_embeddings.weight";

uint64_t layer_stream(const uint64_t stream, const int64_t layer) {
  return (stream * 1024 + static_cast<uint64_t>(layer) + 1) * 16;
}

// An fp32 copy of logits handed to callers (generation, evaluation), whatever the activation storage.
Tensor fp32_copy(const Tensor& t) {
  Tensor out(t.shape(), DType::kF32);
  ops::convert(out, t);
  return out;
}

// Losses, their gradients, log-sum-exps and weight gradients stay fp32 under --bf16 / --fp16, as Megatron's.
Tensor fp32_tensor(std::vector<int64_t> shape) {
  return Tensor(std::move(shape), DType::kF32, MemCategory::kActivations);
}

// Embedding dropout of this rank's rows (element counters at their one-process index).
ops::DropoutSpec embedding_dropout(const ModelConfig& config, const bool training, const uint64_t seed,
                                   const uint64_t stream, const int64_t row_offset) {
  return ops::DropoutSpec{training ? static_cast<float>(config.hidden_dropout) : 0.0f, seed,
                          layer_stream(stream, -1) + kEmbeddingDropoutSite,
                          static_cast<uint64_t>(row_offset * config.hidden_size)};
}

// This rank's rows of the micro-batch in sequence-major order t = s * B + b (under context parallelism the local
// sequence: chunks r and 2 CP - 1 - r), with each token's share of the loss: mask / this rank's unmasked count
// (Megatron's loss_func: the local token mean, no reduction over CP), or the mask itself with per-token loss (the
// sum; schedules.py divides by nothing).
std::unique_ptr<MicroBatchContext> make_context(const int32_t* tokens_BS, const int32_t* labels_BS,
                                                const float* loss_mask_BS, const int64_t B, const int64_t S,
                                                const TokenRows& rows, const ForwardOptions& options) {
  auto ctx = std::make_unique<MicroBatchContext>();
  const int64_t T = rows.count();
  ctx->S = T / B;
  ctx->B = B;
  ctx->rows = rows;
  ctx->training = options.training;
  ctx->dropout_seed = options.dropout_seed;
  ctx->dropout_stream = options.dropout_stream;
  ctx->tokens_SB.assign(static_cast<size_t>(T), 0);
  ctx->labels_SB.assign(static_cast<size_t>(T), 0);
  ctx->loss_weight_SB.assign(static_cast<size_t>(T), 0.0f);
  double mask_sum = 0.0;
  for (const TokenRows::Run& run : rows.runs()) {
    for (int64_t i = 0; i < run.count; ++i) {
      const int64_t g = run.global + i, s = g / B, b = g % B;
      const auto t = static_cast<size_t>(run.local + i);
      if (tokens_BS) ctx->tokens_SB[t] = tokens_BS[b * S + s];
      if (labels_BS) ctx->labels_SB[t] = labels_BS[b * S + s];
      ctx->loss_weight_SB[t] = loss_mask_BS ? loss_mask_BS[b * S + s] : 1.0f;
      mask_sum += ctx->loss_weight_SB[t];
    }
  }
  ctx->loss_tokens = mask_sum;
  ctx->per_token_loss = options.per_token_loss;
  if (!options.per_token_loss) {
    for (float& w : ctx->loss_weight_SB) w = mask_sum > 0 ? static_cast<float>(w / mask_sum) : 0.0f;
  }
  return ctx;
}

StageSpec resolved(StageSpec stage, const int64_t L) {
  if (stage.num_layers < 0) stage.num_layers = L - stage.first_layer;
  if (stage.first_layer < 0 || stage.num_layers < 0 || stage.first_layer + stage.num_layers > L) {
    throw ConfigError("pipeline stage layers [" + std::to_string(stage.first_layer) + ", " +
                      std::to_string(stage.first_layer + stage.num_layers) + ") are outside the model's " +
                      std::to_string(L) + " layers");
  }
  return stage;
}

}  // namespace

GPTModel::GPTModel(const ModelConfig& config, const uint64_t seed, const parallel::ParallelState& parallel,
                   const StageSpec& stage)
    : GPTModel(config, seed, parallel, std::vector<StageSpec>{stage}) {}

GPTModel::GPTModel(const ModelConfig& config, const uint64_t seed, const parallel::ParallelState& parallel,
                   const std::vector<StageSpec>& chunks)
    : config_(config), parallel_(parallel), modules_(std::make_unique<Modules>()) {
  config_.validate();
  if (chunks.empty()) throw ConfigError("a pipeline rank needs at least one model chunk");
  for (size_t c = 0; c < chunks.size(); ++c) {
    chunks_.push_back(resolved(chunks[c], config_.num_layers));
    if ((chunks[c].pre_process && c != 0) || (chunks[c].post_process && c + 1 != chunks.size())) {
      throw ConfigError("only a rank's first model chunk may hold the embedding and only its last the loss");
    }
  }
  inputs_TH_.resize(chunks_.size());
  const bool pre_process = chunks_.front().pre_process, post_process = chunks_.back().post_process;
  const int64_t H = config_.hidden_size, V = config_.vocab_size, L = config_.num_layers;
  Modules& m = *modules_;
  m.tp = TensorParallel::attention(parallel_);
  if (m.tp.size() > 1 && (m.tp.sequence_sharded() || config_.moe.enabled()) && config_.seq_length % m.tp.size() != 0) {
    throw ConfigError("--seq-length (" + std::to_string(config_.seq_length) +
                      ") must be divisible by --tensor-model-parallel-size (" + std::to_string(m.tp.size()) +
                      ") with --sequence-parallel or MoE layers");
  }
  const bool tied = !config_.untie_embeddings_and_output_weights;
  if (pre_process) {
    m.word_embeddings = VocabParallelEmbedding(kWordEmbeddings, V, H, m.tp, params_);
    if (config_.position_embedding_type == PositionEmbedding::kLearnedAbsolute) {
      Param pos =
          make_param("embedding.position_embeddings.weight", {config_.max_position_embeddings, H}, InitKind::kNormal);
      pos.grad_sum_over_tp = m.tp.sequence_sharded();  // added on the local sequence shard
      m.position_embeddings = &params_.push_back(std::move(pos));
    }
  }
  for (const StageSpec& chunk : chunks_) {
    chunk_first_module_.push_back(m.layers.size());
    for (int64_t i = chunk.first_layer; i < chunk.first_layer + chunk.num_layers; ++i) {
      m.layers.emplace_back(config_, i, params_, buffers_, parallel_, &norm_overflows_);
    }
  }
  const std::vector<int64_t> router_layers = moe_router_layers(config_);
  for (TransformerLayer& layer : m.layers) {
    if (!layer.is_moe()) continue;
    const auto at = std::find(router_layers.begin(), router_layers.end(), layer.index());
    layer.moe()->set_replay_router(at - router_layers.begin());
  }
  chunk_first_module_.push_back(m.layers.size());
  if (post_process) {
    m.final_norm =
        NormModule("decoder.final_layernorm", H,
                   norm_options(config_, m.tp.sequence_sharded(), static_cast<int>(L), &norm_overflows_), params_);
    LinearOptions output;
    output.module = static_cast<int>(L);
    if (tied) output.shared_weight = kWordEmbeddings;
    if (!pre_process && (tied || config_.mtp_num_layers > 0)) {
      // A last stage without the embedding holds its own copy of the word embedding under the embedding's name, for
      // the tied output layer and the Multi-Token Prediction input: the counter-RNG init makes it equal to the first
      // stage's; keeping the copies' gradients summed is the pipeline schedule's job (Megatron's embedding group).
      m.word_embeddings = VocabParallelEmbedding(kWordEmbeddings, V, H, m.tp, params_);
    }
    m.output_layer = ColumnParallelLinear("output_layer", H, V, m.tp, output, params_);
    m.cross_entropy = VocabParallelCrossEntropy(m.tp, V, m.tp.rank() * (V / m.tp.size()));
    if (config_.mtp_num_layers > 0) {
      m.mtp = MultiTokenPrediction(config_, static_cast<int>(L), params_, buffers_, parallel_, &norm_overflows_,
                                   &m.word_embeddings, &m.output_layer, &m.cross_entropy);
    }
  }
  if ((tied || config_.mtp_num_layers > 0) && parallel_.pp_size() > 1 && (pre_process || post_process)) {
    Param& word = param(kWordEmbeddings);
    word.sum_over_embedding_group = true;
    word.pipeline_copy = !pre_process;
  }
  delayed_scaling_ = DelayedScalingStates(params_, parallel_.tp_dp_cp);
  for (Param& p : params_) {
    init_param(p, seed, config_.init_method_std, config_.num_layers);
    ops::round_to_dtype_(p.value, config_.params_dtype);  // the 16-bit model weights of --bf16 / --fp16
  }
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

Buffer& GPTModel::buffer(const std::string& name) {
  return const_cast<Buffer&>(static_cast<const GPTModel&>(*this).buffer(name));
}

const Buffer& GPTModel::buffer(const std::string& name) const {
  for (const Buffer& b : buffers_) {
    if (b.name == name) return b;
  }
  throw std::out_of_range("no buffer named " + name);
}

int64_t GPTModel::num_parameters() const {
  int64_t n = 0;
  for (const Param& p : params_) n += p.value.numel();
  return n;
}

void GPTModel::zero_grad() {
  for (Param& p : params_) {
    p.grad.zero_();
    p.grad_zero = true;
  }
}

Tensor GPTModel::embed(MicroBatchContext& ctx, const ForwardOptions& options) const {
  const Modules& m = *modules_;
  const int64_t T = ctx.S * ctx.B;
  // Word embeddings (vocabulary-parallel: summed over TP, or reduce-scattered to the sequence shard), then
  // positions, then dropout.
  Tensor emb_TH = m.word_embeddings.forward(ctx.tokens_SB);
  Tensor x_TH = ops::activation_tensor(emb_TH.shape());
  const TokenRows rows = ctx.rows.slice(m.tp.row_offset(T), m.tp.local_rows(T));
  for (const TokenRows::Run& run : rows.runs()) {
    Tensor emb_RH = emb_TH.slice_rows(run.local, run.local + run.count);
    Tensor x_RH = x_TH.slice_rows(run.local, run.local + run.count);
    if (m.position_embeddings) ops::add_position_embedding(emb_RH, m.position_embeddings->value, ctx.B, run.global);
    ops::dropout_forward(
        x_RH, emb_RH,
        embedding_dropout(config_, options.training, options.dropout_seed, options.dropout_stream, run.global));
  }
  return x_TH;
}

void GPTModel::embed_backward(const Tensor& dx_TH, const MicroBatchContext& ctx) const {
  const Modules& m = *modules_;
  const int64_t T = ctx.S * ctx.B;
  Tensor demb_TH = ops::activation_tensor(dx_TH.shape());
  const TokenRows rows = ctx.rows.slice(m.tp.row_offset(T), m.tp.local_rows(T));
  for (const TokenRows::Run& run : rows.runs()) {
    Tensor d_RH = demb_TH.slice_rows(run.local, run.local + run.count);
    ops::dropout_backward(d_RH, dx_TH.slice_rows(run.local, run.local + run.count),
                          embedding_dropout(config_, true, ctx.dropout_seed, ctx.dropout_stream, run.global));
    if (m.position_embeddings) ops::position_embedding_backward(m.position_embeddings->grad, d_RH, ctx.B, run.global);
  }
  m.word_embeddings.backward(demb_TH, ctx.tokens_SB);
}

double GPTModel::output_and_loss(MicroBatchContext& ctx, const Tensor& hidden_TH, const bool with_labels,
                                 Tensor* logits_SBV) const {
  const Modules& m = *modules_;
  ctx.final_out_TH = ops::activation_tensor(hidden_TH.shape());
  ctx.final_stats = m.final_norm.forward(ctx.final_out_TH, hidden_TH);
  const int64_t T = ctx.S * ctx.B;
  Tensor losses_T = fp32_tensor({T});
  if (with_labels && logits_SBV == nullptr) {
    // Fused: the [T, V] logits live one chunk at a time; a training forward also forms the loss's gradients.
    const Tensor input_TH = m.output_layer.gather_input(ctx.final_out_TH);
    const Tensor& weight_VH = m.output_layer.weight().value;
    Tensor dlosses_T;
    if (ctx.training) {
      dlosses_T = fp32_tensor({T});
      for (int64_t t = 0; t < T; ++t) {
        dlosses_T.data<float>()[t] =
            static_cast<float>(ctx.loss_weight_SB[static_cast<size_t>(t)] * ctx.output_grad_seed);
      }
      ctx.output_dinput_TH = ops::activation_tensor(input_TH.shape());
    }
    // The weight gradient goes straight into the fp32 main gradient, chunk by chunk (Megatron's gradient-accumulation
    // fusion, which writes wgrad GEMMs into main_grad): no [V, H] copy per micro-batch.
    Tensor* dweight_VH = ctx.training ? &m.output_layer.weight().grad : nullptr;
    const ops::VocabShard shard = m.cross_entropy.shard();
    ops::linear_cross_entropy(losses_T, input_TH, weight_VH, ctx.labels_SB,
                              fused_logits_chunk_rows(T, weight_VH, shard), ctx.training ? &dlosses_T : nullptr,
                              ctx.training ? &ctx.output_dinput_TH : nullptr, dweight_VH, &shard);
  } else {
    ctx.logits_TV = m.output_layer.forward(ctx.final_out_TH, ctx.output_layer);
    if (logits_SBV) *logits_SBV = fp32_copy(ctx.logits_TV).view({ctx.S, ctx.B, ctx.logits_TV.dim(1)});
    if (!with_labels) return 0.0;
    ctx.lse_T = fp32_tensor({T});
    m.cross_entropy.forward(losses_T, ctx.lse_T, ctx.logits_TV, ctx.labels_SB);
  }
  double loss = 0.0;
  const float* losses = losses_T.data<float>();
  for (int64_t t = 0; t < T; ++t) loss += static_cast<double>(losses[t]) * ctx.loss_weight_SB[static_cast<size_t>(t)];
  return loss;
}

Tensor GPTModel::output_and_loss_backward(MicroBatchContext& ctx, const double loss_scale) const {
  const Modules& m = *modules_;
  const int64_t T = ctx.S * ctx.B;
  Tensor dfinal_TH;
  if (ctx.output_dinput_TH.defined()) {
    check_fused_backward_seed(ctx.output_grad_seed, loss_scale);
    dfinal_TH = m.output_layer.reduce_input_grad(ctx.output_dinput_TH);
    ctx.output_dinput_TH = Tensor();
  } else {
    Tensor dlosses_T = fp32_tensor({T});
    for (int64_t t = 0; t < T; ++t) {
      dlosses_T.data<float>()[t] = static_cast<float>(ctx.loss_weight_SB[static_cast<size_t>(t)] * loss_scale);
    }
    m.cross_entropy.backward(ctx.logits_TV, dlosses_T, ctx.logits_TV, ctx.lse_T, ctx.labels_SB);  // in place
    dfinal_TH = ops::activation_tensor(ctx.final_out_TH.shape());
    m.output_layer.backward(dfinal_TH, ctx.logits_TV, ctx.output_layer);
    ctx.logits_TV = Tensor();
    ctx.output_layer = LinearActivations();
  }
  if (!ctx.mtp.depths.empty()) {
    const Tensor dmtp_TH = m.mtp.backward(ctx.mtp, mtp_batch(ctx), loss_scale, aux_loss_scale(ctx, loss_scale),
                                          mtp_options(ctx, ctx.mtp.grad_seed));
    ops::add_(dfinal_TH, dmtp_TH);
  }
  Tensor dx_TH = ops::activation_tensor(ctx.output_TH.shape());
  m.final_norm.backward(dx_TH, dfinal_TH, ctx.output_TH, ctx.final_stats);
  return dx_TH;
}

Tensor GPTModel::checkpoint_input(const Tensor& input_TH) const {
  if (!config_.recompute.distribute_saved_activations) return input_TH;
  // --distribute-saved-activations: this TP rank keeps its 1/TP of the (replicated) rows.
  const TensorParallel& tp = modules_->tp;
  const int64_t T = input_TH.dim(0);
  if (T % tp.size() != 0) {
    throw std::invalid_argument("--distribute-saved-activations: the micro-batch's " + std::to_string(T) +
                                " local tokens are not divisible by the TP size");
  }
  const int64_t rows = T / tp.size();
  return input_TH.slice_rows(tp.rank() * rows, (tp.rank() + 1) * rows).clone(MemCategory::kActivations);
}

void GPTModel::recompute_checkpoint(MicroBatchContext& ctx, const int64_t begin, const int64_t end) {
  Modules& m = *modules_;
  const StageSpec& stage = chunks_[static_cast<size_t>(ctx.chunk)];
  const size_t first = chunk_first_module_[static_cast<size_t>(ctx.chunk)];
  const trace::Scope scope("recompute layers ", stage.first_layer + begin, " forward", "backward");
  LayerActivations& head = ctx.layers[static_cast<size_t>(begin)];
  Tensor x_TH = config_.recompute.distribute_saved_activations ? m.tp.all_gather_rows(head.x_TH) : head.x_TH;
  head.x_TH = Tensor();
  for (int64_t i = begin; i < end; ++i) {
    const int64_t layer = stage.first_layer + i;
    if (hooks_) hooks_->before_recompute(static_cast<int>(layer));
    LayerDropout dropout{true, ctx.dropout_seed, layer_stream(ctx.dropout_stream, layer), ctx.rows, &ctx.sequence};
    dropout.recompute = true;
    x_TH = m.layers[first + static_cast<size_t>(i)].forward(x_TH, ctx.S, ctx.B, dropout,
                                                            ctx.layers[static_cast<size_t>(i)]);
  }
}

double GPTModel::forward(std::unique_ptr<MicroBatchContext>& ctx_out, const int32_t* tokens_BS,
                         const int32_t* labels_BS, const float* loss_mask_BS, const int64_t B, const int64_t S,
                         const ForwardOptions& options, Tensor* logits_SBV) {
  const ops::ScopedActivationDType precision(config_.params_dtype, Device::kCPU, config_.activation_storage);
  if (config_.position_embedding_type == PositionEmbedding::kLearnedAbsolute && S > config_.max_position_embeddings) {
    throw std::invalid_argument("sequence length " + std::to_string(S) + " exceeds --max-position-embeddings");
  }
  Modules& m = *modules_;
  const parallel::ProcessGroup& cp_group =
      options.context_parallel != nullptr ? *options.context_parallel : parallel_.cp;
  const int cp = cp_group.size();
  if (cp > 1 && S % (2 * cp) != 0) {
    throw std::invalid_argument("sequence length " + std::to_string(S) + " is not divisible by 2 x the CP size");
  }
  const int64_t S_local = S / cp;  // this context-parallel rank's positions
  if (m.tp.size() > 1 && (m.tp.sequence_sharded() || config_.moe.enabled()) && S_local % m.tp.size() != 0) {
    throw std::invalid_argument("local sequence length " + std::to_string(S_local) +
                                " is not divisible by the TP size");
  }
  if (options.chunk < 0 || options.chunk >= num_chunks()) {
    throw std::invalid_argument("model chunk " + std::to_string(options.chunk) + " of " + std::to_string(num_chunks()));
  }
  const StageSpec& stage = chunks_[static_cast<size_t>(options.chunk)];
  const size_t first = chunk_first_module_[static_cast<size_t>(options.chunk)];
  const size_t count = chunk_first_module_[static_cast<size_t>(options.chunk) + 1] - first;
  auto ctx = make_context(tokens_BS, labels_BS, loss_mask_BS, B, S,
                          TokenRows::context_parallel(S, B, cp_group.rank(), cp), options);
  ctx->chunk = options.chunk;
  if (options.loss_tokens != nullptr) *options.loss_tokens = ctx->loss_tokens;
  SequenceInfo& sequence = ctx->sequence;
  sequence.S = S;
  sequence.B = B;
  sequence.cp_rank = cp_group.rank();
  sequence.cp_size = cp;
  if (options.context_parallel != nullptr) sequence.cp_group = options.context_parallel;
  sequence.positions_SB.resize(static_cast<size_t>(S_local * B));
  for (const TokenRows::Run& run : ctx->rows.runs()) {
    for (int64_t i = 0; i < run.count; ++i) {
      const int64_t g = run.global + i, s = g / B, b = g % B;
      sequence.positions_SB[static_cast<size_t>(run.local + i)] =
          options.position_ids_BS != nullptr ? options.position_ids_BS[b * S + s] : s;
    }
  }
  if (options.position_ids_BS != nullptr && config_.position_embedding_type == PositionEmbedding::kLearnedAbsolute) {
    for (int64_t i = 0; i < B * S; ++i) {
      if (options.position_ids_BS[i] != i % S) {
        throw std::invalid_argument("reset position ids need rotary position embeddings");
      }
    }
  }
  if (options.document_ids_BS != nullptr)
    sequence.documents_BS.assign(options.document_ids_BS, options.document_ids_BS + B * S);
  Tensor x_TH;
  if (stage.pre_process) {
    if (tokens_BS == nullptr) throw std::invalid_argument("the first pipeline stage needs the tokens");
    if (hooks_) hooks_->before_forward(-1);
    const trace::Scope scope("embedding forward", "forward");
    const ActivationOwnerScope owner(ActivationOwner::kEmbedding);
    x_TH = embed(*ctx, options);
  } else {
    Tensor& input_TH = inputs_TH_[static_cast<size_t>(options.chunk)];
    if (!input_TH.defined()) throw std::logic_error("a stage without pre_process needs set_input_tensor() first");
    x_TH = std::move(input_TH);
    input_TH = Tensor();
  }
  ctx->layers.resize(count);
  if (options.is_first_microbatch) {
    delayed_scaling_.set_first_microbatch(stage.first_layer, stage.first_layer + stage.num_layers);
  }
  const RecomputeConfig& recompute = config_.recompute;
  for (size_t i = 0; i < count; ++i) {
    const int64_t layer = stage.first_layer + static_cast<int64_t>(i);
    TransformerLayer& module = m.layers[first + i];
    if (hooks_) hooks_->before_forward(static_cast<int>(layer));
    LayerDropout dropout{options.training, options.dropout_seed, layer_stream(options.dropout_stream, layer), ctx->rows,
                         &ctx->sequence};
    dropout.routing_replay = options.routing_replay;
    LayerActivations scratch;
    LayerActivations& saved = options.training ? ctx->layers[i] : scratch;
    const trace::Scope scope("layer ", layer, " forward", "forward");
    const Tensor input_TH = x_TH;
    x_TH = module.forward(x_TH, S_local, B, dropout, saved);
    if (hooks_) hooks_->after_forward(static_cast<int>(layer));
    if (options.training && module.is_moe()) moe_metrics_.record(layer, saved.moe.routing);
    const auto index = static_cast<int64_t>(i);
    if (options.training && recompute.checkpointed(index)) {
      // Full recomputation (Megatron's TransformerBlock._checkpointed_forward): a checkpoint keeps only its input.
      TransformerLayer::drop_for_full_recompute(saved);
      if (recompute.checkpoint_begin(index) == index) saved.x_TH = checkpoint_input(input_TH);
    }
  }
  if (options.training) delayed_scaling_.after_forward();  // TE's autocast exit around the decoder block
  ctx->output_TH = x_TH;
  double loss = 0.0;
  if (stage.post_process) {
    if (hooks_) hooks_->before_forward(static_cast<int>(config_.num_layers));
    const trace::Scope scope("output layer + loss forward", "forward");
    const ActivationOwnerScope owner(ActivationOwner::kOutputLoss);
    ctx->output_grad_seed = options.backward_seed;
    loss = output_and_loss(*ctx, x_TH, labels_BS != nullptr, logits_SBV);
    if (ctx->per_token_loss) loss /= std::max(ctx->loss_tokens, 1.0);  // the sum's token mean, for the log
    if (m.mtp.depths() > 0 && labels_BS != nullptr) {
      if (tokens_BS == nullptr) throw std::invalid_argument("the Multi-Token Prediction depths need the tokens");
      mtp_forward(*ctx, options, tokens_BS, labels_BS, loss_mask_BS);
    }
  }
  if (options.training) {
    moe_metrics_.count_forward();
    if (!ctx->mtp.depths.empty()) ++mtp_stats_.num_forwards;
    ctx_out = std::move(ctx);
  } else if (!stage.post_process) {
    ctx_out = std::move(ctx);  // the caller reads output_TH
  }
  return loss;
}

Tensor GPTModel::backward(std::unique_ptr<MicroBatchContext> ctx, const double loss_scale,
                          const Tensor* output_grad_TH) {
  const ops::ScopedActivationDType precision(config_.params_dtype, Device::kCPU, config_.activation_storage);
  if (!ctx || !ctx->training || ctx->chunk < 0 || ctx->chunk >= num_chunks()) {
    throw std::logic_error("backward needs the context of a training forward");
  }
  const StageSpec& stage = chunks_[static_cast<size_t>(ctx->chunk)];
  const size_t first = chunk_first_module_[static_cast<size_t>(ctx->chunk)];
  if (stage.post_process && !ctx->lse_T.defined() && !ctx->output_dinput_TH.defined()) {
    throw std::logic_error("backward needs the context of a training forward with labels");
  }
  if (!stage.post_process && output_grad_TH == nullptr) {
    throw std::logic_error("a stage without post_process needs the gradient of its output");
  }
  Modules& m = *modules_;
  const int64_t S = ctx->S, B = ctx->B;
  Tensor dx_TH;
  if (stage.post_process) {
    const trace::Scope scope("output layer + loss backward", "backward");
    const ActivationOwnerScope owner(ActivationOwner::kOutputLoss);
    if (hooks_) hooks_->before_backward(static_cast<int>(config_.num_layers));
    dx_TH = output_and_loss_backward(*ctx, loss_scale);
    if (hooks_) hooks_->after_backward(static_cast<int>(config_.num_layers));
  } else {
    dx_TH = output_grad_TH->clone(MemCategory::kActivations);
  }
  const RecomputeConfig& recompute = config_.recompute;
  for (size_t i = ctx->layers.size(); i-- > 0;) {
    const int64_t layer = stage.first_layer + static_cast<int64_t>(i);
    const auto index = static_cast<int64_t>(i);
    if (recompute.checkpointed(index) &&
        recompute.checkpoint_end(index, static_cast<int64_t>(ctx->layers.size())) == index + 1) {
      recompute_checkpoint(*ctx, recompute.checkpoint_begin(index), index + 1);
    }
    Tensor dprev_TH = ops::activation_tensor(dx_TH.shape());
    const LayerDropout dropout{true, ctx->dropout_seed, layer_stream(ctx->dropout_stream, layer), ctx->rows,
                               &ctx->sequence};
    {
      const trace::Scope scope("layer ", layer, " backward", "backward");
      if (hooks_) hooks_->before_backward(static_cast<int>(layer));
      // The auxiliary losses' gradient scale is loss_scale x CP (Megatron's MoEAuxLossAutoScaler: grad_scale CP / M):
      // each CP rank's aux terms are partial sums over tp-cp, and its gradients are averaged over dp-cp.
      m.layers[first + i].backward(dprev_TH, dx_TH, S, B, dropout, aux_loss_scale(*ctx, loss_scale), ctx->layers[i]);
    }
    ctx->layers[i] = LayerActivations();
    dx_TH = std::move(dprev_TH);
    if (hooks_) hooks_->after_backward(static_cast<int>(layer));
  }
  delayed_scaling_.after_backward();  // at the end of the first FP8 module's backward, as TE
  if (!stage.pre_process) return dx_TH;
  const trace::Scope scope("embedding backward", "backward");
  const ActivationOwnerScope owner(ActivationOwner::kEmbedding);
  if (hooks_) hooks_->before_backward(-1);
  embed_backward(dx_TH, *ctx);
  if (hooks_) hooks_->after_backward(-1);
  return Tensor();
}

MtpBatch GPTModel::mtp_batch(const MicroBatchContext& ctx, const int32_t* tokens_BS, const int32_t* labels_BS,
                             const float* loss_mask_BS) const {
  return MtpBatch{ctx.S, ctx.B, ctx.sequence.S, tokens_BS, labels_BS, loss_mask_BS, &ctx.rows, &ctx.sequence};
}

// The MoE auxiliary losses' gradient scale (Megatron's MoEAuxLossAutoScaler.set_loss_scale in schedules.py:
// loss scale x CP / micro-batches, the backward seed times CP here; with per-token loss the loss scale alone).
double GPTModel::aux_loss_scale(const MicroBatchContext& ctx, const double loss_scale) const {
  return ctx.per_token_loss ? loss_scale : loss_scale * parallel_.cp_size();
}

MtpForwardOptions GPTModel::mtp_options(const MicroBatchContext& ctx, const double backward_seed) const {
  MtpForwardOptions options;
  options.training = ctx.training;
  options.dropout_seed = ctx.dropout_seed;
  options.backward_seed = backward_seed;
  options.per_token_loss = ctx.per_token_loss;
  options.main_loss_tokens = ctx.loss_tokens;
  for (int64_t k = 0; k < config_.mtp_num_layers; ++k) {
    options.layer_streams.push_back(layer_stream(ctx.dropout_stream, mtp_layer_number(config_.num_layers, k)));
    // A layer-style key (stream x 4 + site) of a layer number no decoder layer has.
    options.embedding_keys.push_back(layer_stream(ctx.dropout_stream, mtp_embedding_number(config_.num_layers, k)) * 4 +
                                     kEmbeddingDropoutSite);
  }
  return options;
}

void GPTModel::mtp_forward(MicroBatchContext& ctx, const ForwardOptions& options, const int32_t* tokens_BS,
                           const int32_t* labels_BS, const float* loss_mask_BS) {
  const trace::Scope scope("mtp forward", "forward");
  const ActivationOwnerScope owner(ActivationOwner::kOutputLoss);
  const std::vector<double> losses =
      modules_->mtp.forward(ctx.final_out_TH, mtp_batch(ctx, tokens_BS, labels_BS, loss_mask_BS),
                            mtp_options(ctx, options.backward_seed), ctx.mtp);
  if (!options.training) return;
  mtp_stats_.loss_sums.resize(losses.size(), 0.0);
  for (size_t k = 0; k < losses.size(); ++k) {
    mtp_stats_.loss_sums[k] += losses[k];
    const TransformerLayer& layer = modules_->mtp.layers()[k];
    if (layer.is_moe()) {
      // Megatron's router records an MTP layer's statistics after the decoder's layers (layer_number + num_layers).
      moe_metrics_.record(config_.num_layers + static_cast<int64_t>(k), ctx.mtp.depths[k].layer.moe.routing);
    }
  }
}

MtpStats GPTModel::take_mtp_stats() {
  MtpStats out = std::move(mtp_stats_);
  mtp_stats_ = MtpStats();
  return out;
}

std::optional<NormOverflow> GPTModel::take_norm_overflow() { return norm_overflows_.take(); }

MoEStats GPTModel::take_moe_stats() { return moe_metrics_.take(); }

void GPTModel::set_router_tracer(RouterTracer* tracer) {
  Modules& m = *modules_;
  for (size_t c = 0; c < chunks_.size(); ++c) {
    for (int64_t i = 0; i < chunks_[c].num_layers; ++i) {
      TransformerLayer& layer = m.layers[chunk_first_module_[c] + static_cast<size_t>(i)];
      if (layer.is_moe())
        layer.moe()->set_router_tracer(tracer,
                                       {.mtp = false, .layer = chunks_[c].first_layer + i, .mtp_idx = std::nullopt});
    }
  }
  for (size_t k = 0; k < m.mtp.layers().size(); ++k) {
    TransformerLayer& layer = m.mtp.layers()[k];
    if (layer.is_moe())
      layer.moe()->set_router_tracer(tracer, {.mtp = true, .layer = 0, .mtp_idx = static_cast<int64_t>(k)});
  }
}

void GPTModel::set_routing_recorder(RoutingRecorder* recorder) {
  for (TransformerLayer& layer : modules_->layers) {
    if (layer.is_moe()) layer.moe()->set_routing_recorder(recorder);
  }
}

void GPTModel::finish_global_batch() {
  for (TransformerLayer& layer : modules_->layers) {
    if (layer.is_moe()) layer.moe()->finish_global_batch();
  }
  for (TransformerLayer& layer : modules_->mtp.layers()) {
    if (layer.is_moe()) layer.moe()->finish_global_batch();
  }
}

Buffer* GPTModel::expert_bias(const int64_t layer) {
  return const_cast<Buffer*>(static_cast<const GPTModel&>(*this).expert_bias(layer));
}

const Buffer* GPTModel::expert_bias(const int64_t layer) const {
  const std::string name = "decoder.layers." + std::to_string(layer) + ".mlp.router.expert_bias";
  for (const Buffer& b : buffers_) {
    if (b.name == name) return &b;
  }
  return nullptr;
}

Tensor GPTModel::last_logits(const int32_t* tokens_BS, const int64_t B, const int64_t S) {
  if (modules_->tp.size() > 1 || num_chunks() != 1 || !chunks_[0].pre_process || !chunks_[0].post_process) {
    throw std::logic_error("last_logits needs the whole model in one process: gather the model first");
  }
  std::unique_ptr<MicroBatchContext> unused;
  Tensor logits_SBV;
  ForwardOptions options;
  options.training = false;
  forward(unused, tokens_BS, nullptr, nullptr, B, S, options, &logits_SBV);
  const int64_t V = config_.vocab_size;
  return logits_SBV.view({S * B, V}).slice_rows((S - 1) * B, S * B).clone();
}

Tensor GPTModel::decode_logits(KvCache& cache, const std::span<const int32_t> new_tokens) {
  if (const std::string why = kv_cache_unsupported_reason(*this); !why.empty()) {
    throw std::logic_error("incremental decoding is not exact here: " + why);
  }
  const int64_t T = static_cast<int64_t>(new_tokens.size()), start = cache.length();
  if (T == 0 || start + T > cache.capacity()) {
    throw std::invalid_argument("decode_logits: " + std::to_string(T) + " new tokens after " + std::to_string(start) +
                                " cached positions do not fit the cache of " + std::to_string(cache.capacity()));
  }
  if (config_.position_embedding_type == PositionEmbedding::kLearnedAbsolute &&
      start + T > config_.max_position_embeddings) {
    throw std::invalid_argument("sequence length " + std::to_string(start + T) + " exceeds --max-position-embeddings");
  }
  const ops::ScopedActivationDType precision(config_.params_dtype, Device::kCPU, config_.activation_storage);
  const Modules& m = *modules_;
  Tensor emb_TH = m.word_embeddings.forward(new_tokens);
  if (m.position_embeddings) ops::add_position_embedding(emb_TH, m.position_embeddings->value, 1, start);
  Tensor x_TH = ops::activation_tensor(emb_TH.shape());
  ops::dropout_forward(x_TH, emb_TH, embedding_dropout(config_, false, 0, 0, start));
  emb_TH = Tensor();
  std::vector<int64_t> positions(static_cast<size_t>(T));
  for (int64_t i = 0; i < T; ++i) positions[static_cast<size_t>(i)] = start + i;
  for (size_t i = 0; i < m.layers.size(); ++i) {
    x_TH = m.layers[i].forward_decode(x_TH, positions, cache.layer(static_cast<int64_t>(i)));
  }
  cache.advance(T);
  Tensor final_1H = ops::activation_tensor({1, config_.hidden_size});
  m.final_norm.forward(final_1H, x_TH.slice_rows(T - 1, T));
  LinearActivations unused;
  return fp32_copy(m.output_layer.forward(final_1H, unused));
}

}  // namespace moecore
