// HF's DeepSeek-V3 format (model_type "deepseek_v3", DeepseekV3ForCausalLM) for models with multi-latent attention,
// mapped as Megatron-Bridge maps it (models/deepseek: deepseek_v3_bridge.py, common.py; model_bridge.py's
// CONFIG_MAPPING and MLA_ROPE_SCALING_MAPPING):
//   qk_nope_head_dim / qk_rope_head_dim / v_head_dim / q_lora_rank / kv_lora_rank   the MLA flags (q_lora_rank null:
//                                                     no q latent); head_dim = qk_rope_head_dim (HF's rope width)
//   first_k_dense_replace                             --moe-layer-freq [0]*k + [1]*(L-k) (HF has no other pattern)
//   n_routed_experts, num_experts_per_tok, moe_intermediate_size, n_shared_experts (x moe_intermediate_size =
//   --moe-shared-expert-intermediate-size), n_group / topk_group, routed_scaling_factor, norm_topk_prob
//   rope_scaling {type yarn, factor, original_max_position_embeddings, beta_fast, beta_slow, mscale,
//   mscale_all_dim, attention_factor}; max_position_embeddings = factor x original_max_position_embeddings (older
//   transformers derive the factor from that ratio); num_nextn_predict_layers = --mtp-num-layers.
// HF's router is fixed: sigmoid scores, e_score_correction_bias in the selection, groups scored by their top-2
// experts, renormalisation (norm_topk_prob) and routed_scaling_factor. Megatron scores a group by its top
// (topk / group_topk) experts, so with groups that ratio must be 2; Megatron renormalises sigmoid top-k for k > 1 only.
// A model HF cannot compute is refused with the flag that prevents it.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "moecore/model/config.h"

namespace moecore {

// "" when DeepseekV3ForCausalLM computes exactly this model's forward; otherwise the first obstacle, phrased as the
// flag that causes it.
std::string deepseek_v3_misfit(const ModelConfig& config);

// The DeepSeek-V3 fields of config.json (added to the common llama fields by the export).
void add_deepseek_v3_fields(nlohmann::json& config_json, const ModelConfig& config);

// Reads the DeepSeek-V3 fields into `config` (the common fields already read); throws ConfigError "FILE: ..." for a
// field it cannot represent.
void read_deepseek_v3_fields(const nlohmann::json& config_json, const std::string& file, ModelConfig& config);

}  // namespace moecore
