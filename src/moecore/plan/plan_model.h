// The model a plan is made for: train's ModelConfig plus the planner's own view of Megatron's multi-latent attention
// and multi-token prediction (Megatron's optional q latent; MTP depths placed by layouts on stages of their own,
// which moecore's engine does not run).
#pragma once

#include <cstdint>
#include <optional>

#include "moecore/model/config.h"

namespace moecore::plan {

// Megatron's MLATransformerConfig fields (arguments.py _add_mla_args; the flag defaults in the comments).
struct MlaShape {
  std::optional<int64_t> q_lora_rank;  // --q-lora-rank (None: queries projected straight from the hidden state)
  int64_t kv_lora_rank = 32;           // --kv-lora-rank
  int64_t qk_head_dim = 128;           // --qk-head-dim (the part of a query / key head without RoPE)
  int64_t qk_pos_emb_head_dim = 64;    // --qk-pos-emb-head-dim (the RoPE part)
  int64_t v_head_dim = 128;            // --v-head-dim
};

struct PlanModel {
  // Shapes as train parses them; vocab_size is the padded vocabulary (Megatron's padded_vocab_size).
  ModelConfig config;
  std::optional<MlaShape> mla;  // --multi-latent-attention (then config's kv_channels / query groups are unused)
  int64_t mtp_num_layers = 0;   // --mtp-num-layers: MTP blocks after the decoder, each one transformer layer of the
                                // last decoder layer's kind plus its eh projection [2h -> h] and two norms
};

}  // namespace moecore::plan
