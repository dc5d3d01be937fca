#include "moecore/ckpt/hf_checkpoint.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <stdexcept>
#include <type_traits>

#include "moecore/ckpt/hf_deepseek_v3.h"
#include "moecore/ckpt/hf_layout.h"
#include "moecore/ckpt/hf_moe_config.h"
#include "moecore/ckpt/hf_state_source.h"
#include "moecore/ckpt/json_integer.h"
#include "moecore/ckpt/state_dict.h"
#include "moecore/util/atomic_directory.h"
#include "moecore/util/output_folder.h"

namespace moecore {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

const std::set<std::string> kExportFiles = {"config.json", "generation_config.json", "model.safetensors", "vocab.json",
                                            "merges.txt",  "tokenizer_config.json"};

int64_t row_count(const HfTensorMap& map, const Tensor& megatron_value) {
  return hf_tensor_shape(map, megatron_value.shape())[0];
}

Tensor gather_rows(const HfTensorMap& map, const Tensor& megatron_value) {
  Tensor out(hf_tensor_shape(map, megatron_value.shape()), DType::kF32);
  const int64_t row_numel = megatron_value.numel() / megatron_value.dim(0);
  float* dst = out.data<float>();
  for (const HfRowRange& r : hf_row_ranges(map, megatron_value.dim(0))) {
    const size_t n = static_cast<size_t>((r.end - r.begin) * row_numel);
    std::memcpy(dst, megatron_value.data<float>() + r.begin * row_numel, n * sizeof(float));
    dst += n;
  }
  return out;
}

Tensor to_bf16(const Tensor& f32) {
  Tensor out(f32.shape(), DType::kBF16);
  for (int64_t i = 0; i < f32.numel(); ++i) out.data<uint16_t>()[i] = fp32_to_bf16(f32.data<float>()[i]);
  return out;
}

int64_t max_positions(const ModelConfig& c) {
  return c.max_position_embeddings > 0 ? c.max_position_embeddings : c.seq_length;
}

bool is_moe_type(const std::string& model_type) {
  return model_type == "mixtral" || model_type == "qwen3_moe" || model_type == "moecore_moe";
}

std::string architecture_of(const std::string& model_type) {
  if (model_type == "deepseek_v3") return "DeepseekV3ForCausalLM";
  if (model_type == "llama") return "LlamaForCausalLM";
  if (model_type == "qwen3") return "Qwen3ForCausalLM";
  if (model_type == "mixtral") return "MixtralForCausalLM";
  if (model_type == "qwen3_moe") return "Qwen3MoeForCausalLM";
  return "MoecoreMoeForCausalLM";  // no HF class: a moecore-only format
}

// HF trains with one load-balancing loss over the batch; its coefficient is the first auxiliary-loss coefficient.
double router_aux_loss_coef(const MoEConfig& m) {
  for (size_t i = 0; i < m.load_balancing_types.size() && i < m.aux_loss_coeffs.size(); ++i) {
    const LoadBalancingType type = m.load_balancing_types[i];
    if (type == LoadBalancingType::kAuxLoss || type == LoadBalancingType::kSeqAuxLoss ||
        type == LoadBalancingType::kGlobalAuxLoss) {
      return m.aux_loss_coeffs[i];
    }
  }
  return 0.0;
}

json dense_layer_list(const ModelConfig& c) {
  json layers = json::array();
  for (int64_t i = 0; i < c.num_layers; ++i) {
    if (!c.moe.is_moe_layer(i)) layers.push_back(i);
  }
  return layers;
}

json hf_config_json(const ModelConfig& c, const std::string& model_type, const HfExportInfo& info) {
  json j = {
      {"architectures", {architecture_of(model_type)}},
      {"model_type", model_type},
      {"hidden_size", c.hidden_size},
      {"intermediate_size", c.ffn_hidden_size},
      {"num_hidden_layers", c.num_layers},
      {"num_attention_heads", c.num_attention_heads},
      {"num_key_value_heads", c.num_query_groups},
      {"head_dim", c.kv_channels},
      {"max_position_embeddings", max_positions(c)},
      {"rms_norm_eps", c.norm_epsilon},
      {"rope_theta", c.rotary_base},
      {"rope_scaling", nullptr},
      {"vocab_size", c.vocab_size},
      {"tie_word_embeddings", !c.untie_embeddings_and_output_weights},
      {"attention_bias", c.add_bias_linear},
      {"attention_dropout", c.attention_dropout},
      {"hidden_act", "silu"},
      {"initializer_range", c.init_method_std},
      {"bos_token_id", info.bos_token_id},
      {"eos_token_id", info.eos_token_id},
      {"torch_dtype", info.dtype == DType::kBF16 ? "bfloat16" : "float32"},
      {"use_cache", true},
  };
  const MoEConfig& m = c.moe;
  if (model_type == "qwen3" || model_type == "qwen3_moe") {
    j["use_sliding_window"] = false;
    j["sliding_window"] = nullptr;
    j["max_window_layers"] = c.num_layers;
  }
  if (model_type == "llama" || model_type == "moecore_moe") j["mlp_bias"] = c.add_bias_linear;
  if (model_type == "llama") j["pretraining_tp"] = 1;
  if (model_type == "mixtral") {
    j.erase("attention_bias");  // MixtralConfig has no such field: no biases anywhere
    j["intermediate_size"] = m.ffn_hidden_size;
    j["num_local_experts"] = m.num_experts;
    j["sliding_window"] = nullptr;
    j["router_jitter_noise"] = m.input_jitter_eps;
  }
  if (model_type == "qwen3_moe" || model_type == "moecore_moe") {
    j["moe_intermediate_size"] = m.ffn_hidden_size;
    j["num_experts"] = m.num_experts;
    j["mlp_only_layers"] = dense_layer_list(c);
  }
  if (model_type == "qwen3_moe") {
    j["decoder_sparse_step"] = 1;
    j["norm_topk_prob"] = !m.pre_softmax;  // post-softmax == softmax over all, top-k, renormalised
  }
  if (model_type == "moecore_moe") j["qk_layernorm"] = c.qk_layernorm;
  if (model_type == "deepseek_v3") add_deepseek_v3_fields(j, c);
  if (is_moe_type(model_type)) {
    j["num_experts_per_tok"] = m.topk;
    j["router_aux_loss_coef"] = router_aux_loss_coef(m);
    j["output_router_logits"] = false;
    j[kMoecoreMoeConfigKey] = moe_config_block(c);
  }
  return j;
}

void write_json(const fs::path& path, const json& j) {
  const std::string text = j.dump(2) + "\n";
  write_file_atomically(path.string(), std::as_bytes(std::span(text.data(), text.size())));
}

// Why `dir` may not be deleted or replaced, or "": it must be absent, or a folder holding only files an export writes.
std::string replace_problem(const fs::path& dir) {
  std::error_code ec;
  if (!fs::exists(dir, ec)) return "";
  if (!fs::is_directory(dir, ec)) return dir.string() + " exists and is not a folder";
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (!kExportFiles.contains(name)) {
      return "refusing to replace " + dir.string() + ": it holds '" + name + "', which an export does not write";
    }
  }
  if (ec) return "cannot list " + dir.string() + ": " + ec.message();
  return "";
}

