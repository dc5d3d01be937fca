#include "moecore/plan/hf_flags.h"

#include <charconv>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <utility>

#include "moecore/ckpt/json_integer.h"
#include "moecore/model/config.h"
#include "moecore/util/checked_math.h"
#include "moecore/util/json_error.h"

namespace moecore::plan {
namespace {

using json = nlohmann::json;

namespace fs = std::filesystem;

// train's limits on the flags the fields become (arguments.cpp), checked here to name the field.
constexpr int64_t kMaxCount = int64_t{1} << 16;      // layers, heads, query groups
constexpr int64_t kMaxWidth = int64_t{1} << 24;      // hidden, ffn and head sizes
constexpr int64_t kMaxPositions = int64_t{1} << 24;  // the position table
constexpr int64_t kMaxExperts = int64_t{1} << 20;
constexpr int64_t kMaxVocab = INT32_MAX;  // token ids are 32-bit integers

// The shortest text that reads back as `value` (1e-06, 2.5).
std::string real_text(const double value) {
  char buf[64];
  const auto [end, error] = std::to_chars(buf, buf + sizeof(buf), value);
  if (error != std::errc()) throw std::logic_error("to_chars failed on a double");
  return std::string(buf, end);
}

// The fields of one config.json; every error is one line naming the file and the field.
class HfConfig {
 public:
  HfConfig(std::string path, json j) : path_(std::move(path)), j_(std::move(j)) {}

  [[noreturn]] void fail(const std::string& problem) const { throw ConfigError(path_ + ": " + problem); }

  bool has(const std::string& key) const { return j_.contains(key) && !j_[key].is_null(); }

  int64_t integer(const std::string& key) const {
    if (!has(key)) fail("missing field '" + key + "'");
    return json_integer(j_[key], where(key));
  }
  std::optional<int64_t> optional_integer(const std::string& key) const {
    return has(key) ? std::optional<int64_t>(integer(key)) : std::nullopt;
  }

  // An integer field in [min, max] (min 0 or 1): "field 'hidden_size' must be a positive integer (got -3)";
  // `max_is` names another field the maximum comes from.
  int64_t integer_in(const std::string& key, const int64_t min, const int64_t max,
                     const std::string& max_is = "") const {
    return checked_range(key, integer(key), min, max, max_is);
  }
  std::optional<int64_t> optional_integer_in(const std::string& key, const int64_t min, const int64_t max,
                                             const std::string& max_is = "") const {
    const std::optional<int64_t> value = optional_integer(key);
    if (value) checked_range(key, *value, min, max, max_is);
    return value;
  }
  std::vector<int64_t> integer_list_or_empty(const std::string& key) const {
    return has(key) ? json_integer_list(j_[key], where(key)) : std::vector<int64_t>{};
  }

  std::optional<double> optional_real(const std::string& key) const { return optional_real_in(j_, key); }
  // A number field in (0, max].
  std::optional<double> optional_positive_real(const std::string& key, const double max) const {
    const std::optional<double> value = optional_real(key);
    if (value && !(*value > 0.0 && *value <= max)) {
      fail("field '" + key + "' must be a number in (0, " + real_text(max) + "] (got " + j_[key].dump() + ")");
    }
    return value;
  }
  std::optional<double> optional_real_in(const json& object, const std::string& key) const {
    if (!object.contains(key) || object[key].is_null()) return std::nullopt;
    if (!object[key].is_number()) fail("field '" + key + "' must be a number (got " + object[key].dump() + ")");
    return object[key].get<double>();
  }

  bool boolean_or(const std::string& key, const bool fallback) const {
    if (!has(key)) return fallback;
    if (!j_[key].is_boolean()) fail("field '" + key + "' must be true or false (got " + j_[key].dump() + ")");
    return j_[key].get<bool>();
  }

  std::string string_or(const std::string& key, const std::string& fallback) const {
    if (!has(key)) return fallback;
    if (!j_[key].is_string()) fail("field '" + key + "' must be a string (got " + j_[key].dump() + ")");
    return j_[key].get<std::string>();
  }

  // rope_theta, or rope_parameters.rope_theta (transformers 5 configs).
  std::optional<double> rope_theta() const {
    if (has("rope_theta")) return optional_real("rope_theta");
    if (has("rope_parameters") && j_["rope_parameters"].is_object()) {
      return optional_real_in(j_["rope_parameters"], "rope_theta");
    }
    return std::nullopt;
  }

