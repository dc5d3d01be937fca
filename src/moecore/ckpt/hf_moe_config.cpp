#include "moecore/ckpt/hf_moe_config.h"

#include <initializer_list>
#include <type_traits>
#include <vector>

#include "moecore/ckpt/json_integer.h"

namespace moecore {
namespace {

using json = nlohmann::json;

std::string to_string(const TokenDropPolicy value) { return value == TokenDropPolicy::kProbs ? "probs" : "position"; }
std::string to_string(const RouterDType value) { return value == RouterDType::kFP64 ? "fp64" : "fp32"; }

// Finds the enum value whose text is `text` among `values`; throws naming the key otherwise.
template <typename Enum>
Enum parse_enum(const std::string& text, std::initializer_list<Enum> values, const std::string& where) {
  for (const Enum value : values) {
    if (to_string(value) == text) return value;
  }
  throw ConfigError(where + " has unknown value '" + text + "'");
}

class BlockReader {
 public:
  BlockReader(const json& block, const std::string& file) : block_(block), file_(file) {}

  std::string where(const std::string& key) const { return file_ + ": " + kMoecoreMoeConfigKey + "." + key; }

  template <typename T>
  T get(const std::string& key) const {
    if (!block_.contains(key)) throw ConfigError(where(key) + " is missing");
    if constexpr (std::is_same_v<T, int64_t>) return json_integer(block_.at(key), where(key));
    try {
      return block_.at(key).get<T>();
    } catch (const json::exception&) {
      throw ConfigError(where(key) + " has the wrong type (" + block_.at(key).dump() + ")");
    }
  }

  std::optional<double> optional_number(const std::string& key) const {
    if (!block_.contains(key)) throw ConfigError(where(key) + " is missing");
    if (block_.at(key).is_null()) return std::nullopt;
    return get<double>(key);
  }

