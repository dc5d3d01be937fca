#include "moecore/ckpt/hf_state_source.h"

#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <stdexcept>

#include "moecore/ckpt/hf_checkpoint.h"
#include "moecore/ckpt/hf_layout.h"
#include "moecore/ckpt/hf_moe_config.h"
#include "moecore/ckpt/model_state_keys.h"
#include "moecore/ckpt/safetensors.h"
#include "moecore/tensor/finite_check.h"

namespace moecore {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

// The table of contents of every weight file of an HF folder: the single model.safetensors, or the shards an index
// names.
struct HfFiles {
  std::vector<SafetensorsHeader> headers;
  struct Located {
    const SafetensorsHeader* header;
    const SafetensorsTensorInfo* info;
  };
  std::map<std::string, Located> tensors;
};

std::shared_ptr<const HfFiles> read_hf_files(const std::string& dir) {
  auto files = std::make_shared<HfFiles>();
  const fs::path single = fs::path(dir) / "model.safetensors";
  const fs::path index_path = fs::path(dir) / "model.safetensors.index.json";
  if (fs::exists(single)) {
    files->headers.push_back(read_safetensors_header(single.string()));
  } else if (fs::exists(index_path)) {
    const json index = read_json_file(index_path.string());
    if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object()) {
      throw std::runtime_error(index_path.string() + ": no weight_map object");
    }
    std::set<std::string> shards;
    for (const auto& [name, shard] : index["weight_map"].items()) {
      if (!shard.is_string()) throw std::runtime_error(index_path.string() + ": weight_map entry '" + name + "' bad");
      shards.insert(shard.get<std::string>());
    }
    for (const std::string& shard : shards) {
      files->headers.push_back(read_safetensors_header((fs::path(dir) / shard).string()));
    }
  } else {
    throw std::runtime_error(dir + ": neither model.safetensors nor model.safetensors.index.json exists");
  }
  for (const SafetensorsHeader& header : files->headers) {  // the vector is complete: pointers stay valid
    for (const SafetensorsTensorInfo& info : header.tensors) {
      if (!files->tensors.emplace(info.name, HfFiles::Located{&header, &info}).second) {
        throw std::runtime_error(header.path + ": tensor '" + info.name + "' also appears in another shard");
      }
    }
  }
  return files;
}

bool is_floating(const DType dtype) {
  return dtype == DType::kF32 || dtype == DType::kF16 || dtype == DType::kBF16 || dtype == DType::kF64;
}

// The HF tensors of each moecore key, in the order their rows are stacked.
std::map<std::string, std::vector<HfTensorMap>> maps_by_key(const ModelConfig& config, const std::string& model_type) {
  std::map<std::string, std::vector<HfTensorMap>> by_key;
  for (HfTensorMap& map : hf_layout(config, model_type)) by_key[map.megatron_name].push_back(std::move(map));
  if (!config.moe.enable_expert_bias) return by_key;
  for (const auto& [hf_name, key] : hf_expert_bias_buffers(config, model_type)) {
    by_key[key].push_back(HfTensorMap{hf_name, key, {}});
  }
  return by_key;
}

// The global tensor `shape` of one key from its HF tensors (rows stacked in map order), converted to fp32.
Tensor assemble(const HfFiles& files, const std::vector<HfTensorMap>& maps, const std::vector<int64_t>& shape) {
  Tensor out(shape, DType::kF32);
  const int64_t row_numel = shape[0] == 0 ? 0 : out.numel() / shape[0];
  for (const HfTensorMap& map : maps) {
    const HfFiles::Located& at = files.tensors.at(map.hf_name);
    Tensor values;
    try {
      values = to_float32(read_safetensors_tensor(*at.header, *at.info));
    } catch (const std::runtime_error& e) {
      throw std::runtime_error(at.header->path + ": tensor '" + map.hf_name + "': " + e.what());
    }
    // A NaN or Inf weight would make every forward non-finite (generation then prints token 0 forever).
    require_finite(values, map.hf_name);
    const float* src = values.data<float>();
    for (const HfRowRange& r : hf_row_ranges(map, shape[0])) {
      const size_t n = static_cast<size_t>((r.end - r.begin) * row_numel);
      std::memcpy(out.data<float>() + r.begin * row_numel, src, n * sizeof(float));
      src += n;
    }
  }
  return out;
}

}  // namespace

