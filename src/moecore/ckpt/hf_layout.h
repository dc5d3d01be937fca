// Where each HuggingFace tensor of an llama / qwen3 / mixtral / qwen3_moe / moecore_moe checkpoint sits in moecore's
// parameters: the name and row mapping documented in hf_checkpoint.h, shared by the export (hf_checkpoint.cpp) and
// the import (hf_state_source.cpp).
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "moecore/model/config.h"

namespace moecore {

struct HfRowRange {
  int64_t begin, end;
};

// One HF tensor = some rows (first dimension) of one moecore parameter, in order.
struct HfTensorMap {
  std::string hf_name;
  std::string megatron_name;
  std::vector<HfRowRange> rows;  // empty: all rows
};

// Every HF tensor of the parameters of a `model_type` model with config `c`, in the export's order (the expert-bias
// buffers are not in it: hf_expert_bias_name).
std::vector<HfTensorMap> hf_layout(const ModelConfig& c, const std::string& model_type);

// "model.layers.{layer}." (DeepSeek-V3's MTP depth k is layer num_hidden_layers + k).
std::string hf_layer_prefix(int64_t layer);
// The HF name of the expert-bias buffer of HF layer `layer` (DeepSeek-V3's e_score_correction_bias).
std::string hf_expert_bias_name(int64_t layer);
// (HF name, moecore buffer name) of every MoE layer's expert-bias buffer: the decoder's, and under deepseek_v3 the MTP
// depths' (mtp.layers.k.mtp_model_layer.mlp.router.expert_bias) when the last decoder layer is a MoE layer.
std::vector<std::pair<std::string, std::string>> hf_expert_bias_buffers(const ModelConfig& c,
                                                                        const std::string& model_type);

// The row ranges `map` takes of a parameter with `megatron_rows` rows (all of them when map.rows is empty).
// The JSON document in `path` (config.json, the shard index); std::runtime_error "PATH: cannot open" / "PATH: not
// valid JSON (...)".
nlohmann::json read_json_file(const std::string& path);

std::vector<HfRowRange> hf_row_ranges(const HfTensorMap& map, int64_t megatron_rows);
// The HF tensor's shape: the parameter's shape with the first dimension cut to the map's rows.
std::vector<int64_t> hf_tensor_shape(const HfTensorMap& map, const std::vector<int64_t>& megatron_shape);

}  // namespace moecore