 private:
  const json& block_;
  std::string file_;
};

}  // namespace

std::string hf_moe_misfit(const ModelConfig& c, const std::string& model_type) {
  const MoEConfig& m = c.moe;
  if (c.add_bias_linear) return "--add-bias-linear (HF's MoE router and experts have no biases)";
  if (m.score_function != RouterScoreFunction::kSoftmax) {
    return "--moe-router-score-function " + to_string(m.score_function) + " (HF routes with softmax)";
  }
  if (m.num_groups > 0) return "--moe-router-num-groups (group-limited routing)";
  if (m.enable_expert_bias) return "--moe-router-enable-expert-bias";
  if (m.topk_scaling_factor) return "--moe-router-topk-scaling-factor";
  if (m.capacity_factor) return "--moe-expert-capacity-factor (HF routes every token, dropless)";
  if (m.apply_probs_on_input) return "--moe-apply-probs-on-input";
  if (m.shared_expert_intermediate_size > 0) return "shared experts (--moe-shared-expert-intermediate-size)";
  if (m.force_load_balancing) return "--moe-router-force-load-balancing";
  for (const LoadBalancingType type : m.load_balancing_types) {
    if (type == LoadBalancingType::kSinkhorn) return "--moe-router-load-balancing-type sinkhorn";
  }
  if (model_type == "mixtral") {
    if (c.qk_layernorm) return "--qk-layernorm (mixtral has no q/k norms; qwen3_moe has)";
    if (m.pre_softmax) return "--moe-router-pre-softmax (mixtral renormalises the top-k probabilities)";
    for (int64_t i = 0; i < c.num_layers; ++i) {
      if (!m.is_moe_layer(i)) {
        return "dense layer " + std::to_string(i) + " in --moe-layer-freq (mixtral has a MoE block in every layer)";
      }
    }
  } else if (model_type == "qwen3_moe") {
    if (!c.qk_layernorm) return "no --qk-layernorm (qwen3_moe always normalises q and k)";
  } else {
    return "model_type " + model_type + " (not an HF MoE type)";
  }
  return "";
}

json moe_config_block(const ModelConfig& c) {
  const MoEConfig& m = c.moe;
  json pattern = json::array();
  for (int64_t i = 0; i < c.num_layers; ++i) pattern.push_back(m.is_moe_layer(i) ? 1 : 0);
  json types = json::array();
  for (const LoadBalancingType type : m.load_balancing_types) types.push_back(to_string(type));
  const auto optional = [](const std::optional<double>& value) { return value ? json(*value) : json(nullptr); };
  return {
      {"ffn_hidden_size", c.ffn_hidden_size},
      {"num_experts", m.num_experts},
      {"moe_ffn_hidden_size", m.ffn_hidden_size},
      {"moe_layer_freq", pattern},
      {"moe_router_topk", m.topk},
      {"moe_router_score_function", to_string(m.score_function)},
      {"moe_router_pre_softmax", m.pre_softmax},
      {"moe_router_topk_scaling_factor", optional(m.topk_scaling_factor)},
      {"moe_router_num_groups", m.num_groups},
      {"moe_router_group_topk", m.group_topk},
      {"moe_input_jitter_eps", m.input_jitter_eps},
      {"moe_router_dtype", to_string(m.router_dtype)},
      {"moe_router_enable_expert_bias", m.enable_expert_bias},
      {"moe_router_bias_update_rate", m.bias_update_rate},
      {"moe_router_force_load_balancing", m.force_load_balancing},
      {"moe_router_load_balancing_type", types},
      {"moe_aux_loss_coeff", m.aux_loss_coeffs},
      {"moe_z_loss_coeff", m.z_loss_coeff},
      {"moe_expert_capacity_factor", optional(m.capacity_factor)},
      {"moe_token_drop_policy", to_string(m.drop_policy)},
      {"moe_pad_expert_input_to_capacity", m.pad_expert_input_to_capacity},
      {"moe_apply_probs_on_input", m.apply_probs_on_input},
      {"moe_grouped_gemm", m.grouped_gemm},
      {"moe_shared_expert_intermediate_size", m.shared_expert_intermediate_size},
      {"moe_shared_expert_gate", m.shared_expert_gate},
      {"moe_per_layer_logging", m.per_layer_logging},
  };
}

void read_moe_config_block(const json& block, const std::string& file, ModelConfig& c) {
  if (!block.is_object()) throw ConfigError(file + ": " + kMoecoreMoeConfigKey + " is not an object");
  const BlockReader r(block, file);
  MoEConfig& m = c.moe;
  c.ffn_hidden_size = r.get<int64_t>("ffn_hidden_size");
  m.num_experts = r.get<int64_t>("num_experts");
  m.ffn_hidden_size = r.get<int64_t>("moe_ffn_hidden_size");
  const std::vector<int64_t> pattern =
      json_integer_list(r.get<nlohmann::json>("moe_layer_freq"), r.where("moe_layer_freq"));
  if (static_cast<int64_t>(pattern.size()) != c.num_layers) {
    throw ConfigError(r.where("moe_layer_freq") + " has " + std::to_string(pattern.size()) + " entries for " +
                      std::to_string(c.num_layers) + " layers");
  }
  m.moe_layer_pattern.clear();
  for (const int64_t flag : pattern) {
    if (flag != 0 && flag != 1) throw ConfigError(r.where("moe_layer_freq") + " entries must be 0 or 1");
    m.moe_layer_pattern.push_back(flag == 1);
  }
  m.topk = r.get<int64_t>("moe_router_topk");
  m.score_function =
      parse_enum(r.get<std::string>("moe_router_score_function"),
                 {RouterScoreFunction::kSoftmax, RouterScoreFunction::kSigmoid, RouterScoreFunction::kSqrtSoftplus},
                 r.where("moe_router_score_function"));
  m.pre_softmax = r.get<bool>("moe_router_pre_softmax");
  m.topk_scaling_factor = r.optional_number("moe_router_topk_scaling_factor");
  m.num_groups = r.get<int64_t>("moe_router_num_groups");
  m.group_topk = r.get<int64_t>("moe_router_group_topk");
  m.input_jitter_eps = r.get<double>("moe_input_jitter_eps");
  m.router_dtype = parse_enum(r.get<std::string>("moe_router_dtype"), {RouterDType::kFP32, RouterDType::kFP64},
                              r.where("moe_router_dtype"));
  m.enable_expert_bias = r.get<bool>("moe_router_enable_expert_bias");
  m.bias_update_rate = r.get<double>("moe_router_bias_update_rate");
  m.force_load_balancing = r.get<bool>("moe_router_force_load_balancing");
  m.load_balancing_types.clear();
  for (const std::string& type : r.get<std::vector<std::string>>("moe_router_load_balancing_type")) {
    m.load_balancing_types.push_back(
        parse_enum(type,
                   {LoadBalancingType::kAuxLoss, LoadBalancingType::kSeqAuxLoss, LoadBalancingType::kGlobalAuxLoss,
                    LoadBalancingType::kSinkhorn, LoadBalancingType::kNone},
                   r.where("moe_router_load_balancing_type")));
  }
  m.aux_loss_coeffs = r.get<std::vector<double>>("moe_aux_loss_coeff");
  m.z_loss_coeff = r.get<double>("moe_z_loss_coeff");
  m.capacity_factor = r.optional_number("moe_expert_capacity_factor");
  m.drop_policy = parse_enum(r.get<std::string>("moe_token_drop_policy"),
                             {TokenDropPolicy::kProbs, TokenDropPolicy::kPosition}, r.where("moe_token_drop_policy"));
  m.pad_expert_input_to_capacity = r.get<bool>("moe_pad_expert_input_to_capacity");
  m.apply_probs_on_input = r.get<bool>("moe_apply_probs_on_input");
  m.grouped_gemm = r.get<bool>("moe_grouped_gemm");
  m.shared_expert_intermediate_size = r.get<int64_t>("moe_shared_expert_intermediate_size");
  m.shared_expert_gate = r.get<bool>("moe_shared_expert_gate");
  m.per_layer_logging = r.get<bool>("moe_per_layer_logging");
}

}  // namespace moecore
