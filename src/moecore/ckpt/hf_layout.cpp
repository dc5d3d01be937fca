#include "moecore/ckpt/hf_layout.h"

#include <fstream>
#include <stdexcept>

namespace moecore {

nlohmann::json read_json_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error(path + ": cannot open");
  try {
    return nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    throw std::runtime_error(path + ": not valid JSON (" + std::string(e.what()) + ")");
  }
}
namespace {

// The split of a SwiGLU fc1 [2F, H] into HF's gate (rows [0, F)) and up (rows [F, 2F)) projections.
void push_swiglu_mlp(std::vector<HfTensorMap>& layout, const std::string& gate, const std::string& up,
                     const std::string& down, const std::string& fc1, const std::string& fc2, const int64_t F,
                     const std::vector<std::string>& suffixes) {
  for (const std::string& s : suffixes) {
    layout.push_back({gate + "." + s, fc1 + "." + s, {{0, F}}});
    layout.push_back({up + "." + s, fc1 + "." + s, {{F, 2 * F}}});
    layout.push_back({down + "." + s, fc2 + "." + s, {}});
  }
}

void push_moe_layer(std::vector<HfTensorMap>& layout, const ModelConfig& c, const std::string& model_type,
                    const std::string& P, const std::string& M, const std::vector<std::string>& suffixes) {
  const bool mixtral = model_type == "mixtral";
  const std::string moe = P + (mixtral ? "block_sparse_moe." : "mlp.");
  for (const std::string& s : suffixes) layout.push_back({moe + "gate." + s, M + "mlp.router." + s, {}});
  for (int64_t e = 0; e < c.moe.num_experts; ++e) {
    const std::string expert = moe + "experts." + std::to_string(e) + ".";
    const std::string local = M + "mlp.experts.local_experts." + std::to_string(e) + ".";
    if (mixtral) {
      push_swiglu_mlp(layout, expert + "w1", expert + "w3", expert + "w2", local + "linear_fc1", local + "linear_fc2",
                      c.moe.ffn_hidden_size, suffixes);
    } else {
      push_swiglu_mlp(layout, expert + "gate_proj", expert + "up_proj", expert + "down_proj", local + "linear_fc1",
                      local + "linear_fc2", c.moe.ffn_hidden_size, suffixes);
    }
  }
  if (c.moe.shared_expert_intermediate_size > 0) {  // moecore_moe only (HF types refuse shared experts)
    const std::string shared = M + "mlp.shared_experts.";
    push_swiglu_mlp(layout, moe + "shared_experts.gate_proj", moe + "shared_experts.up_proj",
                    moe + "shared_experts.down_proj", shared + "linear_fc1", shared + "linear_fc2",
                    c.moe.shared_expert_intermediate_size, {"weight"});
    if (c.moe.shared_expert_gate) layout.push_back({moe + "shared_expert_gate.weight", shared + "gate_weight", {}});
  }
}

// Fused qkv rows split into HF's q / k / v projections (per query group), the output projection, q / k norms.
void push_standard_attention(std::vector<HfTensorMap>& layout, const ModelConfig& c, const std::string& hf,
                             const std::string& mc, const std::vector<std::string>& suffixes,
                             const std::vector<HfRowRange>& q_rows, const std::vector<HfRowRange>& k_rows,
                             const std::vector<HfRowRange>& v_rows) {
  for (const std::string& s : suffixes) {
    layout.push_back({hf + "q_proj." + s, mc + "linear_qkv." + s, q_rows});
    layout.push_back({hf + "k_proj." + s, mc + "linear_qkv." + s, k_rows});
    layout.push_back({hf + "v_proj." + s, mc + "linear_qkv." + s, v_rows});
    layout.push_back({hf + "o_proj." + s, mc + "linear_proj." + s, {}});
  }
  if (c.qk_layernorm) {
    layout.push_back({hf + "q_norm.weight", mc + "q_layernorm.weight", {}});
    layout.push_back({hf + "k_norm.weight", mc + "k_layernorm.weight", {}});
  }
}

// Multi-latent attention as DeepSeek-V3's HF files name it (Megatron-Bridge's deepseek common.py): one to one, the
// rows in the same order (per head [nope | rope] and [k_nope | v]; [latent | k_rope] in kv_a_proj_with_mqa).
void push_mla_attention(std::vector<HfTensorMap>& layout, const ModelConfig& c, const std::string& hf,
                        const std::string& mc) {
  if (c.mla->q_lora_rank > 0) {
    layout.push_back({hf + "q_a_proj.weight", mc + "linear_q_down_proj.weight", {}});
    if (c.qk_layernorm) layout.push_back({hf + "q_a_layernorm.weight", mc + "q_layernorm.weight", {}});
    layout.push_back({hf + "q_b_proj.weight", mc + "linear_q_up_proj.weight", {}});
  } else {
    layout.push_back({hf + "q_proj.weight", mc + "linear_q_proj.weight", {}});
  }
  layout.push_back({hf + "kv_a_proj_with_mqa.weight", mc + "linear_kv_down_proj.weight", {}});
  if (c.qk_layernorm) layout.push_back({hf + "kv_a_layernorm.weight", mc + "kv_layernorm.weight", {}});
  layout.push_back({hf + "kv_b_proj.weight", mc + "linear_kv_up_proj.weight", {}});
  layout.push_back({hf + "o_proj.weight", mc + "linear_proj.weight", {}});
  if (c.add_bias_linear) layout.push_back({hf + "o_proj.bias", mc + "linear_proj.bias", {}});
}

}  // namespace