// `dir` without a trailing separator; empty for an empty name.
fs::path normalized_dir(const std::string& dir) {
  fs::path p = fs::path(dir).lexically_normal();
  if (p.filename().empty()) p = p.parent_path();
  return p;
}

[[noreturn]] void config_fail(const fs::path& file, const std::string& problem) {
  throw ConfigError(file.string() + ": " + problem);
}

template <typename T>
T field(const json& j, const fs::path& file, const std::string& key) {
  if (!j.contains(key) || j[key].is_null()) config_fail(file, "missing field '" + key + "'");
  if constexpr (std::is_same_v<T, int64_t>) {
    return json_integer(j[key], file.string() + ": field '" + key + "'");
  } else if constexpr (std::is_same_v<T, std::vector<int64_t>>) {
    return json_integer_list(j[key], file.string() + ": field '" + key + "'");
  }
  try {
    return j[key].get<T>();
  } catch (const json::exception&) {
    config_fail(file, "field '" + key + "' has the wrong type (" + j[key].dump() + ")");
  }
}

template <typename T>
T field_or(const json& j, const fs::path& file, const std::string& key, const T fallback) {
  if (!j.contains(key) || j[key].is_null()) return fallback;
  return field<T>(j, file, key);
}

// The MoE fields of a mixtral / qwen3_moe / moecore_moe config.json into c (dense fields already read).
void read_moe_fields(const json& j, const fs::path& file, const std::string& model_type, ModelConfig& c) {
  const bool has_block = j.contains(kMoecoreMoeConfigKey);
  if (has_block) {
    read_moe_config_block(j[kMoecoreMoeConfigKey], file.string(), c);
  } else if (model_type == "moecore_moe") {
    config_fail(file, "model_type moecore_moe needs its '" + std::string(kMoecoreMoeConfigKey) + "' object");
  }
  MoEConfig& m = c.moe;
  if (model_type == "moecore_moe") {
    // The block is authoritative; the HF-style summary fields must agree with it.
    const auto agree = [&](const std::string& key, const int64_t value) {
      if (j.contains(key) && field<int64_t>(j, file, key) != value) {
        config_fail(file, "field '" + key + "' disagrees with " + kMoecoreMoeConfigKey);
      }
    };
    agree("num_experts", m.num_experts);
    agree("num_experts_per_tok", m.topk);
    agree("moe_intermediate_size", m.ffn_hidden_size);
    agree("intermediate_size", c.ffn_hidden_size);
    return;
  }
  if (c.add_bias_linear) {
    config_fail(file, "attention_bias true: moecore's --add-bias-linear would also give the " + model_type +
                          " router and experts biases it does not have");
  }
  // HF's own fields define the architecture; the block (when present) only adds training-only settings.
  const bool mixtral = model_type == "mixtral";
  m.num_experts = field<int64_t>(j, file, mixtral ? "num_local_experts" : "num_experts");
  m.topk = field<int64_t>(j, file, "num_experts_per_tok");
  m.score_function = RouterScoreFunction::kSoftmax;
  const int64_t expert_ffn = field<int64_t>(j, file, mixtral ? "intermediate_size" : "moe_intermediate_size");
  m.ffn_hidden_size = expert_ffn;
  m.moe_layer_pattern.assign(static_cast<size_t>(c.num_layers), true);
  if (mixtral) {
    m.pre_softmax = false;
    if (!has_block) c.ffn_hidden_size = expert_ffn;  // no dense layers; the dense width only matters to moecore
    if (!has_block) m.input_jitter_eps = field_or<double>(j, file, "router_jitter_noise", 0.0);
  } else {
    m.pre_softmax = !field_or<bool>(j, file, "norm_topk_prob", false);
    const int64_t step = field_or<int64_t>(j, file, "decoder_sparse_step", 1);
    if (step <= 0) config_fail(file, "decoder_sparse_step must be positive");
    const std::vector<int64_t> dense = field_or<std::vector<int64_t>>(j, file, "mlp_only_layers", {});
    for (int64_t i = 0; i < c.num_layers; ++i) {
      const bool listed = std::find(dense.begin(), dense.end(), i) != dense.end();
      m.moe_layer_pattern[static_cast<size_t>(i)] = !listed && (i + 1) % step == 0;
    }
  }
  if (!has_block) {
    m.load_balancing_types = {LoadBalancingType::kAuxLoss};
    m.aux_loss_coeffs = {field_or<double>(j, file, "router_aux_loss_coef", 0.0)};
  }
  const std::string misfit = hf_moe_misfit(c, model_type);
  if (!misfit.empty()) config_fail(file, "model_type " + model_type + " cannot have " + misfit);
}

