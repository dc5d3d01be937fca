#include "moecore/model/config.h"

namespace moecore {
namespace {
void require(const bool ok, const std::string& message) {
  if (!ok) throw ConfigError(message);
}
}  // namespace

void ModelConfig::validate() const {
  require(num_layers > 0, "--num-layers must be positive (got " + std::to_string(num_layers) + ")");
  require(hidden_size > 0, "--hidden-size must be positive (got " + std::to_string(hidden_size) + ")");
  require(num_attention_heads > 0, "--num-attention-heads must be positive");
  require(ffn_hidden_size > 0, "--ffn-hidden-size must be positive");
  require(kv_channels > 0, "--kv-channels must be positive");
  require(num_query_groups > 0, "--num-query-groups must be positive");
  require(num_attention_heads % num_query_groups == 0, "--num-query-groups (" + std::to_string(num_query_groups) +
                                                           ") must divide --num-attention-heads (" +
                                                           std::to_string(num_attention_heads) + ")");
  require(seq_length > 0, "--seq-length must be positive");
  require(vocab_size > 0, "vocabulary size must be positive");
  require(norm_epsilon > 0, "--norm-epsilon must be positive");
  require(attention_dropout >= 0 && attention_dropout < 1, "--attention-dropout must be in [0, 1)");
  require(hidden_dropout >= 0 && hidden_dropout < 1, "--hidden-dropout must be in [0, 1)");
  require(init_method_std > 0, "--init-method-std must be positive");
  if (position_embedding_type == PositionEmbedding::kLearnedAbsolute) {
    require(max_position_embeddings >= seq_length,
            "--max-position-embeddings (" + std::to_string(max_position_embeddings) +
                ") must be at least --seq-length (" + std::to_string(seq_length) + ")");
  }
  if (moe.enabled()) moe.validate(num_layers);
  if (position_embedding_type == PositionEmbedding::kRope) {
    require(rotary_percent > 0 && rotary_percent <= 1, "--rotary-percent must be in (0, 1]");
    require(rotary_dim() % 2 == 0 && rotary_dim() > 0,
            "--rotary-percent times --kv-channels must give an even rotary dimension (got " +
                std::to_string(rotary_dim()) + ")");
    require(rotary_base > 0, "--rotary-base must be positive");
  }
  if (position_embedding_type == PositionEmbedding::kYarn || (mla && mla->rope_type == RopeType::kYarn)) {
    require(yarn.rotary_scaling_factor > 0, "--rotary-scaling-factor must be positive");
    require(yarn.original_max_position_embeddings > 0, "--yarn-original-max-position-embeddings must be positive");
    require(yarn.beta_fast > 0 && yarn.beta_slow > 0, "--yarn-beta-fast and --yarn-beta-slow must be positive");
    require(rotary_base > 1, "--rotary-base must be above 1 under YaRN");
  }
  if (mla) {
    require(mla->q_lora_rank >= 0, "--q-lora-rank must be positive");
    require(mla->kv_lora_rank > 0, "--kv-lora-rank must be positive");
    require(mla->qk_head_dim > 0 && mla->v_head_dim > 0, "--qk-head-dim and --v-head-dim must be positive");
    require(mla->qk_pos_emb_head_dim > 0 && mla->qk_pos_emb_head_dim % 2 == 0,
            "--qk-pos-emb-head-dim must be positive and even (got " + std::to_string(mla->qk_pos_emb_head_dim) + ")");
  }
  require(mtp_num_layers >= 0, "--mtp-num-layers must not be negative");
  require(mtp_loss_scaling_factor >= 0, "--mtp-loss-scaling-factor must not be negative");
}

std::string to_string(const Normalization value) {
  return value == Normalization::kLayerNorm ? "LayerNorm" : "RMSNorm";
}
std::string to_string(const Activation value) {
  switch (value) {
    case Activation::kGelu: return "gelu";
    case Activation::kSwiGLU: return "swiglu";
    case Activation::kSquaredReLU: return "squared_relu";
  }
  return "?";
}
std::string to_string(const PositionEmbedding value) {
  switch (value) {
    case PositionEmbedding::kLearnedAbsolute: return "learned_absolute";
    case PositionEmbedding::kRope: return "rope";
    case PositionEmbedding::kNone: return "none";
    case PositionEmbedding::kYarn: return "yarn";
  }
  return "?";
}

}  // namespace moecore
