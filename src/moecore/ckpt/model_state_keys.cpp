#include "moecore/ckpt/model_state_keys.h"

#include <algorithm>

namespace moecore {
namespace {

class KeyList {
 public:
  void add(const std::string& key, std::vector<int64_t> shape, const InitKind init) {
    keys_.push_back(ModelStateKey{key, std::move(shape), init, false});
  }
  void norm(const std::string& name, const int64_t width, const Normalization kind) {
    add(name + ".weight", {width}, InitKind::kOnes);
    if (kind == Normalization::kLayerNorm) add(name + ".bias", {width}, InitKind::kZeros);
  }
  // model/mlp.cpp: fc1 [F1, H] (normal), fc2 [H, F] (scaled normal), zero biases.
  void mlp(const std::string& prefix, const int64_t H, const int64_t F, const Activation activation, const bool bias) {
    const int64_t F1 = ops::activation_input_width(activation, F);
    add(prefix + "linear_fc1.weight", {F1, H}, InitKind::kNormal);
    if (bias) add(prefix + "linear_fc1.bias", {F1}, InitKind::kZeros);
    add(prefix + "linear_fc2.weight", {H, F}, InitKind::kScaledNormal);
    if (bias) add(prefix + "linear_fc2.bias", {H}, InitKind::kZeros);
  }
  // GPTModel's final norm and output layer, registered after the decoder layers and before any MTP depth.
  void head(const ModelConfig& c) {
    norm("decoder.final_layernorm", c.hidden_size, c.normalization);
    if (c.untie_embeddings_and_output_weights) {
      add("output_layer.weight", {c.vocab_size, c.hidden_size}, InitKind::kNormal);
    }
  }
  // Before MTP depth k's layer: what precedes it (the head, or depth k-1's final norm), then enorm, hnorm, eh_proj.
  void mtp_depth(const ModelConfig& c, const int64_t k) {
    const int64_t H = c.hidden_size;
    if (k == 0) {
      head(c);
    } else {
      norm("mtp.layers." + std::to_string(k - 1) + ".final_layernorm", H, c.normalization);
    }
    const std::string prefix = "mtp.layers." + std::to_string(k) + ".";
    norm(prefix + "enorm", H, c.normalization);
    norm(prefix + "hnorm", H, c.normalization);
    add(prefix + "eh_proj.weight", {H, 2 * H}, InitKind::kNormal);
  }
  // model/attention.cpp or, with config.mla, model/mla_attention.cpp.
  void attention(const std::string& prefix, const ModelConfig& c) {
    const int64_t H = c.hidden_size, N = c.num_attention_heads;
    int64_t attention_width = N * c.kv_channels;
    if (c.mla) {
      const MlaConfig& m = *c.mla;
      if (m.q_lora_rank > 0) {
        add(prefix + "linear_q_down_proj.weight", {m.q_lora_rank, H}, InitKind::kNormal);
        if (c.qk_layernorm) norm(prefix + "q_layernorm", m.q_lora_rank, c.normalization);
        add(prefix + "linear_q_up_proj.weight", {N * m.q_head_dim(), m.q_lora_rank}, InitKind::kNormal);
      } else {
        add(prefix + "linear_q_proj.weight", {N * m.q_head_dim(), H}, InitKind::kNormal);
      }
      add(prefix + "linear_kv_down_proj.weight", {m.kv_lora_rank + m.qk_pos_emb_head_dim, H}, InitKind::kNormal);
      if (c.qk_layernorm) norm(prefix + "kv_layernorm", m.kv_lora_rank, c.normalization);
      add(prefix + "linear_kv_up_proj.weight", {N * (m.qk_head_dim + m.v_head_dim), m.kv_lora_rank}, InitKind::kNormal);
      attention_width = N * m.v_head_dim;
    } else {
      add(prefix + "linear_qkv.weight", {c.qkv_out(), H}, InitKind::kNormal);
      if (c.add_bias_linear) add(prefix + "linear_qkv.bias", {c.qkv_out()}, InitKind::kZeros);
      if (c.qk_layernorm) {
        norm(prefix + "q_layernorm", c.kv_channels, c.normalization);
        norm(prefix + "k_layernorm", c.kv_channels, c.normalization);
      }
    }
    add(prefix + "linear_proj.weight", {H, attention_width}, InitKind::kScaledNormal);
    if (c.add_bias_linear) add(prefix + "linear_proj.bias", {H}, InitKind::kZeros);
  }
  std::vector<ModelStateKey> keys_;
};

}  // namespace

std::vector<ModelStateKey> model_state_keys(const ModelConfig& c) {
  const int64_t H = c.hidden_size;
  KeyList list;
  list.add("embedding.word_embeddings.weight", {c.vocab_size, H}, InitKind::kNormal);
  if (c.position_embedding_type == PositionEmbedding::kLearnedAbsolute) {
    list.add("embedding.position_embeddings.weight", {c.max_position_embeddings, H}, InitKind::kNormal);
  }
  std::vector<ModelStateKey> buffers;
  // The decoder layers, then one layer per Multi-Token Prediction depth, built as the last decoder layer.
  for (int64_t slot = 0; slot < c.num_layers + c.mtp_num_layers; ++slot) {
    const int64_t depth = slot - c.num_layers;
    if (depth >= 0) list.mtp_depth(c, depth);
    const int64_t i = std::min(slot, c.num_layers - 1);
    const std::string M = depth < 0 ? "decoder.layers." + std::to_string(i) + "."
                                    : "mtp.layers." + std::to_string(depth) + ".mtp_model_layer.";
    list.norm(M + "input_layernorm", H, c.normalization);
    list.attention(M + "self_attention.", c);
    list.norm(M + "pre_mlp_layernorm", H, c.normalization);
    if (!c.moe.is_moe_layer(i)) {
      list.mlp(M + "mlp.", H, c.ffn_hidden_size, c.activation, c.add_bias_linear);
      continue;
    }
    const MoEConfig& m = c.moe;
    // moe/router.cpp: weight and bias both drawn with init_method (as Megatron's TopKRouter.reset_parameters).
    list.add(M + "mlp.router.weight", {m.num_experts, H}, InitKind::kNormal);
    if (c.add_bias_linear) list.add(M + "mlp.router.bias", {m.num_experts}, InitKind::kNormal);
    if (m.enable_expert_bias) {
      buffers.push_back(ModelStateKey{M + "mlp.router.expert_bias", {m.num_experts}, InitKind::kZeros, true});
    }
    const int64_t X = m.latent_size > 0 ? m.latent_size : H;  // the routed experts' width
    for (int64_t e = 0; e < m.num_experts; ++e) {
      list.mlp(M + "mlp.experts.local_experts." + std::to_string(e) + ".", X, m.ffn_hidden_size, c.activation,
               c.add_bias_linear);
    }
    if (m.shared_expert_intermediate_size > 0) {  // no biases (as Megatron's SharedExpertMLP)
      list.mlp(M + "mlp.shared_experts.", H, m.shared_expert_intermediate_size, c.activation, false);
      if (m.shared_expert_gate) list.add(M + "mlp.shared_experts.gate_weight", {1, H}, InitKind::kNormal);
    }
    if (m.latent_size > 0) {  // moe/moe_layer.cpp
      list.add(M + "mlp.fc1_latent_proj.weight", {X, H}, InitKind::kNormal);
      if (c.add_bias_linear) list.add(M + "mlp.fc1_latent_proj.bias", {X}, InitKind::kZeros);
      list.add(M + "mlp.fc2_latent_proj.weight", {H, X}, InitKind::kScaledNormal);
      if (c.add_bias_linear) list.add(M + "mlp.fc2_latent_proj.bias", {H}, InitKind::kZeros);
    }
  }
  if (c.mtp_num_layers > 0) {
    list.norm("mtp.layers." + std::to_string(c.mtp_num_layers - 1) + ".final_layernorm", H, c.normalization);
  } else {
    list.head(c);
  }
  std::vector<ModelStateKey> keys = std::move(list.keys_);
  keys.insert(keys.end(), buffers.begin(), buffers.end());
  return keys;
}

}  // namespace moecore