std::unique_ptr<GlobalTensorSource> hf_state_source(const std::string& dir, const ModelConfig& config) {
  const std::string model_type = read_hf_model_type(dir);
  const std::shared_ptr<const HfFiles> files = read_hf_files(dir);
  std::map<std::string, std::vector<HfTensorMap>> by_key = maps_by_key(config, model_type);
  auto source = std::make_unique<GlobalTensorSource>("HF checkpoint " + dir);
  std::set<std::string> used;
  for (const ModelStateKey& key : model_state_keys(config)) {
    const auto it = by_key.find(key.key);
    if (it == by_key.end()) {
      throw ConfigError("HF checkpoint " + dir + ": model_type " + model_type + " has no tensor for " + key.key);
    }
    for (const HfTensorMap& map : it->second) {
      const auto found = files->tensors.find(map.hf_name);
      if (found == files->tensors.end()) throw std::runtime_error(dir + ": missing tensor '" + map.hf_name + "'");
      const SafetensorsTensorInfo& info = *found->second.info;
      const std::vector<int64_t> expected = hf_tensor_shape(map, key.global_shape);
      if (info.shape != expected) {
        throw std::runtime_error(found->second.header->path + ": tensor '" + map.hf_name + "' has shape " +
                                 shape_text(info.shape) + ", the model needs " + shape_text(expected));
      }
      if (!is_floating(info.dtype)) {
        throw std::runtime_error(found->second.header->path + ": tensor '" + map.hf_name + "' has dtype " +
                                 safetensors_dtype_code(info.dtype) + " (floating-point weights expected)");
      }
      used.insert(map.hf_name);
    }
    source->add(
        key.key, StoredTensorInfo{DType::kF32, key.global_shape},
        [files, maps = std::move(it->second), shape = key.global_shape] { return assemble(*files, maps, shape); });
  }
  for (const auto& [name, located] : files->tensors) {
    if (used.contains(name)) continue;
    const bool tied_head = name == "lm_head.weight" && !config.untie_embeddings_and_output_weights;
    const bool rope_buffer = name.ends_with(".rotary_emb.inv_freq");  // older checkpoints store it
    // DeepSeek-V3's MTP layers may hold copies of the embedding and output head; Megatron shares the model's own
    // (Megatron-Bridge maps none of them).
    bool mtp_copy = false;
    for (int64_t k = 0; model_type == "deepseek_v3" && k < config.mtp_num_layers; ++k) {
      const std::string P = hf_layer_prefix(config.num_layers + k);
      mtp_copy |= name == P + "embed_tokens.weight" || name == P + "shared_head.head.weight";
    }
    if (!tied_head && !rope_buffer && !mtp_copy) {
      throw std::runtime_error(located.header->path + ": tensor '" + name + "' has no place in a " + model_type +
                               " model with this config");
    }
  }
  return source;
}

namespace {

std::string number_text(const double value) { return json(value).dump(); }
std::string bool_text(const bool value) { return value ? "true" : "false"; }

std::string list_text(const std::vector<int64_t>& values) {
  std::string out = "[";
  for (size_t i = 0; i < values.size(); ++i) out += (i ? ", " : "") + std::to_string(values[i]);
  return out + "]";
}

std::vector<int64_t> dense_layers(const ModelConfig& c) {
  std::vector<int64_t> layers;
  for (int64_t i = 0; i < c.num_layers; ++i) {
    if (!c.moe.is_moe_layer(i)) layers.push_back(i);
  }
  return layers;
}

[[noreturn]] void fail_mismatch(const std::string& field, const std::string& hf_value, const std::string& flag) {
  throw ConfigError("HF config.json " + field + " " + hf_value + " does not match " + flag);
}

}  // namespace

