#include "moecore/config/flops.h"

#include <string>

namespace moecore {
namespace {

void require(const bool condition, const std::string& message) {
  if (!condition) throw ConfigError("FLOPs count: " + message);
}

void check(const FlopsShape& shape) {
  if (shape.padded_vocab_size <= 0) {
    throw ConfigError("FLOPs count needs the padded vocabulary size (vocab_size is 0)");
  }
  require(shape.hidden_size > 0 && shape.num_layers > 0 && shape.num_attention_heads > 0,
          "hidden size, layers and attention heads must be positive");
  require(shape.num_moe_layers >= 0 && shape.num_moe_layers <= shape.num_layers,
          "MoE layers must be between 0 and the number of layers");
  require(shape.num_moe_layers > 0 || !shape.last_layer_is_moe, "the last layer is MoE but no layer is");
  require(shape.mtp_num_layers >= 0, "MTP layers must not be negative");
  require(shape.moe_latent_size >= 0, "the MoE latent size must not be negative (0: none)");
  if (shape.mla) {
    const MlaConfig& mla = *shape.mla;
    require(mla.q_lora_rank >= 0, "q_lora_rank must not be negative (0: queries from the hidden state)");
    require(mla.kv_lora_rank > 0 && mla.qk_head_dim > 0 && mla.qk_pos_emb_head_dim >= 0 && mla.v_head_dim > 0,
            "multi-latent attention dimensions must be positive");
  } else {
    require(shape.kv_channels > 0 && shape.num_query_groups > 0, "kv channels and query groups must be positive");
  }
}

}  // namespace

// Term by term as training.py's transformer_flops (Megatron-LM d98e8a6), in its order of operations.
double num_floating_point_operations(const FlopsShape& shape, const double tokens, const double seqlen_squared_sum) {
  check(shape);
  constexpr double kForwardBackward = 3.0;  // forward, weight gradient, input gradient
  constexpr double kFma = 2.0;              // a multiply-add is two floating-point operations
  const double ffn_expansion = shape.swiglu ? 3.0 : 2.0;
  const auto h = static_cast<double>(shape.hidden_size);
  const auto heads = static_cast<double>(shape.num_attention_heads);

  // MTP blocks are transformer layers of the last decoder layer's kind.
  const auto mtp = static_cast<double>(shape.mtp_num_layers);
  const double moe_layers = static_cast<double>(shape.num_moe_layers) + (shape.last_layer_is_moe ? mtp : 0.0);
  const double dense_layers =
      static_cast<double>(shape.num_layers - shape.num_moe_layers) + (shape.last_layer_is_moe ? 0.0 : mtp);
  const double layers = static_cast<double>(shape.num_layers) + mtp;

  // Self-attention: a token-linear part (projections) and the core-attention part QK^T, softmax(QK^T)V over the
  // causal half of each L x L score matrix (the /2 of the mask cancels the *2 of the FMA).
  double self_attn_per_layer = 0.0;
  double self_attn_core_per_layer = 0.0;
  if (shape.mla) {
    const MlaConfig& mla = *shape.mla;
    const auto qk = static_cast<double>(mla.qk_head_dim);
    const auto rope = static_cast<double>(mla.qk_pos_emb_head_dim);
    const auto v = static_cast<double>(mla.v_head_dim);
    const auto kv_lora = static_cast<double>(mla.kv_lora_rank);
    // Query down / up projections (+ the q norm, the "+ 1"), or one projection without q_lora_rank.
    const double q_term = mla.q_lora_rank > 0 ? static_cast<double>(mla.q_lora_rank) * (h + heads * (qk + rope) + 1.0)
                                              : h * heads * (qk + rope);
    self_attn_per_layer = kForwardBackward * kFma *
                          (q_term + kv_lora * (h + heads * (qk + v) + 1.0)  // kv down / up projections + kv norm
                           + h * rope                                       // the shared RoPE key
                           + heads * v * h);                                // output projection
    self_attn_core_per_layer = kForwardBackward * kFma * (heads * (qk + rope) / 2.0 + heads * v / 2.0);
  } else {
    const double query = static_cast<double>(shape.kv_channels) * heads;
    const double key_value = static_cast<double>(shape.kv_channels) * static_cast<double>(shape.num_query_groups);
    self_attn_per_layer = kForwardBackward * kFma * (h * (query + key_value + key_value) + query * h);
    self_attn_core_per_layer = kForwardBackward * kFma * query / 2.0 * 2.0;
  }

  // LatentMoE: the experts run on moe_latent_size (their term scaled by latent / h), plus the latent down and up
  // projections.
  const double routed_experts =
      static_cast<double>(shape.moe_ffn_hidden_size) * static_cast<double>(shape.moe_router_topk) * ffn_expansion;
  const auto latent = static_cast<double>(shape.moe_latent_size);
  const double routed_per_moe_layer =
      shape.moe_latent_size > 0 ? routed_experts * latent / h + 2.0 * latent : routed_experts;
  const double mlp =
      kForwardBackward * kFma * h *
      (static_cast<double>(shape.ffn_hidden_size) * ffn_expansion * dense_layers                    // dense layers
       + routed_per_moe_layer * moe_layers                                                          // routed experts
       + static_cast<double>(shape.shared_expert_intermediate_size) * ffn_expansion * moe_layers);  // shared experts
  const double mtp_norms_and_projection = kForwardBackward * kFma * mtp * (3.0 * h + 2.0 * h * h);
  const double logits =
      kForwardBackward * kFma * h * static_cast<double>(shape.padded_vocab_size) * (mtp + 1.0);  // MTP + final
  return tokens * (mlp + self_attn_per_layer * layers + mtp_norms_and_projection + logits) +
         seqlen_squared_sum * (self_attn_core_per_layer * layers);
}

FlopsShape flops_shape(const ModelConfig& config) {
  FlopsShape shape;
  shape.hidden_size = config.hidden_size;
  shape.num_layers = config.num_layers;
  shape.ffn_hidden_size = config.ffn_hidden_size;
  shape.swiglu = config.activation == Activation::kSwiGLU;
  shape.num_attention_heads = config.num_attention_heads;
  shape.num_query_groups = config.num_query_groups;
  shape.kv_channels = config.kv_channels;
  for (int64_t layer = 0; layer < config.num_layers; ++layer) {
    shape.num_moe_layers += config.moe.is_moe_layer(layer) ? 1 : 0;
  }
  shape.last_layer_is_moe = config.num_layers > 0 && config.moe.is_moe_layer(config.num_layers - 1);
  if (config.moe.enabled()) {
    shape.moe_ffn_hidden_size =
        config.moe.ffn_hidden_size > 0 ? config.moe.ffn_hidden_size : config.ffn_hidden_size;  // Megatron's fallback
    shape.moe_router_topk = config.moe.topk;
    shape.shared_expert_intermediate_size = config.moe.shared_expert_intermediate_size;
    shape.moe_latent_size = config.moe.latent_size;
  }
  shape.padded_vocab_size = config.vocab_size;
  shape.mla = config.mla;
  shape.mtp_num_layers = config.mtp_num_layers;
  return shape;
}

}  // namespace moecore