ModelConfig read_typed_config(const std::string& dir, const HfImportOptions& options, std::string& model_type) {
  const fs::path file = fs::path(dir) / "config.json";
  const json j = read_json_file(file.string());
  if (!j.is_object()) config_fail(file, "not a JSON object");
  model_type = field_or<std::string>(j, file, "model_type", "");
  const bool deepseek = model_type == "deepseek_v3";
  if (model_type != "llama" && model_type != "qwen3" && !is_moe_type(model_type) && !deepseek) {
    config_fail(file,
                "HF import supports model_type llama, qwen3, mixtral, qwen3_moe, moecore_moe or deepseek_v3, "
                "not '" +
                    model_type + "'");
  }
  const std::string act = field_or<std::string>(j, file, "hidden_act", "silu");
  if (act != "silu") config_fail(file, "hidden_act '" + act + "' is not supported (SwiGLU needs silu)");
  if (!deepseek && j.contains("rope_scaling") && !j["rope_scaling"].is_null()) {
    config_fail(file, "rope_scaling " + j["rope_scaling"].dump() + " is not supported");
  }
  double rope_theta = 10000.0;
  if (j.contains("rope_parameters") && j["rope_parameters"].is_object()) {  // newer transformers
    const json& rp = j["rope_parameters"];
    if (!deepseek && rp.value("rope_type", std::string("default")) != "default") {
      config_fail(file, "rope_parameters " + rp.dump() + " is not supported");
    }
    rope_theta = field_or<double>(rp, file, "rope_theta", rope_theta);
  }
  rope_theta = field_or<double>(j, file, "rope_theta", rope_theta);
  if (field_or<bool>(j, file, "use_sliding_window", false)) config_fail(file, "use_sliding_window is not supported");

  ModelConfig c;
  c.num_layers = field<int64_t>(j, file, "num_hidden_layers");
  // Checked before the MoE fields size a per-layer pattern by it: every layer is several tensors of the weights file,
  // so no checkpoint holds a million layers.
  constexpr int64_t kMaxLayers = int64_t{1} << 20;
  if (c.num_layers < 1 || c.num_layers > kMaxLayers) {
    config_fail(file, "num_hidden_layers " + std::to_string(c.num_layers) + " is outside [1, " +
                          std::to_string(kMaxLayers) + "]");
  }
  c.hidden_size = field<int64_t>(j, file, "hidden_size");
  c.ffn_hidden_size = field<int64_t>(j, file, "intermediate_size");
  c.num_attention_heads = field<int64_t>(j, file, "num_attention_heads");
  c.num_query_groups = field_or<int64_t>(j, file, "num_key_value_heads", c.num_attention_heads);
  if (c.num_attention_heads <= 0) config_fail(file, "num_attention_heads must be positive");
  c.kv_channels = field_or<int64_t>(j, file, "head_dim", c.hidden_size / c.num_attention_heads);
  c.max_position_embeddings = field<int64_t>(j, file, "max_position_embeddings");
  c.seq_length = options.seq_length > 0 ? options.seq_length : c.max_position_embeddings;
  c.vocab_size = field<int64_t>(j, file, "vocab_size");
  c.normalization = Normalization::kRMSNorm;
  c.norm_epsilon = field_or<double>(j, file, "rms_norm_eps", 1e-6);
  c.activation = Activation::kSwiGLU;
  const bool attention_bias = field_or<bool>(j, file, "attention_bias", false);
  const bool mlp_bias =
      model_type == "llama" || model_type == "moecore_moe" ? field_or<bool>(j, file, "mlp_bias", false) : false;
  if (attention_bias != mlp_bias) {
    config_fail(file, "attention_bias " + std::string(attention_bias ? "true" : "false") + " with mlp_bias " +
                          (mlp_bias ? "true" : "false") + " (" + model_type +
                          ") cannot be expressed with one --add-bias-linear setting");
  }
  c.add_bias_linear = attention_bias;
  c.qk_layernorm = model_type == "qwen3" || model_type == "qwen3_moe" ||
                   (model_type == "moecore_moe" && field<bool>(j, file, "qk_layernorm"));
  c.position_embedding_type = PositionEmbedding::kRope;
  c.rotary_base = rope_theta;
  c.rotary_percent = 1.0;
  c.init_method_std = field_or<double>(j, file, "initializer_range", 0.02);
  c.attention_dropout =
      options.attention_dropout >= 0 ? options.attention_dropout : field_or<double>(j, file, "attention_dropout", 0.0);
  c.hidden_dropout = options.hidden_dropout;
  c.untie_embeddings_and_output_weights = !field_or<bool>(j, file, "tie_word_embeddings", false);
  if (is_moe_type(model_type)) read_moe_fields(j, file, model_type, c);
  if (deepseek) read_deepseek_v3_fields(j, file.string(), c);
  try {
    c.validate();
    if (c.moe.enabled()) c.moe.validate(c.num_layers);
  } catch (const ConfigError& e) {
    config_fail(file, e.what());
  }
  return c;
}

}  // namespace

