#include "moecore/ckpt/hf_deepseek_v3.h"

#include <cmath>

#include "moecore/ckpt/hf_moe_config.h"
#include "moecore/ckpt/json_integer.h"
#include "moecore/kernels/cpu/rotary_frequencies.h"

namespace moecore {
namespace {

using json = nlohmann::json;

[[noreturn]] void fail(const std::string& file, const std::string& problem) {
  throw ConfigError(file + ": " + problem);
}

int64_t integer(const json& j, const std::string& file, const std::string& key) {
  if (!j.contains(key) || j[key].is_null()) fail(file, "missing field '" + key + "'");
  return json_integer(j[key], file + ": field '" + key + "'");
}

int64_t integer_or(const json& j, const std::string& file, const std::string& key, const int64_t fallback) {
  return j.contains(key) && !j[key].is_null() ? integer(j, file, key) : fallback;
}

double number_or(const json& j, const std::string& file, const std::string& key, const double fallback) {
  if (!j.contains(key) || j[key].is_null()) return fallback;
  if (!j[key].is_number()) fail(file, "field '" + key + "' must be a number (got " + j[key].dump() + ")");
  return j[key].get<double>();
}

bool boolean_or(const json& j, const std::string& file, const std::string& key, const bool fallback) {
  if (!j.contains(key) || j[key].is_null()) return fallback;
  if (!j[key].is_boolean()) fail(file, "field '" + key + "' must be true or false (got " + j[key].dump() + ")");
  return j[key].get<bool>();
}

// Leading dense layers of a first-k-dense pattern, or -1 when a dense layer follows a MoE layer.
int64_t first_k_dense(const ModelConfig& c) {
  int64_t k = 0;
  while (k < c.num_layers && !c.moe.is_moe_layer(k)) ++k;
  for (int64_t i = k; i < c.num_layers; ++i) {
    if (!c.moe.is_moe_layer(i)) return -1;
  }
  return k;
}

bool yarn_rope(const ModelConfig& c) { return c.mla && c.mla->rope_type == RopeType::kYarn; }

// HF derives YaRN's factor from max_position_embeddings / original_max_position_embeddings in older releases: the
// export writes that product, which must be a whole number of positions.
double yarn_positions(const ModelConfig& c) {
  return c.yarn.rotary_scaling_factor * static_cast<double>(c.yarn.original_max_position_embeddings);
}

}  // namespace

std::string deepseek_v3_misfit(const ModelConfig& c) {
  if (!c.mla) return "standard attention (DeepSeek-V3's attention is --multi-latent-attention)";
  if (!c.qk_layernorm) return "no --qk-layernorm (DeepSeek-V3 normalises its q and kv latents)";
  if (c.add_bias_linear) return "--add-bias-linear (DeepSeek-V3 has no linear biases)";
  if (c.norm_epsilon != 1e-6) {
    return "--norm-epsilon " + std::to_string(c.norm_epsilon) +
           " (HF's q_a / kv_a norms use 1e-6 whatever rms_norm_eps)";
  }
  if (c.mla->rope_type == RopeType::kRope && c.yarn.rotary_scaling_factor > 1 && c.yarn.mscale_all_dim != 0) {
    return "--rotary-scaling-factor with --mscale-all-dim under --rope-type rope (HF scales the softmax only under "
           "YaRN)";
  }
  if (yarn_rope(c)) {
    if (!c.yarn.correction_range_round_to_int) return "--no-yarn-correction-range-round-to-int";
    const double positions = yarn_positions(c);
    if (positions != std::floor(positions) || positions < 1 || positions > 9.0e15) {
      return "--rotary-scaling-factor x --yarn-original-max-position-embeddings = " + std::to_string(positions) +
             " (HF derives YaRN's factor from max_position_embeddings, a whole number of positions)";
    }
  }
  if (!c.moe.enabled()) return "";
  const MoEConfig& m = c.moe;
  if (first_k_dense(c) < 0) return "--moe-layer-freq with a dense layer after a MoE layer (HF: first_k_dense_replace)";
  if (m.score_function != RouterScoreFunction::kSigmoid) {
    return "--moe-router-score-function " + to_string(m.score_function) + " (DeepSeek-V3 scores with sigmoid)";
  }
  if (m.num_groups > 1 && (m.group_topk <= 0 || m.topk != 2 * m.group_topk)) {
    return "--moe-router-topk " + std::to_string(m.topk) + " with --moe-router-group-topk " +
           std::to_string(m.group_topk) + " (HF scores a group by its top 2 experts, Megatron by its top topk / " +
           "group_topk)";
  }
  if (m.capacity_factor) return "--moe-expert-capacity-factor (HF routes every token, dropless)";
  if (m.apply_probs_on_input) return "--moe-apply-probs-on-input";
  if (m.shared_expert_gate) return "--moe-shared-expert-gate";
  if (m.shared_expert_intermediate_size % m.ffn_hidden_size != 0) {
    return "--moe-shared-expert-intermediate-size " + std::to_string(m.shared_expert_intermediate_size) +
           " (HF: n_shared_experts x moe_intermediate_size " + std::to_string(m.ffn_hidden_size) + ")";
  }
  if (m.force_load_balancing) return "--moe-router-force-load-balancing";
  for (const LoadBalancingType type : m.load_balancing_types) {
    if (type == LoadBalancingType::kSinkhorn) return "--moe-router-load-balancing-type sinkhorn";
  }
  return "";
}

void add_deepseek_v3_fields(json& j, const ModelConfig& c) {
  const MlaConfig& a = c.mla.value();
  j["q_lora_rank"] = a.q_lora_rank > 0 ? json(a.q_lora_rank) : json(nullptr);
  j["kv_lora_rank"] = a.kv_lora_rank;
  j["qk_nope_head_dim"] = a.qk_head_dim;
  j["qk_rope_head_dim"] = a.qk_pos_emb_head_dim;
  j["v_head_dim"] = a.v_head_dim;
  j["head_dim"] = a.qk_pos_emb_head_dim;  // HF's rope width
  j["num_key_value_heads"] = c.num_attention_heads;
  j["rope_interleave"] = true;
  if (yarn_rope(c)) {
    j["rope_scaling"] = {
        {"type", "yarn"},
        {"rope_type", "yarn"},
        {"factor", c.yarn.rotary_scaling_factor},
        {"original_max_position_embeddings", c.yarn.original_max_position_embeddings},
        {"beta_fast", c.yarn.beta_fast},
        {"beta_slow", c.yarn.beta_slow},
        {"mscale", c.yarn.mscale},
        {"mscale_all_dim", c.yarn.mscale_all_dim},
        // Megatron's concentration factor; HF takes it as given (its own default differs when mscale_all_dim is 0).
        {"attention_factor",
         kernels::yarn_concentration_factor(c.yarn.rotary_scaling_factor, c.yarn.mscale, c.yarn.mscale_all_dim)},
    };
    j["max_position_embeddings"] = static_cast<int64_t>(yarn_positions(c));
  }
  j["num_nextn_predict_layers"] = c.mtp_num_layers;
  j["topk_method"] = "noaux_tc";
  j["scoring_func"] = "sigmoid";
  const MoEConfig& m = c.moe;
  if (!m.enabled()) {
    j["first_k_dense_replace"] = c.num_layers;
    return;
  }
  j["first_k_dense_replace"] = first_k_dense(c);
  j["n_routed_experts"] = m.num_experts;
  j["num_experts_per_tok"] = m.topk;
  j["moe_intermediate_size"] = m.ffn_hidden_size;
  j["n_shared_experts"] = m.shared_expert_intermediate_size / m.ffn_hidden_size;
  j["n_group"] = m.num_groups > 1 ? m.num_groups : 1;
  j["topk_group"] = m.num_groups > 1 ? m.group_topk : 1;
  j["routed_scaling_factor"] = m.topk_scaling_factor.value_or(1.0);
  j["norm_topk_prob"] = m.topk > 1;  // Megatron renormalises sigmoid top-k when k > 1
  j["moe_layer_freq"] = 1;
  j[kMoecoreMoeConfigKey] = moe_config_block(c);
}

void read_deepseek_v3_fields(const json& j, const std::string& file, ModelConfig& c) {
  MlaConfig a;
  a.q_lora_rank = integer_or(j, file, "q_lora_rank", 0);
  if (j.contains("q_lora_rank") && !j["q_lora_rank"].is_null() && a.q_lora_rank <= 0) {
    fail(file, "q_lora_rank must be positive or null");
  }
  a.kv_lora_rank = integer(j, file, "kv_lora_rank");
  a.qk_head_dim = integer(j, file, "qk_nope_head_dim");
  a.qk_pos_emb_head_dim = integer(j, file, "qk_rope_head_dim");
  a.v_head_dim = integer(j, file, "v_head_dim");
  if (!boolean_or(j, file, "rope_interleave", true)) {
    fail(file, "rope_interleave false (Megatron's multi-latent attention always de-interleaves its rope channels)");
  }
  c.qk_layernorm = true;
  c.kv_channels = c.hidden_size / c.num_attention_heads;  // Megatron's default; multi-latent attention ignores it
  c.num_query_groups = c.num_attention_heads;
  a.rope_type = RopeType::kRope;
  // rope_scaling, or newer transformers' rope_parameters (rope_type "default" for none).
  json rope = j.contains("rope_scaling") ? j["rope_scaling"] : json(nullptr);
  if (rope.is_null() && j.contains("rope_parameters") && j["rope_parameters"].is_object() &&
      j["rope_parameters"].value("rope_type", std::string("default")) != "default") {
    rope = j["rope_parameters"];
  }
  if (!rope.is_null()) {
    if (!rope.is_object()) fail(file, "rope_scaling must be an object or null");
    const std::string type = rope.value("rope_type", rope.value("type", std::string()));
    if (type != "yarn") fail(file, "rope_scaling type '" + type + "' is not supported (yarn or none)");
    a.rope_type = RopeType::kYarn;
    YarnConfig& y = c.yarn;
    y.rotary_scaling_factor = number_or(rope, file, "factor", 1.0);
    y.original_max_position_embeddings =
        integer_or(rope, file, "original_max_position_embeddings", c.max_position_embeddings);
    y.beta_fast = number_or(rope, file, "beta_fast", 32.0);
    y.beta_slow = number_or(rope, file, "beta_slow", 1.0);
    y.mscale = number_or(rope, file, "mscale", 1.0);
    y.mscale_all_dim = number_or(rope, file, "mscale_all_dim", 0.0);
    if (!boolean_or(rope, file, "truncate", true)) fail(file, "rope_scaling.truncate false is not supported");
    if (rope.contains("original_max_position_embeddings")) {
      const double ratio =
          static_cast<double>(c.max_position_embeddings) / static_cast<double>(y.original_max_position_embeddings);
      if (std::abs(ratio - y.rotary_scaling_factor) > 1e-9 * y.rotary_scaling_factor) {
        fail(file, "rope_scaling.factor " + std::to_string(y.rotary_scaling_factor) +
                       " disagrees with max_position_embeddings / original_max_position_embeddings = " +
                       std::to_string(ratio) + " (transformers releases differ in which they use)");
      }
    }
    const double concentration =
        kernels::yarn_concentration_factor(y.rotary_scaling_factor, y.mscale, y.mscale_all_dim);
    if (rope.contains("attention_factor") && !rope["attention_factor"].is_null() &&
        std::abs(number_or(rope, file, "attention_factor", 0.0) - concentration) > 1e-12 * concentration) {
      fail(file, "rope_scaling.attention_factor " + rope["attention_factor"].dump() +
                     " is not Megatron's get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim) = " +
                     std::to_string(concentration));
    }
    if (!rope.contains("attention_factor") && !(y.mscale != 0 && y.mscale_all_dim != 0) &&
        std::abs(concentration - kernels::yarn_get_mscale(y.rotary_scaling_factor, 1.0)) > 1e-12) {
      fail(file, "rope_scaling mscale " + std::to_string(y.mscale) + " with mscale_all_dim " +
                     std::to_string(y.mscale_all_dim) + ": HF's attention factor differs from Megatron's");
    }
  }
  c.mla = a;
  const int64_t mtp = integer_or(j, file, "num_nextn_predict_layers", 0);
  if (mtp < 0) fail(file, "num_nextn_predict_layers must not be negative");
  c.mtp_num_layers = mtp;
  for (const char* key : {"scoring_func", "topk_method"}) {
    const std::string expected = std::string(key) == "scoring_func" ? "sigmoid" : "noaux_tc";
    if (j.contains(key) && j[key] != expected)
      fail(file, std::string(key) + " " + j[key].dump() + " (" + expected + ")");
  }
  const int64_t dense = integer_or(j, file, "first_k_dense_replace", 0);
  if (dense < 0) fail(file, "first_k_dense_replace must not be negative");
  if (dense >= c.num_layers) return;  // every layer dense
  MoEConfig& m = c.moe;
  if (j.contains(kMoecoreMoeConfigKey)) {  // training-only settings (the architecture comes from HF's fields)
    ModelConfig block = c;
    read_moe_config_block(j[kMoecoreMoeConfigKey], file, block);
    m = block.moe;
  } else {  // Megatron-Bridge's defaults for DeepSeek-V3
    m.load_balancing_types = {LoadBalancingType::kSeqAuxLoss};
    m.aux_loss_coeffs = {1e-4};
    m.bias_update_rate = 1e-3;
  }
  m.num_experts = integer(j, file, "n_routed_experts");
  m.topk = integer(j, file, "num_experts_per_tok");
  m.ffn_hidden_size = integer(j, file, "moe_intermediate_size");
  m.shared_expert_intermediate_size = integer_or(j, file, "n_shared_experts", 0) * m.ffn_hidden_size;
  m.shared_expert_gate = false;
  m.score_function = RouterScoreFunction::kSigmoid;
  m.enable_expert_bias = true;
  m.router_dtype = RouterDType::kFP32;
  m.capacity_factor.reset();
  m.apply_probs_on_input = false;
  const int64_t groups = integer_or(j, file, "n_group", 1), group_topk = integer_or(j, file, "topk_group", 1);
  if (groups > 1) {
    if (m.topk != 2 * group_topk) {
      fail(file, "num_experts_per_tok " + std::to_string(m.topk) + " with topk_group " + std::to_string(group_topk) +
                     ": HF scores a group by its top 2 experts, Megatron by its top num_experts_per_tok / topk_group");
    }
    m.num_groups = groups;
    m.group_topk = group_topk;
  } else {
    m.num_groups = 0;
    m.group_topk = 0;
  }
  const double scaling = number_or(j, file, "routed_scaling_factor", 1.0);
  if (scaling != 1.0) {
    m.topk_scaling_factor = scaling;
  } else {
    m.topk_scaling_factor.reset();
  }
  if (boolean_or(j, file, "norm_topk_prob", true) != (m.topk > 1)) {
    fail(file, "norm_topk_prob " + std::string(m.topk > 1 ? "false" : "true") + " with num_experts_per_tok " +
                   std::to_string(m.topk) + " (Megatron renormalises sigmoid top-k exactly when k > 1)");
  }
  m.moe_layer_pattern.assign(static_cast<size_t>(c.num_layers), true);
  for (int64_t i = 0; i < dense; ++i) m.moe_layer_pattern[static_cast<size_t>(i)] = false;
}

}  // namespace moecore
