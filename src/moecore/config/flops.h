// Megatron's FLOPs count of one training iteration (megatron/training/training.py: num_floating_point_operations,
// its transformer_flops path): forward + backward GEMM FLOPs of a GPT, dense or MoE, with GQA or multi-latent
// attention, SwiGLU, shared experts, the MoE layer pattern, multi-token prediction, the causal core-attention term
// over sum_i L_i^2 and the logit layer over the padded vocabulary. Megatron's hybrid (Mamba), linear-attention,
// latent-MoE and attention-output-gate terms have no counterpart in moecore and are not counted.
#pragma once

#include <cstdint>
#include <optional>

#include "moecore/model/config.h"

namespace moecore {

// The model figures Megatron's formula reads (its args.* names in the comments).
struct FlopsShape {
  int64_t hidden_size = 0;          // hidden_size
  int64_t num_layers = 0;           // num_layers (decoder layers, without MTP)
  int64_t ffn_hidden_size = 0;      // ffn_hidden_size (the dense layers' MLP)
  bool swiglu = false;              // swiglu: 3 MLP GEMMs instead of 2
  int64_t num_attention_heads = 0;  // num_attention_heads
  int64_t num_query_groups = 0;     // num_query_groups (== heads without GQA; unused with MLA)
  int64_t kv_channels = 0;          // kv_channels (unused with MLA)
  // MoE layer pattern (moe_layer_freq): how many decoder layers have a MoE MLP (the others are dense) and whether the
  // last one does (MTP layers are of the last layer's kind). 0 / false for a dense model.
  int64_t num_moe_layers = 0;
  bool last_layer_is_moe = false;
  int64_t moe_ffn_hidden_size = 0;              // moe_ffn_hidden_size (Megatron falls back to ffn_hidden_size)
  int64_t moe_latent_size = 0;                  // moe_latent_size (0: None, the routed experts on hidden_size)
  int64_t moe_router_topk = 0;                  // moe_router_topk (experts each token is routed to)
  int64_t shared_expert_intermediate_size = 0;  // moe_shared_expert_intermediate_size (0: none)
  int64_t padded_vocab_size = 0;                // padded_vocab_size
  std::optional<MlaConfig> mla;                 // multi_latent_attention (q_lora_rank 0: Megatron's None)
  int64_t mtp_num_layers = 0;                   // mtp_num_layers
};

// FLOPs of one iteration over `tokens` = sum_i L_i tokens whose causal attention spans `seqlen_squared_sum` =
// sum_i L_i^2 (B sequences of S tokens: tokens = B * S, seqlen_squared_sum = B * S^2; packed documents attend only
// within themselves). Throws ConfigError for a shape Megatron's formula cannot count (no vocabulary, a layer count
// out of range).
double num_floating_point_operations(const FlopsShape& shape, double tokens, double seqlen_squared_sum);

// The shape of a model moecore trains (GQA / MHA or multi-latent attention, MTP depths); moe_ffn_hidden_size
// already falls back to ffn_hidden_size when --moe-ffn-hidden-size is unset.
FlopsShape flops_shape(const ModelConfig& config);

}  // namespace moecore