std::string hf_model_type(const ModelConfig& c, const std::string& requested) {
  const std::string prefix = "HF export supports llama/qwen3-style models (RMSNorm, SwiGLU, RoPE); this model has ";
  if (c.normalization != Normalization::kRMSNorm)
    throw ConfigError(prefix + "--normalization " + to_string(c.normalization));
  if (c.activation != Activation::kSwiGLU) throw ConfigError(prefix + "activation " + to_string(c.activation));
  if (c.position_embedding_type != PositionEmbedding::kRope) {
    throw ConfigError(prefix + "--position-embedding-type " + to_string(c.position_embedding_type));
  }
  if (c.rotary_percent != 1.0) throw ConfigError(prefix + "--rotary-percent " + std::to_string(c.rotary_percent));
  if (c.moe.latent_size > 0) {
    throw ConfigError("HF export: no model type moecore writes has LatentMoE's projections (--moe-latent-size)");
  }
  if (c.mla || requested == "deepseek_v3") {
    if (!requested.empty() && requested != "deepseek_v3") {
      throw ConfigError("HF export as " + requested + ": this model has --multi-latent-attention (deepseek_v3)");
    }
    const std::string misfit = deepseek_v3_misfit(c);
    if (!misfit.empty()) throw ConfigError("HF export as deepseek_v3 cannot represent " + misfit);
    return "deepseek_v3";
  }
  if (!requested.empty() && requested != "llama" && requested != "qwen3" && !is_moe_type(requested)) {
    throw ConfigError("HF export: unknown model_type '" + requested +
                      "' (llama, qwen3, mixtral, qwen3_moe, moecore_moe or deepseek_v3)");
  }
  if (!c.moe.enabled()) {
    if (is_moe_type(requested)) throw ConfigError("HF export as " + requested + " needs a MoE model (--num-experts)");
    if (c.qk_layernorm && c.add_bias_linear) {
      throw ConfigError(prefix +
                        "--qk-layernorm with linear biases (qwen3 has no MLP biases; use --disable-bias-linear)");
    }
    const std::string automatic = c.qk_layernorm ? "qwen3" : "llama";
    if (!requested.empty() && requested != automatic) {
      throw ConfigError("HF export as " + requested + ": this model " +
                        (c.qk_layernorm ? "has --qk-layernorm (qwen3)" : "has no --qk-layernorm (llama)"));
    }
    return automatic;
  }
  if (requested == "llama" || requested == "qwen3") {
    throw ConfigError("HF export as " + requested + ": this model has MoE layers (--num-experts " +
                      std::to_string(c.moe.num_experts) + "); use mixtral, qwen3_moe or moecore_moe");
  }
  if (requested == "mixtral" || requested == "qwen3_moe") {
    const std::string misfit = hf_moe_misfit(c, requested);
    if (!misfit.empty()) throw ConfigError("HF export as " + requested + " cannot represent " + misfit);
    return requested;
  }
  if (requested == "moecore_moe") return requested;
  if (c.qk_layernorm && hf_moe_misfit(c, "qwen3_moe").empty()) return "qwen3_moe";
  if (hf_moe_misfit(c, "mixtral").empty()) return "mixtral";
  return "moecore_moe";
}

