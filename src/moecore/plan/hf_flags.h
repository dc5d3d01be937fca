// `moecore plan --hf-config config.json`: a HuggingFace config.json as the Megatron flags of the same model, mapped
// as Megatron-Bridge's provider_bridge does (megatron/bridge/models/conversion/model_bridge.py CONFIG_MAPPING and
// the per-family bridges under megatron/bridge/models/{deepseek,qwen,llama,mistral}/).
#pragma once

#include <string>
#include <vector>

namespace moecore::plan {

// The model flags of the config.json at `path`, or in the model folder `path` (model_type deepseek_v3,
// deepseek_v2, qwen3_moe, mixtral, llama, qwen3 or mistral), in the spelling `moecore train` parses plus Megatron's
// MLA and MTP flags, e.g. for Mixtral-8x7B {"--num-layers", "32", "--hidden-size", "4096", ...}. No training-setup
// flag (sequence length, batch, precision) is emitted. Fields that change neither FLOPs nor memory (rope_scaling,
// dropout, token ids, the checkpoint's quantization_config) are ignored. Throws ConfigError "FILE: <problem>" (one
// line naming the config.json and the field) for a file that cannot be read or parsed, a folder without
// config.json, an unsupported model_type, a missing or mistyped field, a size out of range (negative, zero, above
// train's limit for the flag it becomes, or inconsistent with another field), or a shape the flags cannot express
// (qwen2 / qwen2_moe: their bias on the query, key and value projections only).
std::vector<std::string> megatron_flags_from_hf_config(const std::string& path);

}  // namespace moecore::plan
