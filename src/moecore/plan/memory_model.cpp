#include "moecore/plan/memory_model.h"

#include <algorithm>
#include <map>

#include "moecore/config/optimizer_master.h"
#include "moecore/pipeline/pipeline_layout.h"
#include "moecore/plan/moecore_engine_memory.h"
#include "moecore/plan/pipeline_peak.h"

namespace moecore::plan {
namespace {

// ---------------------------------------------------------------------------------------------------------------
// Parameters (elements), split by how ranks hold them.
struct ParamCounts {
  double tp_sharded = 0;  // split over tensor parallelism, replicated over data parallelism
  double replicated = 0;  // norms, router, MLA down-projections: whole on every tensor-parallel rank
  double experts = 0;     // routed experts: split over expert and expert-tensor parallelism

  ParamCounts& operator+=(const ParamCounts& o) {
    tp_sharded += o.tp_sharded;
    replicated += o.replicated;
    experts += o.experts;
    return *this;
  }
};

double norm_size(const ModelConfig& c) { return c.normalization == Normalization::kLayerNorm ? 2.0 : 1.0; }

// Megatron's theoretical_memory_usage.py counts, with MLA's down-projections replicated over tensor parallelism as
// Megatron builds them (linear_q_down_proj / linear_kv_down_proj are not split).
ParamCounts attention_params(const PlanModel& model) {
  const ModelConfig& c = model.config;
  const double h = static_cast<double>(c.hidden_size);
  const double ns = norm_size(c);
  const double bias = c.add_bias_linear ? 1.0 : 0.0;
  ParamCounts p;
  p.replicated += 2.0 * ns * h;  // input_layernorm, pre_mlp_layernorm
  if (c.mla) {
    const MlaConfig& m = *c.mla;
    const double n = static_cast<double>(c.num_attention_heads);
    const double q_head = static_cast<double>(m.qk_head_dim + m.qk_pos_emb_head_dim);
    if (m.q_lora_rank > 0) {
      const double r = static_cast<double>(m.q_lora_rank);
      p.replicated += h * r + ns * r;  // q down-projection, q_layernorm
      p.tp_sharded += r * n * q_head;  // q up-projection
    } else {
      p.tp_sharded += h * n * q_head;
    }
    const double kv = static_cast<double>(m.kv_lora_rank);
    p.replicated += h * (kv + static_cast<double>(m.qk_pos_emb_head_dim)) + ns * kv;
    p.tp_sharded += kv * n * static_cast<double>(m.qk_head_dim + m.v_head_dim);
    p.tp_sharded += n * static_cast<double>(m.v_head_dim) * h + bias * h;
    return p;
  }
  const double qkv = static_cast<double>(c.qkv_out());
  const double q = static_cast<double>(c.num_attention_heads * c.kv_channels);
  p.tp_sharded += qkv * (h + bias) + q * h + bias * h;
  if (c.qk_layernorm) p.replicated += 2.0 * ns * static_cast<double>(c.kv_channels);
  return p;
}

ParamCounts mlp_params(const ModelConfig& c, const bool moe_layer) {
  const double h = static_cast<double>(c.hidden_size);
  const double bias = c.add_bias_linear ? 1.0 : 0.0;
  const double glu = c.activation == Activation::kSwiGLU ? 2.0 : 1.0;
  // An MLP d -> width -> d (d: h, or the routed experts' latent width).
  const auto mlp_of = [&](const double d, const double width, const double b) {
    return glu * width * (d + b) + width * d + b * d;
  };
  const auto mlp = [&](const double width, const double b) { return mlp_of(h, width, b); };
  ParamCounts p;
  if (!moe_layer) {
    p.tp_sharded += mlp(static_cast<double>(c.ffn_hidden_size), bias);
    return p;
  }
  const MoEConfig& moe = c.moe;
  p.replicated += static_cast<double>(moe.num_experts) * h;  // router
  const double shared = static_cast<double>(moe.shared_expert_intermediate_size);
  if (shared > 0) {
    p.tp_sharded += mlp(shared, 0.0);
    if (moe.shared_expert_gate) p.replicated += h;
  }
  const double latent = static_cast<double>(moe.latent_size);
  p.experts += static_cast<double>(moe.num_experts) *
               mlp_of(latent > 0 ? latent : h, static_cast<double>(moe.ffn_hidden_size), bias);
  p.replicated += latent * (2.0 * h + bias) + (latent > 0 ? bias * h : 0.0);  // LatentMoE's projections
  return p;
}

ParamCounts layer_params(const PlanModel& model, const bool moe_layer) {
  ParamCounts p = attention_params(model);
  p += mlp_params(model.config, moe_layer);
  return p;
}

bool last_layer_is_moe(const ModelConfig& c) { return c.moe.enabled() && c.moe.is_moe_layer(c.num_layers - 1); }

// An MTP block: one transformer layer of the last decoder layer's kind, enorm and hnorm, eh_proj [2h -> h] and its
// own final norm (Megatron's MultiTokenPredictionLayer); it shares the embedding and output layer.
ParamCounts mtp_params(const PlanModel& model) {
  const ModelConfig& c = model.config;
  const double h = static_cast<double>(c.hidden_size);
  ParamCounts p = layer_params(model, last_layer_is_moe(c));
  p.replicated += 3.0 * norm_size(c) * h;
  p.tp_sharded += 2.0 * h * h;
  return p;
}

double embedding_params(const ModelConfig& c) {
  double e = static_cast<double>(c.vocab_size) * static_cast<double>(c.hidden_size);
  if (c.position_embedding_type == PositionEmbedding::kLearnedAbsolute) {
    e += static_cast<double>(c.max_position_embeddings) * static_cast<double>(c.hidden_size);
  }
  return e;
}

// ---------------------------------------------------------------------------------------------------------------
// Activations: what one layer keeps for backward per micro-batch on one rank.
enum class Discard { kNone, kLayernorm, kMlaUpProj, kMoeAct };
enum class Module { kAttention, kMlp, kMoe, kShared, kOther };

struct Saved {
  const char* group;     // shown in the breakdown
  double elements = 0;   // on this rank, per micro-batch
  double bytes_per = 2;  // high-precision bytes per element
  Discard discard = Discard::kNone;
  Module module = Module::kOther;
  bool module_input = false;  // kept by a whole-module recompute of `module` (its input)
  // Under FP8 a linear layer keeps its input quantized (one byte per element): kOnly when the linear is the
  // tensor's only keeper (the high-precision copy is freed), kExtra when another op keeps it too.
  enum class Fp8 { kNo, kOnly, kExtra } fp8 = Fp8::kNo;
};

struct ActivationContext {
  const PlanArgs& args;
  double tokens = 0;   // per micro-batch on a rank before the sequence-parallel split: s * b / CP
  double seq_div = 1;  // TP under sequence parallelism
  double tp = 1, etp = 1;
  double act_bytes = 2;  // the activations' dtype
  bool fp8 = false;
  // Megatron sets linear_proj to keep its original input, not a quantized copy, except under delayed scaling
  // (attention.py / multi_latent_attention.py: set_save_original_input, TransformerEngine >= 2.6).
  bool proj_keeps_original = false;
  bool cpu_engine = false;
};

std::vector<Saved> layer_saved(const ActivationContext& x, const bool moe_layer) {
  const PlanModel& model = x.args.model;
  const ModelConfig& c = model.config;
  const double h = static_cast<double>(c.hidden_size);
  const double t = x.tokens, ts = x.tokens / x.seq_div;
  const double a = x.act_bytes;
  std::vector<Saved> s;
  const auto add = [&](const char* group, double elements, double bytes, Discard d, Module m, Saved::Fp8 f,
                       bool module_input = false) {
    s.push_back(Saved{group, elements, bytes, d, m, module_input, f});
  };
  using F = Saved::Fp8;
  // The attention output is kept by the attention kernel for its backward; linear_proj adds a quantized copy only
  // when it does not keep the original.
  const F o_fp8 = x.proj_keeps_original ? F::kNo : F::kExtra;
  // Attention block. The norm keeps its input (the layer input); column-parallel linears keep their input before
  // the sequence-parallel all-gather (Megatron's LinearWithGradAccumulationAndAsyncCommunication).
  add("attention norm", ts * h, a, Discard::kNone, Module::kAttention, F::kNo);
  add("attention norm", ts * h, a, Discard::kLayernorm, Module::kAttention, F::kOnly);
  if (c.mla) {
    const MlaConfig& m = *c.mla;
    const double n = static_cast<double>(c.num_attention_heads) / x.tp;
    // Down-projections are not split over TP: their outputs (and the q / kv norms') are whole on each TP rank.
    if (m.q_lora_rank > 0) {
      const double r = static_cast<double>(m.q_lora_rank);
      add("attention projections", t * r, a, Discard::kNone, Module::kAttention, F::kNo);         // q_layernorm in
      add("attention projections", t * r, a, Discard::kLayernorm, Module::kAttention, F::kOnly);  // q up-proj in
    }
    const double kv = static_cast<double>(m.kv_lora_rank);
    add("attention projections", t * kv, a, Discard::kNone, Module::kAttention, F::kNo);
    add("attention projections", t * kv, a, Discard::kLayernorm, Module::kAttention, F::kOnly);
    const double qk = static_cast<double>(m.qk_head_dim + m.qk_pos_emb_head_dim);
    // Q and K after RoPE and V: the up-projections' outputs, kept by the attention kernel.
    add("core attention", t * n * (2.0 * qk + static_cast<double>(m.v_head_dim)), a, Discard::kMlaUpProj,
        Module::kAttention, F::kNo);
    add("core attention", t * n * static_cast<double>(m.v_head_dim), a, Discard::kNone, Module::kAttention,
        o_fp8);                                                                   // O (and linear_proj's input)
    add("core attention", t * n, 4, Discard::kNone, Module::kAttention, F::kNo);  // softmax log-sum-exp
  } else {
    const double n = static_cast<double>(c.num_attention_heads) / x.tp;
    const double g = static_cast<double>(c.num_query_groups) / x.tp;
    const double d = static_cast<double>(c.kv_channels);
    add("core attention", t * (n + 2.0 * g) * d, a, Discard::kNone, Module::kAttention, F::kNo);
    // --qk-layernorm: the per-head norms keep the projected queries and keys.
    if (c.qk_layernorm) add("core attention", t * (n + g) * d, a, Discard::kNone, Module::kAttention, F::kNo);
    add("core attention", t * n * d, a, Discard::kNone, Module::kAttention, o_fp8);
    add("core attention", t * n, 4, Discard::kNone, Module::kAttention, F::kNo);
  }
  if (c.hidden_dropout > 0) add("dropout masks", 2.0 * ts * h, 1, Discard::kNone, Module::kOther, F::kNo);

  // MLP block.
  const double glu = c.activation == Activation::kSwiGLU ? 2.0 : 1.0;
  add("mlp norm", ts * h, a, Discard::kNone, Module::kOther, F::kNo);
  if (!moe_layer) {
    const double f = static_cast<double>(c.ffn_hidden_size) / x.tp;
    add("mlp norm", ts * h, a, Discard::kLayernorm, Module::kMlp, F::kOnly, true);
    add("dense mlp", t * glu * f, a, Discard::kNone, Module::kMlp, F::kNo);
    add("dense mlp", t * f, a, Discard::kNone, Module::kMlp, F::kOnly);
    return s;
  }
  const MoEConfig& moe = c.moe;
  const double k = static_cast<double>(moe.topk);
  const double experts = static_cast<double>(moe.num_experts);
  // The router's input is the same tensor as the shared experts' and the dispatcher's: kept in high precision.
  add("mlp norm", ts * h, a, Discard::kLayernorm, Module::kMoe, F::kNo, true);
  add("router", ts * experts * 2.0, 4, Discard::kNone, Module::kMoe, F::kNo);  // fp32 logits and scores
  // Routed tokens at the experts: each token's k copies, all-gathered over expert-TP (balanced routing).
  const double routed = ts * k * x.etp;
  const double fm = static_cast<double>(moe.ffn_hidden_size) / x.etp;
  const double latent = static_cast<double>(moe.latent_size), xw = latent > 0 ? latent : h;
  add("routed experts", routed * xw, a, Discard::kNone, Module::kMoe, F::kOnly);      // fc1 input
  add("routed experts", routed * glu * fm, a, Discard::kNone, Module::kMoe, F::kNo);  // fc1 output
  add("routed experts", routed * fm, a, Discard::kMoeAct, Module::kMoe, F::kOnly);    // fc2 input
  if (!x.args.memory_efficient_permutation) {
    add("routed experts", ts * k * xw, a, Discard::kNone, Module::kMoe, F::kNo);  // fc2 output, for d(prob)
  }
  // LatentMoE: fc2_latent_proj keeps its input, the combined output (fc1_latent_proj reads the kept norm output).
  if (latent > 0) add("latent projections", ts * latent, a, Discard::kNone, Module::kMoe, F::kOnly);
  const double sh = static_cast<double>(moe.shared_expert_intermediate_size) / x.tp;
  if (sh > 0) {
    // fc1's input is the norm output; under FP8 fc1 adds a quantized copy, except with layernorm recompute, where
    // Megatron makes it keep the (discarded, recomputed) original (MoELayer.set_for_recompute_pre_mlp_layernorm).
    if (x.fp8) add("shared experts", ts * h, 0, Discard::kLayernorm, Module::kShared, F::kExtra);
    add("shared experts", t * glu * sh, a, Discard::kNone, Module::kShared, F::kNo);
    add("shared experts", t * sh, a, Discard::kNone, Module::kShared, F::kOnly);
  }
  return s;
}

struct ModuleTotals {
  std::map<std::string, double> by_group;
  double total = 0;
  double largest = 0;  // the largest single tensor (for backward's transient gradient buffers)
  void add(const std::string& group, const double bytes) {
    by_group[group] += bytes;
    total += bytes;
    largest = std::max(largest, bytes);
  }
};

// Bytes one layer keeps per micro-batch after recompute and FP8 choices.
ModuleTotals kept_bytes(const ActivationContext& x, const std::vector<Saved>& saved) {
  const Recompute& r = x.args.recompute;
  ModuleTotals totals;
  for (const Saved& item : saved) {
    const bool whole_module = (item.module == Module::kMlp && r.has("mlp")) ||
                              (item.module == Module::kMoe && r.has("moe")) ||
                              (item.module == Module::kShared && (r.has("shared_experts") || r.has("moe")));
    if (whole_module && !item.module_input) continue;
    const bool discarded = (item.discard == Discard::kLayernorm && r.has("layernorm")) ||
                           (item.discard == Discard::kMlaUpProj && r.has("mla_up_proj")) ||
                           (item.discard == Discard::kMoeAct && r.has("moe_act"));
    if (discarded) continue;
    double bytes = item.elements * item.bytes_per;
    if (x.fp8 && item.fp8 == Saved::Fp8::kOnly) bytes = item.elements;
    if (x.fp8 && item.fp8 == Saved::Fp8::kExtra) bytes += item.elements;
    if (bytes > 0) totals.add(item.group, bytes);
  }
  return totals;
}

// What a model chunk holds besides its decoder layers.
ModuleTotals chunk_extras(const ActivationContext& x, const bool embedding, const bool loss, const int64_t mtp) {
  const ModelConfig& c = x.args.model.config;
  const double h = static_cast<double>(c.hidden_size);
  const double ts = x.tokens / x.seq_div;
  const double vocab = static_cast<double>(c.vocab_size) / x.tp;
  const double a = x.act_bytes;
  ModuleTotals totals;
  if (embedding) {
    totals.add("embedding", x.tokens * 8.0);  // token ids (int64)
    if (c.hidden_dropout > 0) totals.add("embedding", ts * h);
  }
  // The output layer's input and Megatron's vocabulary-parallel cross entropy's fp32 softmax [tokens, V / TP].
  const auto output_layer = [&] {
    totals.add("output layer", 2.0 * ts * h * a);  // final norm input and output
    totals.add("output layer", x.tokens * vocab * 4.0);
  };
  if (loss) output_layer();
  for (int64_t i = 0; i < mtp; ++i) {
    const ModuleTotals layer = kept_bytes(x, layer_saved(x, last_layer_is_moe(c)));
    totals.add("mtp", layer.total);
    totals.add("mtp", 4.0 * ts * h * a);  // enorm and hnorm inputs, eh_proj input [2h]
    totals.add("mtp", 2.0 * ts * h * a + x.tokens * vocab * 4.0);
  }
  return totals;
}

struct Chunk {
  ModuleTotals kept;     // per micro-batch
  double transient = 0;  // on top of the kept bytes while its backward runs
  int64_t layers = 0;
  int64_t mtp = 0;
};

Chunk make_chunk(const ActivationContext& x, const PipelineStage& stage, const int64_t mtp) {
  const ModelConfig& c = x.args.model.config;
  const Recompute& r = x.args.recompute;
  const double h = static_cast<double>(c.hidden_size);
  const double ts = x.tokens / x.seq_div;
  Chunk chunk;
  chunk.layers = stage.num_layers;
  chunk.mtp = mtp;
  std::vector<double> layer_totals;
  for (int64_t l = stage.first_layer; l < stage.end_layer(); ++l) {
    const bool moe_layer = c.moe.enabled() && c.moe.is_moe_layer(l);
    ModuleTotals layer = kept_bytes(x, layer_saved(x, moe_layer));
    layer_totals.push_back(layer.total);
    chunk.transient = std::max(chunk.transient, 2.0 * layer.largest);
    const int64_t index = l - stage.first_layer;
    // Full recompute (Megatron's TransformerBlock._checkpointed_forward): only each checkpoint's input is kept.
    const bool checkpointed = r.granularity == Recompute::Granularity::kFull &&
                              (r.method == Recompute::Method::kUniform || index < r.num_layers);
    if (checkpointed) {
      const bool first_of_group = r.method == Recompute::Method::kBlock || index % r.num_layers == 0;
      if (first_of_group) chunk.kept.add("checkpointed layer inputs", ts * h * x.act_bytes);
      continue;
    }
    for (const auto& [group, bytes] : layer.by_group) chunk.kept.add(group, bytes);
  }
  if (r.granularity == Recompute::Granularity::kFull && !layer_totals.empty()) {
    // Backward re-runs one checkpoint at a time: its layers' activations exist again while it runs.
    const int64_t group = r.method == Recompute::Method::kUniform ? r.num_layers : 1;
    double rerun = 0;
    for (size_t i = 0; i < layer_totals.size(); i += static_cast<size_t>(group)) {
      double sum = 0;
      for (size_t j = i; j < std::min(layer_totals.size(), i + static_cast<size_t>(group)); ++j) sum += layer_totals[j];
      rerun = std::max(rerun, sum);
    }
    chunk.transient += rerun;
  }
  const ModuleTotals extras = chunk_extras(x, stage.has_embedding, stage.has_loss, mtp);
  for (const auto& [group, bytes] : extras.by_group) chunk.kept.add(group, bytes);
  return chunk;
}

// ---------------------------------------------------------------------------------------------------------------
struct Bytes {
  double weight = 4, grad = 4, optimizer = 8;  // per parameter; optimizer before the distributed optimizer's split
  double optimizer_main = 0;                   // of which main parameters
};

Bytes bytes_per_parameter(const PlanArgs& args) {
  const TrainingArgs& t = args.train;
  const bool low = t.model.params_dtype != DType::kF32;
  const auto size_of = [](const std::string& dtype) { return dtype == "fp32" ? 4.0 : dtype == "fp8" ? 1.0 : 2.0; };
  Bytes b;
  b.weight = low ? 2.0 : 4.0;
  if (args.cluster.moecore_cpu_engine) {
    // moecore keeps weights and gradients as fp32 buffers; 16-bit weights get fp32 main parameters in the optimizer.
    b.weight = 4.0;
    b.grad = 4.0;
  } else {
    if ((t.fp8_param_gather || t.fp4_param_gather) && t.use_distributed_optimizer) {
      b.weight = t.fp4_param_gather ? 0.5 : 1.0;
    }
    if (t.model.params_dtype == DType::kBF16) {
      b.grad = t.grad_reduce_in_bf16 || t.main_grads_dtype == "bf16" ? 2.0 : 4.0;
    } else if (t.model.params_dtype == DType::kF16) {
      b.grad = t.accumulate_allreduce_grads_in_fp32 ? 4.0 : 2.0;
    }
  }
  // bf16 weights' fp32 main parameters as 16-bit remainders where Megatron stores them (config/optimizer_master.h).
  const double main = !low ? 0.0 : stores_param_remainders(t) ? 2.0 : size_of(t.main_params_dtype);
  b.optimizer = main + size_of(t.exp_avg_dtype) + size_of(t.exp_avg_sq_dtype);
  b.optimizer_main = main;
  return b;
}

// Megatron-FSDP (megatron/core/distributed/fsdp/src/megatron_fsdp/param_and_grad_buffer.py,
// _init_each_parameter_group_buffers): per parameter group a model-weight buffer in the weights' dtype, a main-weight
// buffer in megatron_fsdp_main_params_dtype (fp32 by default, also for fp32 weights) and a main-gradient buffer in
// megatron_fsdp_main_grads_dtype (default: the weights' dtype). The strategy distributes them: optim the main weights
// (and with them the Adam states), optim_grads also the gradients, optim_grads_params also the model weights; no_shard
// none. Dense parameters shard over dp-cp, routed experts over expert-DP; the parameters outside the units (embedding,
// final norm, output layer) stay whole, as in moecore's engine (optim/fsdp.h). Rewrites the stage's weights,
// gradients and optimizer bytes; returns the transient unit buffers: a unit's weights are gathered whole before its
// forward and backward, its gradients reduced from a whole buffer, and with the prefetch (and the reduce-scatter
// running behind the next unit's backward) two units' worth of each are live ("at least two FSDP units worth of
// un-sharded weight memory", docs/user-guide/features/megatron_fsdp.md).
double megatron_fsdp_memory(const TrainingArgs& t, const LayoutSizes& sizes, const Bytes& b, StageMemory& stage) {
  const std::string& strategy = t.data_parallel_sharding_strategy;
  const bool zero3 = strategy == "optim_grads_params";
  const bool sharded_grads = zero3 || strategy == "optim_grads";
  const bool sharded_optimizer = strategy != "no_shard";
  const StageMemory::FsdpElements& e = stage.fsdp;
  const double saved = e.unit_dense * (1.0 - 1.0 / sizes.dp_cp()) + e.unit_expert * (1.0 - 1.0 / sizes.edp());
  const double grad_bytes = b.weight;                    // main gradients in the weights' dtype
  const double main_bytes = 4.0;                         // fp32 main weights
  const double states = b.optimizer - b.optimizer_main;  // Adam's two moments
  stage.weights = (e.dense + e.expert - (zero3 ? saved : 0.0)) * b.weight;
  stage.grads = (e.dense + e.expert - (sharded_grads ? saved : 0.0)) * grad_bytes;
  const double shard = sharded_optimizer ? e.dense / sizes.dp_cp() + e.expert / sizes.edp() : e.dense + e.expert;
  stage.main_weights_and_optimizer = shard * (main_bytes + states);
  return 2.0 * e.largest_unit * ((zero3 ? b.weight : 0.0) + (sharded_grads ? grad_bytes : 0.0));
}

}  // namespace

double count_parameters(const PlanModel& model) {
  const ModelConfig& c = model.config;
  ParamCounts p;
  for (int64_t l = 0; l < c.num_layers; ++l) p += layer_params(model, c.moe.enabled() && c.moe.is_moe_layer(l));
  for (int64_t i = 0; i < c.mtp_num_layers; ++i) p += mtp_params(model);
  double total =
      p.tp_sharded + p.replicated + p.experts + embedding_params(c) + norm_size(c) * static_cast<double>(c.hidden_size);
  if (c.untie_embeddings_and_output_weights) total += static_cast<double>(c.vocab_size * c.hidden_size);
  return total;
}

const StageMemory& MemoryPlan::worst() const {
  if (worst_over_ranks) return *worst_over_ranks;
  return *std::max_element(stages.begin(), stages.end(),
                           [](const StageMemory& a, const StageMemory& b) { return a.total() < b.total(); });
}

MemoryPlan estimate_plan_memory(const PlanArgs& args) {
  if (args.cluster.moecore_cpu_engine) return moecore_engine_memory(args);
  const TrainingArgs& t = args.train;
  const PlanModel& model = args.model;
  const ModelConfig& c = model.config;
  const PipelineLayout layout = pipeline_layout(t);
  const LayoutSizes sizes = layout_sizes(args);
  const int pp = sizes.pp, vpp = sizes.vpp;
  const double tp = sizes.tp(), cp = sizes.cp(), ep = sizes.ep(), etp = sizes.etp();
  const Bytes b = bytes_per_parameter(args);

  ActivationContext x{args};
  x.tokens = static_cast<double>(c.seq_length) * static_cast<double>(t.micro_batch_size) / cp;
  x.seq_div = t.sequence_parallel ? tp : 1.0;
  x.tp = tp;
  x.etp = etp;
  x.cpu_engine = args.cluster.moecore_cpu_engine;
  x.act_bytes = !x.cpu_engine && c.params_dtype != DType::kF32 ? 2.0 : 4.0;
  x.fp8 = !x.cpu_engine && (t.fp8_format.has_value() || t.fp4_format.has_value());
  x.proj_keeps_original = t.fp4_format.has_value() || t.fp8_recipe.value_or("delayed") != "delayed";

  const std::map<int64_t, int64_t> mtp_at = mtp_layers_by_stage(args, pp, vpp);

  const int64_t microbatches = sizes.microbatches;
  MemoryPlan plan;
  plan.total_parameters = count_parameters(model);
  for (int r = 0; r < pp; ++r) {
    StageMemory stage;
    stage.pp_rank = r;
    ParamCounts params, units;  // units: the decoder layers, Megatron-FSDP's units
    double largest_unit = 0;
    double embedding = 0;
    std::vector<Chunk> chunks;
    bool holds_embedding = false;
    for (int v = 0; v < vpp; ++v) {
      const PipelineStage& s = layout.stage(r, v);
      const auto mtp_it = mtp_at.find(static_cast<int64_t>(v) * pp + r);
      const int64_t mtp = mtp_it == mtp_at.end() ? 0 : mtp_it->second;
      for (int64_t l = s.first_layer; l < s.end_layer(); ++l) {
        const ParamCounts layer = layer_params(model, c.moe.enabled() && c.moe.is_moe_layer(l));
        params += layer;
        units += layer;
        largest_unit = std::max(largest_unit, layer.tp_sharded / tp + layer.replicated + layer.experts / (ep * etp));
      }
      for (int64_t i = 0; i < mtp; ++i) params += mtp_params(model);
      if (s.has_embedding) {
        embedding += embedding_params(c);
        holds_embedding = true;
      }
      if (s.has_loss) {
        params.replicated += norm_size(c) * static_cast<double>(c.hidden_size);
        // The output layer: its own weight, or (tied) the embedding's copy on a last stage without the embedding.
        if (c.untie_embeddings_and_output_weights || !s.has_embedding) {
          embedding += static_cast<double>(c.vocab_size) * static_cast<double>(c.hidden_size);
        }
      }
      // MTP embeds the shifted tokens with the word embedding: a stage without it keeps a copy.
      if (mtp > 0 && !s.has_embedding && !holds_embedding) embedding += embedding_params(c);
      stage.decoder_layers += s.num_layers;
      stage.mtp_layers += mtp;
      chunks.push_back(make_chunk(x, s, mtp));
    }
    const double dense = (params.tp_sharded + embedding) / tp + params.replicated;
    const double experts = params.experts / (ep * etp);
    stage.weights = (dense + experts) * b.weight;
    stage.grads = (dense + experts) * b.grad;
    const double dense_share = t.use_distributed_optimizer ? sizes.dp_cp() : 1.0;
    const double expert_share = t.use_distributed_optimizer ? sizes.edp() : 1.0;
    stage.main_weights_and_optimizer = dense * b.optimizer / dense_share + experts * b.optimizer / expert_share;
    stage.fsdp = {.dense = dense,
                  .expert = experts,
                  .unit_dense = units.tp_sharded / tp + units.replicated,
                  .unit_expert = units.experts / (ep * etp),
                  .largest_unit = largest_unit};
    double fsdp_buffers = 0;
    if (t.use_megatron_fsdp) fsdp_buffers = megatron_fsdp_memory(t, sizes, b, stage);

    // Contexts live from their forward to their backward; the peak is reached as some backward starts.
    std::vector<ChunkActivations> per_chunk;
    for (const Chunk& chunk : chunks) per_chunk.push_back({chunk.kept.total, chunk.transient});
    const PipelinePeak peak = pipeline_activation_peak(
        {.pp = pp, .rank = r, .vpp = vpp, .microbatches = microbatches, .group = t.microbatch_group_size_per_vp_stage},
        per_chunk);
    const std::vector<int64_t>& live_at_peak = peak.live;
    stage.activations = peak.bytes;
    if (peak.found)
      stage.activations_by_module.push_back(
          {"backward transient", per_chunk[static_cast<size_t>(peak.chunk)].transient});
    std::map<std::string, double> by_group;
    for (size_t v = 0; v < chunks.size(); ++v) {
      stage.live_chunks_at_peak += live_at_peak[v];
      for (const auto& [group, bytes] : chunks[v].kept.by_group) {
        by_group[group] += bytes * static_cast<double>(live_at_peak[v]);
      }
    }
    for (const auto& [group, bytes] : by_group) stage.activations_by_module.push_back({group, bytes});

    // Communication buffers of one MoE layer (all-to-all send and receive) or of a TP all-gather.
    const double ts = x.tokens / x.seq_div;
    double comm = tp > 1 ? x.tokens * static_cast<double>(c.hidden_size) * x.act_bytes : 0.0;
    if (c.moe.enabled() && ep * etp > 1) {
      comm = std::max(
          comm, 2.0 * ts * static_cast<double>(c.moe.topk) * etp * static_cast<double>(c.hidden_size) * x.act_bytes);
    }
    stage.comm_buffers = comm + fsdp_buffers;
    plan.stages.push_back(std::move(stage));
  }
  return plan;
}

}  // namespace moecore::plan
