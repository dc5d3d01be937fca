#include "moecore/model/rotary_embedding.h"

#include <cmath>

namespace moecore {
namespace {

kernels::YarnParams yarn_params(const YarnConfig& yarn) {
  return kernels::YarnParams{yarn.rotary_scaling_factor, yarn.original_max_position_embeddings, yarn.beta_fast,
                             yarn.beta_slow, yarn.correction_range_round_to_int};
}

float concentration(const YarnConfig& yarn) {
  return static_cast<float>(
      kernels::yarn_concentration_factor(yarn.rotary_scaling_factor, yarn.mscale, yarn.mscale_all_dim));
}

}  // namespace

kernels::RopeSpec attention_rope_spec(const ModelConfig& config) {
  kernels::RopeSpec spec;
  spec.head_dim = config.kv_channels;
  if (config.position_embedding_type == PositionEmbedding::kYarn) {
    spec.inv_freq = kernels::yarn_inv_freq(config.kv_channels, config.rotary_base, yarn_params(config.yarn));
    spec.attention_factor = concentration(config.yarn);
  } else {
    spec.inv_freq = kernels::rope_inv_freq(config.rotary_dim(), config.rotary_base);
  }
  return spec;
}

kernels::RopeSpec mla_rope_spec(const ModelConfig& config) {
  const MlaConfig& mla = config.mla.value();
  kernels::RopeSpec spec;
  spec.head_dim = mla.qk_pos_emb_head_dim;
  spec.mla_interleaved = true;
  if (mla.rope_type == RopeType::kYarn) {
    kernels::YarnParams yarn = yarn_params(config.yarn);
    yarn.round_to_int = true;  // MultiLatentAttention leaves YarnRotaryEmbedding's default
    spec.inv_freq = kernels::yarn_inv_freq(mla.qk_pos_emb_head_dim, config.rotary_base, yarn);
    spec.attention_factor = concentration(config.yarn);
  } else {
    const auto rot = static_cast<int64_t>(static_cast<double>(mla.qk_pos_emb_head_dim) * config.rotary_percent);
    spec.inv_freq = kernels::rope_inv_freq(rot, config.rotary_base);
  }
  return spec;
}

double mla_softmax_scale(const ModelConfig& config) {
  const double mscale = kernels::yarn_get_mscale(config.yarn.rotary_scaling_factor, config.yarn.mscale_all_dim);
  return mscale * mscale / std::sqrt(static_cast<double>(config.mla.value().q_head_dim()));
}

}  // namespace moecore
