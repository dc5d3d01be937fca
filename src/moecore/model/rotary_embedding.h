// The rotary embedding an attention module applies, as Megatron builds it from the config:
//   standard attention, --position-embedding-type rope: RotaryEmbedding over rotary_percent of kv_channels;
//   standard attention, --position-embedding-type yarn: YarnRotaryEmbedding's frequencies over all kv_channels
//     (rotary_percent is not used), cos and sin times the concentration factor of the yarn_* fields (attention.py:
//     mscale=self._yarn_concentration_factor);
//   multi-latent attention (multi_latent_attention.py): over the qk_pos_emb_head_dim rope channels in MLA's
//     de-interleaved layout, RotaryEmbedding (--rope-type rope, rotary_percent applies) or YarnRotaryEmbedding with
//     its concentration factor on cos and sin (--rope-type yarn; the ramp ends always rounded, as MultiLatentAttention
//     leaves correction_range_round_to_int at its default).
#pragma once

#include "moecore/kernels/cpu/rotary_frequencies.h"
#include "moecore/model/config.h"

namespace moecore {

// Standard attention's rope (config.position_embedding_type rope or yarn).
kernels::RopeSpec attention_rope_spec(const ModelConfig& config);
// Multi-latent attention's rope over its [T, heads, qk_pos_emb_head_dim] rope sub-vectors (config.mla set).
kernels::RopeSpec mla_rope_spec(const ModelConfig& config);
// Multi-latent attention's softmax scale: get_mscale(rotary_scaling_factor, mscale_all_dim)^2 / sqrt(dq + dr)
// (MultiLatentAttention.__init__, for either rope type).
double mla_softmax_scale(const ModelConfig& config);

}  // namespace moecore