std::string hf_export_dir_problem(const std::string& dir) {
  const fs::path target = normalized_dir(dir);
  if (target.empty()) return "empty output folder name";
  fs::path tmp = target;
  tmp += ".tmp";
  for (const fs::path& path : {target, tmp}) {
    if (std::string problem = replace_problem(path); !problem.empty()) return problem;
  }
  // DIR.tmp is made next to DIR, then renamed over it: the parent folder must take new entries.
  const fs::path parent = fs::absolute(target).parent_path();
  return folder_write_problem(parent.string());
}

namespace {

void write_export(const std::vector<NamedTensor>& tensors, const ModelConfig& c, const std::string& model_type,
                  const HfExportInfo& info, const fs::path& tmp, const fs::path& target);

// A failed file operation as "PATH: OS error" (std::filesystem's own text reads "filesystem error: ... [PATH]").
std::string io_error_text(const std::exception& e) {
  if (const auto* fs_error = dynamic_cast<const fs::filesystem_error*>(&e)) {
    return fs_error->path1().string() + ": " + fs_error->code().message();
  }
  return e.what();
}

}  // namespace

void export_hf(const GPTModel& model, const HfExportInfo& info, const std::string& dir) {
  const ModelConfig& c = model.config();
  const std::string model_type = hf_model_type(c, info.model_type);
  if (info.dtype != DType::kF32 && info.dtype != DType::kBF16) {
    throw std::invalid_argument("HF export: weights dtype must be float32 or bfloat16");
  }
  std::map<std::string, const Param*> params;
  std::map<std::string, int64_t> rows_exported;
  for (const Param& p : model.params()) params[p.name] = &p;

  std::vector<NamedTensor> tensors;
  for (const HfTensorMap& map : hf_layout(c, model_type)) {
    const auto it = params.find(map.megatron_name);
    if (it == params.end()) throw std::runtime_error("HF export: the model has no parameter " + map.megatron_name);
    const Tensor& value = it->second->value;
    rows_exported[map.megatron_name] += row_count(map, value);
    Tensor hf = gather_rows(map, value);
    tensors.emplace_back(map.hf_name, info.dtype == DType::kBF16 ? to_bf16(hf) : hf);
  }
  // The routers' expert-bias buffers (aux-loss-free balancing) travel under DeepSeek-V3's name, in fp32; DeepSeek-V3's
  // router always adds one, zeros standing for none.
  for (const auto& [hf_name, buffer_name] : hf_expert_bias_buffers(c, model_type)) {
    if (c.moe.enable_expert_bias) {
      tensors.emplace_back(hf_name, model.buffer(buffer_name).value.clone());
    } else if (model_type == "deepseek_v3") {
      tensors.emplace_back(hf_name, Tensor({c.moe.num_experts}, DType::kF32));
    }
  }
  for (const auto& [name, p] : params) {
    // The Multi-Token Prediction depths: DeepSeek-V3's format holds them as layers num_hidden_layers + k (HF's
    // modeling drops them on load); the other formats have no place for them, so their export is the main model.
    if (model_type != "deepseek_v3" && name.starts_with("mtp.")) continue;
    if (rows_exported[name] != p->value.dim(0)) {
      throw ConfigError("HF export: parameter " + name + " has no HF counterpart (the " + model_type +
                        " mapping does not cover it)");
    }
  }

  if (const std::string problem = hf_export_dir_problem(dir); !problem.empty()) {
    throw std::runtime_error("HF export: " + problem);
  }
  const fs::path target = normalized_dir(dir);
  fs::path tmp = target;
  tmp += ".tmp";
  try {
    write_export(tensors, c, model_type, info, tmp, target);
  } catch (const std::exception& e) {
    std::error_code ignored;  // a folder that cannot take writes may refuse the removal too
    fs::remove_all(tmp, ignored);
    throw std::runtime_error("HF export to " + target.string() + " failed: " + io_error_text(e));
  }
}

