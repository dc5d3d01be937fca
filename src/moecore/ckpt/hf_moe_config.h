// The MoE part of an HF export's config.json (used by hf_checkpoint.cpp):
// - hf_moe_misfit: why a MoE model cannot be written as HF's "mixtral" or "qwen3_moe" (empty when it can);
// - the "moecore_moe_config" block: every MoEConfig field under its Megatron flag name (dashes -> underscores,
//   e.g. "moe_router_topk", "moe_layer_freq" as a 0/1 list), plus the dense "ffn_hidden_size". HF's config classes
//   keep unknown keys as plain attributes and ignore them, so the block rides along in mixtral/qwen3_moe exports
//   to carry training-only settings (load balancing, z-loss, router dtype, jitter, ...) back into moecore exactly;
//   for model_type "moecore_moe" it is the authoritative routing description.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "moecore/model/config.h"

namespace moecore {

inline constexpr const char* kMoecoreMoeConfigKey = "moecore_moe_config";

// "" when HF's modeling class for `model_type` ("mixtral" or "qwen3_moe") computes exactly this model's forward;
// otherwise the first obstacle, phrased as the flag that causes it (e.g. "--moe-router-score-function sigmoid").
std::string hf_moe_misfit(const ModelConfig& config, const std::string& model_type);

nlohmann::json moe_config_block(const ModelConfig& config);

// Reads the block into config.moe and config.ffn_hidden_size (num_layers must already be set); throws ConfigError
// "FILE: moecore_moe_config.KEY ..." for a missing or malformed entry.
void read_moe_config_block(const nlohmann::json& block, const std::string& file, ModelConfig& config);

}  // namespace moecore