void check_hf_config_matches(const std::string& dir, const ModelConfig& config) {
  if (config.moe.latent_size > 0) {
    throw ConfigError(
        "loading an HF checkpoint: no HF model type moecore reads has LatentMoE's projections "
        "(--moe-latent-size)");
  }
  const ModelConfig hf = read_hf_config(dir);
  const std::string model_type = read_hf_model_type(dir);
  const bool has_block = read_json_file((fs::path(dir) / "config.json").string()).contains(kMoecoreMoeConfigKey);
  const std::string type_field = "model_type " + model_type;
  const bool moecore_moe = model_type == "moecore_moe", mixtral = model_type == "mixtral";
  const auto block_field = [](const std::string& key) { return std::string(kMoecoreMoeConfigKey) + "." + key; };
  const auto same_int = [](const std::string& field, const int64_t hf_value, const std::string& flag,
                           const int64_t value) {
    if (hf_value != value) fail_mismatch(field, std::to_string(hf_value), flag + " " + std::to_string(value));
  };
  const auto same_double = [](const std::string& field, const double hf_value, const std::string& flag,
                              const double value) {
    if (hf_value != value) fail_mismatch(field, number_text(hf_value), flag + " " + number_text(value));
  };

  same_int("num_hidden_layers", hf.num_layers, "--num-layers", config.num_layers);
  same_int("hidden_size", hf.hidden_size, "--hidden-size", config.hidden_size);
  same_int("num_attention_heads", hf.num_attention_heads, "--num-attention-heads", config.num_attention_heads);
  same_int("num_key_value_heads", hf.num_query_groups, "--num-query-groups", config.num_query_groups);
  same_int("head_dim", hf.kv_channels, "--kv-channels", config.kv_channels);
  if (hf.vocab_size != config.vocab_size) {
    fail_mismatch("vocab_size", std::to_string(hf.vocab_size),
                  "the padded vocabulary size " + std::to_string(config.vocab_size) +
                      " (the tokenizer's vocabulary padded by --make-vocab-size-divisible-by)");
  }
  if (config.normalization != Normalization::kRMSNorm) {
    fail_mismatch(type_field, "(RMSNorm)", "--normalization " + to_string(config.normalization));
  }
  same_double("rms_norm_eps", hf.norm_epsilon, "--norm-epsilon", config.norm_epsilon);
  if (config.activation != Activation::kSwiGLU) {
    fail_mismatch("hidden_act", "silu (SwiGLU)",
                  "the activation " + moecore::to_string(config.activation) + " (no --swiglu)");
  }
  if (config.position_embedding_type != PositionEmbedding::kRope) {
    fail_mismatch(type_field, "(RoPE)", "--position-embedding-type " + to_string(config.position_embedding_type));
  }
  if (config.rotary_percent != 1.0) {
    fail_mismatch(type_field, "(RoPE over the whole head)", "--rotary-percent " + number_text(config.rotary_percent));
  }
  same_double("rope_theta", hf.rotary_base, "--rotary-base", config.rotary_base);
  if (hf.mla.has_value() != config.mla.has_value()) {
    fail_mismatch(type_field, hf.mla ? "(multi-latent attention)" : "(standard attention)",
                  config.mla ? "--multi-latent-attention" : "no --multi-latent-attention");
  }
  if (hf.mla) {
    const MlaConfig &a = *hf.mla, &b = *config.mla;
    same_int("q_lora_rank", a.q_lora_rank, "--q-lora-rank", b.q_lora_rank);
    same_int("kv_lora_rank", a.kv_lora_rank, "--kv-lora-rank", b.kv_lora_rank);
    same_int("qk_nope_head_dim", a.qk_head_dim, "--qk-head-dim", b.qk_head_dim);
    same_int("qk_rope_head_dim", a.qk_pos_emb_head_dim, "--qk-pos-emb-head-dim", b.qk_pos_emb_head_dim);
    same_int("v_head_dim", a.v_head_dim, "--v-head-dim", b.v_head_dim);
    if (a.rope_type != b.rope_type) {
      fail_mismatch("rope_scaling", a.rope_type == RopeType::kYarn ? "yarn" : "null",
                    std::string("--rope-type ") + (b.rope_type == RopeType::kYarn ? "yarn" : "rope"));
    }
    if (a.rope_type == RopeType::kYarn) {
      const YarnConfig &y = hf.yarn, &z = config.yarn;
      same_double("rope_scaling.factor", y.rotary_scaling_factor, "--rotary-scaling-factor", z.rotary_scaling_factor);
      same_int("rope_scaling.original_max_position_embeddings", y.original_max_position_embeddings,
               "--yarn-original-max-position-embeddings", z.original_max_position_embeddings);
      same_double("rope_scaling.beta_fast", y.beta_fast, "--yarn-beta-fast", z.beta_fast);
      same_double("rope_scaling.beta_slow", y.beta_slow, "--yarn-beta-slow", z.beta_slow);
      same_double("rope_scaling.mscale", y.mscale, "--mscale", z.mscale);
      same_double("rope_scaling.mscale_all_dim", y.mscale_all_dim, "--mscale-all-dim", z.mscale_all_dim);
    }
    same_int("num_nextn_predict_layers", hf.mtp_num_layers, "--mtp-num-layers", config.mtp_num_layers);
  }
  if (hf.qk_layernorm != config.qk_layernorm) {
    fail_mismatch(moecore_moe ? "qk_layernorm" : type_field,
                  moecore_moe ? bool_text(hf.qk_layernorm) : (hf.qk_layernorm ? "(q/k norms)" : "(no q/k norms)"),
                  config.qk_layernorm ? "--qk-layernorm" : "no --qk-layernorm");
  }
  if (hf.add_bias_linear != config.add_bias_linear) {
    fail_mismatch(mixtral ? type_field : "attention_bias", mixtral ? "(no biases)" : bool_text(hf.add_bias_linear),
                  config.add_bias_linear ? "--add-bias-linear" : "--disable-bias-linear");
  }
  if (hf.untie_embeddings_and_output_weights != config.untie_embeddings_and_output_weights) {
    fail_mismatch("tie_word_embeddings", bool_text(!hf.untie_embeddings_and_output_weights),
                  config.untie_embeddings_and_output_weights
                      ? "--untie-embeddings-and-output-weights"
                      : "tied embeddings (no --untie-embeddings-and-output-weights)");
  }

  // MoE fields: HF's own names for mixtral / qwen3_moe, moecore's block for moecore_moe (read_hf_config's sources).
  const MoEConfig &h = hf.moe, &m = config.moe;
  if (h.enabled() != m.enabled()) {
    if (!h.enabled()) fail_mismatch(type_field, "(dense)", "--num-experts " + std::to_string(m.num_experts));
    fail_mismatch(mixtral ? "num_local_experts" : "num_experts", std::to_string(h.num_experts),
                  "a dense model (no --num-experts)");
  }
  if (m.enabled()) {
    same_int(mixtral ? "num_local_experts" : "num_experts", h.num_experts, "--num-experts", m.num_experts);
    same_int("num_experts_per_tok", h.topk, "--moe-router-topk", m.topk);
    same_int(mixtral ? "intermediate_size" : "moe_intermediate_size", h.ffn_hidden_size, "--moe-ffn-hidden-size",
             m.ffn_hidden_size);
    if (dense_layers(hf) != dense_layers(config)) {
      const std::string field = moecore_moe ? block_field("moe_layer_freq")
                                : mixtral   ? type_field + " (MoE in every layer), dense layers"
                                            : "mlp_only_layers";
      fail_mismatch(field, list_text(dense_layers(hf)),
                    "--moe-layer-freq (dense layers " + list_text(dense_layers(config)) + ")");
    }
    const auto routing_field = [&](const std::string& key) {
      return moecore_moe ? block_field(key) : type_field + " (HF's router),";
    };
    if (h.score_function != m.score_function) {
      fail_mismatch(routing_field("moe_router_score_function"), to_string(h.score_function),
                    "--moe-router-score-function " + to_string(m.score_function));
    }
    if (m.score_function == RouterScoreFunction::kSoftmax && h.pre_softmax != m.pre_softmax) {
      const std::string field = moecore_moe ? block_field("moe_router_pre_softmax")
                                : mixtral   ? type_field + " (post-softmax top-k), pre-softmax"
                                            : "norm_topk_prob";
      fail_mismatch(field, bool_text(model_type == "qwen3_moe" ? !h.pre_softmax : h.pre_softmax),
                    m.pre_softmax ? "--moe-router-pre-softmax" : "no --moe-router-pre-softmax");
    }
    if (h.topk_scaling_factor != m.topk_scaling_factor) {
      fail_mismatch(routing_field("moe_router_topk_scaling_factor"),
                    h.topk_scaling_factor ? number_text(*h.topk_scaling_factor) : "null",
                    "--moe-router-topk-scaling-factor " +
                        (m.topk_scaling_factor ? number_text(*m.topk_scaling_factor) : std::string("(unset)")));
    }
    same_int(routing_field("moe_router_num_groups"), h.num_groups, "--moe-router-num-groups", m.num_groups);
    same_int(routing_field("moe_router_group_topk"), h.group_topk, "--moe-router-group-topk", m.group_topk);
    if (h.enable_expert_bias != m.enable_expert_bias) {
      fail_mismatch(routing_field("moe_router_enable_expert_bias"), bool_text(h.enable_expert_bias),
                    m.enable_expert_bias ? "--moe-router-enable-expert-bias" : "no --moe-router-enable-expert-bias");
    }
    same_int(routing_field("moe_shared_expert_intermediate_size"), h.shared_expert_intermediate_size,
             "--moe-shared-expert-intermediate-size", m.shared_expert_intermediate_size);
    if (h.shared_expert_gate != m.shared_expert_gate) {
      fail_mismatch(routing_field("moe_shared_expert_gate"), bool_text(h.shared_expert_gate),
                    m.shared_expert_gate ? "--moe-shared-expert-gate" : "no --moe-shared-expert-gate");
    }
  }
  // The dense MLP width matters only where a layer is dense (an all-MoE mixtral stores the experts' width there).
  if (!dense_layers(config).empty()) {
    const std::string field =
        moecore_moe || (mixtral && has_block) ? block_field("ffn_hidden_size") : std::string("intermediate_size");
    same_int(field, hf.ffn_hidden_size, "--ffn-hidden-size", config.ffn_hidden_size);
  }
}

}  // namespace moecore
