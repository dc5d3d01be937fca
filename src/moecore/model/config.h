// Model hyper-parameters, named after Megatron's TransformerConfig fields / command-line flags.
#pragma once

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "moecore/model/recompute_config.h"
#include "moecore/moe/moe_config.h"
#include "moecore/ops/activation.h"
#include "moecore/quant/quantized_gemm.h"
#include "moecore/tensor/dtype.h"

namespace moecore {

// A configuration problem: one line naming the offending setting.
class ConfigError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

enum class Normalization { kLayerNorm, kRMSNorm };
using ops::Activation;
// kYarn: Megatron's --position-embedding-type yarn for standard attention (YarnRotaryEmbedding's frequencies and
// concentration factor, attention.py).
enum class PositionEmbedding { kLearnedAbsolute, kRope, kNone, kYarn };
// Megatron's --rope-type: the rotary embedding of multi-latent attention (MLATransformerConfig.rope_type).
enum class RopeType { kRope, kYarn };

// YaRN (Megatron's YarnRotaryEmbedding, yarn_rotary_pos_embedding.py): the frequencies blend the original and the
// scaled (1 / rotary_scaling_factor) ones over a ramp between the dimensions that make beta_fast and beta_slow
// rotations in original_max_position_embeddings positions; cos / sin are multiplied by the concentration factor
// get_mscale(s, mscale) / get_mscale(s, mscale_all_dim).
struct YarnConfig {
  double rotary_scaling_factor = 1.0;               // --rotary-scaling-factor
  double mscale = 1.0;                              // --mscale
  double mscale_all_dim = 0.0;                      // --mscale-all-dim
  int64_t original_max_position_embeddings = 4096;  // --yarn-original-max-position-embeddings
  double beta_fast = 32.0;                          // --yarn-beta-fast
  double beta_slow = 1.0;                           // --yarn-beta-slow
  bool correction_range_round_to_int = true;        // --[no-]yarn-correction-range-round-to-int
};

// Megatron's multi-latent attention (--multi-latent-attention, MLATransformerConfig; multi_latent_attention.py):
// queries from a low-rank latent (q_lora_rank; 0: linear_q_proj straight from the hidden state), keys and values
// from one latent of kv_lora_rank shared by all heads plus one rope key of qk_pos_emb_head_dim per token.
// Query / key heads are qk_head_dim + qk_pos_emb_head_dim wide, value heads v_head_dim.
struct MlaConfig {
  int64_t q_lora_rank = 0;               // --q-lora-rank (Megatron's None: 0)
  int64_t kv_lora_rank = 32;             // --kv-lora-rank
  int64_t qk_head_dim = 128;             // --qk-head-dim (the part of a query / key head without RoPE)
  int64_t qk_pos_emb_head_dim = 64;      // --qk-pos-emb-head-dim
  int64_t v_head_dim = 128;              // --v-head-dim
  RopeType rope_type = RopeType::kYarn;  // --rope-type (MLA's default: yarn)

  int64_t q_head_dim() const { return qk_head_dim + qk_pos_emb_head_dim; }
};

struct ModelConfig {
  int64_t num_layers = 0;           // --num-layers
  int64_t hidden_size = 0;          // --hidden-size
  int64_t ffn_hidden_size = 0;      // --ffn-hidden-size
  int64_t num_attention_heads = 0;  // --num-attention-heads
  int64_t num_query_groups = 0;     // --num-query-groups (== heads unless --group-query-attention)
  int64_t kv_channels = 0;          // --kv-channels (head dim)
  int64_t seq_length = 0;           // --seq-length
  int64_t max_position_embeddings = 0;
  int64_t vocab_size = 0;  // padded vocabulary (rows of the embedding)
  Normalization normalization = Normalization::kLayerNorm;
  double norm_epsilon = 1e-5;
  Activation activation = Activation::kGelu;
  bool add_bias_linear = true;
  bool qk_layernorm = false;
  PositionEmbedding position_embedding_type = PositionEmbedding::kLearnedAbsolute;
  double rotary_base = 10000.0;
  double rotary_percent = 1.0;
  YarnConfig yarn;               // --position-embedding-type yarn, or multi-latent attention with --rope-type yarn
  std::optional<MlaConfig> mla;  // --multi-latent-attention (then kv_channels and num_query_groups are unused)
  // --mtp-num-layers D (0: none): D Multi-Token Prediction depths after the decoder (multi_token_prediction.py),
  // their losses weighted by --mtp-loss-scaling-factor / D.
  int64_t mtp_num_layers = 0;
  double mtp_loss_scaling_factor = 0.1;
  double init_method_std = 0.02;
  double attention_dropout = 0.1;
  double hidden_dropout = 0.1;
  bool untie_embeddings_and_output_weights = false;
  // --cp-comm-type: one value for every layer, or one per layer (p2p, all_gather, a2a).
  std::vector<std::string> cp_comm_type = {"p2p"};
  MoEConfig moe;  // num_experts == 0: dense
  // Megatron's params_dtype: kF32, or kBF16 / kF16 with --bf16 / --fp16 (weights and activations hold values of that
  // dtype; the optimizer keeps fp32 main parameters).
  DType params_dtype = DType::kF32;
  // --fp8-format / --fp8-recipe or --fp4-format / --fp4-recipe: the recipe the decoder layers' linear layers and
  // experts quantize their GEMMs with (ops/quantization.h); unset: high precision.
  std::optional<quant::QuantizedLinearConfig> quantization;
  bool first_last_layers_bf16 = false;      // --first-last-layers-bf16
  int64_t num_layers_at_start_in_bf16 = 1;  // --num-layers-at-start-in-bf16
  int64_t num_layers_at_end_in_bf16 = 1;    // --num-layers-at-end-in-bf16
  RecomputeConfig recompute;                // --recompute-granularity and its companions (training forwards)

  int64_t rotary_dim() const { return static_cast<int64_t>(static_cast<double>(kv_channels) * rotary_percent); }
  int64_t fc1_out() const { return activation == Activation::kSwiGLU ? 2 * ffn_hidden_size : ffn_hidden_size; }
  int64_t qkv_out() const { return (num_attention_heads + 2 * num_query_groups) * kv_channels; }
  // Megatron's is_first_last_bf16_layer (megatron/core/fp8_utils.py): global decoder layer `layer` is one of the
  // first / last layers --first-last-layers-bf16 keeps unquantized.
  bool is_first_last_bf16_layer(const int64_t layer) const {
    if (!first_last_layers_bf16 || layer < 0) return false;
    return layer < num_layers_at_start_in_bf16 || layer >= num_layers - num_layers_at_end_in_bf16;
  }
  // The quantization of global decoder layer `layer`'s linear layers, or null (high precision).
  const quant::QuantizedLinearConfig* layer_quantization(const int64_t layer) const {
    return quantization && !is_first_last_bf16_layer(layer) ? &*quantization : nullptr;
  }
  // Throws ConfigError for the first inconsistent setting.
  void validate() const;
};

std::string to_string(Normalization value);
std::string to_string(Activation value);
std::string to_string(PositionEmbedding value);

}  // namespace moecore
