#include "moecore/model/multi_token_prediction.h"

#include <algorithm>

#include "moecore/ops/dropout.h"
#include "moecore/ops/elementwise.h"
#include "moecore/ops/linear_cross_entropy.h"
#include "moecore/ops/precision.h"
#include "moecore/ops/rows.h"
#include "moecore/util/trace.h"

namespace moecore {
namespace {

// Losses, their gradients and weight gradients stay fp32 under --bf16 / --fp16, as Megatron's.
Tensor fp32_tensor(std::vector<int64_t> shape) {
  return Tensor(std::move(shape), DType::kF32, MemCategory::kActivations);
}

// Megatron's roll_tensor(shifts=-1) applied `shift` times along the sequence, for this rank's rows: row t (global
// position s of sample b) gets x[b, s + shift], 0 past the end. Under context parallelism this is what roll_tensor's
// boundary exchange between the CP ranks produces; here every rank holds the whole micro-batch.
template <typename T>
std::vector<T> shifted_rows(const T* x_BS, const MtpBatch& batch, const int64_t shift, const T fill_without_x) {
  std::vector<T> out(static_cast<size_t>(batch.rows->count()), T(0));
  for (const TokenRows::Run& run : batch.rows->runs()) {
    for (int64_t i = 0; i < run.count; ++i) {
      const int64_t g = run.global + i, s = g / batch.B + shift, b = g % batch.B;
      if (s < batch.full_S)
        out[static_cast<size_t>(run.local + i)] = x_BS ? x_BS[b * batch.full_S + s] : fill_without_x;
    }
  }
  return out;
}

// [x_TH ; y_TH] along the hidden dimension.
Tensor concat_columns(const Tensor& x_TH, const Tensor& y_TH) {
  const int64_t T = x_TH.dim(0), H = x_TH.dim(1);
  Tensor out = ops::activation_tensor({T, 2 * H});
  ops::copy_columns(out, 2 * H, 0, x_TH, H, 0, H);
  ops::copy_columns(out, 2 * H, H, y_TH, H, 0, H);
  return out;
}

// Columns [begin, begin + width) of x_TW.
Tensor column_block(const Tensor& x_TW, const int64_t begin, const int64_t width) {
  Tensor out = ops::activation_tensor({x_TW.dim(0), width});
  ops::copy_columns(out, width, 0, x_TW, x_TW.dim(1), begin, width);
  return out;
}

ops::DropoutSpec embedding_dropout(const ModelConfig& config, const bool training, const uint64_t seed,
                                   const uint64_t key, const int64_t row_global) {
  return ops::DropoutSpec{training ? static_cast<float>(config.hidden_dropout) : 0.0f, seed, key,
                          static_cast<uint64_t>(row_global * config.hidden_size)};
}

}  // namespace

int64_t mtp_layer_number(const int64_t num_layers, const int64_t depth) { return num_layers + 2 * depth; }
int64_t mtp_embedding_number(const int64_t num_layers, const int64_t depth) { return num_layers + 2 * depth + 1; }

MultiTokenPrediction::MultiTokenPrediction(const ModelConfig& config, const int module, ParamStore& params,
                                           BufferStore& buffers, const parallel::ParallelState& parallel,
                                           NormOverflowLog* norm_overflow_log,
                                           const VocabParallelEmbedding* word_embeddings,
                                           const ColumnParallelLinear* output_layer,
                                           const VocabParallelCrossEntropy* cross_entropy)
    : config_(config),
      tp_(TensorParallel::attention(parallel)),
      word_embeddings_(word_embeddings),
      output_layer_(output_layer),
      cross_entropy_(cross_entropy) {
  const int64_t H = config.hidden_size, L = config.num_layers;
  const NormOptions norm = norm_options(config, tp_.sequence_sharded(), module, norm_overflow_log);
  for (int64_t k = 0; k < config.mtp_num_layers; ++k) {
    const std::string prefix = "mtp.layers." + std::to_string(k) + ".";
    enorm_.emplace_back(prefix + "enorm", H, norm, params);
    hnorm_.emplace_back(prefix + "hnorm", H, norm, params);
    LinearOptions eh;
    eh.module = module;
    eh_proj_.emplace_back(prefix + "eh_proj", 2 * H, H, tp_, eh, params);
    // Megatron builds the depth's layer from the last decoder layer's spec (get_gpt_mtp_block_spec).
    layers_.emplace_back(config, L - 1, params, buffers, parallel, LayerPlacement{prefix + "mtp_model_layer.", module},
                         norm_overflow_log);
    final_norm_.emplace_back(prefix + "final_layernorm", H, norm, params);
  }
}

// eh_proj is column-parallel with its output gathered over TP, then scattered to the sequence shard under sequence
// parallelism (Megatron's _concat_embeddings).
Tensor MultiTokenPrediction::project(const size_t depth, const Tensor& cat_T2H, LinearActivations& saved) const {
  const Tensor y_TO = eh_proj_[depth].forward(cat_T2H, saved);
  if (tp_.size() == 1) return y_TO;
  const int64_t T = y_TO.dim(0), O = y_TO.dim(1), H = config_.hidden_size;
  const Tensor gathered = tp_.all_gather_rows(y_TO);  // rank r's [T, O] block at rows r T
  Tensor z_TH = ops::activation_tensor({T, H});
  for (int r = 0; r < tp_.size(); ++r) {
    ops::copy_columns(z_TH, H, r * O, gathered.view({tp_.size() * T, O}).slice_rows(r * T, (r + 1) * T), O, 0, O);
  }
  return tp_.sequence_sharded() ? tp_.split_rows(z_TH) : z_TH;
}

Tensor MultiTokenPrediction::project_backward(const size_t depth, const Tensor& dz_TH, const Tensor& rows_like,
                                              const LinearActivations& saved) const {
  Tensor dcat = ops::activation_tensor({rows_like.dim(0), 2 * config_.hidden_size});
  if (tp_.size() == 1) {
    eh_proj_[depth].backward(dcat, dz_TH, saved);
    return dcat;
  }
  const Tensor dz_full = tp_.sequence_sharded() ? tp_.all_gather_rows(dz_TH) : dz_TH;
  const int64_t O = eh_proj_[depth].out_local();
  eh_proj_[depth].backward(dcat, column_block(dz_full, tp_.rank() * O, O), saved);
  return dcat;
}

std::vector<double> MultiTokenPrediction::forward(const Tensor& h0_TH, const MtpBatch& batch,
                                                  const MtpForwardOptions& options, MtpActivations& saved) const {
  const int64_t S = batch.S, B = batch.B, T = S * B, D = depths();
  const TokenRows local = batch.rows->slice(tp_.row_offset(T), tp_.local_rows(T));
  const double weight = config_.mtp_loss_scaling_factor / static_cast<double>(D);
  saved = MtpActivations();
  saved.grad_seed = options.backward_seed;
  if (options.training) {
    saved.depths.resize(static_cast<size_t>(D));
  }
  std::vector<double> losses;
  Tensor hidden_TH = h0_TH;
  for (int64_t k = 0; k < D; ++k) {
    const auto d = static_cast<size_t>(k);
    const trace::Scope scope("mtp depth ", k, " forward", "forward");
    MtpDepthActivations scratch;
    MtpDepthActivations& a = options.training ? saved.depths[d] : scratch;
    const std::vector<int32_t> tokens = shifted_rows<int32_t>(batch.tokens_BS, batch, k + 1, 0);
    const std::vector<int32_t> labels = shifted_rows<int32_t>(batch.labels_BS, batch, k + 1, 0);
    const std::vector<float> mask = shifted_rows<float>(batch.loss_mask_BS, batch, k + 1, 1.0f);
    const Tensor emb_TH = word_embeddings_->forward(tokens);
    a.embedded_TH = ops::activation_tensor(emb_TH.shape());
    for (const TokenRows::Run& run : local.runs()) {
      Tensor out = a.embedded_TH.slice_rows(run.local, run.local + run.count);
      ops::dropout_forward(
          out, emb_TH.slice_rows(run.local, run.local + run.count),
          embedding_dropout(config_, options.training, options.dropout_seed, options.embedding_keys[d], run.global));
    }
    Tensor en_TH = ops::activation_tensor(emb_TH.shape());
    a.enorm_stats = enorm_[d].forward(en_TH, a.embedded_TH);
    Tensor hn_TH = ops::activation_tensor(hidden_TH.shape());
    a.hnorm_stats = hnorm_[d].forward(hn_TH, hidden_TH);
    a.hidden_in_TH = hidden_TH;
    const Tensor z_TH = project(d, concat_columns(en_TH, hn_TH), a.eh_proj);
    const LayerDropout dropout{options.training, options.dropout_seed, options.layer_streams[d], *batch.rows,
                               batch.sequence};
    a.layer_out_TH = layers_[d].forward(z_TH, S, B, dropout, a.layer);
    if (options.training && config_.recompute.full()) {
      // Full recomputation checkpoints each depth's norms, projection and layer (Megatron's
      // MultiTokenPredictionLayer._checkpointed_forward): the embedding and the hidden input are kept.
      TransformerLayer::drop_for_full_recompute(a.layer);
      a.eh_proj = LinearActivations{};
    }
    hidden_TH = ops::activation_tensor(a.layer_out_TH.shape());
    a.final_stats = final_norm_[d].forward(hidden_TH, a.layer_out_TH);

    // The depth's loss through the shared output layer, fused as the main loss (the logits are never stored).
    double unmasked = 0.0;
    for (const float m : mask) unmasked += m;
    // Each token's share: 1 / the depth's tokens (its token mean), or with per-token loss main tokens / depth tokens
    // (multi_token_prediction.py: mtp_loss * original_num_tokens / num_tokens, the sum rescaled to the main loss's).
    const double per_token = (options.per_token_loss ? options.main_loss_tokens : 1.0) / std::max(unmasked, 1.0);
    const Tensor input_TH = output_layer_->gather_input(hidden_TH);
    const Tensor& weight_VH = output_layer_->weight().value;
    Tensor losses_T = fp32_tensor({T});
    Tensor dlosses_T;
    if (options.training) {
      dlosses_T = fp32_tensor({T});
      for (int64_t t = 0; t < T; ++t) {
        dlosses_T.data<float>()[t] =
            static_cast<float>(mask[static_cast<size_t>(t)] * weight * per_token * options.backward_seed);
      }
      a.output_dinput_TH = ops::activation_tensor(input_TH.shape());
    }
    // The weight gradient goes straight into the main gradient, as the main loss's (gpt_model.cpp).
    const ops::VocabShard shard = cross_entropy_->shard();
    ops::linear_cross_entropy(losses_T, input_TH, weight_VH, labels, fused_logits_chunk_rows(T, weight_VH, shard),
                              options.training ? &dlosses_T : nullptr, options.training ? &a.output_dinput_TH : nullptr,
                              options.training ? &output_layer_->weight().grad : nullptr, &shard);
    double loss = 0.0;
    for (int64_t t = 0; t < T; ++t)
      loss += static_cast<double>(losses_T.data<float>()[t]) * mask[static_cast<size_t>(t)];
    losses.push_back(loss * per_token);
    if (options.training) a.tokens_SB = tokens;
  }
  return losses;
}

void MultiTokenPrediction::recompute_depth(const size_t depth, MtpDepthActivations& a, const int64_t S, const int64_t B,
                                           const LayerDropout& dropout) const {
  const trace::Scope scope("mtp depth ", depth, " recompute", "backward");
  Tensor en_TH = ops::activation_tensor(a.embedded_TH.shape());
  enorm_[depth].forward(en_TH, a.embedded_TH);
  Tensor hn_TH = ops::activation_tensor(a.hidden_in_TH.shape());
  hnorm_[depth].forward(hn_TH, a.hidden_in_TH);
  const Tensor z_TH = project(depth, concat_columns(en_TH, hn_TH), a.eh_proj);
  en_TH = hn_TH = Tensor();
  LayerDropout again = dropout;
  again.recompute = true;
  layers_[depth].forward(z_TH, S, B, again, a.layer);
}

Tensor MultiTokenPrediction::backward(MtpActivations& saved, const MtpBatch& batch, const double loss_scale,
                                      const double aux_grad_scale, const MtpForwardOptions& options) const {
  const int64_t S = batch.S, B = batch.B, T = S * B;
  const TokenRows local = batch.rows->slice(tp_.row_offset(T), tp_.local_rows(T));
  check_fused_backward_seed(saved.grad_seed, loss_scale);
  Tensor dnext_TH;  // d / d(the depth's output) from the next depth's hnorm
  for (int64_t k = depths(); k-- > 0;) {
    const auto d = static_cast<size_t>(k);
    const trace::Scope scope("mtp depth ", k, " backward", "backward");
    MtpDepthActivations& a = saved.depths[d];
    Tensor dh_TH = output_layer_->reduce_input_grad(a.output_dinput_TH);
    a.output_dinput_TH = Tensor();
    if (dnext_TH.defined()) ops::add_(dh_TH, dnext_TH);
    Tensor dlayer_TH = ops::activation_tensor(dh_TH.shape());
    final_norm_[d].backward(dlayer_TH, dh_TH, a.layer_out_TH, a.final_stats);
    dh_TH = Tensor();
    Tensor dz_TH = ops::activation_tensor(dlayer_TH.shape());
    const LayerDropout dropout{true, options.dropout_seed, options.layer_streams[d], *batch.rows, batch.sequence};
    if (config_.recompute.full()) recompute_depth(d, a, S, B, dropout);
    layers_[d].backward(dz_TH, dlayer_TH, S, B, dropout, aux_grad_scale, a.layer);
    a.layer = LayerActivations();
    dlayer_TH = Tensor();
    const Tensor dcat = project_backward(d, dz_TH, a.embedded_TH, a.eh_proj);
    const int64_t H = config_.hidden_size;
    const Tensor den_TH = column_block(dcat, 0, H), dhn_TH = column_block(dcat, H, H);
    Tensor de_TH = ops::activation_tensor(den_TH.shape());
    enorm_[d].backward(de_TH, den_TH, a.embedded_TH, a.enorm_stats);
    Tensor demb_TH = ops::activation_tensor(de_TH.shape());
    for (const TokenRows::Run& run : local.runs()) {
      Tensor out = demb_TH.slice_rows(run.local, run.local + run.count);
      ops::dropout_backward(
          out, de_TH.slice_rows(run.local, run.local + run.count),
          embedding_dropout(config_, true, options.dropout_seed, options.embedding_keys[d], run.global));
    }
    word_embeddings_->backward(demb_TH, a.tokens_SB);
    dnext_TH = ops::activation_tensor(dhn_TH.shape());
    hnorm_[d].backward(dnext_TH, dhn_TH, a.hidden_in_TH, a.hnorm_stats);
    a = MtpDepthActivations();
  }
  return dnext_TH;
}

}  // namespace moecore