std::string hf_expert_bias_name(const int64_t layer) {
  return "model.layers." + std::to_string(layer) + ".mlp.gate.e_score_correction_bias";
}

std::vector<HfTensorMap> hf_layout(const ModelConfig& c, const std::string& model_type) {
  const int64_t d = c.kv_channels;
  const int64_t heads_per_group = c.num_attention_heads / c.num_query_groups;
  const int64_t group_rows = (heads_per_group + 2) * d;
  std::vector<HfRowRange> q_rows, k_rows, v_rows;
  for (int64_t g = 0; g < c.num_query_groups; ++g) {
    const int64_t base = g * group_rows;
    q_rows.push_back({base, base + heads_per_group * d});
    k_rows.push_back({base + heads_per_group * d, base + (heads_per_group + 1) * d});
    v_rows.push_back({base + (heads_per_group + 1) * d, base + group_rows});
  }
  const std::vector<std::string> suffixes =
      c.add_bias_linear ? std::vector<std::string>{"weight", "bias"} : std::vector<std::string>{"weight"};

  std::vector<HfTensorMap> layout;
  layout.push_back({"model.embed_tokens.weight", "embedding.word_embeddings.weight", {}});
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const std::string P = "model.layers." + std::to_string(i) + ".";
    const std::string M = "decoder.layers." + std::to_string(i) + ".";
    layout.push_back({P + "input_layernorm.weight", M + "input_layernorm.weight", {}});
    if (c.mla) {
      push_mla_attention(layout, c, P + "self_attn.", M + "self_attention.");
    } else {
      push_standard_attention(layout, c, P + "self_attn.", M + "self_attention.", suffixes, q_rows, k_rows, v_rows);
    }
    layout.push_back({P + "post_attention_layernorm.weight", M + "pre_mlp_layernorm.weight", {}});
    if (c.moe.is_moe_layer(i)) {
      push_moe_layer(layout, c, model_type, P, M, suffixes);
    } else {
      push_swiglu_mlp(layout, P + "mlp.gate_proj", P + "mlp.up_proj", P + "mlp.down_proj", M + "mlp.linear_fc1",
                      M + "mlp.linear_fc2", c.ffn_hidden_size, suffixes);
    }
  }
  layout.push_back({"model.norm.weight", "decoder.final_layernorm.weight", {}});
  if (c.untie_embeddings_and_output_weights) layout.push_back({"lm_head.weight", "output_layer.weight", {}});
  return layout;
}

std::vector<HfRowRange> hf_row_ranges(const HfTensorMap& map, const int64_t megatron_rows) {
  return map.rows.empty() ? std::vector<HfRowRange>{{0, megatron_rows}} : map.rows;
}

std::vector<int64_t> hf_tensor_shape(const HfTensorMap& map, const std::vector<int64_t>& megatron_shape) {
  std::vector<int64_t> shape = megatron_shape;
  int64_t rows = 0;
  for (const HfRowRange& r : hf_row_ranges(map, megatron_shape.at(0))) rows += r.end - r.begin;
  shape[0] = rows;
  return shape;
}

}  // namespace moecore