namespace {

// The files of an export into `tmp`, then `tmp` swapped in for `target`.
void write_export(const std::vector<NamedTensor>& tensors, const ModelConfig& c, const std::string& model_type,
                  const HfExportInfo& info, const fs::path& tmp, const fs::path& target) {
  fs::remove_all(tmp);
  fs::create_directories(tmp);
  write_safetensors((tmp / "model.safetensors").string(), tensors, {{"format", "pt"}});
  write_json(tmp / "config.json", hf_config_json(c, model_type, info));
  write_json(tmp / "generation_config.json",
             {{"bos_token_id", info.bos_token_id}, {"eos_token_id", info.eos_token_id}, {"_from_model_config", true}});
  if (!info.gpt2_vocab_file.empty() || !info.gpt2_merge_file.empty()) {
    fs::copy_file(info.gpt2_vocab_file, tmp / "vocab.json");
    fs::copy_file(info.gpt2_merge_file, tmp / "merges.txt");
    write_json(tmp / "tokenizer_config.json", {{"tokenizer_class", "GPT2Tokenizer"},
                                               {"model_max_length", c.seq_length},
                                               {"bos_token", "<|endoftext|>"},
                                               {"eos_token", "<|endoftext|>"},
                                               {"unk_token", "<|endoftext|>"}});
  }
  replace_directory(tmp.string(), target.string());
}

}  // namespace

ModelConfig read_hf_config(const std::string& dir, const HfImportOptions& options) {
  std::string model_type;
  return read_typed_config(dir, options, model_type);
}

std::string read_hf_model_type(const std::string& dir) {
  std::string model_type;
  read_typed_config(dir, HfImportOptions{}, model_type);
  return model_type;
}

std::unique_ptr<GPTModel> load_hf(const std::string& dir, const HfImportOptions& options) {
  const ModelConfig c = read_hf_config(dir, options);
  auto model = std::make_unique<GPTModel>(c, options.seed);
  const std::unique_ptr<GlobalTensorSource> source = hf_state_source(dir, c);
  StateDict state;
  add_model_state(state, *model);
  load_state(*source, state);
  return model;
}

}  // namespace moecore
