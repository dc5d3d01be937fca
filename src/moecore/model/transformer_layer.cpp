#include "moecore/model/transformer_layer.h"

#include <stdexcept>

#include "moecore/ops/dropout.h"
#include "moecore/ops/elementwise.h"
#include "moecore/ops/precision.h"
#include "moecore/ops/quantization.h"
#include "moecore/util/trace.h"

namespace moecore {
namespace {

// Sub-streams of a layer's RNG stream: 0 for the MoE router's input jitter, 1-3 for the dropout sites.
enum DropoutSite : uint64_t { kMoeRouterJitter = 0, kAttentionProbs = 1, kAfterAttention = 2, kAfterMlp = 3 };

// Dropout of `site`; element i of this rank's rows uses counter element_offset + i (the one-process index).
ops::DropoutSpec dropout_spec(const LayerDropout& dropout, const double p, const DropoutSite site,
                              const uint64_t element_offset = 0) {
  ops::DropoutSpec spec;
  spec.p = dropout.training ? static_cast<float>(p) : 0.0f;
  spec.seed = dropout.seed;
  spec.key = dropout.stream * 4 + site;
  spec.offset = element_offset;
  return spec;
}

// Hidden dropout over [rows, H] token rows: each run of rows draws at its one-process elements.
void dropout_rows_forward(Tensor& out_TH, const Tensor& in_TH, ops::DropoutSpec spec, const TokenRows& rows) {
  const int64_t H = in_TH.dim(1);
  for (const TokenRows::Run& run : rows.runs()) {
    spec.offset = static_cast<uint64_t>(run.global * H);
    Tensor out = out_TH.slice_rows(run.local, run.local + run.count);
    ops::dropout_forward(out, in_TH.slice_rows(run.local, run.local + run.count), spec);
  }
}

void dropout_rows_backward(Tensor& din_TH, const Tensor& dout_TH, ops::DropoutSpec spec, const TokenRows& rows) {
  const int64_t H = dout_TH.dim(1);
  for (const TokenRows::Run& run : rows.runs()) {
    spec.offset = static_cast<uint64_t>(run.global * H);
    Tensor din = din_TH.slice_rows(run.local, run.local + run.count);
    ops::dropout_backward(din, dout_TH.slice_rows(run.local, run.local + run.count), spec);
  }
}

// out = residual + dropout(branch).
Tensor dropout_add(const Tensor& branch, const Tensor& residual, const ops::DropoutSpec& spec, const TokenRows& rows) {
  Tensor out = ops::uninitialized_activation(branch.shape());
  dropout_rows_forward(out, branch, spec, rows);
  ops::add_(out, residual);
  return out;
}

// The layer's sequence: the model's, or (a layer used on its own) one plain sequence of S positions kept in `plain`.
const SequenceInfo& sequence_of(const LayerDropout& dropout, const int64_t S, const int64_t B, SequenceInfo& plain) {
  if (dropout.sequence != nullptr) return *dropout.sequence;
  plain.S = S;
  plain.B = B;
  plain.positions_SB.clear();
  for (int64_t s = 0; s < S; ++s) {
    for (int64_t b = 0; b < B; ++b) plain.positions_SB.push_back(s);
  }
  return plain;
}

// The layer's whole local rows (S * B), or this rank's sequence-parallel shard of them.
TokenRows layer_rows(const LayerDropout& dropout, const int64_t T) {
  return dropout.rows.count() == 0 ? TokenRows::contiguous(0, T) : dropout.rows;
}

// The saved tensors a norm output may also be kept as (the linear layers that take it: their input as the GEMM saw
// it, the norm output itself without sequence parallelism).
std::vector<Tensor*> ln1_consumers(LayerActivations& a) {
  return {&a.attention.qkv.input_TI, &a.mla_attention.q_down.input_TI, &a.mla_attention.q_up.input_TI,
          &a.mla_attention.kv_down.input_TI};
}

std::vector<Tensor*> ln2_consumers(LayerActivations& a) {
  return {&a.mlp.fc1.input_TI, &a.moe.shared.mlp.fc1.input_TI};
}

// Under FP8 / FP4 the linear layers reading a norm output keep it quantized (TE's LayerNormLinear saves ln_out
// quantized for wgrad, module/layernorm_linear.py), so the layer frees it where no saved tensor is still a view of it.
void drop_if_unshared(Tensor& out_TH, const std::vector<Tensor*>& consumers) {
  for (const Tensor* slot : consumers) {
    if (slot->defined() && slot->shares_storage(out_TH)) return;
  }
  out_TH = Tensor();
}

// Frees a norm output and every saved tensor that is the same view of it; returns which consumers were.
uint8_t drop_with_aliases(Tensor& out_TH, const std::vector<Tensor*>& consumers) {
  uint8_t aliases = 0;
  for (size_t i = 0; i < consumers.size(); ++i) {
    Tensor& slot = *consumers[i];
    if (!slot.shares_storage(out_TH)) continue;
    if (slot.data<float>() != out_TH.data<float>() || slot.numel() != out_TH.numel()) {
      throw std::logic_error("layernorm recompute: a saved tensor is part of a norm output");
    }
    slot = Tensor();
    aliases = static_cast<uint8_t>(aliases | (1U << i));
  }
  out_TH = Tensor();
  return aliases;
}

void restore_aliases(const uint8_t aliases, const std::vector<Tensor*>& consumers, const Tensor& out_TH) {
  for (size_t i = 0; i < consumers.size(); ++i) {
    if ((aliases >> i) & 1U) *consumers[i] = out_TH;
  }
}

}  // namespace

TransformerLayer::TransformerLayer(const ModelConfig& config, const int64_t index, ParamStore& params,
                                   BufferStore& buffers, const parallel::ParallelState& parallel,
                                   NormOverflowLog* norm_overflow_log)
    : TransformerLayer(config, index, params, buffers, parallel,
                       LayerPlacement{"decoder.layers." + std::to_string(index) + ".", static_cast<int>(index)},
                       norm_overflow_log) {}

TransformerLayer::TransformerLayer(const ModelConfig& config, const int64_t index, ParamStore& params,
                                   BufferStore& buffers, const parallel::ParallelState& parallel,
                                   const LayerPlacement& placement, NormOverflowLog* norm_overflow_log)
    : config_(config), index_(index), tp_(TensorParallel::attention(parallel)), prefix_(placement.prefix) {
  const size_t first_param = params.size();
  const int module = placement.module;
  const bool moe_layer = config.moe.is_moe_layer(index);
  if (!moe_layer && config.ffn_hidden_size % tp_.size() != 0) {
    throw ConfigError("--ffn-hidden-size (" + std::to_string(config.ffn_hidden_size) +
                      ") must be divisible by --tensor-model-parallel-size (" + std::to_string(tp_.size()) + ")");
  }
  const int64_t H = config.hidden_size;
  const NormOptions norm = norm_options(config, tp_.sequence_sharded(), module, norm_overflow_log);
  ln1_ = NormModule(prefix_ + "input_layernorm", H, norm, params);
  if (config.mla) {
    mla_ = MLASelfAttention(config, prefix_, tp_, module, norm_overflow_log, params, parallel.cp);
  } else {
    attention_ = SelfAttention(config, prefix_, tp_, module, norm_overflow_log, params, parallel.cp);
  }
  ln2_ = NormModule(prefix_ + "pre_mlp_layernorm", H, norm, params);
  if (moe_layer) {
    moe_ = std::make_unique<MoELayer>(config, prefix_, params, parallel, module, &buffers);
  } else {
    MLPOptions mlp;
    mlp.ffn_hidden_size = config.ffn_hidden_size;
    mlp.activation = config.activation;
    mlp.bias = config.add_bias_linear;
    mlp.linear.module = module;
    mlp_ = MLP(prefix_ + "mlp.", H, mlp, tp_, params);
  }
  // The linear layers of a quantized layer (attention, MLP, shared and routed experts; not the router or the
  // shared-expert gate, which are not linear layers) quantize their weights with the recipe's weight spec; under FP8
  // delayed scaling each keeps its scaling state beside its weight, as each TE module keeps its fp8_meta.
  if (const quant::QuantizedLinearConfig* q = config.layer_quantization(index)) {
    const quant::QuantSpec spec = quant::make_spec(
        q->recipe, quant::element_format_for(q->recipe, q->format, quant::Role::kWeight), quant::Role::kWeight);
    for (size_t i = first_param; i < params.size(); ++i) {
      if (!params[i].linear_weight) continue;
      params[i].weight_quantization = spec;
      if (q->recipe == quant::Recipe::kDelayed) {
        params[i].delayed_scaling = std::make_unique<quant::DelayedLinearScaling>(q->delayed, q->format);
      }
    }
  }
}

// The MoE layer always works on a sequence shard when TP > 1 (Megatron requires --sequence-parallel with MoE and
// TP; without it this rank takes its shard of the replicated input and the output is gathered back, same numbers).
Tensor TransformerLayer::moe_forward(const Tensor& x_TH, const int64_t S, const int64_t B, const LayerDropout& dropout,
                                     MoELayerActivations& saved) const {
  const TensorParallel moe_tp = tp_.sequence_sharded_always();
  const int64_t T = S * B;
  const Tensor x_shard = tp_.to_sequence_shard(x_TH);
  if (dropout.recompute) return tp_.from_sequence_shard(moe_->recompute(x_shard, saved, true));
  const Tensor out_shard = moe_->forward(
      x_shard, S / tp_.size(), B, layer_rows(dropout, T).slice(moe_tp.row_offset(T), moe_tp.local_rows(T)),
      dropout.training, dropout.seed, dropout.stream * 4 + kMoeRouterJitter, saved, dropout.routing_replay);
  return tp_.from_sequence_shard(out_shard);
}

void TransformerLayer::moe_backward(Tensor& dx_TH, const Tensor& dout_TH, const Tensor& x_TH, const int64_t /*S*/,
                                    const int64_t /*B*/, const double aux_grad_scale,
                                    const MoELayerActivations& saved) const {
  const Tensor dout_shard = tp_.from_sequence_shard_backward(dout_TH);
  const Tensor x_shard = tp_.to_sequence_shard(x_TH);
  const Tensor dx_shard = moe_->backward(dout_shard, x_shard, aux_grad_scale, saved);
  ops::add_(dx_TH, tp_.to_sequence_shard_backward(dx_shard));
}

Tensor TransformerLayer::forward(const Tensor& x_TH, const int64_t S, const int64_t B, const LayerDropout& dropout,
                                 LayerActivations& a) const {
  const int64_t T = S * B;
  const TokenRows rows = layer_rows(dropout, T).slice(tp_.row_offset(T), tp_.local_rows(T));
  const ActivationOwnerScope owner(ActivationOwner::kAttention);
  // FP8 / FP4: the linear layers and experts quantize (Megatron's get_fp8_context around each layer); the router
  // opens its own unquantized scope.
  const ops::ScopedLinearQuantization quantization(config_.layer_quantization(index_));
  if (dropout.training && !dropout.recompute && logs_delayed_scales()) {
    a.delayed_scales = std::make_unique<ops::DelayedScalesLog>();
  }
  const ops::ScopedDelayedScales delayed_scales(a.delayed_scales.get(), dropout.recompute
                                                                            ? ops::ScopedDelayedScales::Mode::kReplay
                                                                            : ops::ScopedDelayedScales::Mode::kRecord);
  a.x_TH = x_TH;
  a.ln1_TH = ops::uninitialized_activation(x_TH.shape());
  a.ln1_stats = ln1_.forward(a.ln1_TH, x_TH);
  // Who besides the linear layers keeps the norm outputs: the layer, for the recomputations that read them again.
  const RecomputeConfig& r = config_.recompute;
  const bool selective = r.granularity == RecomputeConfig::Granularity::kSelective;
  const InputKeepers ln1_keepers = selective && r.has("layernorm") ? InputKeepers::kShared : InputKeepers::kLinearOnly;
  const InputKeepers ln2_keepers =
      selective && (r.has("layernorm") || r.has("mlp")) ? InputKeepers::kShared : InputKeepers::kLinearOnly;
  const quant::QuantizedLinearConfig* quantized = config_.layer_quantization(index_);
  const bool saves_quantized = quantized != nullptr && quantized->save_quantized_input;
  Tensor attn_out_TH;
  {
    const trace::Scope scope("attention forward", "forward");
    SequenceInfo plain;
    const ops::DropoutSpec probs = dropout_spec(dropout, config_.attention_dropout, kAttentionProbs);
    attn_out_TH =
        config_.mla
            ? mla_.forward(a.ln1_TH, S, B, probs, a.mla_attention, sequence_of(dropout, S, B, plain), ln1_keepers)
            : attention_.forward(a.ln1_TH, S, B, probs, a.attention, sequence_of(dropout, S, B, plain), ln1_keepers);
  }
  if (saves_quantized && ln1_keepers == InputKeepers::kLinearOnly) drop_if_unshared(a.ln1_TH, ln1_consumers(a));
  a.x_mid_TH = dropout_add(attn_out_TH, x_TH, dropout_spec(dropout, config_.hidden_dropout, kAfterAttention), rows);
  MemoryTracker::instance().set_owner(mlp_owner());
  a.ln2_TH = ops::uninitialized_activation(x_TH.shape());
  a.ln2_stats = ln2_.forward(a.ln2_TH, a.x_mid_TH);
  Tensor mlp_out_TH;
  {
    const trace::Scope scope(moe_ ? "moe layer forward" : "mlp forward", "forward");
    mlp_out_TH =
        moe_ ? moe_forward(a.ln2_TH, S, B, dropout, a.moe) : mlp_.forward(a.ln2_TH, nullptr, a.mlp, ln2_keepers);
  }
  // (The MoE layer's backward reads its input again: the router's and the shared experts'.)
  if (!moe_ && saves_quantized && ln2_keepers == InputKeepers::kLinearOnly) {
    drop_if_unshared(a.ln2_TH, ln2_consumers(a));
  }
  Tensor out_TH = dropout_add(mlp_out_TH, a.x_mid_TH, dropout_spec(dropout, config_.hidden_dropout, kAfterMlp), rows);
  if (dropout.training && !dropout.recompute) drop_selected(a);
  return out_TH;
}

bool TransformerLayer::logs_delayed_scales() const {
  const quant::QuantizedLinearConfig* q = config_.layer_quantization(index_);
  return q != nullptr && q->recipe == quant::Recipe::kDelayed &&
         config_.recompute.granularity != RecomputeConfig::Granularity::kNone;
}

void TransformerLayer::drop_selected(LayerActivations& a) const {
  const RecomputeConfig& r = config_.recompute;
  if (r.granularity != RecomputeConfig::Granularity::kSelective) return;
  if (r.has("core_attn")) {
    if (config_.mla) {
      MLASelfAttention::drop_core_attention(a.mla_attention);
    } else {
      SelfAttention::drop_core_attention(a.attention);
    }
  }
  if (config_.mla && r.has("mla_up_proj")) MLASelfAttention::drop_up_proj(a.mla_attention);
  if (r.has("layernorm")) {
    a.ln1_aliases = drop_with_aliases(a.ln1_TH, ln1_consumers(a));
    a.ln2_aliases = drop_with_aliases(a.ln2_TH, ln2_consumers(a));
  }
  if (!moe_) {
    if (r.has("mlp")) a.mlp = MLPActivations{};
    return;
  }
  if (r.has("moe")) {
    MoELayer::drop_for_recompute(a.moe);
    return;
  }
  if (r.has("shared_experts") && moe_->has_shared_experts()) a.moe.shared = SharedExpertActivations{};
  if (r.has("moe_act")) moe_->drop_expert_activation(a.moe);
}

void TransformerLayer::recompute_mlp_branch(LayerActivations& a) const {
  const RecomputeConfig& r = config_.recompute;
  if (r.granularity != RecomputeConfig::Granularity::kSelective) return;
  if (r.has("layernorm")) {
    const trace::Scope scope("pre_mlp_layernorm recompute", "backward");
    a.ln2_TH = ops::uninitialized_activation(a.x_mid_TH.shape());
    ln2_.forward(a.ln2_TH, a.x_mid_TH);
    restore_aliases(a.ln2_aliases, ln2_consumers(a), a.ln2_TH);
  }
  if (!moe_) {
    if (r.has("mlp")) {
      const trace::Scope scope("mlp recompute", "backward");
      mlp_.forward(a.ln2_TH, nullptr, a.mlp);
    }
    return;
  }
  const Tensor x_shard = tp_.to_sequence_shard(a.ln2_TH);
  if (r.has("moe")) {
    moe_->recompute(x_shard, a.moe, false);
    return;
  }
  if (r.has("shared_experts") && moe_->has_shared_experts()) moe_->recompute_shared(x_shard, a.moe);
  if (r.has("moe_act")) moe_->recompute_expert_activation(a.moe);
}

void TransformerLayer::recompute_attention_branch(LayerActivations& a, const int64_t S, const int64_t B,
                                                  const LayerDropout& dropout, const SequenceInfo& sequence) const {
  const RecomputeConfig& r = config_.recompute;
  if (r.granularity != RecomputeConfig::Granularity::kSelective) return;
  const trace::Scope scope("attention recompute", "backward");
  if (r.has("layernorm")) {
    a.ln1_TH = ops::uninitialized_activation(a.x_TH.shape());
    ln1_.forward(a.ln1_TH, a.x_TH);
    restore_aliases(a.ln1_aliases, ln1_consumers(a), a.ln1_TH);
  }
  const ops::DropoutSpec probs = dropout_spec(dropout, config_.attention_dropout, kAttentionProbs);
  if (config_.mla) {
    if (r.has("mla_up_proj")) mla_.recompute_up_proj(a.mla_attention, S, B, sequence);
    if (r.has("core_attn")) mla_.recompute_core_attention(a.mla_attention, S, B, probs, sequence);
  } else if (r.has("core_attn")) {
    attention_.recompute_core_attention(a.attention, S, B, probs, sequence);
  }
}

void TransformerLayer::drop_for_full_recompute(LayerActivations& a) {
  LayerActivations kept;
  MoELayer::drop_for_recompute(a.moe);
  kept.moe = std::move(a.moe);
  kept.delayed_scales = std::move(a.delayed_scales);
  a = std::move(kept);
}

void TransformerLayer::backward(Tensor& dx_TH, const Tensor& dout_TH, const int64_t S, const int64_t B,
                                const LayerDropout& dropout, const double aux_grad_scale, LayerActivations& a) const {
  const int64_t T = S * B;
  const TokenRows rows = layer_rows(dropout, T).slice(tp_.row_offset(T), tp_.local_rows(T));
  const ops::ScopedLinearQuantization quantization(config_.layer_quantization(index_));
  const ops::ScopedDelayedScales delayed_scales(a.delayed_scales.get(), ops::ScopedDelayedScales::Mode::kReplay);
  SequenceInfo plain;
  const SequenceInfo& sequence = sequence_of(dropout, S, B, plain);

  // MLP branch: out = x_mid + dropout(mlp(ln2(x_mid))).
  const ActivationOwnerScope owner(mlp_owner());
  Tensor dx_mid_TH = dout_TH.clone(MemCategory::kActivations);
  Tensor dmlp_TH = ops::activation_tensor(dout_TH.shape());
  dropout_rows_backward(dmlp_TH, dout_TH, dropout_spec(dropout, config_.hidden_dropout, kAfterMlp), rows);
  Tensor dln2_TH = ops::activation_tensor(dout_TH.shape());
  recompute_mlp_branch(a);
  {
    const trace::Scope scope(moe_ ? "moe layer backward" : "mlp backward", "backward");
    if (moe_) {
      moe_backward(dln2_TH, dmlp_TH, a.ln2_TH, S, B, aux_grad_scale, a.moe);
    } else {
      mlp_.backward(dln2_TH, nullptr, dmlp_TH, nullptr, a.mlp);
    }
  }
  dmlp_TH = Tensor();
  ln2_.backward(dx_mid_TH, dln2_TH, a.x_mid_TH, a.ln2_stats);
  dln2_TH = Tensor();

  // Attention branch: x_mid = x + dropout(attention(ln1(x))).
  MemoryTracker::instance().set_owner(ActivationOwner::kAttention);
  ops::add_(dx_TH, dx_mid_TH);
  Tensor dattn_TH = ops::activation_tensor(dout_TH.shape());
  dropout_rows_backward(dattn_TH, dx_mid_TH, dropout_spec(dropout, config_.hidden_dropout, kAfterAttention), rows);
  dx_mid_TH = Tensor();
  Tensor dln1_TH = ops::activation_tensor(dout_TH.shape());
  recompute_attention_branch(a, S, B, dropout, sequence);
  {
    const trace::Scope scope("attention backward", "backward");
    const ops::DropoutSpec probs = dropout_spec(dropout, config_.attention_dropout, kAttentionProbs);
    if (config_.mla) {
      mla_.backward(dln1_TH, dattn_TH, S, B, probs, a.mla_attention, sequence);
    } else {
      attention_.backward(dln1_TH, dattn_TH, S, B, probs, a.attention, sequence);
    }
  }
  dattn_TH = Tensor();
  ln1_.backward(dx_TH, dln1_TH, a.x_TH, a.ln1_stats);
}

Tensor TransformerLayer::forward_decode(const Tensor& x_TH, const std::span<const int64_t> positions,
                                        LayerKvCache& cache) const {
  const int64_t T = x_TH.dim(0);
  const LayerDropout inference;  // no dropout, no router jitter
  const TokenRows rows = TokenRows::contiguous(0, T);
  const ops::ScopedLinearQuantization quantization(config_.layer_quantization(index_));
  Tensor ln1_TH = ops::uninitialized_activation(x_TH.shape());
  ln1_.forward(ln1_TH, x_TH);
  const Tensor attn_out_TH =
      config_.mla ? mla_.forward_decode(ln1_TH, positions, cache) : attention_.forward_decode(ln1_TH, positions, cache);
  ln1_TH = Tensor();
  const Tensor x_mid_TH = dropout_add(attn_out_TH, x_TH, dropout_spec(inference, 0.0, kAfterAttention), rows);
  Tensor ln2_TH = ops::uninitialized_activation(x_TH.shape());
  ln2_.forward(ln2_TH, x_mid_TH);
  MoELayerActivations moe_scratch;
  MLPActivations mlp_scratch;
  const Tensor mlp_out_TH =
      moe_ ? moe_forward(ln2_TH, T, 1, inference, moe_scratch) : mlp_.forward(ln2_TH, nullptr, mlp_scratch);
  return dropout_add(mlp_out_TH, x_mid_TH, dropout_spec(inference, 0.0, kAfterMlp), rows);
}

}  // namespace moecore
