#include "moecore/config/memory_estimate.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

#include "moecore/model/config.h"

namespace moecore {
namespace {

constexpr double kFloatBytes = 4.0;  // weights, gradients, states and activations are fp32 buffers

struct ParameterCounts {
  double dense = 0;    // replicated or split over tensor parallelism
  double experts = 0;  // split over expert and expert-tensor parallelism
};

// The attention's parameters: standard (fused qkv, optional q/k norms) or multi-latent (model/mla_attention.h).
double attention_parameters(const ModelConfig& m) {
  const double h = static_cast<double>(m.hidden_size), n = static_cast<double>(m.num_attention_heads);
  const double bias = m.add_bias_linear ? 1.0 : 0.0;
  const double norm = m.normalization == Normalization::kLayerNorm ? 2.0 : 1.0;
  if (!m.mla) {
    const double width = n * static_cast<double>(m.kv_channels);
    const double qk_norms = m.qk_layernorm ? 2.0 * norm * static_cast<double>(m.kv_channels) : 0.0;
    return static_cast<double>(m.qkv_out()) * (h + bias) + h * width + bias * h + qk_norms;
  }
  const MlaConfig& a = *m.mla;
  const double q_rank = static_cast<double>(a.q_lora_rank), kv_rank = static_cast<double>(a.kv_lora_rank);
  const double dqk = static_cast<double>(a.q_head_dim()), dv = static_cast<double>(a.v_head_dim);
  double count = a.q_lora_rank > 0 ? q_rank * h + n * dqk * q_rank : n * dqk * h;
  count += (kv_rank + static_cast<double>(a.qk_pos_emb_head_dim)) * h;
  count += n * (static_cast<double>(a.qk_head_dim) + dv) * kv_rank + h * n * dv + bias * h;
  if (m.qk_layernorm) count += norm * (kv_rank + (a.q_lora_rank > 0 ? q_rank : 0.0));
  return count;
}

// Floats the attention keeps per token for backward (its GEMM inputs, core-attention inputs and output).
double attention_activation_floats(const ModelConfig& m) {
  const double h = static_cast<double>(m.hidden_size), n = static_cast<double>(m.num_attention_heads);
  if (!m.mla) {
    return static_cast<double>(m.qkv_out()) + n * static_cast<double>(m.kv_channels);
  }
  const MlaConfig& a = *m.mla;
  const double dqk = static_cast<double>(a.q_head_dim()), dv = static_cast<double>(a.v_head_dim);
  const double latents = 2.0 * static_cast<double>(a.q_lora_rank + a.kv_lora_rank);  // up inputs (+ pre-norm)
  return h + latents + 2.0 * n * dqk + 2.0 * n * dv;
}

// One decoder layer's parameters, from the shapes in ARCHITECTURE.md's parameter table.
ParameterCounts layer_parameters(const ModelConfig& m, const bool moe_layer) {
  const double h = static_cast<double>(m.hidden_size);
  const double bias = m.add_bias_linear ? 1.0 : 0.0;
  const double norm = m.normalization == Normalization::kLayerNorm ? 2.0 : 1.0;
  ParameterCounts counts;
  counts.dense = attention_parameters(m) + 2.0 * norm * h;
  const double glu = m.activation == Activation::kSwiGLU ? 2.0 : 1.0;
  const auto mlp = [&](const double width) { return glu * width * (h + bias) + h * width + bias * h; };
  if (!moe_layer) {
    counts.dense += mlp(static_cast<double>(m.ffn_hidden_size));
    return counts;
  }
  const MoEConfig& moe = m.moe;
  counts.dense += static_cast<double>(moe.num_experts) * (h + bias);  // router
  const double shared = static_cast<double>(moe.shared_expert_intermediate_size);
  if (shared > 0) counts.dense += glu * shared * h + h * shared + (moe.shared_expert_gate ? h : 0.0);
  counts.experts = static_cast<double>(moe.num_experts) * mlp(static_cast<double>(moe.ffn_hidden_size));
  return counts;
}

// Floats backward keeps per token of one decoder layer (inputs of the norms, GEMMs and activation function), a
// lower estimate: the attention keeps its log-sum-exp, never the S x S probabilities.
double layer_activation_floats(const ModelConfig& m, const bool moe_layer) {
  const double h = static_cast<double>(m.hidden_size);
  double floats = 4.0 * h + attention_activation_floats(m);
  const double glu = m.activation == Activation::kSwiGLU ? 2.0 : 1.0;
  if (!moe_layer) return floats + (glu + 1.0) * static_cast<double>(m.ffn_hidden_size);
  const MoEConfig& moe = m.moe;
  floats += static_cast<double>(moe.topk) * (2.0 * h + (glu + 1.0) * static_cast<double>(moe.ffn_hidden_size));
  return floats + (glu + 1.0) * static_cast<double>(moe.shared_expert_intermediate_size);
}

}  // namespace

MemoryEstimate estimate_memory(const TrainingArgs& args) {
  const ModelConfig& m = args.model;
  const double tp = static_cast<double>(args.parallel.tensor_model_parallel_size);
  const double pp = static_cast<double>(args.parallel.pipeline_model_parallel_size);
  const double expert_shards =
      static_cast<double>(int64_t{args.parallel.expert_model_parallel_size} * args.parallel.expert_tensor_parallel());
  const double dp = static_cast<double>(args.data_parallel_size);

  // The first pipeline stage: the embedding and its share of the layers (the layers' mix of dense and MoE is taken
  // over the whole model).
  double dense = 0, experts = 0, activation_floats = 0;
  for (int64_t layer = 0; layer < m.num_layers; ++layer) {
    const bool moe_layer = m.moe.is_moe_layer(layer);
    const ParameterCounts counts = layer_parameters(m, moe_layer);
    dense += counts.dense;
    experts += counts.experts;
    activation_floats += layer_activation_floats(m, moe_layer);
  }
  const double unit_dense = dense, unit_experts = experts;  // the decoder layers: Megatron-FSDP's units
  const double h = static_cast<double>(m.hidden_size);
  const double vocab = static_cast<double>(m.vocab_size);
  double embedding = vocab * h;
  if (m.position_embedding_type == PositionEmbedding::kLearnedAbsolute) {
    embedding += static_cast<double>(m.max_position_embeddings) * h;
  }
  const double final_norm = (m.normalization == Normalization::kLayerNorm ? 2.0 : 1.0) * h;
  const double output = pp == 1 ? (m.untie_embeddings_and_output_weights ? vocab * h : 0.0) + final_norm : 0.0;
  // Multi-Token Prediction depths, on the loss stage (the first one only with PP 1): each a layer like the last
  // decoder layer, eh_proj [H, 2H] and three norms; backward keeps each depth's layer activations and hidden states,
  // and the depths' output-layer weight gradient.
  const double depths = pp == 1 ? static_cast<double>(m.mtp_num_layers) : 0.0;
  const bool last_moe = m.moe.is_moe_layer(m.num_layers - 1);
  const ParameterCounts depth_layer = layer_parameters(m, last_moe);
  dense += depths * (depth_layer.dense + 2.0 * h * h + 3.0 * final_norm);
  experts += depths * depth_layer.experts;
  activation_floats += depths * (layer_activation_floats(m, last_moe) + 8.0 * h);
  const double local_parameters = (embedding + output + dense / pp) / tp + experts / pp / expert_shards;

  MemoryEstimate estimate;
  estimate.parameters = local_parameters * kFloatBytes;
  estimate.gradients = local_parameters * kFloatBytes;
  const double states = m.params_dtype == DType::kF32 ? 2.0 : 3.0;  // exp_avg, exp_avg_sq (+ main params)
  estimate.optimizer = local_parameters * kFloatBytes * states / (args.use_distributed_optimizer ? dp : 1.0);
  if (args.use_megatron_fsdp) {
    // Megatron-FSDP (optim/fsdp.h): the units' parameters (optim_grads_params) and gradients (optim_grads and above)
    // kept as dp-cp (experts: expert-DP) shards, plus two whole units while in use (the unit and its prefetch, or the
    // unit and the reduce-scatter in flight). no_shard keeps the Adam states whole.
    const double cp = static_cast<double>(args.parallel.context_parallel_size);
    const double edp = tp * cp * dp / expert_shards;
    const double units_local = unit_dense / pp / tp + unit_experts / pp / expert_shards;
    const double units_sharded = unit_dense / pp / tp / (dp * cp) + unit_experts / pp / expert_shards / edp;
    const double layers_per_stage = std::max(1.0, static_cast<double>(m.num_layers) / pp);
    const double in_use = std::min(2.0, layers_per_stage) * units_local / layers_per_stage;
    const double saved = std::max(0.0, units_local - units_sharded - in_use) * kFloatBytes;
    const std::string& strategy = args.data_parallel_sharding_strategy;
    if (strategy == "optim_grads_params") estimate.parameters -= saved;
    if (strategy == "optim_grads" || strategy == "optim_grads_params") estimate.gradients -= saved;
    if (strategy == "no_shard") estimate.optimizer = local_parameters * kFloatBytes * states;
  }

  const double tokens = static_cast<double>(m.seq_length) * static_cast<double>(args.micro_batch_size) /
                        static_cast<double>(args.parallel.context_parallel_size) / tp;
  const double microbatches =
      static_cast<double>(args.global_batch_size) / dp / static_cast<double>(args.micro_batch_size);
  const double live_microbatches = pp == 1 ? 1.0 : std::min(pp, microbatches);
  const double logits_chunk = std::min(64.0 * 1024 * 1024, tokens * vocab * kFloatBytes);
  const double mtp_output_grad = depths > 0 ? vocab * h / tp * kFloatBytes * live_microbatches : 0.0;
  estimate.activations =
      tokens * activation_floats / pp * kFloatBytes * live_microbatches + logits_chunk + mtp_output_grad;

  const double gbs = static_cast<double>(args.global_batch_size);
  const double eval_points = args.eval_interval ? static_cast<double>(args.train_iters / *args.eval_interval + 1) : 1.0;
  const double samples =
      static_cast<double>(args.train_iters) * gbs + (eval_points + 1.0) * static_cast<double>(args.eval_iters) * gbs;
  // Per sample: the sample index (two int64), the shuffle index (int64) and about one document-index entry (int32).
  estimate.data_indices = samples * 28.0;
  return estimate;
}

std::optional<double> available_memory_per_rank() {
  std::ifstream meminfo("/proc/meminfo");
  if (!meminfo) return std::nullopt;
  double available_kib = -1, swap_free_kib = 0;
  std::string line;
  while (std::getline(meminfo, line)) {
    std::istringstream fields(line);
    std::string key;
    double kib = 0;
    if (!(fields >> key >> kib)) continue;
    if (key == "MemAvailable:") available_kib = kib;
    if (key == "SwapFree:") swap_free_kib = kib;
  }
  if (available_kib < 0) return std::nullopt;
  double local_ranks = 1;
  if (const char* local_size = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE")) {
    local_ranks = std::max(1.0, std::atof(local_size));
  }
  return (available_kib + swap_free_kib) * 1024.0 / local_ranks;
}

std::string format_bytes(const double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  double value = bytes;
  size_t unit = 0;
  while (value >= 1024.0 && unit + 1 < std::size(units)) {
    value /= 1024.0;
    ++unit;
  }
  char text[48];
  std::snprintf(text, sizeof(text), value < 1e6 ? "%.1f %s" : "%.3g %s", value, units[unit]);
  return text;
}

void check_memory_fits(const MemoryEstimate& estimate, const double available) {
  if (estimate.total() <= available) return;
  throw ConfigError("this configuration needs about " + format_bytes(estimate.total()) + " per rank (parameters " +
                    format_bytes(estimate.parameters) + ", gradients " + format_bytes(estimate.gradients) +
                    ", optimizer " + format_bytes(estimate.optimizer) + ", activations " +
                    format_bytes(estimate.activations) + ", data indices " + format_bytes(estimate.data_indices) +
                    ") but " + format_bytes(available) +
                    " of memory is available to it: use a smaller model, batch or --train-iters, or more ranks");
}

}  // namespace moecore