 private:
  std::string where(const std::string& key) const { return path_ + ": field '" + key + "'"; }

  int64_t checked_range(const std::string& key, const int64_t value, const int64_t min, const int64_t max,
                        const std::string& max_is) const {
    if (value < min) {
      fail("field '" + key + "' must be a " + (min > 0 ? "positive" : "non-negative") + " integer (got " +
           std::to_string(value) + ")");
    }
    if (value > max) {
      fail("field '" + key + "' is " + std::to_string(value) + ", above " +
           (max_is.empty() ? "the limit of " + std::to_string(max) : max_is + " (" + std::to_string(max) + ")"));
    }
    return value;
  }

  std::string path_;
  json j_;
};

class FlagList {
 public:
  void add(const std::string& flag) { flags_.push_back(flag); }
  void add(const std::string& flag, const std::string& value) { flags_.insert(flags_.end(), {flag, value}); }
  void add(const std::string& flag, const int64_t value) { add(flag, std::to_string(value)); }
  std::vector<std::string> take() { return std::move(flags_); }

 private:
  std::vector<std::string> flags_;
};

// Megatron's list expression for a per-layer MoE pattern, one [v]*n term per run: ([0]*3+[1]*58).
std::string layer_freq_expression(const std::vector<bool>& moe_layers) {
  std::string text = "(";
  for (size_t begin = 0; begin < moe_layers.size();) {
    size_t end = begin;
    while (end < moe_layers.size() && moe_layers[end] == moe_layers[begin]) ++end;
    if (begin > 0) text += "+";
    text += std::string("[") + (moe_layers[begin] ? "1" : "0") + "]*" + std::to_string(end - begin);
    begin = end;
  }
  return text + ")";
}

enum class Family { kDense, kQwenMoe, kMixtral, kDeepSeek };

struct ModelType {
  Family family;
  bool qk_layernorm;  // qwen3's q_norm / k_norm; DeepSeek's q_a_layernorm / kv_a_layernorm on the MLA latents
};

ModelType model_type_of(const HfConfig& c) {
  if (!c.has("model_type")) c.fail("missing field 'model_type'");
  const std::string type = c.string_or("model_type", "");
  if (type == "llama" || type == "mistral") return {Family::kDense, false};
  if (type == "qwen3") return {Family::kDense, true};
  if (type == "qwen3_moe") return {Family::kQwenMoe, true};
  if (type == "mixtral") return {Family::kMixtral, false};
  // megatron/bridge/models/deepseek/deepseek_v{2,3}_bridge.py: qk_layernorm = True.
  if (type == "deepseek_v3" || type == "deepseek_v2") return {Family::kDeepSeek, true};
  if (type == "qwen2" || type == "qwen2_moe") {
    // megatron/bridge/models/qwen/qwen2_bridge.py: add_qkv_bias = True, add_bias_linear = False.
    c.fail("model_type " + type +
           " has biases on the query, key and value projections only (Megatron's --add-qkv-bias), which moecore's "
           "flags cannot express");
  }
  c.fail("model_type '" + type +
         "' is not supported (deepseek_v3, deepseek_v2, qwen3_moe, mixtral, llama, qwen3, mistral)");
}

// Sliding-window attention changes the attention cost and has no flag.
void check_full_attention(const HfConfig& c, const std::string& type) {
  if (c.boolean_or("use_sliding_window", false))
    c.fail("use_sliding_window true (sliding-window attention) is not modelled");
  if ((type == "mistral" || type == "mixtral") && c.has("sliding_window")) {
    c.fail("sliding_window " + std::to_string(c.integer("sliding_window")) +
           " (sliding-window attention) is not modelled");
  }
}

// The largest power of two up to 128 dividing the vocabulary: Megatron-Bridge pads no row onto HF's embedding
// (model_bridge.py make_vocab_size_divisible_by).
int64_t vocab_divisor(const int64_t vocab_size) {
  int64_t divisor = 128;
  while (divisor > 1 && vocab_size % divisor != 0) divisor /= 2;
  return divisor;
}

void add_attention(const HfConfig& c, const Family family, FlagList& flags) {
  const int64_t heads = c.integer_in("num_attention_heads", 1, kMaxCount);
  flags.add("--num-attention-heads", heads);
  if (family == Family::kDeepSeek) {
    // Multi-latent attention (model_bridge.py CONFIG_MAPPING, MLA block); num_key_value_heads and head_dim do not
    // apply. q_lora_rank null (DeepSeek-V2-Lite): queries are projected straight from the hidden state.
    flags.add("--multi-latent-attention");
    if (const auto q_lora_rank = c.optional_integer_in("q_lora_rank", 1, kMaxWidth)) {
      flags.add("--q-lora-rank", *q_lora_rank);
    }
    flags.add("--kv-lora-rank", c.integer_in("kv_lora_rank", 1, kMaxWidth));
    flags.add("--qk-head-dim", c.integer_in("qk_nope_head_dim", 1, kMaxWidth));
    flags.add("--qk-pos-emb-head-dim", c.integer_in("qk_rope_head_dim", 0, kMaxWidth));
    flags.add("--v-head-dim", c.integer_in("v_head_dim", 1, kMaxWidth));
    return;
  }
  const int64_t groups = c.optional_integer_in("num_key_value_heads", 1, kMaxCount).value_or(heads);
  if (heads % groups != 0) {
    c.fail("field 'num_key_value_heads' (" + std::to_string(groups) + ") must divide num_attention_heads (" +
           std::to_string(heads) + ")");
  }
  if (groups != heads) {
    flags.add("--group-query-attention");
    flags.add("--num-query-groups", groups);
  }
  if (const auto head_dim = c.optional_integer_in("head_dim", 1, kMaxWidth)) {
    flags.add("--kv-channels", *head_dim);
  } else if (const int64_t hidden = c.integer("hidden_size"); hidden % heads != 0) {
    c.fail("field 'hidden_size' (" + std::to_string(hidden) + ") is not a multiple of num_attention_heads (" +
           std::to_string(heads) + ") and no head_dim is given");
  }
}

void add_biases(const HfConfig& c, FlagList& flags) {
  // Megatron-Bridge maps attention_bias to add_qkv_bias and mlp_bias to add_bias_linear; moecore's one switch biases
  // every linear layer (router and experts included), so only "all or none" is expressible.
  const bool attention_bias = c.boolean_or("attention_bias", false);
  const bool mlp_bias = c.boolean_or("mlp_bias", false);
  if (attention_bias != mlp_bias) {
    c.fail(std::string("attention_bias ") + (attention_bias ? "true" : "false") + " with mlp_bias " +
           (mlp_bias ? "true" : "false") + " cannot be expressed (--add-bias-linear biases every linear layer)");
  }
  flags.add(attention_bias ? "--add-bias-linear" : "--disable-bias-linear");
}

void add_rope(const HfConfig& c, FlagList& flags) {
  flags.add("--position-embedding-type", "rope");
  if (const auto theta = c.rope_theta()) {
    if (!(*theta >= 1.0 && *theta <= 9.0e15 && *theta == std::floor(*theta))) {
      c.fail("rope_theta " + real_text(*theta) + " is not a positive whole number (--rotary-base takes integers)");
    }
    flags.add("--rotary-base", static_cast<int64_t>(*theta));
  }
  if (const auto percent = c.optional_positive_real("partial_rotary_factor", 1.0); percent && *percent != 1.0) {
    flags.add("--rotary-percent", real_text(*percent));
  }
}

// Which decoder layers are MoE, or an empty vector when all of them are.
std::vector<bool> moe_layers(const HfConfig& c, const Family family, const int64_t num_layers) {
  std::vector<bool> moe(static_cast<size_t>(num_layers), true);
  if (family == Family::kQwenMoe) {
    // transformers Qwen3MoeDecoderLayer: MoE iff not in mlp_only_layers and (layer + 1) % decoder_sparse_step == 0.
    const int64_t step = c.optional_integer_in("decoder_sparse_step", 1, kMaxCount).value_or(1);
    for (int64_t layer = 0; layer < num_layers; ++layer) moe[static_cast<size_t>(layer)] = (layer + 1) % step == 0;
    for (const int64_t dense : c.integer_list_or_empty("mlp_only_layers")) {
      if (dense < 0 || dense >= num_layers) {
        c.fail("field 'mlp_only_layers' names layer " + std::to_string(dense) + " of a " + std::to_string(num_layers) +
               "-layer model");
      }
      moe[static_cast<size_t>(dense)] = false;
    }
  } else if (family == Family::kDeepSeek) {
    // transformers DeepseekV3DecoderLayer (and DeepSeek-V2's modeling code): MoE iff layer >= first_k_dense_replace
    // and layer % moe_layer_freq == 0; Megatron-Bridge writes [0]*first_k_dense_replace + [1]*(rest).
    const int64_t first_dense = c.optional_integer("first_k_dense_replace").value_or(0);
    if (first_dense < 0 || first_dense > num_layers) {
      c.fail("field 'first_k_dense_replace' is " + std::to_string(first_dense) + " for a " +
             std::to_string(num_layers) + "-layer model");
    }
    const int64_t every = c.optional_integer_in("moe_layer_freq", 1, kMaxCount).value_or(1);
    for (int64_t layer = 0; layer < num_layers; ++layer) {
      moe[static_cast<size_t>(layer)] = layer >= first_dense && layer % every == 0;
    }
  }
  for (const bool is_moe : moe) {
    if (!is_moe) return moe;
  }
  return {};
}

void add_deepseek_routing(const HfConfig& c, const bool v3, const int64_t experts, const int64_t topk,
                          FlagList& flags) {
  // Class defaults of transformers' DeepseekV3Config and DeepSeek-V2's configuration_deepseek.py.
  const std::string scoring = c.string_or("scoring_func", v3 ? "sigmoid" : "softmax");
  const std::string method = c.string_or("topk_method", v3 ? "noaux_tc" : "greedy");
  const bool normalized = c.boolean_or("norm_topk_prob", v3);
  if (scoring == "sigmoid") {
    // megatron/core/transformer/moe/moe_utils.py topk_routing_with_score_function: sigmoid top-k scores are always
    // divided by their sum (topk > 1).
    if (!normalized && topk > 1) {
      c.fail(
          "norm_topk_prob false with scoring_func sigmoid cannot be expressed (Megatron normalizes sigmoid top-k "
          "scores)");
    }
    flags.add("--moe-router-score-function", "sigmoid");
  } else if (scoring == "softmax") {
    if (!normalized) flags.add("--moe-router-pre-softmax");
  } else {
    c.fail("scoring_func '" + scoring + "' is not supported (softmax or sigmoid)");
  }
  if (method != "greedy" && method != "gready" && method != "group_limited_greedy" && method != "noaux_tc") {
    c.fail("topk_method '" + method + "' is not supported (greedy, group_limited_greedy or noaux_tc)");
  }
  if (method != "greedy" && method != "gready") {
    // Group-limited routing: Megatron's group_limited_topk ranks a group by the sum of its top experts (DeepSeek-V3's
    // rule; DeepSeek-V2 ranks by the maximum), which picks other experts but costs the same.
    if (const int64_t groups = c.optional_integer_in("n_group", 1, experts, "the routed experts").value_or(1);
        groups > 1) {
      if (experts % groups != 0) {
        c.fail("field 'n_group' (" + std::to_string(groups) + ") must divide n_routed_experts (" +
               std::to_string(experts) + ")");
      }
      flags.add("--moe-router-num-groups", groups);
      flags.add("--moe-router-group-topk", c.integer_in("topk_group", 1, groups, "n_group"));
    }
  }
  if (const auto scale = c.optional_positive_real("routed_scaling_factor", 100.0); scale && *scale != 1.0) {
    flags.add("--moe-router-topk-scaling-factor", real_text(*scale));
  }
  // noaux_tc: the router's e_score_correction_bias (Megatron's expert_bias).
  if (method == "noaux_tc") flags.add("--moe-router-enable-expert-bias");
}

void add_moe(const HfConfig& c, const Family family, const int64_t num_layers, FlagList& flags) {
  if (family == Family::kDense) return;
  const int64_t experts = c.integer_in(family == Family::kMixtral    ? "num_local_experts"
                                       : family == Family::kDeepSeek ? "n_routed_experts"
                                                                     : "num_experts",
                                       1, kMaxExperts);
  const int64_t expert_ffn =
      c.integer_in(family == Family::kMixtral ? "intermediate_size" : "moe_intermediate_size", 1, kMaxWidth);
  const int64_t topk = c.integer_in("num_experts_per_tok", 1, experts, "the routed experts");
  flags.add("--num-experts", experts);
  flags.add("--moe-ffn-hidden-size", expert_ffn);
  flags.add("--moe-router-topk", topk);
  if (const std::vector<bool> moe = moe_layers(c, family, num_layers); !moe.empty()) {
    flags.add("--moe-layer-freq", layer_freq_expression(moe));
  }
  if (family == Family::kDeepSeek) {
    if (const int64_t shared = c.optional_integer_in("n_shared_experts", 0, kMaxExperts).value_or(0); shared != 0) {
      const int64_t size = checked_mul(shared, expert_ffn, "the shared experts' size");
      if (size > kMaxWidth) {
        c.fail("fields 'n_shared_experts' x 'moe_intermediate_size' (" + std::to_string(size) +
               ") are above the limit of " + std::to_string(kMaxWidth));
      }
      flags.add("--moe-shared-expert-intermediate-size", size);
    }
    add_deepseek_routing(c, c.string_or("model_type", "") == "deepseek_v3", experts, topk, flags);
  } else if (family == Family::kQwenMoe) {
    // transformers Qwen3MoeConfig: norm_topk_prob defaults to false; Megatron-Bridge qwen3_moe_bridge.py:
    // moe_router_pre_softmax = not norm_topk_prob.
    if (!c.boolean_or("norm_topk_prob", false)) flags.add("--moe-router-pre-softmax");
  }
  // Mixtral: softmax over the top-k logits (MixtralSparseMoeBlock), Megatron's default.
}

// `path` itself, or the config.json of a model folder.
std::string config_file(const std::string& path) {
  std::error_code error;
  if (!fs::is_directory(path, error)) return path;
  const fs::path file = fs::path(path) / "config.json";
  if (!fs::exists(file, error)) {
    throw ConfigError(path +
                      ": a folder without config.json (--hf-config takes a HuggingFace config.json or the "
                      "model folder holding it)");
  }
  return file.string();
}

json read_config(const std::string& path) {
  std::error_code error;
  if (fs::is_directory(path, error)) throw ConfigError(path + ": a folder, not a config.json file");
  std::ifstream in(path);
  if (!in) throw ConfigError(path + ": cannot open");
  try {
    return json::parse(in);
  } catch (const json::parse_error& e) {
    throw ConfigError(path + ": not valid JSON (" + json_error_text(e) + ")");
  }
}

}  // namespace

std::vector<std::string> megatron_flags_from_hf_config(const std::string& given_path) {
  const std::string path = config_file(given_path);
  json j = read_config(path);
  if (!j.is_object()) throw ConfigError(path + ": not a JSON object");
  const HfConfig c(path, std::move(j));
  const ModelType type = model_type_of(c);
  const std::string type_name = c.string_or("model_type", "");
  if (const std::string act = c.string_or("hidden_act", "silu"); act != "silu") {
    c.fail("hidden_act '" + act + "' is not supported (SwiGLU needs silu)");
  }
  check_full_attention(c, type_name);

  FlagList flags;
  const int64_t num_layers = c.integer_in("num_hidden_layers", 1, kMaxCount);
  flags.add("--num-layers", num_layers);
  flags.add("--hidden-size", c.integer_in("hidden_size", 1, kMaxWidth));
  flags.add("--ffn-hidden-size", c.integer_in("intermediate_size", 1, kMaxWidth));
  add_attention(c, type.family, flags);
  flags.add("--max-position-embeddings", c.integer_in("max_position_embeddings", 1, kMaxPositions));
  const int64_t vocab_size = c.integer_in("vocab_size", 1, kMaxVocab);
  flags.add("--vocab-size", vocab_size);
  if (vocab_divisor(vocab_size) != 128) {
    flags.add("--make-vocab-size-divisible-by", vocab_divisor(vocab_size));
  }
  flags.add("--normalization", "RMSNorm");
  if (const auto eps = c.optional_positive_real("rms_norm_eps", 1.0)) flags.add("--norm-epsilon", real_text(*eps));
  flags.add("--swiglu");
  add_biases(c, flags);
  if (type.qk_layernorm) flags.add("--qk-layernorm");
  add_rope(c, flags);
  if (!c.boolean_or("tie_word_embeddings", false)) flags.add("--untie-embeddings-and-output-weights");
  add_moe(c, type.family, num_layers, flags);
  if (type.family == Family::kDeepSeek) {
    // Multi-token prediction modules after the decoder (model_bridge.py: num_nextn_predict_layers -> mtp_num_layers).
    const int64_t mtp = c.optional_integer_in("num_nextn_predict_layers", 0, kMaxCount).value_or(0);
    if (mtp > 0) flags.add("--mtp-num-layers", mtp);
  }
  return flags.take();
}

}  // namespace moecore::plan
